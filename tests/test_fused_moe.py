"""The Triton grouped-GEMM MoE kernel equals the reference layer (TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch

pytest.importorskip("triton")

from minivllm.kernels.fused_moe import fused_moe_experts, max_tiles, tile_table  # noqa: E402
from minivllm.model.moe import grouped_experts, route, sort_by_expert  # noqa: E402


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("num_experts", [8, 12])
def test_fused_moe_equals_reference(tokens, num_experts):
    torch.manual_seed(tokens)
    hidden, inter, k = 32, 48, 2
    x = torch.randn(tokens, hidden)
    gate_up = torch.randn(num_experts, 2 * inter, hidden) * 0.2
    down = torch.randn(num_experts, hidden, inter) * 0.2
    weights, ids = route(torch.randn(tokens, num_experts), k, renormalize=True)
    order = sort_by_expert(ids, num_experts)
    expected = grouped_experts(x, weights, order, gate_up, down)
    got = fused_moe_experts(x, weights, order, gate_up, down)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_tile_table_never_straddles_experts():
    """A table of a fixed length (the most tiles any routing of the rows could need, so that it never waits on the
    host): the routing's tiles, then tiles that start at the end of the rows and do nothing."""
    offsets = torch.tensor([0, 0, 5, 21, 21, 22])   # experts of 0, 5, 16, 0 and 1 rows
    assert max_tiles(22, 5, 16) == 6 and max_tiles(22, 5, 4) == 10 and max_tiles(3, 8, 16) == 3
    expert, start = tile_table(offsets, 16, max_tiles(22, 5, 16))
    assert expert.tolist()[:3] == [1, 2, 4] and start.tolist() == [0, 5, 21, 22, 22, 22]
    expert, start = tile_table(offsets, 4, max_tiles(22, 5, 4))
    assert expert.tolist()[:7] == [1, 1, 2, 2, 2, 2, 4] and start.tolist() == [0, 4, 5, 9, 13, 17, 21, 22, 22, 22]


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_no_routing_needs_more_tiles_than_the_table_holds(block_m):
    """Every expert's last tile may be partial: the bound holds for the worst routing (all experts used, odd
    counts) and the tiles cover every row exactly once."""
    for counts in ([1] * 8, [3, 1, 0, 7, 2, 1, 1, 1], [16, 0, 0, 0, 0, 0, 0, 0], [5, 5, 5, 1, 0, 0, 0, 0]):
        offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
        rows = offsets[-1].item()
        expert, start = tile_table(offsets, block_m, max_tiles(rows, 8, block_m))
        covered = [r for e, s in zip(expert.tolist(), start.tolist())
                   for r in range(s, min(s + block_m, offsets[e + 1].item()))]
        assert sorted(covered) == list(range(rows))


@pytest.mark.parametrize("tokens", [1, 40])
def test_int8_experts_equal_the_reference(tokens):
    """Int8 experts: the kernel reads the int8 bytes, converts them in registers and scales each output row once,
    as model/moe.py's reference does per expert block."""
    from minivllm.quantization.int8 import quantize_per_channel

    torch.manual_seed(tokens)
    hidden, inter, k, num_experts = 32, 48, 2, 9
    x = torch.randn(tokens, hidden)
    quantized = [quantize_per_channel(w, torch.float32) for w in torch.randn(num_experts, 2 * inter, hidden) * 0.2]
    quantized_down = [quantize_per_channel(w, torch.float32) for w in torch.randn(num_experts, hidden, inter) * 0.2]
    gate_up, gate_up_scale = (torch.stack(t) for t in zip(*quantized))
    down, down_scale = (torch.stack(t) for t in zip(*quantized_down))
    weights, ids = route(torch.randn(tokens, num_experts), k, renormalize=False)
    order = sort_by_expert(ids, num_experts)
    expected = grouped_experts(x, weights, order, gate_up, down, gate_up_scale, down_scale)
    dequantized = grouped_experts(x, weights, order, gate_up.float() * gate_up_scale[..., None],
                                  down.float() * down_scale[..., None])
    torch.testing.assert_close(expected, dequantized, rtol=1e-4, atol=1e-4)
    got = fused_moe_experts(x, weights, order, gate_up, down, gate_up_scale, down_scale)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
