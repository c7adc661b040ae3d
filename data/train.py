"""Train the embedded tokenizer, the two Llama models and the small mixture of experts on the generated corpus.

Plain PyTorch on purpose: the whole recipe (packing, AdamW, cosine schedule) fits
on one screen and runs on a 2-core CPU in well under an hour. Every random
choice is seeded, so a rebuild gives the same weights up to floating-point
non-determinism of the CPU kernels.

The MoE (``minivllm-tiny-moe``, a Qwen3-MoE with 8 experts, 2 per token) has the draft's shapes
except that each layer's MLP is 8 experts of half the draft's MLP width: a token runs through 2 of
them, so its *active* parameters are the draft's, its total several times more. Chapter 14 races
the two. It is trained with transformers' load-balancing loss, as Qwen3-MoE was.

Usage: ``python data/train.py {tokenizer,target,draft,moe}`` (``data/build.py`` runs all).
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from corpus import TRAIN_SEED, generate_chats, generate_corpus
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

DATA = Path(__file__).resolve().parent
MODELS = DATA.parent / "minivllm" / "data" / "models"  # shipped in the package: LLM() finds them installed
TOKENIZER_DIR = DATA / "corpus" / "tokenizer"  # git-ignored staging copy; it ships inside each model folder
STATS = MODELS / "training.json"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# Zephyr/TinyLlama-style template: EOS closes every turn, so generation stops after an answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
NUM_STORIES, NUM_CHATS = 60_000, 12_000


@dataclass
class Recipe:
    """Architecture and optimisation settings of one model."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    steps: int
    lr: float
    batch_size: int = 16
    seq_len: int = 256
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    # mixture of experts (0 experts: a dense Llama)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    router_aux_loss_coef: float = 0.01


RECIPES = {
    "target": Recipe("minivllm-tiny", 256, 768, 6, 8, 4, steps=1500, lr=2e-3),
    "draft": Recipe("minivllm-tiny-draft", 128, 384, 2, 4, 2, steps=1000, lr=3e-3),
    # intermediate_size is each expert's: 2 of 8 experts x 192 = the draft's 384 per token. Sized to about
    # 10 minutes of a busy 2-core CPU (a quarter of the draft's tokens: shorter sequences, fewer steps).
    "moe": Recipe(
        "minivllm-tiny-moe", 128, 192, 2, 4, 2, steps=560, lr=3e-3, seq_len=128, warmup=50,
        num_experts=8, num_experts_per_tok=2,
    ),
}


def log(msg: str) -> None:
    """Timestamped progress line (build.py redirects stdout to data/build.log)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE that, like Llama's tokenizer, prepends BOS but not EOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,  # the corpus has ~1.8k word types, so BPE stops a bit below this cap
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    )


def save_tokenizer(tok: PreTrainedTokenizerFast, out: Path) -> None:
    """Save with the chat template inside tokenizer_config.json and a class name that
    both transformers 4.x and 5.x resolve, so older installs load the same files."""
    tok.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=1024, chat_template=CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def training_documents(tok: PreTrainedTokenizerFast) -> list[list[int]]:
    """Token ids of every training document: BOS + text + EOS, stories and chats shuffled together."""
    stories = generate_corpus(NUM_STORIES, TRAIN_SEED)
    docs = [ids + [tok.eos_token_id] for ids in tok(stories)["input_ids"]]
    chats = [tok.apply_chat_template(c, tokenize=False).rstrip("\n") for c in generate_chats(NUM_CHATS, TRAIN_SEED)]
    docs += tok(chats, add_special_tokens=False)["input_ids"]  # the template already has BOS and EOS
    random.Random(TRAIN_SEED).shuffle(docs)
    return docs


def batches(docs: list[list[int]], r: Recipe) -> torch.Tensor:
    """Pack documents into one stream and cut it into [steps, batch, seq_len] (cycling if short)."""
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    need = r.steps * r.batch_size * r.seq_len
    epochs = need / len(stream)
    log(f"{len(docs)} documents, {len(stream):,} tokens; {r.name} sees {need:,} tokens ({epochs:.2f} epochs)")
    stream = stream.repeat(math.ceil(epochs))[:need]
    return stream.view(r.steps, r.batch_size, r.seq_len)


def build_model(r: Recipe, tok: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A freshly initialised LlamaForCausalLM, or Qwen3MoeForCausalLM when the recipe has experts."""
    common = dict(
        vocab_size=len(tok),
        hidden_size=r.hidden_size,
        num_hidden_layers=r.num_hidden_layers,
        num_attention_heads=r.num_attention_heads,
        num_key_value_heads=r.num_key_value_heads,
        head_dim=r.hidden_size // r.num_attention_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if not r.num_experts:
        return LlamaForCausalLM(LlamaConfig(intermediate_size=r.intermediate_size, **common))
    config = Qwen3MoeConfig(
        moe_intermediate_size=r.intermediate_size,
        intermediate_size=r.intermediate_size * r.num_experts_per_tok,  # unused: every layer is sparse
        num_experts=r.num_experts,
        num_experts_per_tok=r.num_experts_per_tok,
        norm_topk_prob=True,  # the chosen experts' weights are rescaled to sum to 1 (Qwen3-MoE's release)
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=True,  # training adds router_aux_loss_coef x the load-balancing loss
        router_aux_loss_coef=r.router_aux_loss_coef,
        attention_bias=False,
        **common,
    )
    return Qwen3MoeForCausalLM(config)


def train_model(r: Recipe, tok: PreTrainedTokenizerFast) -> dict[str, float | int | str]:
    """Train one model from scratch and save it (fp16) with the tokenizer."""
    torch.manual_seed(r.seed)
    model = build_model(r, tok)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{r.name}: {n_params:,} parameters, {asdict(r)}")
    data = batches(training_documents(tok), r)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": r.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=r.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < r.warmup:
            return r.lr * (step + 1) / r.warmup
        progress = (step - r.warmup) / max(1, r.steps - r.warmup)
        return r.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    # Checkpoints in the git-ignored staging area let an interrupted build resume where it stopped
    # (data order depends only on the step, so a resumed run trains exactly like an uninterrupted one).
    ckpt_path, first, running, before = DATA / "corpus" / f"{r.name}.ckpt.pt", 0, 0.0, 0.0
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        first, running, before = ckpt["step"], ckpt["running"], ckpt["seconds"]
        log(f"{r.name}: resuming at step {first} from {ckpt_path}")
    model.train()
    start = time.time() - before
    for step in range(first, r.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        out = model(input_ids=data[step], labels=data[step])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the MoE's loss includes router_aux_loss_coef x the load-balancing loss: log the language-model part
        aux = getattr(out, "aux_loss", None)
        lm_loss = out.loss.item() - (r.router_aux_loss_coef * aux.item() if aux is not None else 0.0)
        running = lm_loss if step == 0 else 0.98 * running + 0.02 * lm_loss
        if step % 50 == 0 or step == r.steps - 1:
            elapsed = time.time() - start
            eta = (time.time() - start - before) / (step + 1 - first) * (r.steps - step - 1)
            log(
                f"{r.name} step {step}/{r.steps} loss {running:.3f} lr {lr_at(step):.2e} "
                f"elapsed {elapsed / 60:.1f} min eta {eta / 60:.1f} min"
            )
        if (step + 1) % 100 == 0 and step + 1 < r.steps:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1, "running": running}
            torch.save(state | {"seconds": time.time() - start}, ckpt_path)
    seconds = time.time() - start
    out, staging = MODELS / r.name, MODELS / f".{r.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    model.config.output_router_logits = False  # the load-balancing loss was for training: inference skips it
    model.to(torch.float16).save_pretrained(staging)
    save_tokenizer(tok, staging)
    shutil.rmtree(out, ignore_errors=True)  # swap in the new folder only once it is complete,
    staging.rename(out)  # so notebooks and tests using the old model keep working meanwhile
    ckpt_path.unlink(missing_ok=True)
    log(f"saved {out} after {seconds / 60:.1f} min")
    return {
        "parameters": n_params,
        "train_seconds": round(seconds),
        "steps": r.steps,
        "tokens": r.steps * r.batch_size * r.seq_len,
        "final_loss": round(running, 4),
    }


def machine() -> str:
    """CPU model and core count, recorded next to the training time."""
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def main(stage: str) -> None:
    torch.set_num_threads(2)
    MODELS.mkdir(parents=True, exist_ok=True)
    if stage == "tokenizer":
        stories = generate_corpus(NUM_STORIES, TRAIN_SEED)
        chats = [m["content"] for c in generate_chats(NUM_CHATS, TRAIN_SEED) for m in c]
        start = time.time()
        tok = train_tokenizer(stories + chats)
        save_tokenizer(tok, TOKENIZER_DIR)
        log(f"tokenizer: {len(tok)} tokens in {time.time() - start:.1f} s -> {TOKENIZER_DIR}")
        return
    # the MoE shares the target's tokenizer; a checkout without the staging copy reads the shipped one
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR if TOKENIZER_DIR.exists() else MODELS / RECIPES["target"].name)
    stats = json.loads(STATS.read_text()) if STATS.exists() else {}
    stats[stage] = train_model(RECIPES[stage], tok) | {"machine": machine()}
    STATS.write_text(json.dumps(stats, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
