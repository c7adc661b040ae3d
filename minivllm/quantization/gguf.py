"""GGUF files (llama.cpp's single-file format) by path: `LLM("model.Q4_0.gguf")`.

A GGUF file holds the config and the tokenizer as metadata (which transformers reads, `gguf_file=`)
and every tensor in its own type: F32/F16/BF16, or a block format such as Q8_0 (32 weights share an
fp16 scale, one int8 each) or Q4_0 (4 bits each). The `gguf` package reads and dequantizes the
tensors; this module maps llama.cpp's names to ours (NAMES, TOP) and undoes what its converter
does to them: the row permutation of a Llama's (and Mistral's, Mixtral's) attn_q and attn_k (it
pairs rotary dims i and i + d/2 as neighbours), the +1 in Gemma 3's norms, each layer's experts
stacked in one 3-D tensor per projection (copied expert by expert into the stacked layout of
model/moe.py), and the config keys transformers' GGUF reading drops (`with_experts`,
`with_gemma3_rules`). Where the platform has a kernel for a tensor's block format (the cpu
platform's cpu_gguf.py, one process), its linear layer keeps the file's blocks (`GgufLinearMethod`)
and reads them every step: the loader (model/gguf_blocks.py) picks those layers. Everything else is
dequantized at load to the compute dtype; `quantization="int8"` re-quantizes it per channel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from minivllm.quantization.base import Layout, LinearKernel, LinearMethod, NativePart, add_weight

# general.architecture values we map (Mistral and Mixtral files say llama)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma3")
# the files' architecture for our model_type, where it is not the same name
GGUF_ARCHITECTURE = {"mistral": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe",
                     "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3"}
NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         # a mixture of experts: the router, Qwen2-MoE's shared expert and its gate
         "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
         "ffn_up_shexp": "mlp.shared_expert.up_proj",
         "ffn_down_shexp": "mlp.shared_expert.down_proj",
         "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# Gemma 3 norms around attention and the MLP: four a layer, stored with Gemma's +1 already added
# (llama.cpp computes a plain RMSNorm; ours computes (1 + weight), as transformers does)
GEMMA3_NAMES = {**NAMES, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
NORM_SHIFT = {"gemma3": 1.0}
# every expert of a layer in one 3-D tensor [E, out, in]: each expert's projection, by name
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SKIPPED = ("rope_freqs",)  # llama3's rotary factors: we compute them from the config
PERMUTED = ("llama", "mistral", "mixtral")  # the families whose attn_q / attn_k rows are reordered


def is_gguf(path: str | Path) -> bool:
    """A file that starts with GGUF's magic bytes."""
    if not Path(path).is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def read_gguf_hf_config(path: Path):
    """transformers' config from the file's metadata; ValueError for an architecture we lack."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ValueError(f"{path}: reading GGUF files needs the gguf package: "
                         "pip install gguf") from e
    reader = GGUFReader(path)  # (a memory map: the tensors are not read)
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: GGUF file without general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode()
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{ARCHITECTURES})")
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; we promise a ValueError
        raise ValueError(f"{path}: transformers could not read the GGUF metadata: {e}") from e
    return with_gemma3_rules(hf, reader) if arch == "gemma3" else with_experts(hf, reader, arch)


def metadata(reader, key: str, default=None):
    """One scalar metadata value of the file (`default` where the file has none)."""
    field = reader.fields.get(key)
    return default if field is None else field.parts[field.data[0]].tolist()[0]


def with_gemma3_rules(hf, reader):
    """A Gemma 3 file holds the global rope base, its linear scaling, the window; llama.cpp fixes
    the rest, and so must we: every 6th layer global (unless the file says another pattern), local
    layers rotating with base 10000 (unless `rope.freq_base_swa`), queries scaled by
    head_dim**-0.5 (hidden / heads for the 62-layer 27B): transformers' GGUF reading leaves these
    at its defaults."""
    field = reader.fields.get("gemma3.attention.sliding_window_pattern")
    if field is not None and len(field.data) > 1:  # one flag a layer: True where it is local
        local = [bool(field.parts[i][0]) for i in field.data]
    else:  # every `pattern`-th layer global
        pattern = metadata(reader, "gemma3.attention.sliding_window_pattern", 6)
        local = [(i + 1) % pattern != 0 for i in range(hf.num_hidden_layers)]
    hf.layer_types = ["sliding_attention" if each else "full_attention" for each in local]
    full = {"rope_type": "default", "rope_theta": metadata(reader, "gemma3.rope.freq_base", 1e6)}
    if metadata_str(reader, "gemma3.rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=metadata(reader, "gemma3.rope.scaling.factor"))
    hf.rope_parameters = {"full_attention": full, "sliding_attention": {
        "rope_type": "default", "rope_theta": metadata(reader, "gemma3.rope.freq_base_swa", 1e4)}}
    hf.query_pre_attn_scalar = (hf.hidden_size // hf.num_attention_heads
                                if hf.num_hidden_layers == 62 else hf.head_dim)
    return hf


def with_experts(hf, reader, arch: str):
    """What transformers' GGUF reading leaves out of a mixture of experts: a Mixtral file says
    "llama" (and comes back a Llama) with `llama.expert_count` experts; a Qwen MoE file keeps each
    expert's and the shared expert's sizes in keys transformers skips, and says which layers are
    sparse only by which layers hold a router (`ffn_gate_inp`), as llama.cpp reads it."""
    experts = metadata(reader, f"{arch}.expert_count", 0)
    if not experts:
        return hf
    if arch == "llama":
        from transformers import MixtralConfig

        keep = {k: v for k, v in hf.to_dict().items()
                if k not in ("model_type", "architectures", "transformers_version")}
        return MixtralConfig(**{**keep, "num_local_experts": experts,
                                "num_experts_per_tok": metadata(reader, "llama.expert_used_count")})
    routed = {t.name.split(".")[1] for t in reader.tensors if ".ffn_gate_inp." in t.name}
    hf.moe_intermediate_size = metadata(reader, f"{arch}.expert_feed_forward_length")
    hf.shared_expert_intermediate_size = metadata(
        reader, f"{arch}.expert_shared_feed_forward_length", 0)
    hf.decoder_sparse_step = 1
    hf.mlp_only_layers = [i for i in range(hf.num_hidden_layers) if str(i) not in routed]
    return hf


def layer_names(reader) -> dict[str, str]:
    """llama.cpp's per-layer tensor names -> ours, for the file's architecture."""
    return GEMMA3_NAMES if metadata_str(reader, "general.architecture") == "gemma3" else NAMES


def metadata_str(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def hf_name(name: str, names: dict[str, str] = NAMES) -> str | None:
    """llama.cpp's tensor name -> the Hugging Face one (None: a tensor we do not need)."""
    parts = name.split(".")
    if parts[0] in SKIPPED:
        return None
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in EXPERTS:  # all experts: no one name
        return f"model.layers.{parts[1]}.mlp.experts.{EXPERTS[parts[2]]}"
    if len(parts) == 2 and parts[0] in TOP:
        return f"{TOP[parts[0]]}.{parts[1]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's attn_q/attn_k row order: in each head, rows (i, i + d/2) were neighbours."""
    pairs = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
    return pairs.transpose(1, 2).reshape(w.shape)


def tensor_types(path: Path) -> dict[str, int]:
    """Hugging Face name -> the ggml type id the file stores that tensor in."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {name: int(t.tensor_type) for t in reader.tensors
            if (name := hf_name(t.name, layer_names(reader))) is not None}


def gguf_tensors(path: Path, cfg, blocks: frozenset[str] = frozenset()
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) per tensor in the file, un-permuted: the file's blocks as uint8
    [rows, bytes per row] for the names in `blocks`, every other tensor dequantized to float32
    (Gemma's norms with the converter's +1 taken off)."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(path)
    names, shift = layer_names(reader), NORM_SHIFT.get(metadata_str(reader, "general.architecture"))
    for t in reader.tensors:
        name = hf_name(t.name, names)
        if name is None:
            continue
        if name in blocks:  # each row of W is a run of blocks: rows permute like float rows
            w = torch.from_numpy(t.data.copy()).reshape(int(t.shape[-1]), -1)
        else:
            w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
            w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if cfg.model_type in PERMUTED and (".q_proj." in name or ".k_proj." in name):
            w = unpermute(w, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        if shift and name.endswith("norm.weight"):
            w = w - shift
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp's is a vector, transformers' a one-output layer
        if ".experts." in name:  # all experts [E, out, in]: each one's view, copied into place
            for expert, each in enumerate(w):
                yield f"{name.replace('.experts.', f'.experts.{expert}.')}.weight", each
            continue
        yield name, w


def row_bytes(ggml_type: int, inputs: int) -> int:
    """Bytes of one weight row of `inputs` values in blocks of `ggml_type`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]  # per block
    if inputs % weights:
        raise ValueError(f"a layer of {inputs} inputs is not whole blocks of {weights} weights")
    return inputs // weights * nbytes


class GgufLinearMethod(LinearMethod):
    """A layer held as the file's blocks of one ggml type (`ggml_type`): uint8 [N, bytes per row],
    the rows of a fused layer's shards stacked as for float weights. The kernel is the platform's
    (`LinearKernels.gguf`); the loader gives this method only to layers whose shards share a type.
    """

    def __init__(self, kernel: LinearKernel, ggml_type: int, compute_dtype: torch.dtype) -> None:
        super().__init__(kernel)
        self.ggml_type, self.compute_dtype = ggml_type, compute_dtype

    def create_weights(self, layer: nn.Module) -> None:
        shape = (layer.output_size, row_bytes(self.ggml_type, layer.input_size))
        add_weight(layer, "weight", shape, torch.uint8, Layout(output_dim=0, input_dim=1))
        layer.ggml_type, layer.compute_dtype = self.ggml_type, self.compute_dtype
        layer.kernel_type = self.ggml_type  # the kernel may regroup the blocks (cpu_gguf.py)

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """A tied embedding's lookup in this (LM head) layer's blocks."""
        return self.kernel.rows(layer, ids)


class GgufShardsLinearMethod(LinearMethod):
    """A fused layer whose shards the file stores in different block types (Q4_K_M's Q4_K q and k
    beside a Q6_K v): one flat uint8 tensor holds each shard's blocks after the other's, as the file
    has them, and each shard is multiplied in its own type, one kernel call per shard, the outputs
    side by side. The kernel sees each shard as a layer of its own (`shards`)."""

    def __init__(self, kernel: LinearKernel, ggml_types: list[int],
                 compute_dtype: torch.dtype) -> None:
        super().__init__(kernel)
        self.ggml_types, self.compute_dtype = ggml_types, compute_dtype
        self.shapes: list[tuple[int, int]] = []  # (rows, bytes per row) per shard: create_weights

    def create_weights(self, layer: nn.Module) -> None:
        self.shapes = [(rows, row_bytes(ggml_type, layer.input_size))
                       for rows, ggml_type in zip(layer.output_sizes, self.ggml_types)]
        total = sum(rows * nbytes for rows, nbytes in self.shapes)
        add_weight(layer, "weight", (total,), torch.uint8, Layout(output_dim=None, input_dim=None))
        layer.compute_dtype = self.compute_dtype
        for i, ggml_type in enumerate(self.ggml_types):  # ints: a weight cache restores them
            setattr(layer, f"kernel_type_{i}", ggml_type)

    def shards(self, layer: nn.Module) -> list[SimpleNamespace]:
        """Each shard as the kernel reads a layer: its blocks (a view of the flat tensor), types,
        sizes."""
        parts, start = [], 0
        for i, (rows, nbytes) in enumerate(self.shapes):
            parts.append(SimpleNamespace(
                weight=layer.weight[start:start + rows * nbytes].view(rows, nbytes),
                ggml_type=self.ggml_types[i], kernel_type=getattr(layer, f"kernel_type_{i}"),
                output_size=rows, input_size=layer.input_size, compute_dtype=layer.compute_dtype,
                bias=None))
            start += rows * nbytes
        return parts

    def load_weight(self, layer: nn.Module, name: str, loaded: torch.Tensor, shard: int | None,
                    where: str) -> bool:
        part = self.shards(layer)[shard].weight
        if tuple(loaded.shape) != tuple(part.shape) or loaded.dtype != torch.uint8:
            raise ValueError(f"{where} has shape {tuple(loaded.shape)} ({loaded.dtype}), expected "
                             f"{tuple(part.shape)} blocks")
        with torch.no_grad():
            part.copy_(loaded)
        return True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The kernel's layout per shard (it may regroup its bytes), kept in the flat tensor."""
        for i, part in enumerate(self.shards(layer)):
            flat = part.weight.view(-1)
            self.kernel.layout(part)  # may swap part.weight for a regrouped copy
            if part.weight.data_ptr() != flat.data_ptr():
                with torch.no_grad():
                    flat.copy_(part.weight.reshape(-1))
            setattr(layer, f"kernel_type_{i}", part.kernel_type)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.cat([self.kernel.apply(part, x, None) for part in self.shards(layer)], dim=-1)
        return y if bias is None else y + bias

    def bind(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        calls, bias = [self.kernel.bind(part) for part in self.shards(layer)], layer.bias
        if bias is not None:
            return lambda x: self.apply(layer, x, bias)
        return lambda x: torch.cat([call(x) for call in calls], dim=-1)

    def native(self, layer: nn.Module) -> list[NativePart] | None:
        """Each shard's part, in order (C++ concatenates their outputs as `bind` does)."""
        parts = [self.kernel.native(part) for part in self.shards(layer)]
        return None if None in parts else [p for shard in parts for p in shard]


def gguf_names(state: dict, tied: bool, names: dict[str, str] = NAMES
               ) -> Iterator[tuple[str, str, slice | None]]:
    """(llama.cpp's name, our state-dict name, rows of it) per tensor a converter writes: stacked
    experts [E, 2I, H] split into the file's ffn_gate_exps / ffn_up_exps halves."""
    ours = {hf: theirs for theirs, hf in names.items()}
    top = {f"{hf}.weight": f"{theirs}.weight" for theirs, hf in TOP.items()}
    for key, t in state.items():
        if key in top:
            if not (tied and key == "lm_head.weight"):
                yield top[key], key, None
            continue
        _, _, layer, rest = key.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        if module in ours:
            yield f"blk.{layer}.{ours[module]}.{suffix}", key, None
        elif rest == "mlp.experts.gate_up_proj":
            half = t.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", key, slice(0, half)
            yield f"blk.{layer}.ffn_up_exps.weight", key, slice(half, None)
        elif rest == "mlp.experts.down_proj":
            yield f"blk.{layer}.ffn_down_exps.weight", key, None
        else:
            raise ValueError(f"write_gguf: no llama.cpp name for {key}")


def write_gguf(path: str | Path, model, tokenizer_dir: str | Path, mlp_type: str = "Q8_0",
               attention_type: str = "Q4_0", types: dict[str, str] | None = None,
               raw: dict[str, object] | None = None, expert_type: str | None = None) -> None:
    """A transformers model (Llama, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE) as llama.cpp's converter
    writes it (tests, benchmarks): the config keys from which transformers rebuilds the config (a
    Mixtral's architecture is llama with experts), the byte-level BPE tokenizer of
    `tokenizer_dir`/tokenizer.json, attn_q/attn_k rows permuted (Llama family), MLP and attention
    matrices in the given GGML types ("F32": float), the experts in `expert_type` (default
    `mlp_type`), routers and the rest F32; `types`: llama.cpp tensor name -> its type instead (a
    file that mixes types, a quantized token_embd); `raw`: name -> that type's bytes, written as
    given (the gguf package cannot quantize to every type it reads, Q4_K and Q6_K)."""
    import json

    import gguf
    import numpy as np

    cfg = model.config
    arch = GGUF_ARCHITECTURE.get(cfg.model_type, cfg.model_type)
    if arch not in ARCHITECTURES:
        arch = "llama"
    w = gguf.GGUFWriter(str(path), arch)
    rope = getattr(cfg, "rope_parameters", None) or {}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if arch != "gemma3":
        w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    if arch != "llama":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":  # the global layers' rope; the rest is llama.cpp's fixed rules
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(float(full["rope_theta"]))
        w.add_sliding_window(cfg.sliding_window)
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(full["factor"]))
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":  # (a Mixtral's feed_forward_length is each expert's)
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    tok = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    tokens = sorted(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
    special = {a["id"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    table = GEMMA3_NAMES if arch == "gemma3" else NAMES
    for name, ours, rows in gguf_names(state, cfg.tie_word_embeddings, table):
        t = state[ours] if rows is None else state[ours][:, rows]
        if ours.endswith("norm.weight"):
            t = t + NORM_SHIFT.get(arch, 0.0)
        if cfg.model_type in PERMUTED and (".attn_q." in name or ".attn_k." in name):
            n = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        kind = (types or {}).get(name, mlp_type if ".ffn_" in name else attention_type)
        if "_exps." in name and name not in (types or {}):
            kind = expert_type or mlp_type
        if ".ffn_gate_inp" in name:  # routers stay float, as llama.cpp's quantizer keeps them
            kind = "F32"
        if name in (raw or {}):
            w.add_tensor(name, raw[name], raw_dtype=gguf.GGMLQuantizationType[kind])
        elif (name.startswith("blk.") or name in (types or {})) and t.ndim >= 2 and kind != "F32":
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t), qtype),
                         raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
