"""The rest of vLLM's SamplingParams: penalties, min_tokens, logit_bias, allowed ids, bad words,
text options, and structured outputs. Each alone, then all of them mixed in one batch against each
request run alone."""

import json
import re

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sampling.sampler import (
    SamplingBatch,
    apply_frequency_presence_penalties,
    apply_logits_processors,
)
from minivllm.sampling_params import StructuredOutputsParams
from tests.conftest import build_checkpoint
from tests.test_server import write_tokenizer

PROMPT = "Hi, my name is"


@pytest.fixture(scope="module")
def llm():
    return LLM(block_size=16, num_kv_blocks=128)


def greedy(**kw):
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 16), **kw)


def run(llm, params, prompt=PROMPT):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_frequency_and_presence_penalties_are_openai_s():
    logits = torch.zeros(1, 6)
    batch = SamplingBatch.build([SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)],
                                [[9, 9, 1, 1, 1, 4]],
                                "cpu", num_prompt_tokens=[2])  # prompt [9, 9] is not penalised
    out = apply_frequency_presence_penalties(logits.clone(), batch)[0]
    assert out.tolist() == [0, -(3 * 0.5 + 0.25), 0, 0, -(0.5 + 0.25), 0]


def test_penalties_steer_away_from_repeats(llm):
    plain = run(llm, greedy(max_tokens=40))
    for field in ("frequency_penalty", "presence_penalty"):
        penalised = run(llm, greedy(max_tokens=40, **{field: 1.5}))
        assert len(set(penalised.token_ids)) > len(set(plain.token_ids)), field


def test_min_tokens_masks_stops(llm):
    ids = run(llm, greedy(max_tokens=8)).token_ids
    stop = ids[1]
    first = ids.index(stop)
    assert run(llm, greedy(max_tokens=8, stop_token_ids=[stop])).token_ids == ids[: first + 1]
    late = run(llm, greedy(max_tokens=8, stop_token_ids=[stop], min_tokens=first + 3))
    assert len(late.token_ids) >= first + 3 and stop not in late.token_ids[: first + 2]
    eos_out = run(llm, greedy(max_tokens=200), "Hello there")
    assert eos_out.finish_reason == "stop", "the embedded model ends this one with EOS"
    forced = run(llm, greedy(max_tokens=200, min_tokens=len(eos_out.token_ids) + 5), "Hello there")
    assert len(forced.token_ids) >= len(eos_out.token_ids) + 5


def test_logit_bias_and_allowed_token_ids(llm):
    tok = llm.get_tokenizer()
    target = tok.encode(" cat", add_special_tokens=False)[0]
    assert set(run(llm, greedy(max_tokens=5, logit_bias={target: 100.0})).token_ids) == {target}
    allowed = tok.encode(" the cat sat on a mat", add_special_tokens=False)
    out = run(llm, SamplingParams(temperature=1.0, seed=0, max_tokens=20,
                                  allowed_token_ids=allowed))
    assert set(out.token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)


def test_bad_words_are_never_said(llm):
    plain = run(llm, greedy(max_tokens=12))
    assert "Tom" in plain.text
    out = run(llm, greedy(max_tokens=12, bad_words=["Tom", "two words"]))
    assert "Tom" not in out.text and out.text != plain.text


def test_text_options(llm):
    tok = llm.get_tokenizer()
    ends = run(llm, greedy(max_tokens=200), "Hello there")
    assert ends.token_ids[-1] == tok.eos_token_id and "</s>" not in ends.text
    kept = run(llm, greedy(max_tokens=200, skip_special_tokens=False,
                           include_stop_str_in_output=True), "Hello there")
    assert kept.text.endswith("</s>")
    silent = run(llm, greedy(max_tokens=10, detokenize=False))
    assert silent.text == "" and silent.token_ids == run(llm, greedy(max_tokens=10)).token_ids
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    out = llm.generate("One two three four five six",
                       greedy(max_tokens=2, truncate_prompt_tokens=3), use_tqdm=False)[0]
    full = tok.encode("One two three four five six")
    assert out.prompt_token_ids == full[-3:]


def test_every_field_mixed_in_one_batch_equals_each_alone(llm):
    tok = llm.get_tokenizer()
    cat = tok.encode(" cat", add_special_tokens=False)[0]
    params = [
        SamplingParams(temperature=0.9, seed=1, max_tokens=20, presence_penalty=1.0,
                       frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, logprobs=2),
        SamplingParams(temperature=1.2, seed=2, max_tokens=20, top_k=20, top_p=0.9, min_p=0.05,
                       min_tokens=10),
        SamplingParams(temperature=0.7, seed=3, max_tokens=20, logit_bias={cat: 3.0},
                       bad_words=["Tom"]),
        SamplingParams(temperature=1.0, seed=4, max_tokens=20,
                       allowed_token_ids=tok.encode(" the a cat dog ran sat . and",
                                                    add_special_tokens=False)),
        SamplingParams(temperature=0, max_tokens=30, stop=["."], include_stop_str_in_output=True,
                       skip_special_tokens=False),
        SamplingParams(temperature=0.8, seed=5, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(regex=r" (yes|no)[.!]")),
    ]
    prompts = ["Hi, my name is", "Once upon a time", "The dog", "Tom had a", "The cat",
               "Hello there", "Is it?"]
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together):
        alone = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids and out.outputs[0].text == alone.text, p


def test_processors_keep_plain_rows_untouched():
    logits = torch.randn(2, 50)
    batch = SamplingBatch.build([SamplingParams(), SamplingParams(logit_bias={3: 2.0})], [[1], [1]],
                                "cpu")
    out = apply_logits_processors(logits, batch)
    assert torch.equal(out[0], logits[0]) and out[1, 3] == logits[1, 3] + 2.0


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                  "maxItems": 3}}}


def check_schema(value):
    assert (set(value) == {"name", "age", "pets"} and isinstance(value["name"],
                                                                 str) and len(value["name"]) <= 10)
    assert (isinstance(value["age"], int) and value["age"] >= 0 and set(value["pets"]) <= {"cat",
                                                                                           "dog"})


def constrained(llm, spec, n=6, temperature=1.0, max_tokens=80):
    params = SamplingParams(temperature=temperature, seed=7, n=n, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(**spec))
    return [c.text for c in llm.generate("Tom said:", params, use_tqdm=False)[0].outputs]


def test_structured_outputs_parse(llm):
    for text in constrained(llm, {"json": SCHEMA}):
        check_schema(json.loads(text))
    params = SamplingParams(temperature=1.0, seed=7, n=6, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    # a story-teller rambles inside keys:
    for c in llm.generate("Tom said:", params, use_tqdm=False)[0].outputs:
        # whatever max_tokens cuts short is a valid start; what ends is an object
        assert c.text.startswith("{")
        assert c.finish_reason == "length" or isinstance(json.loads(c.text), dict)
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)
               for t in constrained(llm, {"regex": r"[0-9]{3}-[0-9]{4}"}))
    assert set(constrained(llm, {"choice": ["yes", "no", "maybe not"]},
                           n=12)) <= {"yes", "no", "maybe not"}
    lark = 'start: "Tom " VERB " a " NOUN "."\nVERB: "has" | "sees"\nNOUN: /[a-z]+/'
    assert all(re.fullmatch(r"Tom (has|sees) a [a-z]+\.", t)
               for t in constrained(llm, {"grammar": lark}))
    gbnf = 'root ::= "Tom " ("has" | "sees") " a cat."'
    assert set(constrained(llm, {"grammar": gbnf})) <= {"Tom has a cat.", "Tom sees a cat."}


def test_structured_output_with_speculative_decoding(llm):
    """Drafts the grammar forbids are rejected and rolled back: the output equals plain
    decoding's."""
    spec = LLM(speculative_model="[ngram]", num_speculative_tokens=3, num_kv_blocks=128)
    for kind, value in (("json", SCHEMA), ("regex", r"( [a-z]+){3}\.")):
        params = SamplingParams(temperature=0, max_tokens=80,
                                structured_outputs=StructuredOutputsParams(**{kind: value}))
        prompts = ["Tom said:", "Tom said: Tom said:"]
        plain = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].text for o in spec.generate(prompts, params, use_tqdm=False)] == plain
    assert spec.engine.stats()["spec_num_proposed"] > 0


def test_structured_outputs_with_an_llguidance_that_takes_one_end_id(monkeypatch):
    """llguidance 1.6 (what pip finds for some platforms) refuses a list of end ids: the first one
    ends the grammar, and the output still parses."""
    import llguidance.hf

    ends, build = [], llguidance.LLTokenizer

    def one_end(*args, eos_token=None, **kwargs):
        ends.append(eos_token)
        if isinstance(eos_token, list):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        return build(*args, eos_token=eos_token, **kwargs)

    monkeypatch.setattr(llguidance.hf, "LLTokenizer", one_end)
    llm = LLM(block_size=16, num_kv_blocks=64)
    for text in constrained(llm, {"json": SCHEMA}, n=3):
        check_schema(json.loads(text))
    assert ends == [list(llm.engine.eos_token_ids), llm.engine.eos_token_ids[0]]


def test_bad_grammars_are_refused_before_any_work(llm):
    for spec, message in (({"regex": "(unclosed"}, "structured outputs"),
                          ({"json": "{not json"}, "structured"),
                          ({"grammar": "start: foo("}, "grammar")):
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(**spec)),
                         use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="x")
    assert not llm.engine.has_unfinished_requests()


def test_structured_output_on_a_byte_level_tokenizer(tmp_path):
    """A byte-level BPE (characters split across tokens) and a vocabulary padded past the
    tokenizer."""
    path = tmp_path / "bytes"
    path.mkdir()
    vocab = write_tokenizer(path)
    build_checkpoint("llama", path, vocab_size=vocab + 20, eos_token_id=vocab - 1)
    llm = LLM(path, block_size=8, num_kv_blocks=128)
    for text in constrained(llm, {"json": SCHEMA}, n=8, max_tokens=120):
        check_schema(json.loads(text))
    assert all(re.fullmatch(r"[a-zé]{2,6}", t) for t in constrained(llm, {"regex": r"[a-zé]{2,6}"},
                                                                    n=8))
