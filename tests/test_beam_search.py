"""Beam search on copy-on-write blocks: the same beams as transformers, and blocks shared rather
than copied."""

import pytest
import torch

from minivllm import LLM, BeamSearchParams
from minivllm.engine.beam_search import get_beam_search_score

PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(5 + 3 * i)] for i in range(3)]


def hf_beams(model, prompt, width, n, length_penalty=1.0):
    out = model.generate(torch.tensor([prompt]), num_beams=width, do_sample=False, max_new_tokens=n,
                         num_return_sequences=width, early_stopping=True,
                         length_penalty=length_penalty,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize("kind,width,length_penalty",
                         [("llama", 3, 1.0), ("qwen2", 2, 0.5), ("qwen3", 4, 1.0)])
def test_same_beams_as_transformers(checkpoints, kind, width, length_penalty):
    """No EOS in the tiny checkpoints: every beam runs to max_tokens, so both scorings rank alike
    and the whole beam set, scores included, must match (transformers divides by the generated
    length)."""
    path, hf = checkpoints[kind]
    n = 7
    llm = LLM(path, block_size=4, num_kv_blocks=256)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=n,
                                                     length_penalty=length_penalty))
    for prompt, out in zip(PROMPTS, outs):
        theirs, scores = hf_beams(hf, prompt, width, n, length_penalty)
        ours = [s.tokens[len(prompt):] for s in out.sequences]
        assert ours == theirs
        assert [s.cum_logprob / n**length_penalty
                for s in out.sequences] == pytest.approx(scores, abs=1e-4)
        assert all(s.tokens[: len(prompt)] == prompt and s.finish_reason == "length"
                   for s in out.sequences)
        assert all(len(s.logprobs) == n for s in out.sequences)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert 0 < stats["num_cow_copies"] < stats["num_forked_blocks"]


def test_forks_share_blocks_and_copy_only_the_written_partial_block(llama_path):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=64)
    llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=3, max_tokens=6))
    trace = llm.engine.trace
    forks = [t for t in trace if t.forked]
    assert forks and any(t.shared_blocks for t in trace)
    for t in trace:
        for rid, copies in t.copied.items():
            assert len(copies) == 1  # one block per write into a shared, partly filled block
            assert copies[0] in t.block_tables[rid] and copies[0] not in t.shared_blocks
    # a step that writes at a block boundary starts a fresh block: no copy at all
    assert any(t.forked and not t.copied for t in trace)


def test_tiny_pool_gives_the_same_beams(llama_path):
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    roomy = LLM(llama_path, block_size=4, num_kv_blocks=256).beam_search(PROMPTS, params)
    for mode in ("recompute", "swap"):
        llm = LLM(llama_path, block_size=4, num_kv_blocks=10, preemption_mode=mode, swap_space=0.01)
        tight = llm.beam_search(PROMPTS, params)
        assert [[s.tokens for s in o.sequences] for o in tight] == [[s.tokens for s in o.sequences]
                                                                    for o in roomy]
        stats = llm.engine.stats()
        assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == 10


def test_eos_finishes_a_beam(llama_path):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=64)
    first = (llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2,
                                                            max_tokens=3))[0].sequences[0])
    eos = first.tokens[len(PROMPTS[0])]  # the best first token: make it the EOS
    llm.engine.eos_token_ids = (eos,)
    out = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3))[0]
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert (stopped and stopped[0].tokens[-1] == eos
            and len(stopped[0].tokens) == len(PROMPTS[0]) + 1)
    ignoring = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3,
                                                              ignore_eos=True))[0]
    assert [s.tokens for s in ignoring.sequences][0] == first.tokens
    # a final EOS does not count in the length
    assert get_beam_search_score([1, 2, eos], -2.0, eos) == -1.0


def test_beam_search_checks(llama_path):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    llm = LLM(llama_path, block_size=4, num_kv_blocks=64)
    llm.engine.add_request("busy", [1, 2, 3])
    with pytest.raises(ValueError, match="idle"):
        llm.beam_search([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=2))
