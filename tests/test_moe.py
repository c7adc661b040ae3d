"""The reference MoE layer equals transformers' own sparse-MoE blocks (fp32, random weights)."""

import pytest
import torch

from minivllm.model.moe import ExpertLoad, SparseMoeBlock, route, sort_by_expert

H, INTER, E, K = 32, 48, 8, 2


def _hf_block(family: str):
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        cfg = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                            num_experts_per_tok=K)
        return MixtralSparseMoeBlock(cfg), True, 0
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E,
                             num_experts_per_tok=K, norm_topk_prob=True)
        return Qwen3MoeSparseMoeBlock(cfg), True, 0
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=False, shared_expert_intermediate_size=40)
    return Qwen2MoeSparseMoeBlock(cfg), False, 40


def _pair(family: str):
    torch.manual_seed(0)
    hf, renormalize, shared = _hf_block(family)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = SparseMoeBlock(H, INTER, E, K, renormalize, shared)
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.down_proj.copy_(hf.experts.down_proj)
        if shared:
            for name in ("gate_proj", "up_proj", "down_proj"):
                ours.shared[name].weight.copy_(getattr(hf.shared_expert, name).weight)
            ours.shared["gate"].weight.copy_(hf.shared_expert_gate.weight)
    return hf, ours


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
def test_reference_equals_transformers(family, tokens):
    hf, ours = _pair(family)
    x = torch.randn(1, tokens, H)
    with torch.no_grad():
        expected = hf(x)
        got = ours(x[0])
    if isinstance(expected, tuple):
        expected = expected[0]
    torch.testing.assert_close(got, expected.reshape(tokens, H), rtol=1e-5, atol=1e-5)


def test_few_tokens_leave_experts_empty_and_are_counted():
    logits = torch.randn(3, E)
    _, ids = route(logits, K, renormalize=True)
    order = sort_by_expert(ids, E)
    counts = order.tokens_per_expert()
    assert sum(counts) == 3 * K and counts.count(0) >= E - 3 * K
    assert counts == torch.bincount(ids.reshape(-1), minlength=E).tolist()
    load = ExpertLoad(layer=0, tokens_per_expert=tuple(counts))
    assert load.experts_used == len(set(ids.reshape(-1).tolist()))


def test_renormalisation_follows_the_family():
    logits = torch.randn(5, E)
    kept, _ = route(logits, K, renormalize=False)
    normed, _ = route(logits, K, renormalize=True)
    torch.testing.assert_close(normed.sum(-1), torch.ones(5))
    assert (kept.sum(-1) < 1).all()


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_cpu_chosen_experts_equals_reference(tokens):
    from minivllm.model.moe import grouped_experts
    from minivllm.platforms.cpu_moe import chosen_experts

    torch.manual_seed(tokens)
    x = torch.randn(tokens, H)
    gate_up, down = torch.randn(16, 2 * INTER, H) * 0.2, torch.randn(16, H, INTER) * 0.2
    weights, ids = route(torch.randn(tokens, 16), K, renormalize=False)
    order = sort_by_expert(ids, 16)
    torch.testing.assert_close(chosen_experts(x, weights, order, gate_up, down),
                               grouped_experts(x, weights, order, gate_up, down), rtol=1e-6, atol=1e-6)


def test_decode_reads_only_the_chosen_experts():
    """Qwen3-MoE's routing shape (128 experts, 8 per token): a decode token reads 8/128 of the bytes."""
    from minivllm.platforms.cpu_moe import expert_bytes_read

    torch.manual_seed(0)
    experts, k = 128, 8
    gate_up, down = torch.empty(experts, 2 * INTER, H), torch.empty(experts, H, INTER)
    reads = {}
    for batch in (1, 64):
        _, ids = route(torch.randn(batch, experts), k, renormalize=True)
        reads[batch], total = expert_bytes_read(sort_by_expert(ids, experts), gate_up, down)
    per_expert = total // experts
    assert reads[1] == k * per_expert and total == experts * per_expert
    assert k * per_expert < reads[64] <= total


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_saved_checkpoint_stacks_into_the_in_memory_layout(family, tmp_path):
    """transformers 5.x keeps experts fused in memory but save_pretrained writes them per expert."""
    from safetensors.torch import load_file
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from minivllm.model.moe import stack_expert_weights

    common = dict(hidden_size=H, intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=64)
    if family == "mixtral":
        model, prefix = MixtralForCausalLM(MixtralConfig(num_local_experts=E, **common)), "block_sparse_moe"
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(num_experts=E, moe_intermediate_size=INTER,
                                                   shared_expert_intermediate_size=INTER, **common))
        prefix = "mlp"
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    gate_up, down = stack_expert_weights(tensors, f"model.layers.0.{prefix}.experts", E, family)
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(gate_up, experts.gate_up_proj) and torch.equal(down, experts.down_proj)
    fused = {"x.gate_up_proj": gate_up, "x.down_proj": down}
    assert stack_expert_weights(fused, "x", E, family)[0] is gate_up
