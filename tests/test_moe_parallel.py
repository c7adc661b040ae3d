"""MoE under tensor and expert parallel on 2 gloo ranks equals the single-rank reference."""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.model.moe import grouped_experts, route, sort_by_expert
from minivllm.model.moe_parallel import expert_parallel_experts, expert_range, local_order, tensor_parallel_shard

E, K, H, INTER = 9, 2, 16, 24  # 9 experts: not a multiple of 2 ranks


def _inputs(tokens: int):
    torch.manual_seed(tokens)
    x = torch.randn(tokens, H)
    gate_up, down = torch.randn(E, 2 * INTER, H) * 0.2, torch.randn(E, H, INTER) * 0.2
    weights, ids = route(torch.randn(tokens, E), K, renormalize=True)
    return x, gate_up, down, weights, sort_by_expert(ids, E)


def _rank(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for tokens in (1, 3, 20):
            x, gate_up, down, weights, order = _inputs(tokens)
            expected = grouped_experts(x, weights, order, gate_up, down)
            gu, dn = tensor_parallel_shard(gate_up, down, rank, world)
            tp = grouped_experts(x, weights, order, gu, dn)
            dist.all_reduce(tp)
            mine = expert_range(E, rank, world)
            ep = expert_parallel_experts(x, weights, order, gate_up[mine.start:mine.stop],
                                         down[mine.start:mine.stop], mine)
            torch.testing.assert_close(tp, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ep, expected, rtol=1e-5, atol=1e-5)
        results.put((rank, "ok"))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, repr(exc)))
    finally:
        dist.destroy_process_group()


def test_tp_and_ep_on_two_gloo_ranks_equal_one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {0: "ok", 1: "ok"}


def test_expert_ranges_cover_every_expert_once():
    for world in (1, 2, 3, 4):
        ranges = [expert_range(E, r, world) for r in range(world)]
        assert [e for rg in ranges for e in rg] == list(range(E))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_local_orders_partition_the_rows():
    *_, order = _inputs(7)
    parts = [local_order(order, expert_range(E, r, 3)) for r in range(3)]
    assert torch.equal(torch.cat([p.pair_order for p in parts]), order.pair_order)
    assert sum(int(p.offsets[-1]) for p in parts) == 7 * K
