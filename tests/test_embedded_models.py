"""The embedded models in minivllm/data/models load in plain transformers and speak simple English.

These are the models every offline chapter and CI job uses, so they are checked
here with transformers alone (CPU, a few seconds); rebuild them with
``python data/build.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

MODELS = Path(__file__).resolve().parents[1] / "minivllm" / "data" / "models"
TARGET, DRAFT = MODELS / "minivllm-tiny", MODELS / "minivllm-tiny-draft"
MOE = MODELS / "minivllm-tiny-moe"
PROMPTS = ["Hi, my name is", "Today is a beautiful summer day", "Hello there"]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def models() -> dict[str, PreTrainedModel]:
    return {p.name: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (TARGET, DRAFT, MOE)}


def greedy_text(model: PreTrainedModel, tok: PreTrainedTokenizerBase, ids: list[int], n: int) -> tuple[str, list[int]]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()
    return tok.decode(out, skip_special_tokens=True), out


def test_models_load_as_llama_with_gqa(models: dict[str, PreTrainedModel], tok: PreTrainedTokenizerBase) -> None:
    target, draft = models[TARGET.name], models[DRAFT.name]
    for m in (target, draft):
        assert m.config.model_type == "llama"
        assert m.config.vocab_size == len(tok)
        assert m.config.num_key_value_heads < m.config.num_attention_heads  # grouped-query attention
        assert (m.config.bos_token_id, m.config.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 4_000_000 <= n_target <= 15_000_000
    assert n_draft * 4 <= n_target


def test_moe_is_a_qwen3_moe_as_active_as_the_draft(models: dict[str, PreTrainedModel]) -> None:
    """8 experts, 2 per token, renormalised, each half the draft's MLP width: a token runs through the draft's
    MLP size (chapter 14 races the two), the model holds 4x the MLP weights."""
    moe, draft = models[MOE.name], models[DRAFT.name]
    c = moe.config
    assert c.model_type == "qwen3_moe" and (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob) == (8, 2, True)
    assert not c.output_router_logits  # the load-balancing loss was for training
    assert c.decoder_sparse_step == 1 and not c.mlp_only_layers  # every layer is sparse
    assert c.num_experts_per_tok * c.moe_intermediate_size == draft.config.intermediate_size
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(c, name) == getattr(draft.config, name), name
    experts = sum(p.numel() for n, p in moe.named_parameters() if ".experts." in n)
    active = sum(p.numel() for p in moe.parameters()) - experts + experts * 2 // 8
    router_and_norms = c.num_hidden_layers * (c.num_experts * c.hidden_size + 2 * c.head_dim)
    assert active == sum(p.numel() for p in draft.parameters()) + router_and_norms


@pytest.mark.parametrize("other", [DRAFT, MOE], ids=["draft", "moe"])
def test_every_model_ships_the_same_tokenizer(tok: PreTrainedTokenizerBase, other: Path) -> None:
    other_tok = AutoTokenizer.from_pretrained(other)
    assert other_tok.get_vocab() == tok.get_vocab()
    assert other_tok.chat_template == tok.chat_template


def test_tokenizer_prepends_bos_and_has_eos(tok: PreTrainedTokenizerBase) -> None:
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    ids = tok("Hi, my name is").input_ids
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert ids[-1] != tok.eos_token_id  # like Llama: BOS only, EOS comes from the model
    assert tok.decode(ids, skip_special_tokens=True) == "Hi, my name is"
    assert tok.decode(tok("héllo ☃").input_ids, skip_special_tokens=True) == "héllo ☃"  # byte-level: no UNK


def test_chat_template_renders(tok: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "What color is the sky?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>\nWhat color is the sky?</s>\n<|assistant|>\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<|user|>")]
    assert tok.convert_tokens_to_ids("<|assistant|>") in ids


@pytest.mark.parametrize("name", [TARGET.name, DRAFT.name, MOE.name])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generation_is_english(
    models: dict[str, PreTrainedModel], tok: PreTrainedTokenizerBase, name: str, prompt: str
) -> None:
    text, _ = greedy_text(models[name], tok, tok(prompt).input_ids, 24)
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 5, text
    assert text.isascii() and re.fullmatch(r"[A-Za-z0-9 ,.!?'\"-]+", text.strip()), text


def test_chat_answer_stops_at_eos(models: dict[str, PreTrainedModel], tok: PreTrainedTokenizerBase) -> None:
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What color is the sky?"}], add_generation_prompt=True, tokenize=False
    )
    answer, ids = greedy_text(models[TARGET.name], tok, tok(text, add_special_tokens=False).input_ids, 40)
    assert ids[-1] == tok.eos_token_id, answer
    assert "blue" in answer, answer


# --- minivllm vs transformers ------------------------------------------------------------------
@pytest.mark.parametrize("name", [TARGET.name, DRAFT.name, MOE.name])
def test_minivllm_greedy_equals_transformers(models: dict[str, PreTrainedModel], tok: PreTrainedTokenizerBase,
                                              name: str) -> None:
    """Token for token, for the seed prompts in one batch, with chunked prefill and preemption in play."""
    from minivllm import LLM, SamplingParams

    refs = [greedy_text(models[name], tok, tok(p).input_ids, 48)[1] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=48)
    for kw in (dict(), dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=5)):
        llm = LLM(str(MODELS / name), **kw)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
        assert [o.outputs[0].text for o in outs] == [tok.decode(r, skip_special_tokens=True) for r in refs]
        if kw:
            assert llm.engine.stats()["num_preemptions"] > 0
