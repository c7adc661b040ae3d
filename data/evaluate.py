"""Measure the embedded models with plain transformers and write data/README.md.

Every figure in the README comes from this script (nothing is typed by hand), so
the README always describes the weights that are actually in minivllm/data/models/ (shipped as package data).
Models are evaluated in float32: the float16 checkpoints are upcast exactly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from corpus import HELDOUT_SEED, generate_chats, generate_corpus
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DATA = Path(__file__).resolve().parent
MODELS = DATA.parent / "minivllm" / "data" / "models"  # shipped in the package: LLM() finds them installed
TARGET, DRAFT = MODELS / "minivllm-tiny", MODELS / "minivllm-tiny-draft"
MOE = MODELS / "minivllm-tiny-moe"  # Qwen3-MoE: 8 experts, 2 per token; the draft's active size
SEED_PROMPTS = ["Hi, my name is", "Today is a beautiful summer day", "Hello there"]
CHAT_QUESTIONS = ["What color is the sky?", "What is two plus three?", "Tell me a short story."]
NEW_TOKENS = 40
CHAT_TOKENS = 160  # enough for a whole story answer, which ends with EOS
HELDOUT_STORIES, HELDOUT_CHATS = 400, 100  # perplexity sample
AGREEMENT_PROMPTS, AGREEMENT_TOKENS = 40, 64  # draft-vs-target sample
REBUILD = "python data/build.py"


def greedy(model: PreTrainedModel, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation token ids (stops at EOS, which the models learned to emit)."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def heldout_documents(tok: PreTrainedTokenizerBase) -> list[list[int]]:
    """Held-out stories and chats (a seed the training never used), formatted exactly like training."""
    stories = generate_corpus(HELDOUT_STORIES, HELDOUT_SEED)
    docs = [ids + [tok.eos_token_id] for ids in tok(stories)["input_ids"]]
    for chat in generate_chats(HELDOUT_CHATS, HELDOUT_SEED):
        text = tok.apply_chat_template(chat, tokenize=False).rstrip("\n")
        docs.append(tok(text, add_special_tokens=False)["input_ids"])
    return docs


@torch.no_grad()
def perplexity(model: PreTrainedModel, docs: list[list[int]]) -> float:
    """Token-weighted perplexity over all predicted positions of the documents."""
    nll, count = 0.0, 0
    for ids in docs:
        x = torch.tensor([ids])
        nll += model(input_ids=x, labels=x).loss.item() * (len(ids) - 1)
        count += len(ids) - 1
    return float(torch.tensor(nll / count).exp())


@torch.no_grad()
def draft_agreement(target: PreTrainedModel, draft: PreTrainedModel, tok: PreTrainedTokenizerBase) -> float:
    """Fraction of positions in target-generated text where the draft's greedy token equals the target's.

    This is the per-token acceptance rate of greedy speculative decoding.
    """
    prompts = SEED_PROMPTS + [" ".join(s.split()[:4]) for s in generate_corpus(AGREEMENT_PROMPTS, HELDOUT_SEED + 1)]
    same = total = 0
    for prompt in prompts:
        ids = tok(prompt)["input_ids"]
        seq = torch.tensor([ids + greedy(target, ids, AGREEMENT_TOKENS)])
        start = len(ids) - 1  # first position whose next token was generated
        t = target(seq).logits[0, start:-1].argmax(-1)
        d = draft(seq).logits[0, start:-1].argmax(-1)
        same += int((t == d).sum())
        total += len(t)
    return same / total


def folder_size(path: Path) -> int:
    """Bytes of the files that ship (git-ignored corpus/, logs and caches excluded)."""
    skip = {"corpus", "__pycache__"}
    return sum(
        f.stat().st_size
        for f in path.rglob("*")
        if f.is_file() and not skip & set(f.relative_to(path).parts) and f.suffix != ".log"
    )


def mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def active_parameters(model: PreTrainedModel) -> int:
    """Parameters one token runs through: all of a dense model; a MoE's experts count k/E of theirs."""
    c = model.config
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    if not experts:
        return sum(p.numel() for p in model.parameters())
    others = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    return others + experts * c.num_experts_per_tok // c.num_experts


def mlp_shape(c: Any) -> str:
    if getattr(c, "num_experts", 0):
        return f"{c.num_experts_per_tok} of {c.num_experts} experts x {c.moe_intermediate_size}"
    return str(c.intermediate_size)


def model_table(models: dict[str, PreTrainedModel], stats: dict[str, dict], ppl: dict[str, float]) -> str:
    """Markdown table with one column per model."""
    cols = [(TARGET, stats["target"]), (DRAFT, stats["draft"]), (MOE, stats["moe"])]

    def row(label: str, cell: Callable[[Any, dict, Path], str]) -> str:
        return f"| {label} | " + " | ".join(cell(models[p.name].config, s, p) for p, s in cols) + " |"

    return "\n".join(
        [
            "| | " + " | ".join(f"`{p.name}`" for p, _ in cols) + " |",
            "|---" * (len(cols) + 1) + "|",
            row("parameters", lambda c, s, p: f"{s['parameters']:,}"),
            row("parameters active per token", lambda c, s, p: f"{active_parameters(models[p.name]):,}"),
            row(
                "layers / hidden / MLP",
                lambda c, s, p: f"{c.num_hidden_layers} / {c.hidden_size} / {mlp_shape(c)}",
            ),
            row(
                "attention heads / KV heads / head dim",
                lambda c, s, p: f"{c.num_attention_heads} / {c.num_key_value_heads} / {c.head_dim}",
            ),
            row("vocabulary / max positions", lambda c, s, p: f"{c.vocab_size:,} / {c.max_position_embeddings:,}"),
            row("`model.safetensors` (float16)", lambda c, s, p: mb((p / "model.safetensors").stat().st_size)),
            row("training steps x tokens per step", lambda c, s, p: f"{s['steps']:,} x {s['tokens'] // s['steps']:,}"),
            row("training time", lambda c, s, p: f"{s['train_seconds'] / 60:.1f} min"),
            row("final training loss (smoothed)", lambda c, s, p: f"{s['final_loss']:.3f}"),
            row("**held-out perplexity**", lambda c, s, p: f"**{ppl[p.name]:.3f}**"),
        ]
    )


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    start = time.time()
    tok = AutoTokenizer.from_pretrained(TARGET)
    models = {
        p.name: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (TARGET, DRAFT, MOE)
    }
    target, draft = models[TARGET.name], models[DRAFT.name]
    stats = json.loads((MODELS / "training.json").read_text())
    docs = heldout_documents(tok)
    ppl = {name: perplexity(m, docs) for name, m in models.items()}
    agreement = draft_agreement(target, draft, tok)
    continuations = {
        name: [
            (p, tok.decode(greedy(m, tok(p)["input_ids"], NEW_TOKENS), skip_special_tokens=True)) for p in SEED_PROMPTS
        ]
        for name, m in models.items()
    }
    chats = []
    for q in CHAT_QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        ids = tok(ids, add_special_tokens=False)["input_ids"]
        chats.append((q, tok.decode(greedy(target, ids, CHAT_TOKENS), skip_special_tokens=True)))

    table = model_table(models, stats, ppl)
    files = "\n".join(
        f"| `{f.relative_to(DATA.parent)}` | {f.stat().st_size:,} |"
        for p in (TARGET, DRAFT, MOE) for f in sorted(p.iterdir())
    )
    samples = "\n\n".join(
        f"**`{name}`**\n\n" + "\n".join(f"- **{p}**{c}" for p, c in conts) for name, conts in continuations.items()
    )
    chat_lines = "\n".join(f"- user: *{q}*  \n  assistant: {a}" for q, a in chats)
    ratio = stats["draft"]["parameters"] / stats["target"]["parameters"]
    moe = models[MOE.name].config
    readme = f"""# Embedded models

`data/` trains, and `minivllm/data/models/` holds (as package data), the models every offline
chapter, test and CI job uses: a small
Llama-architecture **target** model and a **draft** model for speculative
decoding, and a small **mixture of experts** (chapter 14), all trained by this project from scratch
on a synthetic corpus of simple children's stories and short chats (`data/corpus.py`). Nothing is
downloaded; the whole folder is rebuilt by one command.

Everything below is written by `data/evaluate.py`; do not edit it by hand.

## Rebuild

```bash
{REBUILD}    # corpus -> tokenizer -> target -> draft -> moe -> evaluation, log in data/build.log
```

{table}

- Draft size: {ratio:.1%} of the target's parameters.
- `{MOE.name}` is a `Qwen3MoeForCausalLM` trained by `python data/train.py moe` (transformers' own model and
  its load-balancing loss, coefficient {moe.router_aux_loss_coef}; the loss in the table is the language-model
  part), with the target's tokenizer on the same corpus: {moe.num_experts} experts per layer, {moe.num_experts_per_tok}
  chosen per token (`norm_topk_prob`: their weights rescaled to sum to 1), each expert half the draft's MLP
  width, so one token runs through as many parameters as the draft while the model holds
  {stats["moe"]["parameters"] / stats["draft"]["parameters"]:.1f}x as many. Its training is sized to about
  10 minutes of a busy 2-core CPU (a quarter of the draft's tokens).
- Training machine (recorded by `data/train.py`): {stats["target"]["machine"]}.
- Held-out perplexity: {len(docs)} documents ({HELDOUT_STORIES} stories and {HELDOUT_CHATS} chats) from
  the generator with seed {HELDOUT_SEED} (training used another seed), BOS ... EOS as in training.
- **Draft agreement: {agreement:.1%}** of positions where the draft's greedy next token equals the target's,
  measured on {AGREEMENT_TOKENS}-token greedy target continuations of {AGREEMENT_PROMPTS + len(SEED_PROMPTS)} prompts.
- Total size of `data/` (without the git-ignored `corpus/` and logs) and its models in
  `minivllm/data/models/`: {mb(folder_size(DATA) + folder_size(MODELS))}.
- Evaluation took {time.time() - start:.0f} s.

## Greedy continuations ({NEW_TOKENS} new tokens, transformers `generate`, prompt in bold)

{samples}

## Chat (target, greedy, `apply_chat_template(..., add_generation_prompt=True)`, up to {CHAT_TOKENS} tokens)

{chat_lines}

## Tokenizer

Byte-level BPE trained with `tokenizers` on the corpus ({len(tok)} tokens; the corpus has
fewer word types than the 2048 cap). Special tokens: `<pad>`={tok.pad_token_id}, `<s>`={tok.bos_token_id} (BOS,
prepended to every encoding like Llama), `</s>`={tok.eos_token_id} (EOS, ends every story and chat turn),
`<|system|>`, `<|user|>`, `<|assistant|>`. The chat template (in `tokenizer_config.json`) renders

```text
{tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True, tokenize=False)}
```

## Files

| file | bytes |
|---|---|
{files}

Weights are stored in float16; configs say `"dtype": "float16"`. Load with
`AutoModelForCausalLM.from_pretrained("minivllm/data/models/minivllm-tiny")` and `AutoTokenizer.from_pretrained(...)`
(pass `dtype=torch.float32` for fast CPU inference).
"""
    (DATA / "README.md").write_text(readme)
    print(readme)


if __name__ == "__main__":
    main()
