// GGUF's block formats multiplied as the file stores them (layout and why: quantization/cpu_gguf.py). Each
// output row is a run of 32-weight blocks: Q8_0 = fp16 d + 32 int8 (w = d q), Q4_0 = fp16 d + 16 bytes of
// nibbles (w = d (q - 8)), Q4_1 = fp16 d + fp16 m + 16 bytes (w = d q + m); a byte's low nibble is weight j,
// its high nibble weight j + 16. Q5_0 and Q5_1 (what llama.cpp's Q4_K_M uses for rows whose length is not a
// multiple of 256) add a fifth bit per weight, bit j of a 32-bit word after d (and m): w = d (q - 16), d q + m.
// A decode step reads each block once and turns it into two vectors of 16
// weights, exactly the dequantized floats (x stays fp32, so the result differs from dequantize + matmul only in
// the order of the fp32 sums). A Q4 block does it with a lookup: its 16 bytes widen once to 32-bit lanes and
// index a 16-float table of d (q - 8) (or d q + m) built for the block, low nibbles as they are (vpermps reads
// an index's low 4 bits) and high ones after a shift; a Q5 block's 5-bit codes index two such tables
// (vpermt2ps reads 5 bits). The small-batch loop takes 8 output rows per pass at
// batch 1-2 (4 at 3-4, 2 beyond): one accumulator per output row and row of x, so the fused multiply-add
// chains of the rows overlap instead of each row waiting on its own, and one transpose-and-add sums a group's
// accumulators at the end. The blocks' fp16 scales are converted a chunk ahead, and a later group's blocks are
// prefetched as this group's are read: at batch 1 the loop is a stream of the file's bytes.
//
// The "K" formats (Q4_K, Q6_K: what most downloaded files hold) group 256 weights into a super-block whose
// sub-blocks carry small integer scales, themselves scaled by the super-block's fp16 d (super_block_weights
// spells each layout out). With AVX-512 a super-block is unpacked 16 weights at a time into registers
// (super_block_vectors: Q4_K through a table per sub-block as above, its 16 scales and mins decoded and scaled as
// one vector) and each vector multiplied at once by every row of x, in the same groups of output rows. With AVX2
// only, blocks become vectors of 8 weights (multiply_group's AVX2 version); with neither, every format is
// dequantized block by block into floats and multiplied by plain loops. Where x goes in as int8 (llama.cpp's
// arithmetic, cpu_gguf.py), AVX512-VNNI's vpdpbusd or AVX2's vpmaddubsw multiply codes and x in integers.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../platforms/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;  // ggml's ids
constexpr int64_t kBlock = 32;                       // weights per block of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
constexpr int64_t kSuper = 256;                      // weights per super-block of Q4_K, Q6_K
constexpr int64_t kRows = 8;                         // rows of x multiplied per pass over the weights

constexpr int64_t block_bytes(int64_t type) {  // constexpr: the kernels' block sizes
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;  // fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles
    case kQ5_1: return 24;  // fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes of nibbles
    case kQ8_0: return 34;
    case kQ4_K: return 144;  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
    case kQ6_K: return 210;  // 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d
  }
  TORCH_CHECK(false, "GGUF type ", type,
              " is not one of Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q6_K (14)");
}

constexpr bool is_super(int64_t type) { return type == kQ4_K || type == kQ6_K; }
int64_t block_weights(int64_t type) { return is_super(type) ? kSuper : kBlock; }

// 32-weight blocks regrouped for int8 activations (gguf_pack): each run of four blocks of a row keeps its
// headers field by field (the four fp16 d, then the four m of Q4_1/Q5_1, then the four 32-bit fifth-bit
// words of Q5_0/Q5_1) and then the four payloads (nibbles, or Q8_0's int8), so that one load reads four
// blocks' scales and one or two their codes. The same bytes in another order; a row's last run holds the
// 1-3 blocks that are left, alike. `type | kPacked` names such rows.
constexpr int64_t kPacked = 256, kRun = 4;
bool is_packed(int64_t type) { return (type & kPacked) != 0; }
// Q4_0 and Q5_0 rows interleaved eight at a time for AVX2's int8 kernel (multiply_interleaved): `type | kPacked |
// kInterleaved` names such rows
constexpr int64_t kInterleaved = 512, kLanes = 8;
bool is_interleaved(int64_t type) { return (type & kInterleaved) != 0; }
int64_t stored_type(int64_t type) { return type & (kPacked - 1); }
// Q4_K and Q6_K keep their layout on the int8 path (a super-block's codes are already contiguous)
bool regrouped(int64_t type) { return is_packed(type) && !is_super(stored_type(type)) && !is_interleaved(type); }

constexpr bool is_q5(int64_t type) { return type == kQ5_0 || type == kQ5_1; }  // a fifth bit per weight
constexpr bool has_min(int64_t type) { return type == kQ4_1 || type == kQ5_1; }  // w = d q + m

// A block's header fields, in the order the file stores them: d, then m (Q4_1, Q5_1), then the fifth bits (Q5)
struct Fields {
  int count = 0;
  int64_t size[3] = {};
};
constexpr Fields header_fields(int64_t type) {
  Fields f;
  f.size[f.count++] = 2;
  if (has_min(type)) f.size[f.count++] = 2;
  if (is_q5(type)) f.size[f.count++] = 4;
  return f;
}

// Copies block b of a packed row to `block` in the file's layout (unpack), or the file's block into the
// packed row (pack): the one map between the two orders
template <bool unpack>
inline void map_block(uint8_t* packed_row, int64_t blocks, int64_t type, int64_t bytes, int64_t b, uint8_t* block) {
  const int64_t run = b / kRun, i = b % kRun, count = std::min(kRun, blocks - kRun * run);
  uint8_t* at = packed_row + kRun * run * bytes;
  const Fields fields = header_fields(type);
  int64_t offset = 0;
  for (int f = 0; f < fields.count; ++f) {
    uint8_t* field = at + fields.size[f] * i;
    unpack ? std::memcpy(block + offset, field, fields.size[f]) : std::memcpy(field, block + offset, fields.size[f]);
    at += fields.size[f] * count;
    offset += fields.size[f];
  }
  uint8_t* payload = at + (bytes - offset) * i;
  unpack ? std::memcpy(block + offset, payload, bytes - offset) : std::memcpy(payload, block + offset, bytes - offset);
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


// where a 32-weight block's nibbles start: after d (Q4_0), d and m (Q4_1), and a Q5's 4 bytes of fifth bits
constexpr int64_t nibbles_at(int64_t type) {
  return type == kQ4_0 ? 2 : type == kQ4_1 ? 4 : type == kQ5_0 ? 6 : 8;
}

// the 32 fifth bits of a Q5 block (bit j: weight j), just before its nibbles
inline uint32_t fifth_bits(int64_t type, const uint8_t* block) {
  uint32_t bits;
  std::memcpy(&bits, block + nibbles_at(type) - 4, 4);
  return bits;
}

// Interleaved Q4_0 (Q5_0): output rows 8 g .. 8 g + 7 keep, per block b, their eight fp16 d side by side (16 bytes),
// (Q5_0: then their eight 32-bit words of fifth bits, 32 bytes,) then their nibbles four bytes at a time: byte
// 4 m + i of row l's 16 at 32 m + 4 l + i. So one 32-byte load holds weights 4m .. 4m + 3 (low nibbles) and
// 16 + 4m .. (high) of all eight rows, a row per 32-bit lane, and the block's dot products come out as one vector, a
// row per lane: no sum across lanes. The same bytes, in another order.
constexpr bool interleaves(int64_t type) { return type == kQ4_0 || type == kQ5_0; }
inline int64_t interleaved_block(int64_t type, int64_t row, int64_t b, int64_t blocks) {  // row's group's block b
  return ((row / kLanes) * blocks + b) * kLanes * block_bytes(type);
}
template <bool unpack>
inline void map_interleaved(int64_t type, uint8_t* rows, int64_t blocks, int64_t row, int64_t b, uint8_t* block) {
  uint8_t* at = rows + interleaved_block(type, row, b, blocks);
  const int64_t l = row % kLanes, header = nibbles_at(type);  // d (and the fifth bits) of one row
  unpack ? std::memcpy(block, at + 2 * l, 2) : std::memcpy(at + 2 * l, block, 2);
  if (type == kQ5_0)
    unpack ? std::memcpy(block + 2, at + 16 + 4 * l, 4) : std::memcpy(at + 16 + 4 * l, block + 2, 4);
  for (int64_t m = 0; m < 4; ++m) {
    uint8_t* four = at + kLanes * header + 32 * m + 4 * l;
    unpack ? std::memcpy(block + header + 4 * m, four, 4) : std::memcpy(four, block + header + 4 * m, 4);
  }
}

// the block's 32 weights before d and m: q (Q8_0, signed) or the codes (Q4: 0..15, Q5: 0..31), in order
inline void block_values(int64_t type, const uint8_t* block, float* out) {
  if (type == kQ8_0) {
    for (int j = 0; j < kBlock; ++j) out[j] = static_cast<int8_t>(block[2 + j]);
    return;
  }
  const uint8_t* nibbles = block + nibbles_at(type);
  const uint32_t fifth = is_q5(type) ? fifth_bits(type, block) : 0;
  for (int j = 0; j < kBlock / 2; ++j) {
    out[j] = (nibbles[j] & 0x0F) | (((fifth >> j) & 1) << 4);
    out[j + kBlock / 2] = (nibbles[j] >> 4) | (((fifth >> (j + kBlock / 2)) & 1) << 4);
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

// The same for all eight sub-blocks at once, four to a word: words = {scales 0-3, scales 4-7, mins 0-3, mins 4-7},
// each a byte (little-endian: sub-block 4w + i in byte i)
inline void q4_k_scales_mins(const uint8_t* packed, uint32_t* words) {
  uint32_t p[3];
  std::memcpy(p, packed, 12);
  words[0] = p[0] & 0x3F3F3F3F;
  words[1] = (p[2] & 0x0F0F0F0F) | (((p[0] >> 6) & 0x03030303) << 4);
  words[2] = p[1] & 0x3F3F3F3F;
  words[3] = ((p[2] >> 4) & 0x0F0F0F0F) | (((p[1] >> 6) & 0x03030303) << 4);
}

// The super-block layouts, whose 256 weights super_block_weights writes as floats exactly as llama.cpp does:
//   Q4_K: w = d scale_j q - dmin min_j for sub-block j of 32; the nibbles come in runs of 32 bytes, each run
//         holding two sub-blocks: low nibbles the first 32 weights, high nibbles the next 32.
//   Q6_K: w = d scale_i (q - 32), q 6 bits, scale_i an int8 per 16 weights. Each 128 weights read 64 bytes of
//         low nibbles (ql) and 32 bytes of high pairs (qh): weight l, l + 32, l + 64, l + 96 (l < 32) take ql[l]'s
//         low, ql[l + 32]'s low, ql[l]'s high, ql[l + 32]'s high nibble, and bits 0-1, 2-3, 4-5, 6-7 of qh[l].
#ifdef __AVX512F__
inline __m512i load16_bytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The same weights, 16 at a time as vectors: use(j, w) for w = weights j..j + 15 of the super-block, in whatever
// order of j the layout reads best, so that the multiply consumes them from registers.
//   Q4_K: each sub-block's 16 possible weights d scale q - dmin min form a table that its nibbles index (vpermps
//         reads an index's low 4 bits: the low nibbles need no mask, the high ones a shift); every entry is
//         exactly llama.cpp's float (d scale q is exact in fp32: 11 x 6 x 4 bits, then one rounding).
//   Q6_K: the 16 bytes of ql[l], ql[l + 32] and qh[l] are widened once for the four weights they hold each.
template <int64_t type, typename Use>
inline void super_block_vectors(const uint8_t* block, Use&& use) {
  alignas(64) float sub[16];  // the sub-blocks' float scales (and Q4_K's mins), broadcast from memory below
  if constexpr (type == kQ4_K) {
    uint32_t words[4];  // scales 0-3, 4-7, mins 0-3, 4-7
    q4_k_scales_mins(block + 4, words);
    const __m128i scale_min = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words));
    const __m512 d_dmin = _mm512_insertf32x8(_mm512_set1_ps(half_at(block)), _mm256_set1_ps(half_at(block + 2)), 1);
    _mm512_store_ps(sub, _mm512_mul_ps(d_dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scale_min))));
    const __m512 nibble = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const uint8_t* q = block + 16;
    for (int run = 0; run < 4; ++run, q += 32) {  // 32 bytes: sub-block 2 run in low nibbles, 2 run + 1 in high
      const __m512 low_table = _mm512_fmsub_ps(_mm512_set1_ps(sub[2 * run]), nibble, _mm512_set1_ps(sub[8 + 2 * run]));
      const __m512 high_table = _mm512_fmsub_ps(_mm512_set1_ps(sub[2 * run + 1]), nibble,
                                                _mm512_set1_ps(sub[9 + 2 * run]));
      const __m512i first = load16_bytes(q), second = load16_bytes(q + 16);
      use(64 * run, _mm512_permutexvar_ps(first, low_table));
      use(64 * run + 16, _mm512_permutexvar_ps(second, low_table));
      use(64 * run + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(first, 4), high_table));
      use(64 * run + 48, _mm512_permutexvar_ps(_mm512_srli_epi32(second, 4), high_table));
    }
  } else {
    const uint8_t *ql = block, *qh = block + 128;
    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));  // 16 int8
    _mm512_store_ps(sub, _mm512_mul_ps(_mm512_set1_ps(half_at(block + 208)),
                                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scales))));
    const __m512i mask4 = _mm512_set1_epi32(15), mask2 = _mm512_set1_epi32(3), centre = _mm512_set1_epi32(32);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32) {
      for (int l = 0; l < 32; l += 16) {
        const __m512i low[2] = {load16_bytes(ql + l), load16_bytes(ql + l + 32)}, high = load16_bytes(qh + l);
        for (int part = 0; part < 4; ++part) {  // weights 32 part + l: ql[l] (part 0, 2) or ql[l + 32] (1, 3)
          const __m512i q = _mm512_or_si512(
              _mm512_and_si512(_mm512_srli_epi32(low[part % 2], 4 * (part / 2)), mask4),
              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * part), mask2), 4));
          const float scale = sub[8 * half + 2 * part + l / 16];  // d scale: one per 16 weights
          use(128 * half + 32 * part + l,
              _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(_mm512_sub_epi32(q, centre))));
        }
      }
    }
  }
}
#endif

// One super-block's 256 weights as floats: the vectors above stored, or plain loops where there is no AVX-512
inline void super_block_weights(int64_t type, const uint8_t* block, float* out) {
#ifdef __AVX512F__
  const auto store = [out](int j, __m512 w) { _mm512_storeu_ps(out + j, w); };
  return type == kQ4_K ? super_block_vectors<kQ4_K>(block, store) : super_block_vectors<kQ6_K>(block, store);
#else
  if (type == kQ4_K) {
    const float d = half_at(block), dmin = half_at(block + 2);
    const uint8_t *packed = block + 4, *q = block + 16;
    for (int run = 0; run < 4; ++run, q += 32, out += 64) {
      int scale_low, min_low, scale_high, min_high;
      q4_k_scale_min(packed, 2 * run, scale_low, min_low);
      q4_k_scale_min(packed, 2 * run + 1, scale_high, min_high);
      const float d_low = d * scale_low, m_low = dmin * min_low, d_high = d * scale_high, m_high = dmin * min_high;
      for (int l = 0; l < 32; ++l) out[l] = d_low * (q[l] & 0x0F) - m_low;
      for (int l = 0; l < 32; ++l) out[l + 32] = d_high * (q[l] >> 4) - m_high;
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
      for (int l = 0; l < 32; ++l)  // 16 weights per scale
        out[32 * part + l] = d * scales[2 * part + l / 16] *
                             ((((low[l] >> low_shift) & 0x0F) | (((qh[l] >> high_shift) & 3) << 4)) - 32);
    }
  }
#endif
}

// One block's weights (32, or 256 for Q4_K/Q6_K) as floats, exactly as llama.cpp dequantizes them
inline void dequantize_block(int64_t type, const uint8_t* block, float* out) {
  if (is_super(type)) return super_block_weights(type, block, out);
  float values[kBlock];
  block_values(type, block, values);
  const float d = half_at(block);
  const float add = type == kQ4_0   ? -8.0f * d  // d q - 8 d = d (q - 8), exactly
                    : type == kQ5_0 ? -16.0f * d
                    : has_min(type) ? half_at(block + 2) : 0.0f;
  for (int j = 0; j < kBlock; ++j) out[j] = d * values[j] + add;
}

// ---- int8 activations (llama.cpp's arithmetic): x quantized, for AVX512-VNNI's vpdpbusd or AVX2's vpmaddubsw ----
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MINIVLLM_INT8_DOT 1
constexpr bool kVnni = true;
#elif defined(__AVX2__) && defined(__FMA__)
#define MINIVLLM_INT8_DOT 1
#define MINIVLLM_INT8_AVX2 1
constexpr bool kVnni = false;
#endif
#ifdef __AVX2__
inline float sum_lanes(__m256 v) {  // the 8 lanes' total
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

inline __m256i load_256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// A Q6_K super-block's 6-bit codes of weights 32 v .. 32 v + 31 (v = 4 half + part; the layout:
// super_block_weights): ql[l]'s (part 0, 2) or ql[l + 32]'s (1, 3) low or high nibble, and bits 2 part, 2 part + 1
// of qh[l] above them (0..63: no carry crosses a byte)
inline __m256i q6_k_codes(const uint8_t* block, int v) {
  const int half = v / 4, part = v % 4;
  const __m256i nibble = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(3);
  const __m256i low = load_256(block + 64 * half + 32 * (part % 2));
  const __m256i low4 = _mm256_and_si256(part / 2 ? _mm256_srli_epi16(low, 4) : low, nibble);
  const __m256i high2 = _mm256_and_si256(_mm256_srli_epi16(load_256(block + 128 + 32 * half), 2 * part), pair);
  return _mm256_or_si256(low4, _mm256_slli_epi16(high2, 4));
}
#endif
#ifdef MINIVLLM_INT8_DOT
constexpr bool kInt8Dot = true;

// 32 values of x as Q8_0 (q = x / d rounded half to even, d = max |x| / 127) into q[0, 32); returns d
inline float quantize_block(const float* x, int8_t* q) {
  float top = 0.0f;
  for (int i = 0; i < kBlock; ++i) top = std::max(top, std::fabs(x[i]));
  const float inverse = top > 0 ? 127.0f / top : 0.0f;
  for (int i = 0; i < kBlock; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
  return top / 127.0f;
}

// x's rows for the 32-weight formats' packed runs, laid out per run in the order the weights' bytes come in, so
// that the weights need no shuffle:
//   Q4/Q5: a run's 64 bytes of nibbles give the four blocks' weights 0-15 (low nibbles) and 16-31 (high), so
//         x's run is 64 bytes of each block's values 0-15 then 64 of values 16-31. Lane l of 16 (4 values of
//         each half: what one 32-bit lane of either instruction sums) belongs to block l / 4.
//   Q8_0: block i's 32 values at 32 i. vpdpbusd's first operand is unsigned, so for VNNI x goes in as q + 128
//         (and each lane subtracts 128 x its four weights); AVX2 keeps q signed (its weights go in as |w|, q
//         takes their signs).
// Q4_0's -8 (Q5_0's -16) is a per-lane sum of x (`offset`); Q4_1's (Q5_1's) m multiplies d_x times it (`sum`).
struct QuantizedX {
  int64_t runs;
  std::vector<int8_t> q;         // [row][run][128]
  std::vector<float> scale;      // [row][run][32]: lane l's d_x (Q4/Q5: block l / 4; Q8_0: block l / 8)
  std::vector<int32_t> offset;   // [row][run][16]: -8 (Q4_0) or -16 (Q5_0) x the sum of the lane's 8 values
  std::vector<float> sum;        // [row][run][16]: d_x x the sum of the lane's 8 values (Q4_1, Q5_1's m)
  const int8_t* q_at(int r, int64_t run) const { return q.data() + (r * runs + run) * 128; }
  const float* scale_at(int r, int64_t run) const { return scale.data() + (r * runs + run) * 32; }
  const int32_t* offset_at(int r, int64_t run) const { return offset.data() + (r * runs + run) * 16; }
  const float* sum_at(int r, int64_t run) const { return sum.data() + (r * runs + run) * 16; }
};

QuantizedX quantize_x(int64_t type, const float* x, int rows, int64_t k) {
  const int64_t blocks = k / kBlock, runs = (blocks + kRun - 1) / kRun;
  const bool biased = type == kQ8_0 && kVnni;
  QuantizedX out{runs, std::vector<int8_t>(rows * runs * 128, biased ? -128 : 0),
                 std::vector<float>(rows * runs * 32, 0.0f), std::vector<int32_t>(rows * runs * 16, 0),
                 std::vector<float>(rows * runs * 16, 0.0f)};
  const int32_t minus = type == kQ4_0 ? -8 : type == kQ5_0 ? -16 : 0;
  int8_t values[kBlock];
  for (int r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float d = quantize_block(x + r * k + b * kBlock, values);
      const int64_t run = b / kRun, i = b % kRun, at = r * runs + run;
      int8_t* q = out.q.data() + at * 128;
      float* scale = out.scale.data() + at * 32;
      if (type == kQ8_0) {
        for (int j = 0; j < kBlock; ++j) q[32 * i + j] = static_cast<int8_t>(biased ? values[j] ^ 0x80 : values[j]);
        for (int lane = 0; lane < 8; ++lane) scale[8 * i + lane] = d;
        continue;
      }
      std::memcpy(q + 16 * i, values, 16);
      std::memcpy(q + 64 + 16 * i, values + 16, 16);
      for (int lane = 0; lane < 4; ++lane) {
        int32_t sum = 0;
        for (int j = 0; j < 4; ++j) sum += q[16 * i + 4 * lane + j] + q[64 + 16 * i + 4 * lane + j];
        out.offset[at * 16 + 4 * i + lane] = minus * sum;
        out.sum[at * 16 + 4 * i + lane] = d * static_cast<float>(sum);
        scale[4 * i + lane] = d;
      }
    }
  return out;
}

// x's rows for Q4_K and Q6_K, quantized per 32 values as for the other formats (llama.cpp takes one d_x per 256:
// a little faster, but a large activation then coarsens 256 values, not 32). Sub-block j of 32 values sits at
// 32 j, except for VNNI's Q4_K, whose 64-byte loads hold two runs of nibbles: [s0 s2] [s1 s3] [s4 s6] [s5 s7].
//   Q4_K's mins term is dmin sum_j min_j (d_x,j x the sum of sub-block j's values): `mins`.
//   Q6_K's -32 is a sum of x: per 32-bit lane of 4 values for VNNI (`offset`), per 16 values (one weight scale)
//         for AVX2 (`sums`).
struct QuantizedSuperX {
  int64_t supers;
  std::vector<int8_t> q;        // [row][super][256]
  std::vector<float> lanes;     // [row][super][64]: the d_x of each 32-bit lane of the codes (VNNI)
  std::vector<float> scale;     // [row][super][8]: d_x of sub-block j
  std::vector<float> mins;      // [row][super][8]: d_x,j x the sum of sub-block j's values (Q4_K)
  std::vector<int32_t> offset;  // [row][super][64]: -32 x the sum of each lane's 4 values (Q6_K, VNNI)
  std::vector<int16_t> sums;    // [row][super][16]: the sum of each 16 values (Q6_K, AVX2)
};

QuantizedSuperX quantize_x_super(int64_t type, const float* x, int rows, int64_t k) {
  const int64_t supers = k / kSuper;
  QuantizedSuperX out{supers, std::vector<int8_t>(rows * supers * kSuper), std::vector<float>(rows * supers * 64),
                      std::vector<float>(rows * supers * 8), std::vector<float>(rows * supers * 8),
                      std::vector<int32_t>(rows * supers * 64), std::vector<int16_t>(rows * supers * 16)};
  for (int r = 0; r < rows; ++r)
    for (int64_t b = 0; b < supers; ++b) {
      const int64_t at = r * supers + b;
      for (int j = 0; j < 8; ++j) {
        const int64_t place = type == kQ4_K && kVnni ? (j / 4) * 128 + (j % 2) * 64 + ((j % 4) / 2) * 32 : 32 * j;
        int8_t* q = out.q.data() + at * kSuper + place;
        const float d = quantize_block(x + r * k + b * kSuper + 32 * j, q);
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) sum += q[i];
        out.scale[at * 8 + j] = d;
        out.mins[at * 8 + j] = d * static_cast<float>(sum);
        for (int half = 0; half < 2; ++half) {
          int16_t part = 0;
          for (int i = 0; i < 16; ++i) part = static_cast<int16_t>(part + q[16 * half + i]);
          out.sums[at * 16 + 2 * j + half] = part;
        }
        for (int lane = 0; lane < 8; ++lane) {  // place / 4: the first of this sub-block's 8 lanes
          out.lanes[at * 64 + place / 4 + lane] = d;
          out.offset[at * 64 + place / 4 + lane] =
              -32 * (q[4 * lane] + q[4 * lane + 1] + q[4 * lane + 2] + q[4 * lane + 3]);
        }
      }
    }
  return out;
}
#else
constexpr bool kInt8Dot = false;
#endif
#ifndef MINIVLLM_INT8_AVX2
constexpr bool kInterleaves = false;  // VNNI's and the plain loops read the regrouped layout
#endif

#ifdef __AVX512F__
// A 32-weight block as the two vectors of its weights, exactly the dequantized floats (d q, d (q - 8) and d q are
// exact in fp32: an 11-bit fp16 mantissa times a 4- or 8-bit integer; d q + m rounds once, as llama.cpp does).
// A Q4 block's nibbles index a table of the 16 weights they can stand for, built per block with d and m folded
// in: one widening of the 16 bytes to 32-bit lanes, and vpermps, which reads only an index's low 4 bits, picks
// the low nibbles as they are and the high ones after a shift. That is one vpmovzx and two vpermps per block
// instead of two widenings, two masks and two int-to-float conversions, and no per-block offset term.
// `scales` holds the block's d (and m, Q4_1) already in fp32 (see block_scales).
// (Q8_0 with `scaled` false: q alone, for a caller that multiplies by d after the dot product.)
template <int64_t type, bool scaled = true>
inline void block_vectors(const uint8_t* block, const float* scales, __m512& low, __m512& high) {
  const __m512 d = _mm512_set1_ps(scales[0]);  // a broadcast from memory: a load, no shuffle
  if constexpr (type == kQ8_0) {
    const auto bytes = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
    low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(block + 2)));
    high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(block + 18)));
    if constexpr (scaled) {
      low = _mm512_mul_ps(d, low);
      high = _mm512_mul_ps(d, high);
    }
  } else if constexpr (is_q5(type)) {  // codes 0..31: two tables, of q < 16 and q >= 16
    const __m512 nibble = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 upper = _mm512_add_ps(nibble, _mm512_set1_ps(16));
    __m512 below, above;
    if constexpr (type == kQ5_0) {  // d (q - 16): -16 d .. -d, then 0 .. 15 d
      below = _mm512_mul_ps(d, _mm512_sub_ps(nibble, _mm512_set1_ps(16)));
      above = _mm512_mul_ps(d, nibble);
    } else {
      below = _mm512_fmadd_ps(d, nibble, _mm512_set1_ps(scales[1]));
      above = _mm512_fmadd_ps(d, upper, _mm512_set1_ps(scales[1]));
    }
    // code j = nibble j | 16 where bit j of the word is set: its low and high 16 bits are the two halves'
    // lane masks, so each half costs one masked or (vpermt2ps reads 5 bits: the low nibble is masked first)
    const uint32_t fifth = fifth_bits(type, block);
    const __m512i bytes = load16_bytes(block + nibbles_at(type)), sixteen = _mm512_set1_epi32(16);
    const __m512i nibble_low = _mm512_and_si512(bytes, _mm512_set1_epi32(15));
    const __m512i nibble_high = _mm512_srli_epi32(bytes, 4);
    const __m512i code_low = _mm512_mask_or_epi32(nibble_low, static_cast<__mmask16>(fifth), nibble_low, sixteen);
    const __m512i code_high = _mm512_mask_or_epi32(nibble_high, static_cast<__mmask16>(fifth >> 16), nibble_high,
                                                   sixteen);
    low = _mm512_permutex2var_ps(below, code_low, above);
    high = _mm512_permutex2var_ps(below, code_high, above);
  } else {
    const __m512 nibble = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = type == kQ4_0 ? _mm512_mul_ps(d, _mm512_sub_ps(nibble, _mm512_set1_ps(8)))
                                       : _mm512_fmadd_ps(d, nibble, _mm512_set1_ps(scales[1]));
    const __m512i bytes = load16_bytes(block + nibbles_at(type));
    low = _mm512_permutexvar_ps(bytes, table);
    high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
}

// The fp16 d (and m) of `count` consecutive blocks of a row, as floats: scales[c * 4] = d, scales[c * 4 + 1] = m.
// Converting them a chunk ahead keeps the shuffle port free for the blocks' own vpmovzx and vpermps: vcvtph2ps
// straight from memory needs no shuffle, and block_vectors then broadcasts d from memory, which is a plain load,
// where converting in the loop costs an insert, half a conversion and a broadcast on that port per block.
inline void block_scales(const uint8_t* row, int64_t bytes, int count, float* scales) {
  for (int c = 0; c < count; ++c)
    _mm_store_ps(scales + 4 * c, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c * bytes))));
}

// The totals of `group` accumulators (one output row each) to out[0, group): a transpose-and-add, so that a group
// of 8 rows pays 24 shuffles and adds where a horizontal reduction per row pays about 8 each.
inline __m512 add_halves(__m512 a, __m512 b) {  // 128-bit lanes: a0+a2, a1+a3, b0+b2, b1+b3
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m512 add_quarters(__m512 a, __m512 b) {  // two add_halves results -> 128-bit lane i holds row i's 4 partials
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
template <int group>
inline void store_totals(const __m512* acc, float* out) {
  if constexpr (group == 1) {
    out[0] = _mm512_reduce_add_ps(acc[0]);
  } else {
    __m512 rows_0123, rows_4567;  // 128-bit lane i: 4 partial sums of row i (of 4 + i)
    if constexpr (group == 2) {
      const __m512 halves = add_halves(acc[0], acc[1]);
      rows_0123 = rows_4567 = add_quarters(halves, halves);  // rows 0, 1, 0, 1
    } else {
      rows_0123 = rows_4567 = add_quarters(add_halves(acc[0], acc[1]), add_halves(acc[2], acc[3]));
      if constexpr (group == 8) rows_4567 = add_quarters(add_halves(acc[4], acc[5]), add_halves(acc[6], acc[7]));
    }
    // within each 128-bit lane i: (row i's pair sums, row 4 + i's pair sums), then each pair added
    const __m512 pairs = _mm512_add_ps(_mm512_shuffle_ps(rows_0123, rows_4567, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_ps(rows_0123, rows_4567, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 totals = _mm512_add_ps(pairs, _mm512_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 3, 0, 1)));
    // row i's total sits in lane 4 i, row 4 + i's in lane 4 i + 2
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1 << group) - 1), _mm512_permutexvar_ps(order, totals));
  }
}

// How far ahead of its reads an AVX-512 kernel prefetches: the same bytes `groups` groups of output rows on, or
// nothing near the end of W. At batch 1-2 the 32-weight formats' kernels go two groups ahead into L2
// (prefetcht1). Measured at batch 1 on a Zen 4, all 30 layers of a 135M model streamed from memory on 2 threads:
// Q4_0 with int8 x took 3.3 ms a token one group ahead into L1 (prefetcht0), 2.65 ms two ahead into L2 (float x:
// 4.0 and 3.6 ms; Q8_0's 113 MB: 5.9 and 4.5 ms). With more rows of x there is more work per byte, and there, as
// for the K formats (which unpack more per byte), one group ahead into L1 stays: the other was 3-10% slower.
constexpr int64_t kAheadGroups = 2;
inline int64_t prefetch_distance(int64_t groups, int group, int64_t o, int64_t n, int64_t row_bytes) {
  return o + (groups + 1) * group <= n ? groups * group * row_bytes : 0;
}
template <int rows>
inline void prefetch_ahead(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), rows <= 2 ? _MM_HINT_T1 : _MM_HINT_T0);
}

// Output rows [o, o + group) of W for `rows` rows of x (fp32, [rows, K]): each block is unpacked once and
// multiplied by every row of x, into rows x group independent accumulators. Several output rows per pass matter
// at batch 1: one row's chain of fused multiply-adds (4 cycles each) would wait on itself at every block, and
// its horizontal sum would cost as much as a few blocks; 8 rows overlap their chains and share one transpose.
template <int64_t type, int rows, int group>
void multiply_group(const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x, int64_t k, float* y,
                    int64_t n, int64_t o) {
  constexpr int64_t bytes = block_bytes(type);
  // each block read also prefetches the same block of a later group's rows (at batch 1 the hardware prefetcher
  // alone left the loop waiting on memory): see prefetch_distance
  const int64_t ahead = prefetch_distance(is_super(type) || rows > 2 ? 1 : kAheadGroups, group, o, n, row_bytes);
  __m512 acc[rows][group];
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < group; ++g) acc[r][g] = _mm512_setzero_ps();
  if constexpr (type == kQ4_K || type == kQ6_K) {
    // a super-block adds 16 products to each accumulator, one after another; at batch 1 two accumulators per
    // output row halve that chain for Q4_K (measured: Q6_K's unpacking wants those registers, and is slower)
    constexpr int chains = type == kQ4_K && rows * group <= 8 ? 2 : 1;
    __m512 odd[rows][group];
    for (int r = 0; r < rows; ++r)
      for (int g = 0; g < group; ++g) odd[r][g] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b)
      for (int g = 0; g < group; ++g) {
        const uint8_t* block = w + (o + g) * row_bytes + b * bytes;
        for (int64_t line = 0; line < bytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(block + ahead + line), _MM_HINT_T0);
        super_block_vectors<type>(block, [&](int j, __m512 weights) {
          for (int r = 0; r < rows; ++r) {
            __m512& sum = chains == 2 && (j / 16) % 2 ? odd[r][g] : acc[r][g];
            sum = _mm512_fmadd_ps(weights, _mm512_loadu_ps(x + r * k + b * kSuper + j), sum);
          }
        });
      }
    if constexpr (chains == 2)
      for (int r = 0; r < rows; ++r)
        for (int g = 0; g < group; ++g) acc[r][g] = _mm512_add_ps(acc[r][g], odd[r][g]);
  } else {
    constexpr int kChunk = 16;  // blocks whose scales are converted ahead, per output row
    alignas(64) float scales[group][4 * kChunk];
    for (int64_t first = 0; first < blocks; first += kChunk) {
      const int count = static_cast<int>(std::min<int64_t>(kChunk, blocks - first));
      for (int g = 0; g < group; ++g) block_scales(w + (o + g) * row_bytes + first * bytes, bytes, count, scales[g]);
      for (int c = 0; c < count; ++c) {
        const int64_t b = first + c;
        for (int g = 0; g < group; ++g) {
          __m512 low, high;
          const uint8_t* block = w + (o + g) * row_bytes + b * bytes;
          prefetch_ahead<rows>(block + ahead);
          if constexpr (type == kQ8_0 && rows == 1) {  // d after the dot product: one multiply by d, not two
            block_vectors<type, false>(block, scales[g] + 4 * c, low, high);
            const float* xb = x + b * kBlock;
            const __m512 dot = _mm512_fmadd_ps(high, _mm512_loadu_ps(xb + 16),
                                               _mm512_mul_ps(low, _mm512_loadu_ps(xb)));
            acc[0][g] = _mm512_fmadd_ps(dot, _mm512_set1_ps(scales[g][4 * c]), acc[0][g]);
            continue;
          }
          block_vectors<type>(block, scales[g] + 4 * c, low, high);
          for (int r = 0; r < rows; ++r) {
            const float* xb = x + r * k + b * kBlock;
            acc[r][g] = _mm512_fmadd_ps(high, _mm512_loadu_ps(xb + 16),
                                        _mm512_fmadd_ps(low, _mm512_loadu_ps(xb), acc[r][g]));
          }
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) store_totals<group>(acc[r], y + r * n + o);
}

// Output rows per pass for `rows` rows of x: rows x group accumulators in at most 16 of the 32 vector registers
constexpr int group_for(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 4 : 2; }

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// ---- int8 activations with AVX512-VNNI: each run of four blocks is multiplied in integers (vpdpbusd adds four
// u8 x s8 products per 32-bit lane, 64 per instruction, where the float path unpacks, converts and multiplies 16
// weights at a time); one int-to-float conversion and one fused multiply-add per 16 lanes apply d_w d_x. The
// codes (0..15, Q5: the fifth bit added where its bit is set, 0..31) are the unsigned operand, x the signed one;
// Q8_0's weights are the signed operand, and one vpdpbusd of them by 128 per run takes x's bias back.
inline __m512i load_bytes(const uint8_t* p, int64_t count) {  // the first `count` bytes (at most 64), zeros beyond
  if (count >= 64) return _mm512_loadu_si512(p);
  return count > 0 ? _mm512_maskz_loadu_epi8((~0ULL) >> (64 - count), p) : _mm512_setzero_si512();
}

inline __m128 load_halves(const uint8_t* p, int64_t count) {  // `count` (1-4) fp16 values as floats
  return _mm_cvtph_ps(count == kRun ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))
                                    : _mm_maskz_loadu_epi16(static_cast<__mmask8>((1 << count) - 1), p));
}

// Row r of x's run as multiply_group_int8 reads it: the int8 values that meet the low and the high nibbles (Q8_0:
// the run's two halves), d_x per lane, and what `type` adds: Q8_0's d_x for its second half, Q4_1/Q5_1's sums,
// Q4_0/Q5_0's offsets
struct RunOfX {
  __m512i low, high, offset;
  __m512 scale, scale_high, sum;
};
template <int64_t type>
inline RunOfX run_of_x(const QuantizedX& x, int r, int64_t run) {
  RunOfX out{};
  out.low = _mm512_loadu_si512(x.q_at(r, run));
  out.high = _mm512_loadu_si512(x.q_at(r, run) + 64);
  out.scale = _mm512_loadu_ps(x.scale_at(r, run));
  if constexpr (type == kQ8_0) out.scale_high = _mm512_loadu_ps(x.scale_at(r, run) + 16);
  else if constexpr (has_min(type)) out.sum = _mm512_loadu_ps(x.sum_at(r, run));
  else out.offset = _mm512_loadu_si512(x.offset_at(r, run));
  return out;
}

// Output rows [o, o + group) of a packed W for `rows` rows of quantized x, as multiply_group does in floats
template <int64_t type, int rows, int group>
void multiply_group_int8(const uint8_t* w, int64_t row_bytes, int64_t blocks, const QuantizedX& x, float* y,
                         int64_t n, int64_t o) {
  constexpr int64_t bytes = block_bytes(type);
  constexpr bool has_m = has_min(type), has_fifth = is_q5(type);
  constexpr int64_t header = nibbles_at(type == kQ8_0 ? kQ4_0 : type);  // d (m) (fifth bits): bytes per block
  const int64_t ahead = prefetch_distance(rows <= 2 ? kAheadGroups : 1, group, o, n, row_bytes);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i sixteen = _mm512_set1_epi8(16);
  const __m512i each_of_4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i first_2 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i last_2 = _mm512_add_epi32(first_2, _mm512_set1_epi32(2));
  // a run's four fifth-bit words -> bytes 0-7: each word's low halves (weights 0-15), 8-15: its high halves
  const __m128i halves_apart = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  __m512 acc[rows][group];
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < group; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t run = 0; run < x.runs; ++run) {
    const int64_t count = std::min(kRun, blocks - kRun * run);
    // At batch 1-2, x's run is loaded once for the group's 8 output rows: a 512-bit load is one of this loop's
    // scarcest operations (Zen 4 issues one a cycle). With more rows of x, its vectors and the accumulators would
    // not fit in the registers together, and each use loads them (from L1).
    constexpr int kHeld = rows <= 2 ? rows : 0;
    RunOfX held[kHeld + 1];
    for (int r = 0; r < kHeld; ++r) held[r] = run_of_x<type>(x, r, run);
    const auto x_at = [&](int r) { return kHeld ? held[r] : run_of_x<type>(x, r, run); };
    for (int g = 0; g < group; ++g) {
      const uint8_t* base = w + (o + g) * row_bytes + kRun * run * bytes;
      for (int64_t line = 0; line < kRun * bytes; line += 64) prefetch_ahead<rows>(base + ahead + line);
      const __m512 d_w = _mm512_castps128_ps512(load_halves(base, count));
      const uint8_t* payload = base + header * count;
      if constexpr (type == kQ8_0) {
        const __m512i w0 = load_bytes(payload, 32 * count), w1 = load_bytes(payload + 64, 32 * count - 64);
        const __m512i zero = _mm512_setzero_si512();
        const __m512i minus0 = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, w0));
        const __m512i minus1 = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, w1));
        const __m512 d0 = _mm512_permutexvar_ps(first_2, d_w), d1 = _mm512_permutexvar_ps(last_2, d_w);
        for (int r = 0; r < rows; ++r) {
          const RunOfX xr = x_at(r);
          const __m512i dot0 = _mm512_dpbusd_epi32(minus0, xr.low, w0);
          const __m512i dot1 = _mm512_dpbusd_epi32(minus1, xr.high, w1);
          acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(d0, xr.scale), acc[r][g]);
          acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(d1, xr.scale_high), acc[r][g]);
        }
      } else {
        const __m512i nibbles = load_bytes(payload, 16 * count);
        __m512i low = _mm512_and_si512(nibbles, low_nibbles);
        __m512i high = _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low_nibbles);
        if constexpr (has_fifth) {  // bit j of block i's word: +16 on byte 16 i + j of low (j < 16) or high
          const uint8_t* words = base + (has_m ? 4 : 2) * count;
          const __m128i fifth = _mm_shuffle_epi8(
              count == kRun ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(words))
                            : _mm_maskz_loadu_epi32(static_cast<__mmask8>((1 << count) - 1), words),
              halves_apart);
          low = _mm512_mask_add_epi8(low, static_cast<__mmask64>(_mm_cvtsi128_si64(fifth)), low, sixteen);
          high = _mm512_mask_add_epi8(high, static_cast<__mmask64>(_mm_extract_epi64(fifth, 1)), high, sixteen);
        }
        const __m512 d_lanes = _mm512_permutexvar_ps(each_of_4, d_w);
        __m512 m_lanes = _mm512_setzero_ps();
        if constexpr (has_m)
          m_lanes = _mm512_permutexvar_ps(each_of_4, _mm512_castps128_ps512(load_halves(base + 2 * count, count)));
        for (int r = 0; r < rows; ++r) {
          const RunOfX xr = x_at(r);
          __m512i dot = has_m ? _mm512_setzero_si512() : xr.offset;
          dot = _mm512_dpbusd_epi32(dot, low, xr.low);
          dot = _mm512_dpbusd_epi32(dot, high, xr.high);
          acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d_lanes, xr.scale), acc[r][g]);
          if constexpr (has_m) acc[r][g] = _mm512_fmadd_ps(m_lanes, xr.sum, acc[r][g]);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) store_totals<group>(acc[r], y + r * n + o);
}

// ---- int8 activations for Q4_K and Q6_K: x quantized per 32 values as for the other formats (llama.cpp
// takes one d_x per 256: 5-10% faster here, but a large activation then coarsens 256 values, not 32), the
// codes of a super-block's sub-blocks multiplied in integers (four vpdpbusd), each dot product times its
// sub-block's integer scale (vpmulld), then d_x per lane in floats and d once per super-block.
//   Q4_K: w = d scale_j q - dmin min_j over sub-blocks of 32; the nibbles come as four runs of 32 bytes,
//         low nibbles sub-block 2p, high 2p + 1, so x is laid out [s0 s2] [s1 s3] [s4 s6] [s5 s7]; the mins
//         term is dmin sum_j min_j (d_x,j x the sum of sub-block j's values), `mins`.
//   Q6_K: w = d scale_i (q - 32), an int8 scale per 16 weights; x in its own order, each 64 values meeting
//         one vector of 6-bit codes (ql's nibbles with two qh bits added), the -32 as a per-lane sum of x.
// Output rows [o, o + group) of a Q4_K or Q6_K W for `rows` rows of quantized x: each super-block's codes as four
// vectors of 64 bytes and their scales as four vectors of lanes, then the same integer dot products for both
template <int64_t type, int rows, int group>
void multiply_group_super_int8(const uint8_t* w, int64_t row_bytes, const QuantizedSuperX& x, float* y, int64_t n,
                               int64_t o) {
  constexpr int64_t bytes = block_bytes(type);
  const int64_t ahead = prefetch_distance(1, group, o, n, row_bytes);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), high_pair = _mm512_set1_epi8(0x30), zero = _mm512_setzero_si512();
  constexpr __mmask64 upper = 0xFFFFFFFF00000000ULL;  // Q6_K: the bytes of weights l + 32 (l + 96)
  // which scale each lane of code vector c multiplies by: Q4_K's per sub-block (lanes 0-7 and 8-15: the two
  // sub-blocks a vector holds), Q6_K's per 16 weights (4 lanes each)
  const auto pick = [](int c) {
    if constexpr (type == kQ4_K) {
      const int a = (c / 2) * 4 + c % 2, b = a + 2;  // [s0 s2] [s1 s3] [s4 s6] [s5 s7]
      return _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
    } else {
      const int a = 4 * c;
      return _mm512_setr_epi32(a, a, a, a, a + 1, a + 1, a + 1, a + 1, a + 2, a + 2, a + 2, a + 2, a + 3, a + 3,
                               a + 3, a + 3);
    }
  };
  const __m512i picks[4] = {pick(0), pick(1), pick(2), pick(3)};
  __m512 acc[rows][group];
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < group; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < x.supers; ++sb)
    for (int g = 0; g < group; ++g) {
      const uint8_t* block = w + (o + g) * row_bytes + sb * bytes;
      for (int64_t line = 0; line < bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(block + ahead + line), _MM_HINT_T0);
      __m512i codes[4], scales;
      __m256 mins = _mm256_setzero_ps();
      float d, dmin = 0.0f;
      if constexpr (type == kQ4_K) {
        d = half_at(block), dmin = half_at(block + 2);
        uint32_t words[4];  // scales 0-3, 4-7, mins 0-3, 4-7
        q4_k_scales_mins(block + 4, words);
        scales = _mm512_cvtepu8_epi32(_mm_setr_epi32(words[0], words[1], 0, 0));
        mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32(words[2], words[3], 0, 0)));
        for (int h = 0; h < 2; ++h) {  // low nibbles: sub-blocks 4h and 4h + 2, high: 4h + 1 and 4h + 3
          const __m512i nibbles = _mm512_loadu_si512(block + 16 + 64 * h);
          codes[2 * h] = _mm512_and_si512(nibbles, low_nibbles);
          codes[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low_nibbles);
        }
      } else {
        d = half_at(block + 208);
        scales = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
        for (int h = 0; h < 2; ++h) {  // weights 128 h + 0-63, then 128 h + 64-127
          const __m512i ql = _mm512_loadu_si512(block + 64 * h);
          const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              block + 128 + 32 * h)));
          const __m512i bits_a = _mm512_mask_blend_epi8(upper, _mm512_slli_epi16(qh, 4), _mm512_slli_epi16(qh, 2));
          const __m512i bits_b = _mm512_mask_blend_epi8(upper, qh, _mm512_srli_epi16(qh, 2));
          codes[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low_nibbles), _mm512_and_si512(bits_a, high_pair));
          codes[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low_nibbles),
                                             _mm512_and_si512(bits_b, high_pair));
        }
      }
      __m512i scale[4];
      for (int c = 0; c < 4; ++c) scale[c] = _mm512_permutexvar_epi32(picks[c], scales);
      for (int r = 0; r < rows; ++r) {
        const int64_t at = r * x.supers + sb;
        const int8_t* q = x.q.data() + at * kSuper;
        const float* lanes = x.lanes.data() + at * 64;
        __m512 sum = _mm512_setzero_ps();  // sum over lanes of d_x scale (codes . x), then times d
        for (int c = 0; c < 4; ++c) {
          const __m512i start = type == kQ4_K ? zero : _mm512_loadu_si512(x.offset.data() + at * 64 + 16 * c);
          sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(
                                    _mm512_dpbusd_epi32(start, codes[c], _mm512_loadu_si512(q + 64 * c)), scale[c])),
                                _mm512_loadu_ps(lanes + 16 * c), sum);
        }
        acc[r][g] = _mm512_fmadd_ps(sum, _mm512_set1_ps(d), acc[r][g]);
        if constexpr (type == kQ4_K) {
          const __m256 by_min = _mm256_mul_ps(mins, _mm256_loadu_ps(x.mins.data() + at * 8));
          const __m512 by_min_16 = _mm512_castpd_ps(  // lanes 8-15 zero
              _mm512_insertf64x4(_mm512_setzero_pd(), _mm256_castps_pd(by_min), 0));
          acc[r][g] = _mm512_fnmadd_ps(by_min_16, _mm512_set1_ps(dmin), acc[r][g]);
        }
      }
    }
  for (int r = 0; r < rows; ++r) store_totals<group>(acc[r], y + r * n + o);
}

// Output rows per pass of the int8 kernels: as the float ones
constexpr int int8_group_for(int rows) { return group_for(rows); }
#endif
#else
#if defined(__AVX2__) && defined(__FMA__)
// AVX2: a 32-weight block's weights as four vectors of 8, exactly the dequantized floats. The codes widen byte by
// byte to 32-bit lanes (a Q5's fifth bits shifted into place lane by lane) and convert; d (q - 8), d (q - 16)
// and d q + m are computed as llama.cpp computes them.
template <int64_t type>
__attribute__((always_inline)) inline void block_vectors_avx2(const uint8_t* block, __m256* out) {
  const __m256 d = _mm256_set1_ps(half_at(block));
  if constexpr (type == kQ8_0) {
    for (int v = 0; v < 4; ++v) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * v));
      out[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    }
    return;
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + nibbles_at(type)));
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
    const __m128i halves[2] = {low, high};  // weights 0-15, 16-31
    const __m256 m = has_min(type) ? _mm256_set1_ps(half_at(block + 2))
                     : _mm256_set1_ps(type == kQ4_0 ? -8.0f : -16.0f);
    const uint32_t fifth = is_q5(type) ? fifth_bits(type, block) : 0;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int v = 0; v < 4; ++v) {
      const __m128i bytes = v % 2 ? _mm_srli_si128(halves[v / 2], 8) : halves[v / 2];
      __m256i code = _mm256_cvtepu8_epi32(bytes);
      if constexpr (is_q5(type)) {  // bit 8 v + lane of `fifth` is weight 8 v + lane's
        const __m256i bits = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(fifth >> (8 * v))), lane);
        code = _mm256_or_si256(code, _mm256_slli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(1)), 4));
      }
      const __m256 q = _mm256_cvtepi32_ps(code);
      out[v] = has_min(type) ? _mm256_fmadd_ps(d, q, m) : _mm256_mul_ps(d, _mm256_add_ps(q, m));
    }
  }
}

// 32 codes (bytes, unsigned) times x: code i's weight is scale * code + offset, scale and offset per 16 codes
// (lanes 0-7 and 8-15 take index 0, 16-31 index 1). Adds into acc[rows][chains], chain = the vector's index.
template <int rows, int chains>
__attribute__((always_inline)) inline void add_codes(__m256i codes, const __m256* scale, const __m256* offset,
                                                     const float* x, int64_t k, __m256 (&acc)[rows][chains]) {
  const __m128i halves[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
  for (int v = 0; v < 4; ++v) {
    const __m128i bytes = v % 2 ? _mm_srli_si128(halves[v / 2], 8) : halves[v / 2];
    const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), scale[v / 2], offset[v / 2]);
    for (int r = 0; r < rows; ++r) {
      __m256& sum = acc[r][v % chains];
      sum = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * k + 8 * v), sum);
    }
  }
}

// A super-block's 256 weights times x, 32 codes at a time (the layouts: super_block_weights)
template <int64_t type, int rows, int chains>
__attribute__((always_inline)) inline void add_super_block(const uint8_t* block, const float* x, int64_t k,
                                                           __m256 (&acc)[rows][chains]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  if constexpr (type == kQ4_K) {
    const float d = half_at(block), dmin = half_at(block + 2);
    const uint8_t *packed = block + 4, *q = block + 16;
    for (int run = 0; run < 4; ++run, q += 32) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      const __m256i codes[2] = {_mm256_and_si256(bytes, nibble),
                                _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)};
      for (int half = 0; half < 2; ++half) {  // low nibbles: sub-block 2 run, high: 2 run + 1
        int scale, min;
        q4_k_scale_min(packed, 2 * run + half, scale, min);
        const __m256 sc = _mm256_set1_ps(d * scale), off = _mm256_set1_ps(-dmin * min);
        const __m256 scales[2] = {sc, sc}, offsets[2] = {off, off};
        add_codes<rows, chains>(codes[half], scales, offsets, x + 64 * run + 32 * half, k, acc);
      }
    }
  } else {  // Q6_K
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_at(block + 208);
    for (int half = 0; half < 2; ++half, scales += 8) {
      for (int part = 0; part < 4; ++part) {
        const __m256i codes = q6_k_codes(block, 4 * half + part);
        __m256 sc[2], off[2];
        for (int i = 0; i < 2; ++i) {
          sc[i] = _mm256_set1_ps(d * scales[2 * part + i]);
          off[i] = _mm256_mul_ps(sc[i], _mm256_set1_ps(-32.0f));
        }
        add_codes<rows, chains>(codes, sc, off, x + 128 * half + 32 * part, k, acc);
      }
    }
  }
}

// Output rows [o, o + group) of W for `rows` rows of x: each block's weights as vectors of 8 (32-weight formats
// above; a super-block's 256 through the plain loops of super_block_weights, which the compiler vectorises),
// multiplied into rows x chains accumulators: several chains per row at small batches, so that a block's fused
// multiply-adds do not wait on each other. On a 2-core Zen 3, the 120 matmuls of a 135M Llama at batch 1 went from
// 50-160 ms with the plain loops to 10-15 ms (bench/gguf_kernel.py; Q6_K 11x, Q4_K 3.5x, Q4_0 5x faster).
template <int64_t type, int rows, int group>
void multiply_group(const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x, int64_t k, float* y,
                    int64_t n, int64_t o) {
  constexpr int64_t bytes = block_bytes(type);
  constexpr int chains = rows == 1 ? 4 : rows <= 4 ? 2 : 1;
  for (int64_t row = o; row < o + group; ++row) {
    __m256 acc[rows][chains];
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < chains; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = w + row * row_bytes + b * bytes;
      if constexpr (is_super(type)) {
        add_super_block<type, rows, chains>(block, x + b * kSuper, k, acc);
      } else {
        __m256 vectors[4];
        block_vectors_avx2<type>(block, vectors);
        for (int v = 0; v < 4; ++v)
          for (int r = 0; r < rows; ++r) {
            __m256& sum = acc[r][v % chains];
            sum = _mm256_fmadd_ps(vectors[v], _mm256_loadu_ps(x + r * k + b * kBlock + 8 * v), sum);
          }
      }
    }
    for (int r = 0; r < rows; ++r) {
      __m256 total = acc[r][0];
      for (int c = 1; c < chains; ++c) total = _mm256_add_ps(total, acc[r][c]);
      y[r * n + row] = sum_lanes(total);
    }
  }
}
#else
// Output rows [o, o + group) of W for `rows` rows of x, one output row at a time (no AVX2: plain loops)
template <int64_t type, int rows, int group>
void multiply_group(const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x, int64_t k, float* y,
                    int64_t n, int64_t o) {
  const int64_t bytes = block_bytes(type), per_block = block_weights(type);
  float weights[kSuper];
  for (int64_t row = o; row < o + group; ++row) {
    float acc[rows] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      dequantize_block(type, w + row * row_bytes + b * bytes, weights);
      for (int r = 0; r < rows; ++r) {  // a block's sum in vector lanes (a scalar chain ran at a quarter of the speed)
        const float* xb = x + r * k + b * per_block;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < per_block; ++j) sum += weights[j] * xb[j];
        acc[r] += sum;
      }
    }
    for (int r = 0; r < rows; ++r) y[r * n + row] = acc[r];
  }
}
#endif

constexpr int group_for(int) { return 1; }
#endif

#ifdef MINIVLLM_INT8_AVX2
constexpr int64_t kAheadRows = 4;  // how far ahead of its reads the int8 kernels prefetch, in output rows
// ---- int8 activations with AVX2 (no VNNI): vpmaddubsw multiplies u8 x s8 pairs into 16-bit sums and vpmaddwd
// adds pairs of those into 32-bit lanes (by ones, or by a K format's integer scales): two instructions per 32
// products. No 16-bit sum saturates: codes are at most 63 and |q| at most 127 (2 x 63 x 127 < 32767), and Q8_0
// goes in as |w| (at most 128) against q with w's sign.

// byte j of the result is 0xFF where bit j of `bits` is set (a Q5 run's fifth bits, 32 bytes' worth)
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte j <- byte j / 8 of bits
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));  // byte j: bit j % 8
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// `count` (1-4) fp16 values as floats in lanes 0-3, zeros after them (a row's last run may hold fewer blocks)
inline __m256 halves_avx2(const uint8_t* p, int64_t count) {
  uint64_t bits = 0;
  if (count == kRun) {
    std::memcpy(&bits, p, 8);  // a whole run: one load
  } else {
    for (int64_t i = 0; i < count; ++i) {  // fixed-size copies: a memcpy of variable size is a call, and the
      uint16_t half;                       // call spills every accumulator of the group around it
      std::memcpy(&half, p + 2 * i, 2);
      bits |= static_cast<uint64_t>(half) << (16 * i);
    }
  }
  return _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(bits))));
}

// 32-bit lanes: the sums of 4 products of u8 `codes` by s8 `q`, each pair of 16-bit sums times `by`
inline __m256i dot_u8_s8(__m256i codes, __m256i q, __m256i by) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q), by);
}

// Output rows [o, o + group) of a packed W for `rows` rows of quantized x, the group's rows side by side so that each
// load of x (its codes, scales and sums) serves all of them: per run of four blocks, the nibbles of blocks 0-1 and
// 2-3 as two vectors each of low and high codes, each pair's 16-bit products added before the widening (a lane's 8
// products, 4 per half), then d_w d_x per lane in floats
template <int64_t type, int rows, int group>
void multiply_group_int8(const uint8_t* w, int64_t row_bytes, int64_t blocks, const QuantizedX& x, float* y,
                         int64_t n, int64_t o) {
  constexpr int64_t bytes = block_bytes(type);
  constexpr bool has_m = has_min(type), has_fifth = is_q5(type);
  constexpr int64_t header = nibbles_at(type == kQ8_0 ? kQ4_0 : type);  // d (m) (fifth bits): bytes per block
  constexpr int chains = rows * group == 1 ? 2 : 1;  // one output alone: two chains, so its FMAs overlap
  const __m256i nibble = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16), ones = _mm256_set1_epi16(1);
  const __m256i blocks_01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i blocks_23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  __m256 acc[group][rows][chains];
  for (int g = 0; g < group; ++g)
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < chains; ++c) acc[g][r][c] = _mm256_setzero_ps();
  // each run read also prefetches the same run kAheadRows rows on (the hardware prefetcher alone left the loop
  // waiting on memory at batch 1: a Q8_0 LM head read 11 GB/s of 27), or of these rows again near the end
  const int64_t ahead = o + group + kAheadRows <= n ? kAheadRows * row_bytes : 0;
  for (int64_t run = 0; run < x.runs; ++run) {
    const int64_t count = std::min(kRun, blocks - kRun * run);
    const uint8_t* base[group];
    __m256 d_w[group];
    for (int g = 0; g < group; ++g) {
      base[g] = w + (o + g) * row_bytes + kRun * run * bytes;
      for (int64_t line = 0; line < kRun * bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(base[g] + ahead + line), _MM_HINT_T0);
      d_w[g] = halves_avx2(base[g], count);
    }
    if constexpr (type == kQ8_0) {
      for (int i = 0; i < count; ++i) {
        __m256i weights[group], size[group];
        __m256 d_i[group];
        for (int g = 0; g < group; ++g) {
          weights[g] = load_256(base[g] + header * count + 32 * i);
          size[g] = _mm256_abs_epi8(weights[g]);
          d_i[g] = _mm256_permutevar8x32_ps(d_w[g], _mm256_set1_epi32(i));
        }
        for (int r = 0; r < rows; ++r) {
          const __m256i q = load_256(x.q_at(r, run) + 32 * i);
          const __m256 scale = _mm256_loadu_ps(x.scale_at(r, run) + 8 * i);
          for (int g = 0; g < group; ++g) {
            __m256& sum = acc[g][r][i % chains];
            sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(size[g], _mm256_sign_epi8(q, weights[g]), ones)),
                                  _mm256_mul_ps(d_i[g], scale), sum);
          }
        }
      }
    } else {
      uint32_t words[group][kRun] = {};  // Q5: each block's fifth bits
      __m256 m_w[group];
      for (int g = 0; g < group; ++g) {
        if constexpr (has_fifth) {
          for (int64_t i = 0; i < count; ++i) std::memcpy(words[g] + i, base[g] + (has_m ? 4 : 2) * count + 4 * i, 4);
        }
        if constexpr (has_m) m_w[g] = halves_avx2(base[g] + 2 * count, count);
      }
      const int halves = count > 2 ? 2 : 1;  // a row's last run of 1-2 blocks has nothing in its second half
      for (int h = 0; h < halves; ++h) {  // blocks 0-1, then 2-3: weights 0-15 of each (low), then 16-31 (high)
        __m256i low[group], high[group];
        __m256 d_lanes[group], m_lanes[group];
        for (int g = 0; g < group; ++g) {
          const uint8_t* payload = base[g] + header * count;
          const __m256i nibbles = count >= 2 * h + 2 ? load_256(payload + 32 * h)  // a short run: only its blocks
                                  : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                        payload + 32 * h)));
          low[g] = _mm256_and_si256(nibbles, nibble);
          high[g] = _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), nibble);
          if constexpr (has_fifth) {  // bit j of block i's word: +16 on weight j of block i
            const uint32_t* pair = words[g] + 2 * h;
            const uint32_t low_bits = (pair[0] & 0xFFFF) | (pair[1] << 16);
            const uint32_t high_bits = (pair[0] >> 16) | (pair[1] & 0xFFFF0000u);
            low[g] = _mm256_or_si256(low[g], _mm256_and_si256(bits_to_bytes(low_bits), sixteen));
            high[g] = _mm256_or_si256(high[g], _mm256_and_si256(bits_to_bytes(high_bits), sixteen));
          }
          d_lanes[g] = _mm256_permutevar8x32_ps(d_w[g], h == 0 ? blocks_01 : blocks_23);
          if constexpr (has_m) m_lanes[g] = _mm256_permutevar8x32_ps(m_w[g], h == 0 ? blocks_01 : blocks_23);
        }
        for (int r = 0; r < rows; ++r) {
          const int8_t* q = x.q_at(r, run);
          const __m256i q_low = load_256(q + 32 * h), q_high = load_256(q + 64 + 32 * h);
          const __m256 scale = _mm256_loadu_ps(x.scale_at(r, run) + 8 * h);
          __m256i offset = _mm256_setzero_si256();
          __m256 sums = _mm256_setzero_ps();
          if constexpr (has_m) sums = _mm256_loadu_ps(x.sum_at(r, run) + 8 * h);
          else offset = load_256(x.offset_at(r, run) + 8 * h);
          for (int g = 0; g < group; ++g) {
            const __m256i products = _mm256_add_epi16(_mm256_maddubs_epi16(low[g], q_low),
                                                      _mm256_maddubs_epi16(high[g], q_high));
            __m256i dot = _mm256_madd_epi16(products, ones);
            if constexpr (!has_m) dot = _mm256_add_epi32(dot, offset);
            __m256& sum = acc[g][r][h % chains];
            sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d_lanes[g], scale), sum);
            if constexpr (has_m) sum = _mm256_fmadd_ps(m_lanes[g], sums, sum);
          }
        }
      }
    }
  }
  for (int g = 0; g < group; ++g)
    for (int r = 0; r < rows; ++r) {
      __m256 total = acc[g][r][0];
      for (int c = 1; c < chains; ++c) total = _mm256_add_ps(total, acc[g][r][c]);
      y[r * n + o + g] = sum_lanes(total);
    }
}

// Output rows [o, o + group) of a Q4_K or Q6_K W for `rows` rows of quantized x: 32 codes at a time (one
// sub-block of Q4_K, two scales of Q6_K) against x's sub-block, their integer scale applied by vpmaddwd, then
// d_x per sub-block in floats; two chains per row (low and high nibbles, or a Q6_K half's even and odd parts)
template <int64_t type, int rows, int group>
void multiply_group_super_int8(const uint8_t* w, int64_t row_bytes, const QuantizedSuperX& x, float* y, int64_t n,
                               int64_t o) {
  constexpr int64_t bytes = block_bytes(type);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t row = o; row < o + group; ++row) {
    __m256 acc[rows];
    for (int r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
    const int64_t ahead = row + kAheadRows < n ? kAheadRows * row_bytes : 0;  // as multiply_group_int8
    for (int64_t sb = 0; sb < x.supers; ++sb) {
      const uint8_t* block = w + row * row_bytes + sb * bytes;
      for (int64_t line = 0; line < bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(block + ahead + line), _MM_HINT_T0);
      uint32_t scales_mins[4] = {};  // Q4_K: the 8 scales, then the 8 mins, a byte each
      if constexpr (type == kQ4_K) q4_k_scales_mins(block + 4, scales_mins);
      const auto* q4_k_scales = reinterpret_cast<const uint8_t*>(scales_mins);
      for (int r = 0; r < rows; ++r) {
        const int64_t at = r * x.supers + sb;
        const int8_t* q = x.q.data() + at * kSuper;
        const float* scale = x.scale.data() + at * 8;
        __m256 sums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        if constexpr (type == kQ4_K) {
          for (int p = 0; p < 4; ++p) {  // low nibbles: sub-block 2p, high: 2p + 1
            const __m256i nibbles = load_256(block + 16 + 32 * p);
            const __m256i codes[2] = {_mm256_and_si256(nibbles, nibble),
                                      _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), nibble)};
            for (int h = 0; h < 2; ++h) {
              const int j = 2 * p + h;
              const __m256i dot = dot_u8_s8(codes[h], load_256(q + 32 * j), _mm256_set1_epi16(q4_k_scales[j]));
              sums[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[j]), sums[h]);
            }
          }
          const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
              reinterpret_cast<const __m128i*>(q4_k_scales + 8))));
          const __m256 by_min = _mm256_mul_ps(mins, _mm256_loadu_ps(x.mins.data() + at * 8));
          acc[r] = _mm256_fmadd_ps(_mm256_add_ps(sums[0], sums[1]), _mm256_set1_ps(half_at(block)), acc[r]);
          acc[r] = _mm256_fnmadd_ps(by_min, _mm256_set1_ps(half_at(block + 2)), acc[r]);
        } else {  // Q6_K: w = d scale_i (q - 32), the layout as in add_super_block
          const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
          for (int v = 0; v < 8; ++v) {  // weights 32 v .. 32 v + 31: scales 2 v, 2 v + 1
            const __m256i by = _mm256_setr_m128i(_mm_set1_epi16(scales[2 * v]), _mm_set1_epi16(scales[2 * v + 1]));
            const __m256i dot = dot_u8_s8(q6_k_codes(block, v), load_256(q + 32 * v), by);
            sums[v % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[v]), sums[v % 2]);
          }
          // the -32: sum_i scale_i (the sum of its 16 values), in lanes per sub-block, times d_x
          const __m256i by_scale = _mm256_madd_epi16(
              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales))),
              load_256(x.sums.data() + at * 16));
          const __m256 minus = _mm256_mul_ps(_mm256_cvtepi32_ps(by_scale), _mm256_loadu_ps(scale));
          const __m256 total = _mm256_fnmadd_ps(minus, _mm256_set1_ps(32.0f), _mm256_add_ps(sums[0], sums[1]));
          acc[r] = _mm256_fmadd_ps(total, _mm256_set1_ps(half_at(block + 208)), acc[r]);
        }
      }
    }
    for (int r = 0; r < rows; ++r) y[r * n + row] = sum_lanes(acc[r]);
  }
}

// x's rows per 32 values for multiply_interleaved: q in order, d_x, and the sum of q (Q4_0's -8)
struct BlocksOfX {
  int64_t blocks;
  std::vector<int8_t> q;     // [row][block][32]
  std::vector<float> d;      // [row][block]
  std::vector<int32_t> sum;  // [row][block]
};

BlocksOfX quantize_blocks(const float* x, int rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  BlocksOfX out{blocks, std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks),
                std::vector<int32_t>(rows * blocks)};
  for (int64_t i = 0; i < rows * blocks; ++i) {
    int8_t* q = out.q.data() + i * kBlock;
    out.d[i] = quantize_block(x + i * kBlock, q);  // row r's block b is x's values (r k + 32 b) on: i = r blocks + b
    int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) sum += q[j];
    out.sum[i] = sum;
  }
  return out;
}

// Output rows [8 g, 8 g + 8) of interleaved Q4_0 (Q5_0) rows for `rows` rows of x: per block, four 32-byte loads hold
// the eight rows' codes; each meets four of x's values broadcast to every lane (vpmaddubsw), the 16-bit sums of all
// four added before one widening (Q4_0: at most 8 x 2 x 15 x 127 = 30480, no overflow; Q5_0's codes reach 31, so
// each load's sums widen on their own), so a lane holds its row's whole integer dot product; then -8 (-16) sum(q_x),
// and d_w d_x as one vector of the rows' scales. A Q5_0 load's fifth bits: bits 4m .. 4m + 3 (16 + 4m ..) of each
// lane's word, its byte m / 2 (2 + m / 2) copied to the lane's four bytes and compared with one bit per byte.
template <int64_t type>
void multiply_interleaved(const uint8_t* w, const BlocksOfX& x, int rows, float* y, int64_t n, int64_t g) {
  constexpr int64_t bytes = kLanes * block_bytes(type), codes_at = kLanes * nibbles_at(type);
  constexpr int32_t offset = type == kQ4_0 ? 8 : 16;
  const int64_t blocks = x.blocks;
  const uint8_t* group = w + g * blocks * bytes;
  const int64_t ahead = (g + 2) * kLanes <= n ? blocks * bytes : 0;  // the next group's same block, as above
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < rows; ++r) {
    const int8_t* q = x.q.data() + r * blocks * kBlock;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, q += kBlock) {
      const uint8_t* block = group + b * bytes;
      if (r == 0)
        for (int64_t line = 0; line < bytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(block + ahead + line), _MM_HINT_T0);
      __m256i sums = _mm256_setzero_si256(), wide = _mm256_setzero_si256();
      [[maybe_unused]] const __m256i fifth = load_256(block + 16);  // Q5_0: the eight rows' words
      for (int m = 0; m < 4; ++m) {
        const __m256i both = load_256(block + codes_at + 32 * m);
        __m256i low_codes = _mm256_and_si256(both, nibble), high_codes = _mm256_and_si256(_mm256_srli_epi16(both, 4),
                                                                                          nibble);
        if constexpr (type == kQ5_0) {
          const __m256i bit = _mm256_set1_epi32(static_cast<int32_t>(0x08040201u << (4 * (m % 2))));
          const auto spread = [&](int byte) {  // 16 where the byte's bit is set, per byte of each lane
            const __m256i lane = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404,
                                                   0x08080808, 0x0C0C0C0C);  // a lane's first byte, in its half
            const __m256i copies = _mm256_shuffle_epi8(fifth, _mm256_add_epi32(lane, _mm256_set1_epi32(
                                                                                    byte * 0x01010101)));
            return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(copies, bit), bit), _mm256_set1_epi8(16));
          };
          low_codes = _mm256_or_si256(low_codes, spread(m / 2));
          high_codes = _mm256_or_si256(high_codes, spread(2 + m / 2));
        }
        int32_t low, high;  // x's values 4m .. 4m + 3 and 16 + 4m ..: what the low and high nibbles multiply
        std::memcpy(&low, q + 4 * m, 4);
        std::memcpy(&high, q + 16 + 4 * m, 4);
        const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(low_codes, _mm256_set1_epi32(low)),
                                              _mm256_maddubs_epi16(high_codes, _mm256_set1_epi32(high)));
        if constexpr (type == kQ4_0) sums = _mm256_add_epi16(sums, pair);
        else wide = _mm256_add_epi32(wide, _mm256_madd_epi16(pair, ones));
      }
      const int64_t at = r * blocks + b;
      const __m256i whole = type == kQ4_0 ? _mm256_madd_epi16(sums, ones) : wide;
      const __m256i dot = _mm256_sub_epi32(whole, _mm256_set1_epi32(offset * x.sum[at]));
      const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d_w, _mm256_set1_ps(x.d[at])), acc);
    }
    _mm256_storeu_ps(y + r * n + g * kLanes, acc);
  }
}
constexpr bool kInterleaves = true;

// Output rows per pass of the 32-weight formats' int8 kernel: two at batch 1-2, sharing x's loads (more rows of x
// would need more accumulators than AVX2's 16 registers hold); the K formats' kernel takes one
constexpr int int8_group_for(int rows) { return rows <= 2 ? 2 : 1; }
#endif

// f(group size, o) for output rows [o, o + group size) of n: whole groups of kGroup split evenly between the
// threads (a grain of about 16 output rows); the last group, where n is not a multiple of kGroup, one row at a time
template <int kGroup, typename F>
void for_each_group(int64_t n, F&& f) {
  at::parallel_for(0, (n + kGroup - 1) / kGroup, std::max(1, 16 / kGroup), [&](int64_t first, int64_t last) {
    for (int64_t group = first; group < last; ++group) {
      const int64_t o = group * kGroup;
      if (o + kGroup <= n) {
        f(std::integral_constant<int, kGroup>{}, o);
      } else {
        for (int64_t row = o; row < n; ++row) f(std::integral_constant<int, 1>{}, row);
      }
    }
  });
}

void check(const at::Tensor& blocks, int64_t type, int64_t n, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "GGUF blocks must be contiguous uint8 [out, bytes per row]");
  const int64_t per_block = block_weights(stored_type(type));
  TORCH_CHECK(k % per_block == 0 && blocks.size(0) == n &&
              blocks.size(1) == k / per_block * block_bytes(stored_type(type)),
              "GGUF blocks [", blocks.size(0), ", ", blocks.size(1), "] do not hold a [", n, ", ", k, "] weight");
}

// f(std::integral_constant<int64_t, type>{}) for the block format `type`: one instance of the multiply per format
template <typename F>
void with_type(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    default: return f(std::integral_constant<int64_t, kQ6_K>{});  // check() refused every other type
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

}  // namespace

namespace minivllm_cpu {

// x [..., K] (fp32/bf16/fp16; meant for a few rows) @ W.T, W [N, K] as GGUF `type` blocks -> [..., N] in x's dtype
at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type, int64_t n) {
  const int64_t k = x_in.size(-1), m = x_in.numel() / std::max<int64_t>(k, 1);
  check(blocks, type, n, k);
  // The kernels read x and write y in fp32. A decode step's fp32 x is already [M, K] and contiguous: used as it is.
  // bf16 (dtype "auto" on a CPU with native bf16) or fp16 x is widened, and y rounded back, by plain loops: with
  // torch's `to`, two dispatches a call, a 135M model's Q4_0 layers took 5.50 ms a token at batch 1, 4.97 without.
  const bool flat = x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous();
  at::Tensor x = x_in;
  if (!flat) {
    const at::Tensor src = x_in.is_contiguous() ? x_in : x_in.contiguous();
    x = x_in.scalar_type() == at::kFloat ? src.view({m, k}) : at::empty({m, k}, src.options().dtype(at::kFloat));
    if (x_in.scalar_type() != at::kFloat)
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "gguf_linear_x", [&] {
        const scalar_t* from = src.data_ptr<scalar_t>();
        float* to = x.data_ptr<float>();
        for (int64_t i = 0; i < m * k; ++i) to[i] = static_cast<float>(from[i]);
      });
  }
  auto y = at::empty({m, n}, x.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1), blocks_per_row = k / block_weights(stored_type(type));
  TORCH_CHECK(!is_packed(type) || kInt8Dot,
              "packed GGUF rows need AVX2 or AVX512-VNNI (gguf_int8_dot() is false here)");
  TORCH_CHECK(!is_interleaved(type) || (kInterleaves && interleaves(stored_type(type)) && n % kLanes == 0),
              "interleaved GGUF rows are Q4_0 or Q5_0, 8 at a time, for AVX2's int8 kernel (gguf_interleaves())");
  for (int64_t r = 0; r < m; r += kRows) {
    const int rows = static_cast<int>(std::min(kRows, m - r));
    const float* xr = x.data_ptr<float>() + r * k;
    float* yr = y.data_ptr<float>() + r * n;
#ifdef MINIVLLM_INT8_AVX2
    if (is_interleaved(type)) {  // x as int8 per block, eight output rows a pass
      const BlocksOfX qx = quantize_blocks(xr, rows, k);
      at::parallel_for(0, n / kLanes, 2, [&](int64_t first, int64_t last) {
        for (int64_t g = first; g < last; ++g)
          stored_type(type) == kQ4_0 ? multiply_interleaved<kQ4_0>(w, qx, rows, yr, n, g)
                                     : multiply_interleaved<kQ5_0>(w, qx, rows, yr, n, g);
      });
      continue;
    }
#endif
    with_type(stored_type(type), [&](auto type_constant) {
      constexpr int64_t kType = decltype(type_constant)::value;
#ifdef MINIVLLM_INT8_DOT
      if (is_packed(type)) {  // x as int8, once for every output row
        const auto qx = [&] {
          if constexpr (is_super(kType)) return quantize_x_super(kType, xr, rows, k);
          else return quantize_x(kType, xr, rows, k);
        }();
        with_rows(rows, [&](auto rows_constant) {
          constexpr int kRowsOfX = decltype(rows_constant)::value;
          constexpr int kGroup = is_super(kType) ? group_for(kRowsOfX) : int8_group_for(kRowsOfX);
          for_each_group<kGroup>(n, [&](auto group_constant, int64_t o) {
            constexpr int kOutputs = decltype(group_constant)::value;
            if constexpr (is_super(kType))
              multiply_group_super_int8<kType, kRowsOfX, kOutputs>(w, row_bytes, qx, yr, n, o);
            else
              multiply_group_int8<kType, kRowsOfX, kOutputs>(w, row_bytes, blocks_per_row, qx, yr, n, o);
          });
        });
        return;
      }
#endif
      with_rows(rows, [&](auto rows_constant) {
        constexpr int kRowsOfX = decltype(rows_constant)::value;
        for_each_group<group_for(kRowsOfX)>(n, [&](auto group_constant, int64_t o) {
          multiply_group<kType, kRowsOfX, decltype(group_constant)::value>(w, row_bytes, blocks_per_row, xr, k, yr,
                                                                            n, o);
        });
      });
    });
  }
  if (flat) return y;
  auto shape = x_in.sizes().vec();
  shape.back() = n;
  if (x_in.scalar_type() == at::kFloat) return y.view(shape);
  auto out = at::empty(shape, x_in.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "gguf_linear_y", [&] {
    const float* from = y.data_ptr<float>();
    scalar_t* to = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i < m * n; ++i) to[i] = static_cast<scalar_t>(from[i]);  // nearest even, as torch's `to`
  });
  return out;
}

}  // namespace minivllm_cpu

// W [N, K] in float from its blocks: the prompt's path (one copy per call, then a GEMM) and the reference's
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t n, int64_t k) {
  check(blocks, type, n, k);
  auto w = at::empty({n, k}, at::kFloat);
  const int64_t stored = stored_type(type), bytes = block_bytes(stored), row_bytes = blocks.size(1);
  const int64_t per_block = block_weights(stored), blocks_per_row = k / per_block;
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = w.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    uint8_t block[kSuper];  // a packed block put back together in the file's layout
    for (int64_t o = first; o < last; ++o)
      for (int64_t b = 0; b < blocks_per_row; ++b) {
        const uint8_t* at = src + o * row_bytes + b * bytes;
        if (is_interleaved(type)) {
          map_interleaved<true>(stored, const_cast<uint8_t*>(src), blocks_per_row, o, b, block);
          at = block;
        } else if (regrouped(type)) {
          map_block<true>(const_cast<uint8_t*>(src) + o * row_bytes, blocks_per_row, stored, bytes, b, block);
          at = block;
        }
        dequantize_block(stored, at, dst + o * k + b * per_block);
      }
  });
  return w;
}

// Rows of 32-weight blocks regrouped for the int8 path (the same bytes: see map_block); `type | 256` names them.
// `type | 512` asks for Q4_0 or Q5_0 rows interleaved 8 at a time instead (map_interleaved), where
// gguf_interleaves().
at::Tensor gguf_pack(const at::Tensor& blocks, int64_t type_in) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "GGUF blocks must be contiguous uint8 [out, bytes per row]");
  const int64_t type = stored_type(type_in);
  const int64_t bytes = block_bytes(type), row_bytes = blocks.size(1), per_row = row_bytes / bytes;  // refuses others
  TORCH_CHECK(row_bytes % bytes == 0, "a row of ", row_bytes, " bytes is not whole blocks of ", bytes);
  auto out = at::empty_like(blocks);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  if (is_interleaved(type_in)) {
    TORCH_CHECK(kInterleaves && interleaves(type) && blocks.size(0) % kLanes == 0,
                "only Q4_0 and Q5_0 rows, 8 at a time, interleave, where AVX2's int8 kernel is built "
                "(gguf_interleaves())");
    at::parallel_for(0, blocks.size(0), 64, [&](int64_t first, int64_t last) {
      for (int64_t o = first; o < last; ++o)
        for (int64_t b = 0; b < per_row; ++b)
          map_interleaved<false>(type, dst, per_row, o, b, const_cast<uint8_t*>(src) + o * row_bytes + b * bytes);
    });
    return out;
  }
  if (is_super(type)) return blocks.clone();  // their layout serves the int8 path as it is
  at::parallel_for(0, blocks.size(0), 64, [&](int64_t first, int64_t last) {
    for (int64_t o = first; o < last; ++o)
      for (int64_t b = 0; b < per_row; ++b)
        map_block<false>(dst + o * row_bytes, per_row, type, bytes, b,
                         const_cast<uint8_t*>(src) + o * row_bytes + b * bytes);
  });
  return out;
}

bool gguf_int8_dot() { return kInt8Dot; }
bool gguf_interleaves() { return kInterleaves; }

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int type, int n) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type, int n, int k) -> Tensor");
  m.def("gguf_pack(Tensor blocks, int type) -> Tensor");
  m.def("gguf_int8_dot() -> bool", &gguf_int8_dot);
  m.def("gguf_interleaves() -> bool", &gguf_interleaves);
  m.impl("gguf_pack", c10::DispatchKey::CPU, TORCH_FN(gguf_pack));
  m.impl("gguf_linear", c10::DispatchKey::CPU, TORCH_FN(minivllm_cpu::gguf_linear));
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, TORCH_FN(gguf_dequantize));
}
