"""GGUF files (llama.cpp's single-file format) by path: `LLM("model.Q4_0.gguf")`.

A GGUF file holds the config as metadata (`llama.block_count`, ...), the tokenizer (its tokens, merges and
special ids), and every tensor, each in its own type: F32/F16/BF16, or a block format such as Q8_0 (32
weights share an fp16 scale, one int8 each) or Q4_0 (32 weights, an fp16 scale, 4 bits each). transformers
reads the config and builds the tokenizer from the metadata (`gguf_file=`); the `gguf` package reads and
dequantizes the tensors, and this module maps llama.cpp's names to ours:

    token_embd -> embed_tokens          blk.N.attn_q/k/v/output -> layers.N.self_attn.q/k/v/o_proj
    output_norm -> norm, output -> lm_head    blk.N.ffn_gate/up/down -> layers.N.mlp.gate/up/down_proj
    blk.N.attn_norm / ffn_norm -> input_layernorm / post_attention_layernorm

llama.cpp's converter permutes the rows of a Llama's attn_q and attn_k (it pairs rotary dims i and i + d/2
as neighbours, its own rotary convention): undone here. Weights are dequantized at load to the compute
dtype (see bench/RESULTS.md for why rather than running Q8_0 blocks as they are); `quantization="int8"`
re-quantizes them per channel.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # general.architecture values we map (Mistral files say llama)
NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SKIPPED = ("rope_freqs",)  # llama3's rotary factors: we compute them from the config


def is_gguf(path: str | Path) -> bool:
    """A file that starts with GGUF's magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: GGUF file without general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def read_gguf_hf_config(path: Path):
    """transformers' config from the file's metadata; ValueError for an architecture we do not run."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{path}: reading GGUF files needs the gguf package: pip install gguf") from e
    arch = gguf_architecture(path)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {ARCHITECTURES})")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; we promise a ValueError
        raise ValueError(f"{path}: transformers could not read the GGUF metadata: {e}") from e


def hf_name(name: str) -> str | None:
    """llama.cpp's tensor name -> the Hugging Face one (None: a tensor we do not need)."""
    parts = name.split(".")
    if parts[0] in SKIPPED:
        return None
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in NAMES:
        return f"model.layers.{parts[1]}.{NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP:
        return f"{TOP[parts[0]]}.{parts[1]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's attn_q/attn_k row order: within each head, rows (i, i + d/2) were made neighbours."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(path: Path, cfg) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor in the file, dequantized and un-permuted."""
    from gguf import GGUFReader, dequantize

    for t in GGUFReader(path).tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if cfg.model_type in ("llama", "mistral") and (".q_proj." in name or ".k_proj." in name):
            w = unpermute(w, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        yield name, w
