"""Reference solution, chapter 14: the router's top-k experts per token and their weights."""

import torch


def my_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)  # over all experts, in float32
    weights, expert_ids = probs.topk(top_k, dim=-1)  # the k most probable experts of each token
    if renormalize:  # Mixtral, Qwen3-MoE with norm_topk_prob: the k weights sum to 1
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids
