"""How many bytes a model's weights take in each format: the arithmetic chapter 12 tabulates.

Linear layers hold almost all the weights; embeddings, LM head and norms stay in the compute dtype
in every format here (as GPTQ and AWQ checkpoints keep them). Per linear layer, K inputs, N outputs:

    float            N * K * dtype bytes
    int8             N * K + N * dtype bytes              (one scale per output channel)
    gptq / awq       N * K / 2 + (K / G) * N * (2 + 1/2)  (fp16 scale, 4-bit zero point per group)
                     (+ 4 * K for GPTQ's g_idx)
    gguf Q8_0, Q4_0  N * K * 34 / 32, N * K * 18 / 32     (blocks of 32: an fp16 scale plus 32 or
                     16 bytes; as stored in the file: minivllm dequantizes them at load)
"""

from __future__ import annotations

# (K inputs, N outputs, dtype bytes, group size) -> bytes, per format
BYTES = {"float": lambda k, n, d, g: n * k * d,
         "int8": lambda k, n, d, g: n * k + n * d,
         "gptq": lambda k, n, d, g: n * k // 2 + (k // g) * n * 2 + (k // g) * n // 2 + 4 * k,
         "awq": lambda k, n, d, g: n * k // 2 + (k // g) * n * 2 + (k // g) * n // 2,
         "gguf-Q8_0": lambda k, n, d, g: n * k * 34 // 32,
         "gguf-Q4_0": lambda k, n, d, g: n * k * 18 // 32}
FORMATS = tuple(BYTES)


def linear_bytes(in_features: int, out_features: int, fmt: str = "float", dtype_bytes: int = 2,
                 group_size: int = 128) -> int:
    if fmt not in BYTES:
        raise ValueError(f"unknown format {fmt!r} (known: {FORMATS})")
    group = in_features if group_size == -1 else group_size
    return BYTES[fmt](in_features, out_features, dtype_bytes, group)


def model_weight_bytes(mc, fmt: str = "float", dtype_bytes: int = 2, group_size: int = 128) -> int:
    """Weight bytes of a ModelConfig (read_model_config) with its linear layers in `fmt`."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    shapes = [(mc.hidden_size, q + 2 * kv), (q, mc.hidden_size),
              (mc.hidden_size, 2 * mc.intermediate_size), (mc.intermediate_size, mc.hidden_size)]
    per_layer = (sum(linear_bytes(k, n, fmt, dtype_bytes, group_size) for k, n in shapes)
                 + 2 * mc.hidden_size * dtype_bytes)  # the two norms
    if mc.qkv_bias:
        per_layer += (q + 2 * kv) * dtype_bytes
    embeddings = mc.vocab_size * mc.hidden_size * dtype_bytes * (1 if mc.tie_word_embeddings else 2)
    return mc.num_layers * per_layer + embeddings + mc.hidden_size * dtype_bytes
