"""Text in, text out on the embedded model: incremental detokenization, stop strings, EOS and
chat."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.tokenizer import find_stop_string
from tests.conftest import EMBEDDED

SEEDS = ["Hi, my name is", "Today is a beautiful summer day", "Hello there"]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(EMBEDDED), num_kv_blocks=256)


def test_text_is_the_same_streamed_or_decoded_once(llm):
    """CUMULATIVE outputs build text token by token; LLM.generate (FINAL_ONLY) decodes it once at
    the end.

    High temperatures reach rare byte-level tokens, whose characters may span several tokens."""
    prompts = SEEDS + [{"prompt_token_ids": [1] + list(range(6, 40))}]
    work = [(p, SamplingParams(temperature=t, seed=10 * i + j, max_tokens=48))
            for i, p in enumerate(prompts) for j, t in enumerate([0.9, 1.5, 3.0, 6.0])]
    once = llm.generate([p for p, _ in work], [sp for _, sp in work], use_tqdm=False)
    engine = llm.engine
    for i, (prompt, sp) in enumerate(work):
        engine.add_request(f"streamed-{i}", prompt, sp)
    streamed = {}
    while engine.has_unfinished_requests():
        streamed.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    for i, out in enumerate(once):
        # same seeds, same tokens
        assert streamed[f"streamed-{i}"].token_ids == out.outputs[0].token_ids
        assert streamed[f"streamed-{i}"].text == out.outputs[0].text


def test_incremental_text_equals_decoding_everything(llm):
    outs = llm.generate(SEEDS, SamplingParams(temperature=0.9, seed=3, max_tokens=48),
                        use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.text == llm.tokenizer.decode(c.token_ids), "step-by-step text must equal one decode"
        assert c.text.strip(), "the embedded model says something"


def test_prompt_starts_with_bos_and_generation_ends_at_eos(llm):
    ids = llm.tokenizer.encode("Hello there")
    assert ids[0] == llm.tokenizer.hf.bos_token_id
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=400),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == llm.engine.eos_token_id
    assert "</s>" not in out.text


def test_stop_strings_cut_the_text_and_stream_monotonically(llm):
    full = llm.generate("Hi, my name is", SamplingParams(temperature=0, max_tokens=40),
                        use_tqdm=False)[0].outputs[0].text
    word = full.split()[3]
    eng = llm.engine
    eng.add_request("s", "Hi, my name is", SamplingParams(temperature=0, max_tokens=40,
                                                          stop=[word, "zzz"]))
    seen = []
    while eng.has_unfinished_requests():
        seen += [o.outputs[0] for o in eng.step()]
    texts = [c.text for c in seen]
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:])), "streamed text only grows"
    final = seen[-1]
    assert final.finish_reason == "stop" and final.stop_reason == word
    assert final.text == full[: full.index(word)]


def test_find_stop_string_only_looks_at_new_text():
    # " def" is new: STOP was complete before
    assert find_stop_string("abc STOP def", 4, ["STOP"]) is None
    # "P def": its last letter is new
    assert find_stop_string("abc STOP def", 5, ["STOP"]) == (4, "STOP")
    assert find_stop_string("abc ST", 2, ["STOP"]) is None
    assert find_stop_string("abc STOP", 2, ["STOP", "c S"]) == (4, "STOP")
    assert find_stop_string("abc STOP", 6, ["STOP", "c S"]) == (2, "c S")


def test_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "What color is the sky?"}],
                   SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert out.outputs[0].text.strip()
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_decoding_once_holds_back_what_streaming_holds_back(llm):
    """Cut a text with multi-byte characters (several byte-level tokens each) after every token: the
    one-shot decode of the output equals the step-by-step text, also when it ends inside a
    character."""
    tok = llm.tokenizer
    ids = tok.encode("Hi ☃ there, 日本 café!")
    assert len(ids) > len("Hi ☃ there, 日本 café!".split()) + 4, "some characters span several tokens"
    split_ends = 0
    for end in range(4, len(ids) + 1):
        prompt, out = ids[:3], ids[3:end]
        state = tok.start_detokenizer(len(prompt))
        streamed = "".join(tok.detokenize_step(prompt + out[:i], state)
                           for i in range(1, len(out) + 1))
        once = tok.detokenize_rest(prompt + out, tok.start_detokenizer(len(prompt)))
        assert once == streamed
        split_ends += tok.decode(prompt + out).endswith("\ufffd")
    assert split_ends > 0, "some cuts end inside a character"
