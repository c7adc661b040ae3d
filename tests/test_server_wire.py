"""Issue 14 on the wire: logprobs in OpenAI's two formats, echo, penalties, logit_bias,
response_format and vLLM's extra fields, through the real `openai` client against test_server's tiny
chat model."""

from __future__ import annotations

import json
import logging
import math

import pytest

from tests.test_server import PROMPT, chat_ckpt, client, offline, server  # noqa: F401  (module fixtures)

MSGS = [{"role": "user", "content": "Hello there"}]


def test_completion_logprobs_match_the_engine(client, offline):  # noqa: F811
    from minivllm import SamplingParams

    r = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                           use_tqdm=False)[0]
    ids = ref.outputs[0].token_ids
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    for pos, tok, value, top in zip(ref.outputs[0].logprobs, ids, lp.token_logprobs,
                                    lp.top_logprobs):
        assert math.isclose(value, pos[tok].logprob, abs_tol=1e-5)
        # keyed by text, as OpenAI's format is: byte pieces of a character all read "\ufffd" and
        # share a key
        assert 1 <= len(top) <= 3 and max(top.values()) >= value - 1e-6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=6,
                                            temperature=0, logprobs=3, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    # the second request finds the prompt in the prefix cache: another computation path, so fp32
    # rounding may differ by ~1e-6 (seen: 1.4e-6); the suite's logprob tolerance against
    # transformers is 1e-4
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_echo_with_logprobs(client):  # noqa: F811
    r = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=3, temperature=0,
                                  logprobs=1, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith(PROMPT)
    n_prompt = r.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == n_prompt + 3
    assert (choice.logprobs.token_logprobs[0] is None
            and all(v is not None for v in choice.logprobs.token_logprobs[1:]))
    plain = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=3, temperature=0,
                                      echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def test_chat_logprobs(client):  # noqa: F811
    r = client.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert (bytes(item.bytes).decode("utf-8",
                                         errors="replace") == item.token or "\ufffd" in item.token)
    none = client.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=2)
    assert none.choices[0].logprobs is None


def test_penalties_logit_bias_and_vllm_extras(client, offline):  # noqa: F811
    from minivllm import SamplingParams

    r = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=5, temperature=0,
                                  logit_bias={"42": 100})
    tok = offline.get_tokenizer()
    assert tok(r.choices[0].text, add_special_tokens=False).input_ids[:1] == [42]
    extras = dict(min_tokens=4, include_stop_str_in_output=True, top_k=5, min_p=0.05,
                  repetition_penalty=1.2, skip_special_tokens=False, bad_words=["fox"],
                  allowed_token_ids=list(range(3, 200)))
    r = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=8, temperature=0.7,
                                  seed=3,
                                  presence_penalty=0.5, frequency_penalty=0.5, extra_body=extras)
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.7, seed=3,
                                                  presence_penalty=0.5, frequency_penalty=0.5,
                                                  **extras), use_tqdm=False)[0]
    assert r.choices[0].text == ref.outputs[0].text, "every field reaches the engine as the offline API sets it"


def test_response_format_and_guided_fields(client):  # noqa: F811
    schema = {"type": "object", "additionalProperties": False, "required": ["answer"],
              "properties": {"answer": {"enum": ["yes", "no"]}}}
    r = client.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=30,
                                       temperature=1.0, response_format={"type": "json_schema",
                                                        "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(r.choices[0].message.content)["answer"] in ("yes", "no")
    text = client.chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=3,
                                          response_format={"type": "text"})
    assert text.choices[0].finish_reason in ("stop", "length")
    for extra, check in [({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
                         ({"guided_regex": "[a-c]{3}"},
                          lambda t: len(t) == 3 and set(t) <= set("abc")),
                         ({"structured_outputs": {"choice": ["up", "down"]}},
                          lambda t: t in ("up", "down"))]:
        r = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=10,
                                      extra_body=extra)
        assert check(r.choices[0].text), (extra, r.choices[0].text)


def test_continuous_usage_stats(client):  # noqa: F811
    """What a standard streaming benchmark asks for: usage in every chunk, growing."""
    chunks = list(client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=6,
                                            temperature=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1].usage.completion_tokens == 6
    plain = list(client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=3,
                                           stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_unknown_fields_are_ignored_with_a_warning(client, caplog):  # noqa: F811
    with caplog.at_level(logging.WARNING, logger="minivllm.server"):
        r = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2,
                                      extra_body={"frobnicate": 1})
    assert r.choices[0].text is not None
    assert any("frobnicate" in rec.getMessage() for rec in caplog.records)
