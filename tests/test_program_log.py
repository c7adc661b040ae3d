"""minivllm/kernels/program_log.py: a kernel launch logged program by program in Triton's interpreter.

The log must be the kernel's own: the block-table entries each tile loaded are the request's blocks in
order, the running max it logged is the one the reference softmax implies, and the child-process path
(the one a GPU machine takes, where the kernels are compiled) returns the same log as the in-process one.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import paged_decode_attention
from minivllm.kernels.program_log import Load, _run_here, _run_in_child, run_logged
from minivllm.widgets import decode_walk

SCALE = 32**-0.5


def decode_inputs():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(12, 8, 2, 32, generator=gen) for _ in range(2))
    block_tables = torch.tensor([[3, 7, 1, 9], [5, 2, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([27, 11], dtype=torch.int32)
    q = torch.randn(2, 8, 32, generator=gen)
    return q, k_cache, v_cache, block_tables, seq_lens, SCALE


def test_the_walk_reads_each_requests_blocks_in_table_order_split_by_split():
    log = run_logged(paged_decode_attention, *decode_inputs(), num_splits=2, block_n=16)
    walk = decode_walk(log)
    # request 0: 27 positions = two 16-position tiles, one per split; request 1: one tile, split 1 empty
    assert [t.blocks for t in walk[(0, 0, 0)]] == [(3, 7)] and [t.blocks for t in walk[(0, 0, 1)]] == [(1, 9)]
    assert [t.blocks for t in walk[(1, 0, 0)]] == [(5, 2)] and (1, 0, 1) not in walk
    assert {e.tensor for e in log.events if isinstance(e, Load)} >= {"block_tables", "k_cache", "v_cache"}


def test_the_logged_running_max_is_the_softmax_max_of_the_tile_scores():
    q, k_cache, v_cache, block_tables, seq_lens, scale = decode_inputs()
    walk = decode_walk(run_logged(paged_decode_attention, q, k_cache, v_cache, block_tables, seq_lens, scale,
                                  num_splits=1, block_n=16))
    k = k_cache[block_tables[1, :2].long()].reshape(16, 2, 32)[:11, 0]  # request 1, kv head 0, 11 positions
    scores = q[1, :4] @ k.T * scale * 1.4426950408889634  # the kernel's log2 units (it uses exp2)
    logged = torch.tensor(walk[(1, 0, 0)][-1].running_max[:4])
    torch.testing.assert_close(logged, scores.max(dim=1).values, atol=1e-5, rtol=1e-5)


def test_the_child_process_gives_the_same_result_and_log_as_this_process():
    args = decode_inputs()
    here = _run_here(paged_decode_attention, args, {"num_splits": 2, "block_n": 16})
    child = _run_in_child(paged_decode_attention, args, {"num_splits": 2, "block_n": 16})
    assert torch.equal(here.result, child.result)
    assert decode_walk(here) == decode_walk(child)
    assert [(e.program, e.tensor) for e in here.loads("k_cache")] == [
        (e.program, e.tensor) for e in child.loads("k_cache")]


def test_tensors_off_the_cpu_are_refused_before_anything_runs():
    q, *rest = decode_inputs()
    with pytest.raises(ValueError, match="CPU tensors"):
        run_logged(paged_decode_attention, q.to("meta"), *rest)
