// A decode step's decoder layer as one op: the bound layer's Python (model/cpu_bound_layer.py, which says when this
// runs) in C++. The same kernels, in the same order, on the same tensors, so the results are bitwise the same; what
// goes is what lay between them. At batch 1 a 135M Llama's layer is ten op calls with a few microseconds of work
// each, and from Python each call cost about as much again: argument parsing, the dispatcher, a frame. Here they
// are plain C++ calls (platforms/cpu_ops.h).
#include <torch/library.h>
#include <ATen/ATen.h>

#include "../platforms/cpu_ops.h"

#include <vector>

namespace minivllm_cpu {
namespace {

// How a linear layer's weight is held: the codes model/cpu_bound_layer.py passes (cpu_unquantized.py's tiles,
// cpu_gguf.py's blocks of a GGUF type).
constexpr int64_t kTiled = 0, kGguf = 1;

// One linear layer: parts [first, first + count) of the lists. Tiles are one part, their bias added in the kernel; a
// GGUF layer is one part per shard (shards of different types, gguf.py's GgufShardsLinearMethod), their outputs
// side by side, then the bias added, as gguf.py's and cpu_gguf.py's `bind` do.
at::Tensor linear(const at::Tensor& x, at::TensorList weights, const std::optional<at::Tensor>& bias,
                  at::IntArrayRef layouts, at::IntArrayRef types, at::IntArrayRef outputs, int64_t first,
                  int64_t count) {
  if (layouts[first] == kTiled) {
    TORCH_CHECK(count == 1, "decoder_layer: tiles are one part");
    return small_linear(x, weights[first], bias, outputs[first]);
  }
  std::vector<at::Tensor> shards;
  for (int64_t i = first; i < first + count; ++i) {
    TORCH_CHECK(layouts[i] == kGguf, "decoder_layer: unknown weight layout ", layouts[i]);
    shards.push_back(gguf_linear(x, weights[i], types[i], outputs[i]));
  }
  at::Tensor y = shards.size() == 1 ? shards[0] : at::cat(shards, -1);
  return bias.has_value() ? y + *bias : y;
}

}  // namespace

// x [T, hidden], residual [T, hidden] or None (the first layer). The four linear layers, in the order qkv_proj,
// o_proj, gate_up_proj, down_proj: their biases and how many parts each has; per part, its weight, layout (kTiled,
// kGguf), GGUF type and outputs.
// The caches and metadata as paged_attention takes them. Returns (the MLP's output, the residual), the residual add
// left to the next layer's norm, as DecoderLayer.forward leaves it.
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& positions,
    const at::Tensor& cos_sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef parts,
    at::IntArrayRef layouts, at::IntArrayRef types, at::IntArrayRef outputs, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double qk_eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
    double scale, int64_t sliding_window) {
  TORCH_CHECK(biases.size() == 4 && parts.size() == 4,
              "decoder_layer: four linear layers (qkv, o, gate_up, down)");
  const int64_t count = parts[0] + parts[1] + parts[2] + parts[3];
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == count && static_cast<int64_t>(layouts.size()) == count &&
                  static_cast<int64_t>(types.size()) == count && static_cast<int64_t>(outputs.size()) == count,
              "decoder_layer: one weight, layout, type and output size per part");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decoder_layer: q and k norms come together");
  const int64_t firsts[4] = {0, parts[0], parts[0] + parts[1], parts[0] + parts[1] + parts[2]};
  const auto project = [&](const at::Tensor& in, size_t i) {
    return linear(in, weights, biases.get(i), layouts, types, outputs, firsts[i], parts[i]);
  };
  at::Tensor h, sum;
  if (residual.has_value()) {
    std::tie(h, sum) = add_rms_norm(x, *residual, input_norm, eps);
  } else {  // the first layer: nothing to add yet
    h = rms_norm(x, input_norm, eps);
    sum = x;
  }
  const at::Tensor qkv = project(h, 0).view({-1, heads + 2 * kv_heads, head_dim});
  at::Tensor q = qkv.narrow(1, 0, heads), k = qkv.narrow(1, heads, kv_heads);
  const at::Tensor v = qkv.narrow(1, heads + kv_heads, kv_heads);
  if (q_norm.has_value()) {
    q = rms_norm(q, *q_norm, qk_eps);
    k = rms_norm(k, *k_norm, qk_eps);
  }
  rotary_embedding(positions, q, k, cos_sin);
  const at::Tensor o = paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                       query_start_loc, scale, sliding_window);
  std::tie(h, sum) = add_rms_norm(project(o.flatten(1), 1), sum, post_norm, eps);
  return {project(silu_and_mul(project(h, 2)), 3), sum};
}

}  // namespace minivllm_cpu

// The caches are written in place (a!, b!), as paged_attention's schema says.
TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("decoder_layer(Tensor x, Tensor? residual, Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
        "Tensor[] weights, Tensor?[] biases, int[] parts, int[] layouts, int[] types, int[] outputs, "
        "Tensor input_norm, Tensor post_norm, float eps, Tensor? q_norm, Tensor? k_norm, float qk_eps, int heads, "
        "int kv_heads, int head_dim, float scale, int sliding_window) -> (Tensor, Tensor)");
  m.impl("decoder_layer", c10::DispatchKey::CPU, TORCH_FN(minivllm_cpu::decoder_layer));
}
