"""Chapter 08 exercise: the paged-decode kernel's block-table address computation, i.e. for a
position of a request's context, the physical block and the slot in it where its K and V are.

The reference is the kernel itself: the checker runs the real Triton kernel in Triton's interpreter
on the engine's own KV cache and block tables after a real generation, logs the cache rows each
program instance loads, tile by tile, and asks the learner's function where the same positions are.
It also runs the engine's reference attention on K/V gathered at the learner's addresses, which
must equal the kernel's output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from unittest import mock

import numpy as np
import torch

from minivllm.config import DEFAULT_MODEL, EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.exercises.common import PROMPTS
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.sampling_params import SamplingParams

BLOCK_N = 16  # the tile the checker launches the kernel with: 4 blocks of 4 positions


@contextlib.contextmanager
def interpreted_decode_kernel():
    """The decode kernel as Triton's interpreter runs it: as it is under TRITON_INTERPRET=1, else
    (a GPU machine) its interpreted twin for the length of the block."""
    from triton.runtime.interpreter import InterpretedFunction

    from minivllm.kernels import paged_decode

    kernel = paged_decode._paged_decode_kernel
    if isinstance(kernel, InterpretedFunction):
        yield
        return
    with mock.patch.object(paged_decode, "_paged_decode_kernel", InterpretedFunction(kernel.fn)):
        yield


@contextlib.contextmanager
def kernel_k_reads(k_cache: torch.Tensor, reads: dict):
    """Log, per request, (position, block, slot) of every K row the kernel loads from `k_cache`:
    the element offsets of its pointers, mapped back through the cache's strides."""
    from triton.runtime.interpreter import interpreter_builder as builder

    load, base = builder.create_masked_load, k_cache.data_ptr()
    size, item = k_cache.numel() * k_cache.element_size(), k_cache.element_size()
    tiles: dict[tuple, int] = {}

    def recording_load(ptrs, mask, other, *rest):
        addr = ptrs.data
        if addr.ndim == 2 and base <= addr.min() and addr.max() < base + size:
            b, tile = builder.grid_idx[0], tiles.get(builder.grid_idx, 0)
            tiles[builder.grid_idx] = tile + 1
            for r in np.flatnonzero(mask.data[:, 0]):
                offset = (int(addr[r, 0]) - base) // item
                reads.setdefault(b, {})[tile * BLOCK_N + int(r)] = (
                    offset // k_cache.stride(0), offset % k_cache.stride(0) // k_cache.stride(1))
        return load(ptrs, mask, other, *rest)

    builder.create_masked_load = recording_load
    try:
        yield
    finally:
        del builder.create_masked_load


def _engine_state() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """Layer 0's K and V caches, the block tables and context lengths of the requests in flight,
    after a real generation: 4-token blocks, two requests finished early so that later blocks are
    reused out of order."""
    engine = LLMEngine(EngineConfig(DEFAULT_MODEL, block_size=4, num_kv_blocks=64,
                                    enable_prefix_caching=False, trace_steps=0, device="cpu"))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=2 + 6 * (i % 2),
                                                          ignore_eos=True))
    for _ in range(50):
        if len(engine.scheduler.running) <= 2 and not engine.scheduler.waiting:
            break
        engine.step()
    engine.add_request("late", PROMPTS[3] + " And then", SamplingParams(max_tokens=4))
    for _ in range(3):
        engine.step()
    tables = {rid: list(t) for rid, t in engine.scheduler.kv.block_tables.items() if t}
    seqs = [s for s in engine.scheduler.running if s.request_id in tables]
    width = max(len(tables[s.request_id]) for s in seqs)
    block_tables = torch.tensor([tables[s.request_id] + [0] * (width - len(tables[s.request_id]))
                                 for s in seqs], dtype=torch.int32)
    seq_lens = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.int32)
    kv = engine.runner.kv_cache[0]
    return kv[0], kv[1], block_tables, seq_lens, [s.request_id for s in seqs]


def check_block_and_slot(block_and_slot: Callable) -> Report:
    """Grade `block_and_slot(block_table [max_blocks] int, positions [n] int, block_size)`, which
    returns (physical blocks [n], slots [n]) of those positions of one request."""
    def known_answers():
        table, positions = torch.tensor([7, 2, 9]), torch.tensor([0, 3, 4, 9, 11])
        blocks, slots = (torch.as_tensor(t).tolist() for t in block_and_slot(table, positions, 4))
        if (blocks, slots) != ([7, 7, 2, 9, 9], [0, 3, 0, 1, 3]):
            raise ExerciseFailure(
                f"block table [7, 2, 9], 4 positions per block, positions [0, 3, 4, 9, 11]: your "
                f"function gave blocks {blocks} and slots {slots}; they are [7, 7, 2, 9, 9] and "
                f"[0, 3, 0, 1, 3]: position p is in logical block p // block_size, whose physical "
                f"block is table[p // block_size], at slot p % block_size.")

    def kernel_reads():
        from minivllm.kernels import paged_decode_attention

        k_cache, v_cache, block_tables, seq_lens, rids = _engine_state()
        heads, dim = 4 * k_cache.shape[2], k_cache.shape[3]
        q = torch.randn(len(rids), heads, dim, generator=torch.Generator().manual_seed(0))
        reads: dict = {}
        with interpreted_decode_kernel(), kernel_k_reads(k_cache, reads):
            out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, dim**-0.5,
                                         num_splits=1, block_n=BLOCK_N)
        for b, rid in enumerate(rids):
            positions = torch.arange(int(seq_lens[b]))
            blocks, slots = (torch.as_tensor(t).tolist()
                             for t in block_and_slot(block_tables[b].clone(), positions, 4))
            for p in positions.tolist():
                if reads[b][p] != (blocks[p], slots[p]):
                    raise ExerciseFailure(
                        f"the engine's request {rid!r} (block table "
                        f"{block_tables[b].tolist()}): for position {p} the kernel read block "
                        f"{reads[b][p][0]}, slot {reads[b][p][1]}; your function says block "
                        f"{blocks[p]}, slot {slots[p]}.")
            k = k_cache[blocks, slots].repeat_interleave(heads // k_cache.shape[2], dim=1)
            v = v_cache[blocks, slots].repeat_interleave(heads // k_cache.shape[2], dim=1)
            want = torch.einsum("hn,nhd->hd", torch.einsum("hd,nhd->hn", q[b], k).mul(
                dim**-0.5).softmax(-1), v)
            if not torch.allclose(out[b], want, atol=1e-4):
                raise ExerciseFailure(f"attention over K/V gathered at your addresses differs "
                                      f"from the kernel's output for request {rid!r}.")

    return run_checks("ch08 block_and_slot", [
        ("the addresses are right on a table with a known answer", known_answers),
        ("the real kernel, on the engine's own cache, reads the same blocks and slots",
         kernel_reads)])
