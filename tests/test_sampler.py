"""The sampler's filters, penalty and seeds; sampling paths are checked statistically, not by exact
tokens."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sampling.sampler import Sampler, SamplingBatch, apply_top_k_top_p_min_p

INF = float("-inf")


def batch_for(params: list[SamplingParams], history=None):
    return SamplingBatch.build(params, [history or [0]] * len(params), "cpu")


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]] * 2)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([2, 0]), torch.ones(2), torch.zeros(2))
    assert torch.equal(out[0].isfinite(), torch.tensor([False, True, False, True, False]))
    assert torch.equal(out[1], logits[1]), "top_k=0 leaves the row alone"


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep = lambda p: apply_top_k_top_p_min_p(logits, torch.tensor([0]), torch.tensor([p]),
                                             torch.zeros(1))[0].isfinite().tolist()
    assert keep(0.5) == [True, False, False, False]
    assert keep(0.6) == [True, True, False, False]
    assert keep(0.81) == [True, True, True, False]
    assert keep(1.0) == [True, True, True, True]
    assert keep(0.01) == [True, False, False, False], "the top token always survives"


def test_min_p_is_relative_to_the_top_token():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = apply_top_k_top_p_min_p(logits, torch.tensor([0]), torch.ones(1), torch.tensor([0.5]))
    assert out[0].isfinite().tolist() == [True, True, False, False]  # 0.15 < 0.5 * 0.5


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    from minivllm.sampling.sampler import apply_repetition_penalty

    logits = torch.tensor([[2.0, -2.0, 1.5]])
    batch = batch_for([SamplingParams(temperature=0, repetition_penalty=2.0)], history=[0, 1])
    assert apply_repetition_penalty(logits.clone(), batch).tolist() == [[1.0, -4.0, 1.5]]
    assert Sampler()(logits.clone(), batch).item() == 2, "greedy decoding sees the penalty too"


def test_greedy_is_argmax_and_mixed_batches_keep_per_row_params():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.7, top_p=1e-6), SamplingParams(temperature=0)]
    out = Sampler()(logits.clone(), batch_for(params))
    assert out.tolist() == logits.argmax(-1).tolist()  # top_k=1 / tiny top_p are greedy too


def test_sampling_follows_the_distribution():
    """Frequencies of 20k draws at temperature 0.5 match softmax(logits / 0.5) in total
    variation."""
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0])
    n = 20_000
    sampler = Sampler(seed=123)
    params = [SamplingParams(temperature=0.5)] * n
    draws = sampler(logits.expand(n, -1).clone(), batch_for(params))
    freq = torch.bincount(draws, minlength=5).float() / n
    expected = (logits / 0.5).softmax(-1)
    assert 0.5 * (freq - expected).abs().sum() < 0.02


def test_top_k_sampling_never_leaves_the_top_k():
    logits = torch.randn(1, 100).expand(2000, -1).clone()
    draws = (Sampler(seed=1)(logits.clone(), batch_for([SamplingParams(temperature=1.0,
                                                                       top_k=3)] * 2000)))
    assert set(draws.tolist()) <= set(logits[0].topk(3).indices.tolist())
    assert len(set(draws.tolist())) == 3


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, block_size=4, num_kv_blocks=128)


def test_seeded_requests_repeat_whatever_the_batch(llm):
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(10, 10 + k))} for k in (3, 9, 17)]
    mixed = llm.generate(others + [prompt] + others,
                         [SamplingParams(temperature=1.0, max_tokens=12)] * 3
                         + [seeded] + [SamplingParams(temperature=0.8, max_tokens=20)] * 3,
                         use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    again = llm.generate(prompt, SamplingParams(temperature=1.0, seed=8, max_tokens=12,
                                                ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert again != alone, "another seed gives another sample"


def test_n_completions(llm):
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=3, temperature=1.0, seed=0,
                       max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.num_cached_tokens == 0


def test_engine_stream_is_not_reseeded_between_calls():
    """The same device spelled two ways ("cpu" / torch.device, or "cuda" / "cuda:0") keeps one
    stream going."""
    sampler = Sampler(seed=3)
    first = sampler.generator_for(torch.device("cpu"))
    draw = torch.rand(4, generator=first)
    assert sampler.generator_for("cpu") is first
    assert not torch.equal(torch.rand(4, generator=sampler.generator_for("cpu")), draw)
