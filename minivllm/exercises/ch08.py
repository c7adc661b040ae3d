"""Chapter 08 exercise: the paged-decode kernel's block-table address computation, i.e. for a
position of a request's context, the physical block and the slot in it where its K and V are.

The reference is the kernel itself: the checker runs the real Triton kernel in Triton's interpreter
on the engine's own KV cache and block tables after a real generation, logs the cache rows each
program instance loads, tile by tile, and asks the learner's function where the same positions are.
It also runs the engine's reference attention on K/V gathered at the learner's addresses, which
must equal the kernel's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from minivllm.config import DEFAULT_MODEL, EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.exercises.common import PROMPTS
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # importing minivllm.kernels imports triton: the checker does so when it runs
    from minivllm.kernels.program_log import ProgramLog

BLOCK_N = 16  # the tile the checker launches the kernel with: 4 blocks of 4 positions


def kernel_k_reads(log: ProgramLog, k_cache: torch.Tensor) -> dict[int, dict[int, tuple]]:
    """Per request, position -> (block, slot) of every K row the logged decode launch loaded: the
    element offsets of its pointers into the cache, mapped back through the cache's strides."""
    reads: dict[int, dict[int, tuple]] = {}
    tiles: dict[tuple, int] = {}
    for load in log.loads("k_cache"):
        tile = tiles.get(load.program, 0)
        tiles[load.program] = tile + 1
        for r in np.flatnonzero(load.mask[:, 0]):
            offset = int(load.offsets[r, 0])
            reads.setdefault(load.program[0], {})[tile * BLOCK_N + int(r)] = (
                offset // k_cache.stride(0), offset % k_cache.stride(0) // k_cache.stride(1))
    return reads


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
        from minivllm.kernels.program_log import run_logged

        k_cache, v_cache, block_tables, seq_lens, rids = _engine_state()
        heads, dim = 4 * k_cache.shape[2], k_cache.shape[3]
        q = torch.randn(len(rids), heads, dim, generator=torch.Generator().manual_seed(0))
        log = run_logged(paged_decode_attention, q, k_cache, v_cache, block_tables, seq_lens,
                         dim**-0.5, num_splits=1, block_n=BLOCK_N)
        out, reads = log.result, kernel_k_reads(log, k_cache)
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
