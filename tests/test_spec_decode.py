"""Speculative decoding: same greedy tokens, same sampling distribution, no leaked blocks in either
cache."""

import math

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sampling.rejection_sampler import verify_greedy, verify_sampled
from minivllm.spec_decode import NgramProposer
from tests.conftest import build_checkpoint, build_noisy_copy

PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 40)), [100, 3], [5, 6, 7, 5, 6, 7, 5, 6]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target, a much smaller random draft, and a draft that is the target with noise in its
    head."""
    root = tmp_path_factory.mktemp("spec")
    target = build_checkpoint("llama", root / "target")
    build_checkpoint("llama", root / "small", hidden_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    noisy = build_noisy_copy(target, root / "noisy")
    return root, target, noisy


def greedy_tokens(llm, n=30):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                         params,
                                                           use_tqdm=False)]


@pytest.mark.parametrize("drafter", ["target", "small", "noisy", "[ngram]"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_is_unchanged_with_preemption(models, drafter, k):
    root, _, _ = models
    reference = greedy_tokens(LLM(root / "target", block_size=4, num_kv_blocks=100))
    spec = drafter if drafter == "[ngram]" else root / drafter
    llm = LLM(root / "target", block_size=4, num_kv_blocks=20, max_num_batched_tokens=9,
              speculative_model=spec, num_speculative_tokens=k)
    assert greedy_tokens(llm) == reference
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_proposed"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    proposer = llm.engine.runner.proposer
    # the runner hears of the last finished requests with the next step, as in vLLM
    llm.engine.step()
    if drafter != "[ngram]":
        assert proposer.kv.num_free_blocks == proposer.kv.pool.num_blocks, "the draft cache is empty too"
        assert not proposer.shadows
    if drafter == "target":
        assert (stats["spec_acceptance_rate"] == 1.0
                and stats["spec_mean_accepted_length"] > min(k, 3))


def test_abort_frees_both_caches(models):
    root, _, _ = models
    llm = LLM(root / "target", block_size=4, num_kv_blocks=40, speculative_model=root / "small",
              num_speculative_tokens=3)
    eng, draft = llm.engine, llm.engine.runner.proposer
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert draft.kv.num_free_blocks < draft.kv.pool.num_blocks
    eng.abort_request("1")
    eng.abort_request("3")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats()["num_free_blocks"] == eng.stats()["num_total_blocks"]
    eng.step()  # nothing to run: the runner only forgets the requests that finished last step
    assert draft.kv.num_free_blocks == draft.kv.pool.num_blocks and not draft.shadows
    assert not eng.runner.sequences


def test_self_drafting_needs_fewer_steps(models):
    root, _, _ = models
    plain = LLM(root / "target", block_size=4, num_kv_blocks=100)
    greedy_tokens(plain)
    spec = LLM(root / "target", block_size=4, num_kv_blocks=100, speculative_model=root / "target",
               num_speculative_tokens=4)
    greedy_tokens(spec)
    assert spec.engine.num_steps * 3 < plain.engine.num_steps


def exact_marginals(model, prompt, top_k, depth):
    """P(token at each of the first `depth` positions) under top-k sampling at temperature 1, by
    enumeration."""
    def dist(ctx):
        logits = model(torch.tensor([ctx])).logits[0, -1]
        top = logits.topk(top_k)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    marginals, frontier = [], {tuple(prompt): 1.0}
    with torch.no_grad():
        for _ in range(depth):
            nxt, m = {}, {}
            for ctx, w in frontier.items():
                for tok, p in dist(list(ctx)).items():
                    nxt[ctx + (tok,)] = w * p
                    m[tok] = m.get(tok, 0.0) + w * p
            marginals.append(m)
            frontier = nxt
    return marginals


def total_variation(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(t, 0) - q.get(t, 0)) for t in set(p) | set(q))


def test_sampling_distribution_matches_the_target(models):
    """The 2nd and 3rd tokens come from verification; their distribution must be the target's, not
    the draft's."""
    root, target, noisy = models
    prompt, top_k, n = [9, 8, 7, 6, 5], 4, 3000
    exact = exact_marginals(target, prompt, top_k, 3)
    draft_exact = exact_marginals(noisy, prompt, top_k, 3)
    assert (total_variation(exact[1],
                            draft_exact[1]) > 0.15), "the draft must really differ for this to test much"
    llm = LLM(root / "target", block_size=4, num_kv_blocks=1200, speculative_model=root / "noisy",
              num_speculative_tokens=2, seed=1)
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert 0.2 < stats["spec_acceptance_rate"] < 0.95, "both acceptances and rejections happened"
    for pos in (1, 2):
        counts: dict[int, float] = {}
        for o in outs:
            tok = o.outputs[0].token_ids[pos]
            counts[tok] = counts.get(tok, 0) + 1 / n
        # sampling noise at n=3000 is ~0.05 (plain sampling shows the same); the draft is ~0.8 away
        assert total_variation(counts, exact[pos]) < 0.08, f"position {pos}"
        assert total_variation(counts, draft_exact[pos]) > total_variation(counts, exact[pos])


def sequence_log10_probability(model, prompt: list[int], tokens: list[int],
                               temperature: float) -> float:
    """log10 P(the target samples exactly `tokens` after `prompt`) at this temperature (speculation
    keeps it)."""
    with torch.no_grad():
        logits = (model(torch.tensor([prompt + tokens])).logits[0,
                                                                len(prompt) - 1:-1].double() / temperature)
    return (logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:,
                                                                  None]).sum().item() / math.log(10))


def test_seeded_sampling_with_speculation_repeats(models):
    """A seed fixes a request's tokens, alone or batched with others; another seed, or none, gives
    other tokens.

    Speculation keeps the target's distribution, so a request whose seed were ignored would still
    sample from it, just from the engine-wide stream: it would then differ from its seeded twin and
    from itself run alone; and an engine that gave every seeded request one fixed stream would
    repeat seed 11's tokens for seed 12. Temperature 2 flattens the tiny target (its likeliest next
    token has probability ~0.1 or less on random contexts; 0.29 at temperature 1.5, 0.59 at 1), and
    24 tokens make any given output improbable: two independent streams give the same 24 tokens with
    probability p(output), which the test computes under the target and requires to be < 1e-6 (it is
    about 1e-52). So "same tokens" cannot happen by coincidence and "other tokens" cannot fail by
    one; and every stream here is seeded (the unseeded request draws from the engine's seed-0
    stream), so the outcome is the same on every run.
    """
    root, target, _ = models
    temperature, n = 2.0, 24

    def params(seed):
        return SamplingParams(temperature=temperature, seed=seed, max_tokens=n, ignore_eos=True)

    def run(prompts, sampling_params):
        llm = LLM(root / "target", block_size=4, num_kv_blocks=200,
                  speculative_model=root / "noisy", num_speculative_tokens=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params,
                            use_tqdm=False)
        assert llm.engine.stats()["spec_num_proposed"] > 0
        return [o.outputs[0].token_ids for o in outs]

    prompt = PROMPTS[1]
    alone = run([prompt], params(11))[0]
    assert (len(alone) == n
            and run([prompt], params(11))[0] == alone), "a fresh engine repeats a seeded request"
    log10_p = sequence_log10_probability(target, prompt, alone, temperature)
    assert log10_p < -6, f"p(output) = 1e{log10_p:.1f}: too likely for the inequalities below to mean anything"
    # one batch: another prompt first (so no twin sits in row 0), then the same seed twice, another
    # seed, no seed
    batch = run([PROMPTS[0], prompt, PROMPTS[3], prompt, prompt, prompt],
                [params(None), params(11), params(3), params(11), params(12), params(None)])
    assert (batch[1] == alone
            and batch[3] == alone), "same seed, same tokens, alone or batched with others"
    assert batch[4] != alone, "another seed, other tokens"
    assert batch[5] != alone, "no seed: the engine's stream, other tokens"


def test_verify_rules():
    logits = torch.full((4, 10), -1.0)
    for i, best in enumerate([3, 4, 5, 6]):
        logits[i, best] = 1.0
    assert verify_greedy(logits, [3, 4, 5]) == [3, 4, 5, 6], "all accepted plus the bonus token"
    assert (verify_greedy(logits,
                          [3, 9, 5]) == [3, 4]), "first mismatch replaced by the target's token"
    probs = torch.zeros(3, 10)
    probs[:, 2] = 1.0
    gen = torch.Generator().manual_seed(0)
    assert verify_sampled(probs, [2, 2], None, gen) == [2, 2, 2]
    assert verify_sampled(probs, [7, 2], None, gen) == [2], "p(7) = 0: rejected, resampled from p"


def test_ngram_lookup():
    prop = NgramProposer(3)
    assert prop.lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert prop.lookup([1, 2, 3, 4, 5], 3) == []
    assert prop.lookup([7, 8, 7], 3) == [8, 7]


def test_bad_speculative_configs(models, tmp_path):
    root, _, _ = models
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(root / "target", num_kv_blocks=10, speculative_model="[ngram]")
    build_checkpoint("llama", tmp_path / "other_vocab", vocab_size=300)
    with pytest.raises(ValueError, match="vocab size"):
        LLM(root / "target", num_kv_blocks=10, speculative_model=tmp_path / "other_vocab",
            num_speculative_tokens=2)


def test_draft_memory_is_reserved_for(models):
    """On a GPU the target sizes its cache for itself and the draft: what the draft will need, in
    bytes."""
    from dataclasses import replace

    from minivllm.config import EngineConfig
    from minivllm.core.kv_sizing import kv_bytes_per_block
    from minivllm.model import read_model_config
    from minivllm.spec_decode.draft_model import draft_extra_blocks, draft_memory_needs

    root, _, _ = models
    config = EngineConfig(root / "target", device="cpu", block_size=8, max_num_seqs=10,
                          speculative_model=root / "small", num_speculative_tokens=3)
    assert draft_memory_needs(config) == (0, 0), "off the GPU nothing is reserved"
    fixed, per_block = draft_memory_needs(replace(config, device="cuda", dtype="float32"))
    mc = read_model_config(root / "small")
    # fp32 on CPU
    assert per_block == kv_bytes_per_block(mc.num_layers, 8, mc.num_kv_heads, mc.head_dim, 4)
    weights = sum(f.stat().st_size for f in (root / "small").glob("*.safetensors"))
    assert draft_extra_blocks(config, 3) == 10 * 2
    assert fixed == weights + 20 * per_block
