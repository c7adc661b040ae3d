// GGUF's block formats multiplied as the file stores them (layout and why: quantization/cpu_gguf.py). Each
// output row is a run of 32-weight blocks: Q8_0 = fp16 d + 32 int8 (w = d q), Q4_0 = fp16 d + 16 bytes of
// nibbles (w = d (q - 8)), Q4_1 = fp16 d + fp16 m + 16 bytes (w = d q + m); a byte's low nibble is weight j,
// its high nibble weight j + 16. A decode step reads each block once: its 32 weights widen to two vectors of
// 16 floats, multiply the input's 32 values, and the block's sum is scaled by d. The offsets fold into one
// scalar per block: d (q - 8) . x = d (q . x) - 8 d sum(x), and m's term is m sum(x).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // ggml's type ids
constexpr int64_t kBlock = 32;                       // weights per block, every format here
constexpr int64_t kRows = 8;                         // rows of x multiplied per pass over a weight row

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
  }
  TORCH_CHECK(false, "GGUF type ", type, " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8)");
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction, where c10's conversion is a dozen
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// the block's 32 weights before d and m: q (Q8_0, signed) or the nibbles (Q4, 0..15), in order
inline void block_values(int64_t type, const uint8_t* block, float* out) {
  if (type == kQ8_0) {
    for (int j = 0; j < kBlock; ++j) out[j] = static_cast<int8_t>(block[2 + j]);
    return;
  }
  const uint8_t* nibbles = block + (type == kQ4_1 ? 4 : 2);
  for (int j = 0; j < kBlock / 2; ++j) {
    out[j] = nibbles[j] & 0x0F;
    out[j + kBlock / 2] = nibbles[j] >> 4;
  }
}

#ifdef __AVX512F__
inline void block_vectors(int64_t type, const uint8_t* block, __m512& first, __m512& second) {
  if (type == kQ8_0) {
    first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2))));
    second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18))));
    return;
  }
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (type == kQ4_1 ? 4 : 2)));
  const __m128i low = _mm_set1_epi8(0x0F);
  first = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low)));
  second = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
}
#endif

// rows [first, last) of W for `rows` rows of x (fp32, [rows, K]); block_sums[r][b] = sum of x[r]'s block b
void multiply_rows(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x, int64_t k,
                   const float* block_sums, int rows, float* y, int64_t n, int64_t first, int64_t last) {
  const int64_t bytes = block_bytes(type);
  for (int64_t o = first; o < last; ++o) {
    const uint8_t* row = w + o * row_bytes;
    float offset[kRows] = {};
#ifdef __AVX512F__
    __m512 acc[kRows];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * bytes;
      __m512 first_half, second_half;
      block_vectors(type, block, first_half, second_half);
      const float d = half_at(block);
      const float extra = type == kQ4_0 ? -8.0f * d : type == kQ4_1 ? half_at(block + 2) : 0.0f;
      const __m512 dv = _mm512_set1_ps(d);
      for (int r = 0; r < rows; ++r) {
        const float* xb = x + r * k + b * kBlock;
        const __m512 dot = _mm512_fmadd_ps(first_half, _mm512_loadu_ps(xb),
                                           _mm512_mul_ps(second_half, _mm512_loadu_ps(xb + 16)));
        acc[r] = _mm512_fmadd_ps(dot, dv, acc[r]);
        offset[r] += extra * block_sums[r * blocks + b];
      }
    }
    for (int r = 0; r < rows; ++r) y[r * n + o] = _mm512_reduce_add_ps(acc[r]) + offset[r];
#else
    float acc[kRows] = {}, values[kBlock];
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * bytes;
      block_values(type, block, values);
      const float d = half_at(block);
      const float extra = type == kQ4_0 ? -8.0f * d : type == kQ4_1 ? half_at(block + 2) : 0.0f;
      for (int r = 0; r < rows; ++r) {
        float dot = 0.0f;
        for (int j = 0; j < kBlock; ++j) dot += values[j] * x[r * k + b * kBlock + j];
        acc[r] += d * dot;
        offset[r] += extra * block_sums[r * blocks + b];
      }
    }
    for (int r = 0; r < rows; ++r) y[r * n + o] = acc[r] + offset[r];
#endif
  }
}

void check(const at::Tensor& blocks, int64_t type, int64_t n, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "GGUF blocks must be contiguous uint8 [out, bytes per row]");
  TORCH_CHECK(k % kBlock == 0 && blocks.size(0) == n && blocks.size(1) == k / kBlock * block_bytes(type),
              "GGUF blocks [", blocks.size(0), ", ", blocks.size(1), "] do not hold a [", n, ", ", k, "] weight");
}

}  // namespace

// x [..., K] (fp32/bf16/fp16; meant for a few rows) @ W.T, W [N, K] as GGUF `type` blocks -> [..., N] in x's dtype
at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type, int64_t n) {
  const int64_t k = x_in.size(-1), m = x_in.numel() / std::max<int64_t>(k, 1);
  check(blocks, type, n, k);
  const at::Tensor x = x_in.reshape({m, k}).to(at::kFloat).contiguous();
  const int64_t nblocks = k / kBlock;
  const at::Tensor sums = x.view({m, nblocks, kBlock}).sum(-1).contiguous();  // each block's sum of x
  auto y = at::empty({m, n}, x.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  for (int64_t r = 0; r < m; r += kRows) {
    const int rows = static_cast<int>(std::min(kRows, m - r));
    const float* xr = x.data_ptr<float>() + r * k;
    const float* sr = sums.data_ptr<float>() + r * nblocks;
    float* yr = y.data_ptr<float>() + r * n;
    at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
      multiply_rows(type, w, blocks.size(1), nblocks, xr, k, sr, rows, yr, n, first, last);
    });
  }
  auto shape = x_in.sizes().vec();
  shape.back() = n;
  return y.to(x_in.scalar_type()).view(shape);
}

// W [N, K] in float from its blocks: the prompt's path (one copy per call, then a GEMM) and the reference's
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t n, int64_t k) {
  check(blocks, type, n, k);
  auto w = at::empty({n, k}, at::kFloat);
  const int64_t nblocks = k / kBlock, bytes = block_bytes(type), row_bytes = blocks.size(1);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = w.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    float values[kBlock];
    for (int64_t o = first; o < last; ++o)
      for (int64_t b = 0; b < nblocks; ++b) {
        const uint8_t* block = src + o * row_bytes + b * bytes;
        block_values(type, block, values);
        const float d = half_at(block);
        const float add = type == kQ4_0 ? -8.0f * d : type == kQ4_1 ? half_at(block + 2) : 0.0f;
        for (int j = 0; j < kBlock; ++j) dst[o * k + b * kBlock + j] = d * values[j] + add;
      }
  });
  return w;
}

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int type, int n) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type, int n, int k) -> Tensor");
  m.impl("gguf_linear", c10::DispatchKey::CPU, TORCH_FN(gguf_linear));
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, TORCH_FN(gguf_dequantize));
}
