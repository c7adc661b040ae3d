// Fused elementwise ops of a decoder layer on CPU (minivllm/model/cpu_layer_ops.py, which says why and what they
// saved): RMSNorm (with the residual add before it), rotary embedding of q and k, and SwiGLU's silu(gate) * up, each
// chain of small aten ops as one op, one pass over its rows.
// Rounding follows the readable ops (minivllm/model/layer_ops.py) step by step, so that bf16 results equal theirs:
// every value the torch code rounds to the model's dtype is rounded here too (`round_to`). What differs: sums of
// squares run in another order, silu's exp is a polynomial (~1 ulp from torch's), and fp32 products may be fused into
// FMAs by the compiler; measured, bf16 outputs were bit-equal, fp32 ones ~1 ulp off.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <type_traits>

#include "../platforms/cpu_ops.h"
#include "../platforms/cpu_vector_math.h"  // with <algorithm>, <cmath>, <cstring>

// The dtypes a model runs in on CPU.
#define DISPATCH_MODEL_DTYPES(TYPE, NAME, ...)                                                         \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                             \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace minivllm_cpu {
namespace {

constexpr int64_t kGrain = 16384;  // elements per thread below which a loop stays on the calling thread
constexpr int64_t kMaxHeadDim = 1024;

// Rows per thread for at::parallel_for, rows of `row_size` elements: a batch-1 step stays on one thread.
inline int64_t grain(int64_t row_size) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, row_size)); }

// Loads and stores through fp32. bf16 is spelled out with shifts so the loops vectorise (c10's scalar conversion
// may not); its rounding is round-to-nearest-even, like torch's.
inline float load(const float* p) { return *p; }
inline float load(const c10::Half* p) { return static_cast<float>(*p); }
inline float load(const c10::BFloat16* p) {
  const uint32_t bits = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float* p, float v) { *p = v; }
inline void store(c10::Half* p, float v) { *p = static_cast<c10::Half>(v); }
inline void store(c10::BFloat16* p, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  *reinterpret_cast<uint16_t*>(p) = std::isnan(v) ? uint16_t{0x7FC0} : rounded;
}

// v rounded to scalar_t and back: where the torch code stores an intermediate in the model's dtype.
template <typename scalar_t>
inline float round_to(float v) {
  if constexpr (std::is_same_v<scalar_t, float>) return v;
  scalar_t tmp;
  store(&tmp, v);
  return load(&tmp);
}


// ---- RMSNorm: out = w * round(v / sqrt(mean(v^2) + eps)), v = x, or round(x + residual) written back as the new
// residual (layer_ops.py's rms_norm: the add in the model's dtype, the norm in fp32, the weight product in the model's
// dtype).
template <typename scalar_t>
void norm_row(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, scalar_t* out,
              scalar_t* residual_out, int64_t dim, float eps) {
  if (residual != nullptr) {  // the sum, rounded, is the new residual and the row normalised
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) store(residual_out + d, load(x + d) + load(residual + d));
    x = residual_out;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < dim; ++d) sum += load(x + d) * load(x + d);
  const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) store(out + d, load(weight + d) * round_to<scalar_t>(load(x + d) * inv_rms));
}

// x: [T, dim] or [T, heads, dim] (q/k norm; any strides but the last), residual: [T, dim] or undefined.
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor* residual,
                   at::Tensor& out, at::Tensor* residual_out) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "rms_norm: x must be [T, dim] or [T, heads, dim]");
  TORCH_CHECK(x.stride(-1) == 1 && weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: x's last dim must be contiguous and match the weight");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x must share a dtype");
  const int64_t tokens = x.size(0), heads = x.dim() == 3 ? x.size(1) : 1, dim = x.size(-1);
  const int64_t stride_t = x.stride(0), stride_h = x.dim() == 3 ? x.stride(1) : 0;
  int64_t stride_r = 0;
  if (residual != nullptr) {
    TORCH_CHECK(x.dim() == 2 && residual->sizes() == x.sizes() && residual->stride(-1) == 1 &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: the residual must be [T, dim] like x");
    stride_r = residual->stride(0);
  }
  DISPATCH_MODEL_DTYPES(x.scalar_type(), "minivllm_rms_norm", [&] {
    const scalar_t *px = x.data_ptr<scalar_t>(), *pw = weight.data_ptr<scalar_t>();
    const scalar_t* pr = residual ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t *po = out.data_ptr<scalar_t>(), *pro = residual_out ? residual_out->data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, tokens * heads, grain(dim), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t t = row / heads, h = row % heads;
        norm_row(px + t * stride_t + h * stride_h, pr != nullptr ? pr + t * stride_r : nullptr, pw, po + row * dim,
                 pro != nullptr ? pro + t * dim : nullptr, dim, static_cast<float>(eps));
      }
    });
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm_impl(x, weight, eps, nullptr, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options()), residual_out = at::empty(x.sizes(), x.options());
  rms_norm_impl(x, weight, eps, &residual, out, &residual_out);
  return {out, residual_out};
}

namespace {

// ---- Rotary embedding (NeoX / rotate_half style), in place. layer_ops.py's rotary computes q * cos + rotate_half(q) *
// sin in the model's dtype with cos and sin cast to it: each product rounded, then their sum.
template <typename scalar_t>
void rotate_heads(scalar_t* base, int64_t heads, int64_t stride_h, int64_t half, const float* cos, const float* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* x = base + h * stride_h;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = load(x + i), x2 = load(x + half + i);
      store(x + i, round_to<scalar_t>(x1 * cos[i]) - round_to<scalar_t>(x2 * sin[i]));
      store(x + half + i, round_to<scalar_t>(x2 * cos[half + i]) + round_to<scalar_t>(x1 * sin[half + i]));
    }
  }
}

}  // namespace

// positions [T]; q [T, heads, dim], k [T, kv_heads, dim] (strided views of the qkv output are fine);
// cos_sin [max_positions, 2, dim] fp32, cos then sin for each position.
void rotary_embedding(const at::Tensor& positions, at::Tensor q, at::Tensor k, const at::Tensor& cos_sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.stride(2) == 1 && k.stride(2) == 1 && q.scalar_type() == k.scalar_type(),
              "rotary_embedding: q and k must be [T, heads, dim] of one dtype, the last dim contiguous");
  const int64_t tokens = q.size(0), dim = q.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && dim <= kMaxHeadDim, "rotary_embedding: head_dim must be even and at most ",
              kMaxHeadDim);
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.dim() == 3 &&
                  cos_sin.size(1) == 2 && cos_sin.size(2) == dim,
              "rotary_embedding: cos_sin must be a contiguous fp32 [max_positions, 2, head_dim] table");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens && positions.is_contiguous(),
              "rotary_embedding: positions must be [T]");
  const at::Tensor pos = positions.to(at::kLong);  // no copy when already int64
  const int64_t* ppos = pos.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  const int64_t heads_q = q.size(1), heads_k = k.size(1), max_pos = cos_sin.size(0);
  DISPATCH_MODEL_DTYPES(q.scalar_type(), "minivllm_rotary", [&] {
    scalar_t *pq = q.data_ptr<scalar_t>(), *pk = k.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain((heads_q + heads_k) * dim), [&](int64_t begin, int64_t end) {
      float cos[kMaxHeadDim], sin[kMaxHeadDim];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = ppos[t];
        TORCH_CHECK(p >= 0 && p < max_pos, "rotary_embedding: position ", p, " outside the table");
        const float* row = table + p * 2 * dim;
        for (int64_t d = 0; d < dim; ++d) {  // the table cast to the model's dtype, as layer_ops.py casts it
          cos[d] = round_to<scalar_t>(row[d]);
          sin[d] = round_to<scalar_t>(row[dim + d]);
        }
        rotate_heads(pq + t * q.stride(0), heads_q, q.stride(1), half, cos, sin);
        rotate_heads(pk + t * k.stride(0), heads_k, k.stride(1), half, cos, sin);
      }
    });
  });
}

namespace {

// ---- SwiGLU: gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I], silu rounded to the model's dtype first,
// as `F.silu(gate) * up` does; silu(g) = g / (1 + e^-g), torch's formula.
template <typename scalar_t>
void silu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = load(gate + i);
    store(out + i, round_to<scalar_t>(g / (1.0f + exp_approx(-g))) * load(up + i));
  }
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be [T, 2 * I], the last dim contiguous");
  const int64_t tokens = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({tokens, n}, gate_up.options());
  DISPATCH_MODEL_DTYPES(gate_up.scalar_type(), "minivllm_silu_and_mul", [&] {
    const scalar_t* pin = gate_up.data_ptr<scalar_t>();
    scalar_t* pout = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_mul_row(pin + t * stride, pin + t * stride + n, pout + t * n, n);
    });
  });
  return out;
}

}  // namespace minivllm_cpu

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(minivllm_cpu::rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(minivllm_cpu::add_rms_norm));
  m.impl("rotary_embedding", c10::DispatchKey::CPU, TORCH_FN(minivllm_cpu::rotary_embedding));
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(minivllm_cpu::silu_and_mul));
}
