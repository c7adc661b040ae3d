"""Logprobs equal transformers' log-softmax, whatever the scheduler does (chunks, preemption, cache
hits, drafts)."""

import math

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import RequestOutputKind
from tests.conftest import build_noisy_copy

PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 40)), [100, 3], list(range(200, 250, 3))]
TOL = 1e-4


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `tokens`: row p predicts token p +
    1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def check(out, model, k: int, prompt_k: int | None) -> None:
    prompt, completion = out.prompt_token_ids, out.outputs[0]
    ref = hf_logprobs(model, prompt + completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for i, (tok, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(position[tok].logprob - float(row[tok])) < TOL
        assert position[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k)
        assert set(position) == {tok, *top.indices.tolist()}, "the chosen token and the top k"
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(position[t].logprob - lp) < TOL
        total += float(row[tok])
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-3)
    if prompt_k is not None:
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for t in range(1, len(prompt)):
            row = ref[t - 1]
            assert abs(out.prompt_logprobs[t][prompt[t]].logprob - float(row[prompt[t]])) < TOL
            assert len(out.prompt_logprobs[t]) >= prompt_k


@pytest.mark.parametrize("setting", [
    dict(block_size=16, num_kv_blocks=64),
    dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=7),  # every prompt chunked
    # preemption: recomputed, not repeated
    dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32),
])
def test_logprobs_equal_transformers(checkpoints, setting):
    path, model = checkpoints["llama"]
    llm = LLM(path, **setting)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out in outs:
        check(out, model, 3, 2)
    if setting["num_kv_blocks"] == 16:
        assert llm.engine.stats()["num_preemptions"] > 0


def test_sampled_tokens_and_cache_hits(checkpoints):
    """Sampled tokens get the model's logprobs too; a prompt served from the prefix cache still gets
    its prompt logprobs (such requests skip the cache, as in vLLM) and the others hit it."""
    path, model = checkpoints["qwen3"]
    llm = LLM(path, block_size=4, num_kv_blocks=64)
    shared = list(range(10, 30))
    # warms the cache
    llm.generate({"prompt_token_ids": shared + [1]}, SamplingParams(max_tokens=2), use_tqdm=False)
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=10, logprobs=1)
    hit = llm.generate({"prompt_token_ids": shared + [2, 3]}, sampled, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 20
    check(hit, model, 1, None)
    prompt_lp = llm.generate({"prompt_token_ids": shared + [4]},
                             SamplingParams(max_tokens=3, logprobs=0,
                                                                                prompt_logprobs=1),
                             use_tqdm=False)[0]
    assert prompt_lp.num_cached_tokens == 0
    check(prompt_lp, model, 0, 1)


def test_verified_drafts_carry_the_targets_logprobs(checkpoints, tmp_path):
    path, model = checkpoints["llama"]
    build_noisy_copy(model, tmp_path / "draft")
    llm = LLM(path, block_size=4, num_kv_blocks=64, speculative_model=tmp_path / "draft",
              num_speculative_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False):
        check(out, model, 2, None)
    assert llm.engine.stats()["spec_num_accepted"] > 0


def test_logprobs_stream_as_deltas_and_cost_nothing_when_not_asked(checkpoints):
    path, model = checkpoints["llama"]
    llm = LLM(path, block_size=4, num_kv_blocks=64)
    eng = llm.engine
    eng.add_request("d", {"prompt_token_ids": PROMPTS[1]},
                    SamplingParams(temperature=0, max_tokens=8, logprobs=1,
                                   output_kind=RequestOutputKind.DELTA))
    eng.add_request("plain", {"prompt_token_ids": PROMPTS[0]},
                    SamplingParams(temperature=0, max_tokens=8))
    pieces, plain = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == "d":
                assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
                pieces += out.outputs[0].logprobs
            else:
                plain = out
    assert (len(pieces) == 8 and plain.outputs[0].logprobs is None
            and plain.outputs[0].cumulative_logprob is None)
    assert plain.prompt_logprobs is None
    full = llm.generate({"prompt_token_ids": PROMPTS[1]},
                        SamplingParams(temperature=0, max_tokens=8, logprobs=1), use_tqdm=False)[0]
    assert [list(p) for p in pieces] == [list(p) for p in full.outputs[0].logprobs]


def test_whole_vocabulary_and_bad_values(checkpoints):
    path, _ = checkpoints["llama"]
    # -1 ("all") needs max_logprobs=-1, as in vLLM
    llm = LLM(path, block_size=4, num_kv_blocks=64, max_logprobs=-1)
    out = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, logprobs=-1),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == 251
    probs = [math.exp(lp.logprob) for lp in out.outputs[0].logprobs[0].values()]
    assert abs(sum(probs) - 1) < 1e-4
    for bad in (-2, 1.5):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
    capped = LLM(path, block_size=4, num_kv_blocks=64)  # vLLM's default max_logprobs: 20
    for name, value in (("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21),
                        ("prompt_logprobs", -1)):
        with pytest.raises(ValueError, match=f"{name}.*max_logprobs of 20"):
            capped.generate({"prompt_token_ids": [1, 2]},
                            SamplingParams(max_tokens=2, **{name: value}), use_tqdm=False)
    assert capped.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, logprobs=20),
                           use_tqdm=False)[0].outputs[0].logprobs is not None


def test_prompt_logprobs_are_computed_a_bounded_chunk_a_step():
    """A long prompt with prompt_logprobs is prefilled at most PROMPT_LOGPROBS_TOKENS_PER_STEP
    positions a step, so it cannot stall the others' step; the logprobs equal those of a much finer
    chunking."""
    from minivllm.core.scheduler import PROMPT_LOGPROBS_TOKENS_PER_STEP as CAP

    prompt = [(37 * i) % 500 + 3 for i in range(2 * CAP + 88)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    llm = LLM(num_kv_blocks=128)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    chunks = [e.num_tokens for t in llm.engine.trace for e in t.scheduled if e.kind == "prefill"]
    assert chunks == [CAP, CAP, 88], chunks
    fine = LLM(num_kv_blocks=128, max_num_batched_tokens=64).generate([{"prompt_token_ids": prompt}], params,
                                                                        use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for ours, ref, token in zip(out.prompt_logprobs[1:], fine.prompt_logprobs[1:], prompt[1:]):
        assert ours[token].logprob == pytest.approx(ref[token].logprob, abs=1e-4)
