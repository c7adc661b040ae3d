"""Load a Hugging Face checkpoint (config.json + *.safetensors), or a GGUF file, into our decoder.

The config is parsed by transformers' AutoConfig and the tensors are read with safetensors, shard by
shard, straight into the (possibly fused) parameters, so nothing is held twice in memory. A
quantized checkpoint (config.json's `quantization_config`) is recognised when the config is read,
and refused there if it is of a format we do not run; its linear layers then hold the format's own
tensors (minivllm/quantization/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from minivllm.distributed.parallel import SINGLE, TensorParallel
from minivllm.model.gguf_blocks import EMBEDDING, keep_gguf_blocks
from minivllm.model.lazy_loading import load_layers_on_first_use
from minivllm.model.llama import Implementations
from minivllm.model.registry import SUPPORTED_MODEL_TYPES, architecture_of, model_class
from minivllm.model.weight_cache import cache_key, load_cached
from minivllm.model.weights import LAYERS, CheckpointWeights
from minivllm.quantization import QuantizationConfig, checkpoint_quantization
from minivllm.quantization.gguf import gguf_tensors, is_gguf, read_gguf_hf_config, tensor_types

SUPPORTED = SUPPORTED_MODEL_TYPES  # the model_types whose architecture registry.py lists


@dataclass
class ModelConfig:
    """The handful of numbers the engine needs, normalised across model families and transformers
    versions."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: torch.dtype | None
    eos_token_id: int | list[int] | None
    hf_config: object = None
    sliding_window: int | None = None  # tokens a query may look back, where limited (Mistral v0.1)
    sliding_layers: tuple[bool, ...] | None = None  # which layers slide (None: all, given a window)
    quantization: QuantizationConfig | None = None  # what the linear layers hold (None: floats)
    gguf: bool = False  # the checkpoint is one GGUF file (see gguf_blocks.py)
    architecture: str = "LlamaForCausalLM"  # the registry key (model/registry.py) of its family
    # a mixture of experts (model/moe_layer.py), from the family's layer_options; 0 experts: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0  # k: the experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's (`intermediate_size` is the dense layers')
    norm_topk_prob: bool = False  # the k kept router weights rescaled to sum to 1
    moe_layers: tuple[bool, ...] | None = None  # which layers are sparse (None: all of them)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    expert_parallel: bool = False  # whole experts per rank (EngineConfig.enable_expert_parallel)


def read_model_config(path: str | Path) -> ModelConfig:
    """Parse config.json with transformers; a ValueError naming the path where it isn't usable."""
    from transformers import AutoConfig

    path = Path(path)
    gguf = is_gguf(path)
    if gguf:
        hf = read_gguf_hf_config(path)
    elif not path.is_dir():
        raise ValueError(f"model directory not found: {path}")
    elif not (path / "config.json").is_file():
        raise ValueError(f"no config.json in model directory {path}")
    else:
        try:
            hf = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises many kinds; we only promise a ValueError
            raise ValueError(f"malformed config.json in {path}: {e}") from e
    architecture = architecture_of(hf, str(path))
    options = model_class(architecture).layer_options(hf)  # what the family reads from its config
    heads = hf.num_attention_heads
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    # transformers 5 calls it `dtype`, 4.x `torch_dtype` (reading the old name in 5 warns)
    dtype = vars(hf).get("dtype") or vars(hf).get("torch_dtype")
    qc = getattr(hf, "quantization_config", None)
    return ModelConfig(
        model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        rms_norm_eps=hf.rms_norm_eps, rope_theta=float(theta),
        rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default"
        else None,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        torch_dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
        eos_token_id=hf.eos_token_id, hf_config=hf,
        quantization=checkpoint_quantization(qc if qc is None or isinstance(qc, dict)
                                             else qc.to_dict(), str(path)),
        gguf=gguf, architecture=architecture, **options,
    )


def read_generation_config(path: str | Path) -> dict:
    """generation_config.json as a dict: EOS ids and sampling defaults ({} when the checkpoint has
    none, as a GGUF file: its path is not a directory)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"malformed generation_config.json in {path}: {e}") from e


def load_model(path: str | Path, cfg: ModelConfig, impl: Implementations, dtype: torch.dtype,
               device: str, tp: TensorParallel = SINGLE, lazy: bool = False,
               weight_cache: Path | None = None) -> torch.nn.Module:
    """Build the model without initialising weights, then copy every checkpoint tensor into place. A
    linear layer's tensors go through its `weight_loader` (model/linear.py), whatever the format;
    once all are in, each layer's quantization method prepares them for its kernels
    (`process_weights_after_loading`). `impl`: the ops, attention and linear kernels the model runs
    (a platform's, minivllm/platforms/). Under tensor parallelism (`tp`) every rank reads the whole
    checkpoint and keeps its slices. A GGUF file's layers keep its blocks where the platform has a
kernel for them (gguf_blocks.py). `lazy`: the decoder layers stay unallocated until a forward
    pass first reaches them (lazy_loading.py); a GGUF file is always read whole. `weight_cache`: a
    directory where the loaded model is written once, then mapped by every process that loads it
    (weight_cache.py; CPU and one rank only, ignored elsewhere; mapped pages load lazily anyway).
    """
    path = Path(path)
    family = model_class(cfg.architecture)  # registry.py: the class config.json's name asks for
    family.check_dtype(dtype)

    def meta() -> tuple[torch.nn.Module, frozenset[str]]:
        """The model on "meta", and the GGUF tensors its layers keep as blocks (gguf_blocks.py)."""
        with torch.device("meta"):
            model = family(cfg, impl, tp)
            blocks = frozenset()
            if cfg.gguf and impl.linear.gguf is not None and tp.size == 1 and not cfg.quantization:
                blocks = keep_gguf_blocks(model, tensor_types(path), impl.linear.gguf, dtype,
                                          cfg.tie_word_embeddings)
        return model, blocks

    if weight_cache is not None and device == "cpu" and tp.size == 1:
        key = cache_key(path, cfg, impl, dtype, device)
        return load_cached(Path(weight_cache), key, lambda: meta()[0],
                           lambda: load_model(path, cfg, impl, dtype, device, tp))
    model, blocks = meta()
    lazy = lazy and not cfg.gguf
    layers, model.model.layers = model.model.layers, torch.nn.ModuleList()
    model = model.to_empty(device=device).to(dtype)  # all but the decoder layers
    if not lazy:
        layers = layers.to_empty(device=device).to(dtype)
    model.model.layers = layers
    if cfg.tie_word_embeddings and EMBEDDING not in blocks:  # (else the head holds the blocks)
        model.lm_head.tie_to(model.model.embed_tokens)
    weights = CheckpointWeights(model, cfg, skip=LAYERS if lazy else None)
    for where, name, tensor in checkpoint_tensors(path, cfg, blocks):
        if name == EMBEDDING and name in blocks:  # the tied head holds the embedding's blocks
            model.lm_head.weight_loader("weight", tensor(), None, f"{where}: {name}")
            weights.loaded.add(name)
            continue
        weights.load(where, name, tensor)
    weights.finish(path)
    if lazy:
        load_layers_on_first_use(model, path, cfg, device, dtype)
    model.share_tied_weight()
    model.model.rotary_emb.build()
    return model.eval()


def checkpoint_tensors(path: Path, cfg: ModelConfig, blocks: frozenset[str] = frozenset()):
    """(where, name, get-the-tensor) for each tensor of the checkpoint, in Hugging Face names
    (`blocks`: GGUF tensors read as the file's blocks)."""
    if cfg.gguf:
        for name, tensor in gguf_tensors(path, cfg, blocks):
            yield path.name, name, lambda tensor=tensor: tensor
        return
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in model directory {path}")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield file, name, lambda f=f, name=name: f.get_tensor(name)


def generation_defaults(path: str | Path, eos_token_id: int | list[int] | None,
                        use_generation_config: bool = True) -> tuple[tuple[int, ...], dict]:
    """Every id that ends a sequence, and the sampling defaults used without SamplingParams. The
    ids: `eos_token_id` (the tokenizer's, or config.json's without one) plus
    generation_config.json's list (Llama 3 and Qwen name several: end of text, end of turn). The
    defaults: its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens, in
    SamplingParams' names (vLLM's generation_config="auto")."""
    generation = read_generation_config(path) if use_generation_config else {}
    eos: list = []
    for ids in (eos_token_id, generation.get("eos_token_id")):
        eos += ids if isinstance(ids, list) else [ids]
    sampling = {{"max_new_tokens": "max_tokens"}.get(k, k): v for k, v in generation.items()
                if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                         "max_new_tokens")}
    return tuple(dict.fromkeys(i for i in eos if i is not None)), sampling
