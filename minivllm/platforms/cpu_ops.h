// The CPU fast path's entry points, declared once: each source defines its own and registers it as a torch op; the
// decoder layer (model/cpu_decoder_layer.cpp) calls them all directly, with no Python or dispatcher between them.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace minivllm_cpu {

// attention/cpu_paged_attention.cpp: store k, v at their slots, then attend each query over its context
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                           int64_t sliding_window);

// model/cpu_layer_ops.cpp: RMSNorm (with the residual add before it), rotary in place, SwiGLU
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
void rotary_embedding(const at::Tensor& positions, at::Tensor q, at::Tensor k, const at::Tensor& cos_sin);
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// quantization/cpu_unquantized.cpp: x @ W.T (+ b), W in tiles of 64 outputs
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t n);

// quantization/cpu_gguf.cpp: x @ W.T, W as the GGUF file's blocks of `type`
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t n);

}  // namespace minivllm_cpu
