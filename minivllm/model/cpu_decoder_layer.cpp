// A decode step's decoder layer as one op: the bound layer's Python (model/cpu_bound_layer.py, which says when this
// runs) in C++. The same kernels, in the same order, on the same tensors, so the results are bitwise the same; what
// goes is what lay between them. At batch 1 a 135M Llama's layer is ten op calls with a few microseconds of work
// each, and from Python each call cost about as much again: argument parsing, the dispatcher, a frame. Here they
// are plain C++ calls (platforms/cpu_ops.h). `decoder_layers` runs a whole stack of them in one op: from Python each
// layer's call cost another 25-50 us of argument conversion and frames (27 arguments), a millisecond a step.
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

using Biases = c10::ArrayRef<std::optional<at::Tensor>>;

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
    at::TensorList weights, Biases biases, at::IntArrayRef parts, at::IntArrayRef layouts, at::IntArrayRef types,
    at::IntArrayRef outputs, const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double qk_eps, int64_t heads,
    int64_t kv_heads, int64_t head_dim, double scale, int64_t sliding_window) {
  TORCH_CHECK(biases.size() == 4 && parts.size() == 4,
              "decoder_layer: four linear layers (qkv, o, gate_up, down)");
  const int64_t count = parts[0] + parts[1] + parts[2] + parts[3];
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == count && static_cast<int64_t>(layouts.size()) == count &&
                  static_cast<int64_t>(types.size()) == count && static_cast<int64_t>(outputs.size()) == count,
              "decoder_layer: one weight, layout, type and output size per part");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decoder_layer: q and k norms come together");
  const int64_t firsts[4] = {0, parts[0], parts[0] + parts[1], parts[0] + parts[1] + parts[2]};
  const auto project = [&](const at::Tensor& in, size_t i) {
    return linear(in, weights, biases[i], layouts, types, outputs, firsts[i], parts[i]);
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

// The op's entry: its list of optional biases as the layer reads them
std::tuple<at::Tensor, at::Tensor> decoder_layer_op(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& positions,
    const at::Tensor& cos_sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef parts,
    at::IntArrayRef layouts, at::IntArrayRef types, at::IntArrayRef outputs, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double qk_eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
    double scale, int64_t sliding_window) {
  const std::vector<std::optional<at::Tensor>> each = biases.vec();
  return decoder_layer(x, residual, positions, cos_sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                       query_start_loc, weights, each, parts, layouts, types, outputs, input_norm, post_norm, eps,
                       q_norm, k_norm, qk_eps, heads, kv_heads, head_dim, scale, sliding_window);
}

// Every layer of a stack, layer i reading kv_caches[i] ([layers, 2, blocks, block_size, kv_heads, dim]) and its
// slice of each list: 4 biases and 4 part counts, its parts' weights, layouts, types and outputs, 2 norms (input,
// post-attention), 2 optional q/k norms, 3 floats (eps, qk_eps, scale) and 4 ints (heads, kv_heads, head_dim,
// sliding window). Returns the last layer's (output, residual), as decoder_layer does.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin, at::Tensor& kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
    at::IntArrayRef parts, at::IntArrayRef layouts, at::IntArrayRef types, at::IntArrayRef outputs,
    at::TensorList norms, const c10::List<std::optional<at::Tensor>>& qk_norms, at::ArrayRef<double> floats,
    at::IntArrayRef ints) {
  const int64_t layers = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(parts.size()) == 4 * layers &&
                  static_cast<int64_t>(qk_norms.size()) == 2 * layers &&
                  static_cast<int64_t>(floats.size()) == 3 * layers &&
                  static_cast<int64_t>(ints.size()) == 4 * layers && kv_caches.size(0) >= layers,
              "decoder_layers: per layer 2 norms, 4 biases, 4 part counts, 2 q/k norms, 3 floats, 4 ints, a cache");
  const std::vector<std::optional<at::Tensor>> each_bias = biases.vec(), each_qk = qk_norms.vec();
  const Biases all_biases(each_bias);
  at::Tensor h = x;
  std::optional<at::Tensor> residual;
  int64_t first = 0;  // the layer's first part
  for (int64_t i = 0; i < layers; ++i) {
    const at::IntArrayRef counts = parts.slice(4 * i, 4);
    const int64_t count = counts[0] + counts[1] + counts[2] + counts[3];
    TORCH_CHECK(first + count <= static_cast<int64_t>(weights.size()), "decoder_layers: too few parts");
    at::Tensor cache = kv_caches.select(0, i), k_cache = cache.select(0, 0), v_cache = cache.select(0, 1);
    const int64_t* n = ints.data() + 4 * i;
    const double* f = floats.data() + 3 * i;
    auto [out, sum] = decoder_layer(h, residual, positions, cos_sin, k_cache, v_cache, slot_mapping, block_tables,
                                    seq_lens, query_start_loc, weights.slice(first, count),
                                    all_biases.slice(4 * i, 4), counts, layouts.slice(first, count),
                                    types.slice(first, count), outputs.slice(first, count), norms[2 * i],
                                    norms[2 * i + 1], f[0], each_qk[2 * i], each_qk[2 * i + 1], f[1], n[0], n[1],
                                    n[2], f[2], n[3]);
    h = std::move(out);
    residual = std::move(sum);
    first += count;
  }
  return {h, *residual};
}

}  // namespace minivllm_cpu

// The caches are written in place (a!, b!), as paged_attention's schema says.
TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("decoder_layer(Tensor x, Tensor? residual, Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
        "Tensor[] weights, Tensor?[] biases, int[] parts, int[] layouts, int[] types, int[] outputs, "
        "Tensor input_norm, Tensor post_norm, float eps, Tensor? q_norm, Tensor? k_norm, float qk_eps, int heads, "
        "int kv_heads, int head_dim, float scale, int sliding_window) -> (Tensor, Tensor)");
  m.impl("decoder_layer", c10::DispatchKey::CPU, TORCH_FN(minivllm_cpu::decoder_layer_op));
  m.def("decoder_layers(Tensor x, Tensor positions, Tensor cos_sin, Tensor(a!) kv_caches, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor[] weights, Tensor?[] biases, "
        "int[] parts, int[] layouts, int[] types, int[] outputs, Tensor[] norms, Tensor?[] qk_norms, "
        "float[] floats, int[] ints) -> (Tensor, Tensor)");
  m.impl("decoder_layers", c10::DispatchKey::CPU, TORCH_FN(minivllm_cpu::decoder_layers));
}
