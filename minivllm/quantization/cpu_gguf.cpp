// GGUF's block formats multiplied as the file stores them (layout and why: quantization/cpu_gguf.py). Each
// output row is a run of 32-weight blocks: Q8_0 = fp16 d + 32 int8 (w = d q), Q4_0 = fp16 d + 16 bytes of
// nibbles (w = d (q - 8)), Q4_1 = fp16 d + fp16 m + 16 bytes (w = d q + m); a byte's low nibble is weight j,
// its high nibble weight j + 16. A decode step reads each block once: its 32 weights widen to two vectors of
// 16 floats, multiply the input's 32 values, and the block's sum is scaled by d. The offsets fold into one
// scalar per block: d (q - 8) . x = d (q . x) - 8 d sum(x), and m's term is m sum(x).
//
// The "K" formats (Q4_K, Q6_K: what most downloaded files hold) group 256 weights into a super-block whose
// sub-blocks carry small integer scales, themselves scaled by the super-block's fp16 d (super_block_weights
// spells each layout out). A super-block is unpacked to 256 floats on the stack (in L1; 16 lanes at a time with
// AVX-512 where the CPU has it) and then multiplied by every row of x: the unpacking is paid once per weight.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;  // ggml's type ids
constexpr int64_t kBlock = 32;                       // weights per block of Q8_0, Q4_0, Q4_1
constexpr int64_t kSuper = 256;                      // weights per super-block of Q4_K, Q6_K
constexpr int64_t kRows = 8;                         // rows of x multiplied per pass over a weight row

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    case kQ4_K: return 144;  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
    case kQ6_K: return 210;  // 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d
  }
  TORCH_CHECK(false, "GGUF type ", type, " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q6_K (14)");
}

bool is_super(int64_t type) { return type == kQ4_K || type == kQ6_K; }
int64_t block_weights(int64_t type) { return is_super(type) ? kSuper : kBlock; }

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

// Q4_K's eight sub-blocks of 32 weights each have a 6-bit scale and a 6-bit min, packed into 12 bytes: sub-blocks
// 0-3 keep theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 keep their low 4 bits in
// the nibbles of bytes 8-11 and their top 2 bits in the spare top bits of bytes 0-3 (scales) and 4-7 (mins).
inline void q4_k_scale_min(const uint8_t* packed, int j, int& scale, int& min) {
  if (j < 4) {
    scale = packed[j] & 63;
    min = packed[j + 4] & 63;
  } else {
    scale = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4);
    min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// One super-block of 256 weights as floats, exactly as llama.cpp dequantizes it.
//   Q4_K: w = d scale_j q - dmin min_j for sub-block j of 32; the nibbles come in runs of 32 bytes, each run
//         holding two sub-blocks: low nibbles the first 32 weights, high nibbles the next 32.
//   Q6_K: w = d scale_i (q - 32), q 6 bits, scale_i an int8 per 16 weights. Each 128 weights read 64 bytes of
//         low nibbles (ql) and 32 bytes of high pairs (qh): weight l, l + 32, l + 64, l + 96 (l < 32) take ql[l]'s
//         low, ql[l + 32]'s low, ql[l]'s high, ql[l + 32]'s high nibble, and bits 0-1, 2-3, 4-5, 6-7 of qh[l].
inline void super_block_weights(int64_t type, const uint8_t* block, float* out) {
  if (type == kQ4_K) {
    const float d = half_at(block), dmin = half_at(block + 2);
    const uint8_t *packed = block + 4, *q = block + 16;
    for (int run = 0; run < 4; ++run, q += 32, out += 64) {
      int scale_low, min_low, scale_high, min_high;
      q4_k_scale_min(packed, 2 * run, scale_low, min_low);
      q4_k_scale_min(packed, 2 * run + 1, scale_high, min_high);
      const float d_low = d * scale_low, m_low = dmin * min_low, d_high = d * scale_high, m_high = dmin * min_high;
#ifdef __AVX512F__  // the two loops below, 16 bytes at once (d_low q is exact in fp32: 11 x 6 x 4 bits)
      for (int l = 0; l < 32; l += 16) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + l)));
        const __m512 lows = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
        const __m512 highs = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        _mm512_storeu_ps(out + l, _mm512_fmsub_ps(_mm512_set1_ps(d_low), lows, _mm512_set1_ps(m_low)));
        _mm512_storeu_ps(out + l + 32, _mm512_fmsub_ps(_mm512_set1_ps(d_high), highs, _mm512_set1_ps(m_high)));
      }
#else
      for (int l = 0; l < 32; ++l) out[l] = d_low * (q[l] & 0x0F) - m_low;
      for (int l = 0; l < 32; ++l) out[l + 32] = d_high * (q[l] >> 4) - m_high;
#endif
    }
    return;
  }
  const uint8_t *ql = block, *qh = block + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_at(block + 208);
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32, scales += 8, out += 128) {
    for (int part = 0; part < 4; ++part) {  // weights 32 part + l: ql[l] (part 0, 2) or ql[l + 32] (1, 3)
      const uint8_t* low = ql + 32 * (part % 2);
      const int low_shift = 4 * (part / 2), high_shift = 2 * part;
      for (int group = 0; group < 2; ++group) {  // 16 weights per scale
        const float scale = d * scales[2 * part + group];
#ifdef __AVX512F__  // the loop below, 16 lanes at once (GCC does not vectorize it well by itself)
        const int l = 16 * group;
        const __m512i lows = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + l)));
        const __m512i highs = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + l)));
        const __m512i q = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(lows, low_shift), _mm512_set1_epi32(15)),
                                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(highs, high_shift),
                                                                             _mm512_set1_epi32(3)), 4));
        const __m512 centred = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(32)));
        _mm512_storeu_ps(out + 32 * part + l, _mm512_mul_ps(_mm512_set1_ps(scale), centred));
#else
        for (int l = 16 * group; l < 16 * group + 16; ++l)
          out[32 * part + l] = scale * ((((low[l] >> low_shift) & 0x0F) | (((qh[l] >> high_shift) & 3) << 4)) - 32);
#endif
      }
    }
  }
}

// rows [first, last) of W in a K format for `rows` rows of x: each super-block unpacked once, then 256 fused
// multiply-adds per row of x
template <int rows>  // a constant, so that each row's accumulator stays in a register
void multiply_rows_super(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x,
                         int64_t k, float* y, int64_t n, int64_t first, int64_t last) {
  const int64_t bytes = block_bytes(type);
  alignas(64) float weights[kSuper];
  for (int64_t o = first; o < last; ++o) {
    const uint8_t* row = w + o * row_bytes;
#ifdef __AVX512F__
    __m512 acc[rows];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      super_block_weights(type, row + b * bytes, weights);
      for (int r = 0; r < rows; ++r) {
        const float* xb = x + r * k + b * kSuper;
        for (int j = 0; j < kSuper; j += 16)
          acc[r] = _mm512_fmadd_ps(_mm512_load_ps(weights + j), _mm512_loadu_ps(xb + j), acc[r]);
      }
    }
    for (int r = 0; r < rows; ++r) y[r * n + o] = _mm512_reduce_add_ps(acc[r]);
#else
    float acc[rows] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      super_block_weights(type, row + b * bytes, weights);
      for (int r = 0; r < rows; ++r)
        for (int j = 0; j < kSuper; ++j) acc[r] += weights[j] * x[r * k + b * kSuper + j];
    }
    for (int r = 0; r < rows; ++r) y[r * n + o] = acc[r];
#endif
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
template <int rows>  // a constant, so that each row's accumulator stays in a register
void multiply_rows(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x, int64_t k,
                   const float* block_sums, float* y, int64_t n, int64_t first, int64_t last) {
  const int64_t bytes = block_bytes(type);
  for (int64_t o = first; o < last; ++o) {
    const uint8_t* row = w + o * row_bytes;
    float offset[rows] = {};
#ifdef __AVX512F__
    __m512 acc[rows];
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
    float acc[rows] = {}, values[kBlock];
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

// f(std::integral_constant<int, rows>{}) for rows in 1..kRows: one instance of the multiply per batch size
template <typename F>
void with_rows(int rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

void check(const at::Tensor& blocks, int64_t type, int64_t n, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "GGUF blocks must be contiguous uint8 [out, bytes per row]");
  const int64_t per_block = block_weights(type);
  TORCH_CHECK(k % per_block == 0 && blocks.size(0) == n && blocks.size(1) == k / per_block * block_bytes(type),
              "GGUF blocks [", blocks.size(0), ", ", blocks.size(1), "] do not hold a [", n, ", ", k, "] weight");
}

}  // namespace

// x [..., K] (fp32/bf16/fp16; meant for a few rows) @ W.T, W [N, K] as GGUF `type` blocks -> [..., N] in x's dtype
at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type, int64_t n) {
  const int64_t k = x_in.size(-1), m = x_in.numel() / std::max<int64_t>(k, 1);
  check(blocks, type, n, k);
  const at::Tensor x = x_in.reshape({m, k}).to(at::kFloat).contiguous();
  auto y = at::empty({m, n}, x.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  if (is_super(type)) {
    for (int64_t r = 0; r < m; r += kRows) {
      const int rows = static_cast<int>(std::min(kRows, m - r));
      const float* xr = x.data_ptr<float>() + r * k;
      float* yr = y.data_ptr<float>() + r * n;
      with_rows(rows, [&](auto constant) {
        at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
          multiply_rows_super<decltype(constant)::value>(type, w, blocks.size(1), k / kSuper, xr, k, yr, n, first,
                                                         last);
        });
      });
    }
    auto shape = x_in.sizes().vec();
    shape.back() = n;
    return y.to(x_in.scalar_type()).view(shape);
  }
  const int64_t nblocks = k / kBlock;
  const at::Tensor sums = x.view({m, nblocks, kBlock}).sum(-1).contiguous();  // each block's sum of x
  for (int64_t r = 0; r < m; r += kRows) {
    const int rows = static_cast<int>(std::min(kRows, m - r));
    const float* xr = x.data_ptr<float>() + r * k;
    const float* sr = sums.data_ptr<float>() + r * nblocks;
    float* yr = y.data_ptr<float>() + r * n;
    at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
      with_rows(rows, [&](auto constant) {
        multiply_rows<decltype(constant)::value>(type, w, blocks.size(1), nblocks, xr, k, sr, yr, n, first, last);
      });
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
  const int64_t bytes = block_bytes(type), row_bytes = blocks.size(1);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = w.data_ptr<float>();
  if (is_super(type)) {
    at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
      for (int64_t o = first; o < last; ++o)
        for (int64_t b = 0; b < k / kSuper; ++b)
          super_block_weights(type, src + o * row_bytes + b * bytes, dst + o * k + b * kSuper);
    });
    return w;
  }
  const int64_t nblocks = k / kBlock;
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
