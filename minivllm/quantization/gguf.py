"""GGUF files (llama.cpp's single-file format) by path: `LLM("model.Q4_0.gguf")`.

A GGUF file holds the config as metadata (`llama.block_count`, ...), the tokenizer (tokens, merges,
special ids), and every tensor in its own type: F32/F16/BF16, or a block format such as Q8_0 (32
weights share an fp16 scale, one int8 each) or Q4_0 (the same, 4 bits each). transformers reads the
config and tokenizer from the metadata (`gguf_file=`); the `gguf` package reads and dequantizes the
tensors, and this module maps llama.cpp's names to ours:

    token_embd -> embed_tokens          blk.N.attn_q/k/v/output -> layers.N.self_attn.q/k/v/o_proj
    output_norm -> norm, output -> lm_head blk.N.ffn_gate/up/down -> layers.N.mlp.gate/up/down_proj
    blk.N.attn_norm / ffn_norm -> input_layernorm / post_attention_layernorm

llama.cpp's converter permutes the rows of a Llama's attn_q and attn_k (it pairs rotary dims i and i
+ d/2 as neighbours, its own rotary convention): undone here. Weights are dequantized at load to the
compute dtype (see bench/RESULTS.md for why rather than running Q8_0 blocks as they are);
`quantization="int8"` re-quantizes them per channel.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

# general.architecture values we map (Mistral files say llama)
ARCHITECTURES = ("llama", "qwen2", "qwen3")
NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SKIPPED = ("rope_freqs",)  # llama3's rotary factors: we compute them from the config


def is_gguf(path: str | Path) -> bool:
    """A file that starts with GGUF's magic bytes."""
    if not Path(path).is_file():
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
    """transformers' config from the file's metadata; ValueError for an architecture we lack."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{path}: reading GGUF files needs the gguf package: "
                         "pip install gguf") from e
    arch = gguf_architecture(path)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{ARCHITECTURES})")
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
    """Undo llama.cpp's attn_q/attn_k row order: in each head, rows (i, i + d/2) were neighbours."""
    pairs = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
    return pairs.transpose(1, 2).reshape(w.shape)


def gguf_tensors(path: Path, cfg) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) per tensor in the file, dequantized, un-permuted."""
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


def _gguf_metadata(writer, cfg) -> None:
    """The config keys llama.cpp's converter writes, from which transformers rebuilds the config."""
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)


def _gguf_tokenizer(writer, tokenizer_dir: str | Path) -> None:
    """The byte-level BPE tokenizer of tokenizer.json as metadata, so the file carries its own."""
    import json

    import gguf

    tok = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    tokens = sorted(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
    special = {a["id"] for a in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in tok["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)


def _gguf_names(cfg) -> dict[str, str]:
    """Our tensor names -> llama.cpp's, in the converter's order (no output.weight when tied)."""
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for i in range(cfg.num_hidden_layers):
        for theirs, ours in NAMES.items():
            if theirs not in ("attn_q_norm", "attn_k_norm"):  # Qwen3's; a Llama has none
                names[f"model.layers.{i}.{ours}.weight"] = f"blk.{i}.{theirs}.weight"
    if cfg.tie_word_embeddings:  # no output.weight: readers tie the head to token_embd
        del names["lm_head.weight"]
    return names


def write_gguf(path: str | Path, model, tokenizer_dir: str | Path, arch: str = "llama",
               mlp_type: str = "Q8_0", attention_type: str = "Q4_0") -> None:
    """A transformers Llama as llama.cpp's converter writes it (tests, benchmarks): metadata, the
    byte-level BPE tokenizer of `tokenizer_dir`/tokenizer.json, attn_q/attn_k rows permuted, MLP
    and attention matrices in the given GGML types ("F32": float), the rest F32."""
    import gguf
    import numpy as np

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    _gguf_metadata(writer, cfg)
    _gguf_tokenizer(writer, tokenizer_dir)

    def permute(w, n):
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    for hf_name, name in _gguf_names(cfg).items():
        w = state[hf_name]
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            w = permute(w, heads)
        kind = mlp_type if ".ffn_" in name else attention_type
        if name.startswith("blk.") and w.ndim == 2 and kind != "F32":
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
