"""The Triton grouped-GEMM MoE kernel equals the reference layer (TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch

pytest.importorskip("triton")

from minivllm.kernels.fused_moe import fused_moe_experts, tile_table  # noqa: E402
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
    offsets = torch.tensor([0, 0, 5, 21, 21, 22])   # experts of 0, 5, 16, 0 and 1 rows
    expert, start = tile_table(offsets, 16)
    assert expert.tolist() == [1, 2, 4] and start.tolist() == [0, 5, 21]
    expert, start = tile_table(offsets, 4)
    assert expert.tolist() == [1, 1, 2, 2, 2, 2, 4] and start.tolist() == [0, 4, 5, 9, 13, 17, 21]
