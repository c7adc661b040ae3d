// Tiled linear layers on CPU: y = x @ W.T (+ b), W held in tiles of 64 outputs (layout and measurements:
// quantization/cpu_unquantized.py). Decoding reads every weight byte once for two flops per byte, so the time is
// the time to stream the weights: laid out in the order they are read, each 64-byte load feeds sixteen outputs
// (the input element broadcast into sixteen accumulators, no horizontal sum). Sums are fp32 whatever the dtype.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define MINIVLLM_TILED 1
#endif

#include "../platforms/cpu_ops.h"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace {

constexpr int64_t kTile = 64;   // output rows per tile: four 16-lane vectors
constexpr int64_t kRows = 4;    // rows of x per pass over a tile
constexpr int64_t kRowsPerPart = 8;  // the fewest rows of x a thread's part of a tile gets (parts_per_tile)

// W [N, K] -> [ceil(N / 64), K / pack, 64, pack], zero-padded; pack = 2 for bf16 (one pair per 32-bit lane,
// what vdpbf16ps multiplies), 1 for fp32.
at::Tensor pack_small_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [out, in]");
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || weight.scalar_type() == at::kFloat, "bf16 or fp32 weights only");
  const int64_t pack = bf16 ? 2 : 1, n = weight.size(0), k = weight.size(1);
  const int64_t tiles = (n + kTile - 1) / kTile, k_padded = (k + pack - 1) / pack * pack;
  auto padded = at::zeros({tiles * kTile, k_padded}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [tiles, 64, K/pack, pack] -> [tiles, K/pack, 64, pack]
  return padded.view({tiles, kTile, k_padded / pack, pack}).transpose(1, 2).contiguous();
}

#ifdef MINIVLLM_TILED
// Sixteen fp32 lanes: one AVX-512 register, or two AVX2 ones. The tile loop below is written once over these;
// only what a lane op compiles to differs between the two instruction sets.
#ifdef __AVX512F__
constexpr bool kPrefetch = true;  // see tile_rows
struct Lanes16 {
  __m512 v;
};
inline Lanes16 splat(float x) { return {_mm512_set1_ps(x)}; }
inline Lanes16 load_lanes(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store_lanes(float* p, Lanes16 a) { _mm512_storeu_ps(p, a.v); }
inline Lanes16 fma(Lanes16 a, Lanes16 b, Lanes16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// 16 bf16 pairs (64 bytes) -> their even and odd elements as fp32: a bf16 is the top half of an fp32, so the even
// one widens with a shift and the odd one with a mask
inline void widen_pairs(const char* p, Lanes16& even, Lanes16& odd) {
  const __m512i both = _mm512_loadu_si512(p);
  even.v = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
  odd.v = _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32(0xFFFF0000)));
}
#else
constexpr bool kPrefetch = false;  // see tile_rows
struct Lanes16 {
  __m256 lo, hi;
};
inline Lanes16 splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Lanes16 load_lanes(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store_lanes(float* p, Lanes16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Lanes16 fma(Lanes16 a, Lanes16 b, Lanes16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline void widen_pairs(const char* p, Lanes16& even, Lanes16& odd) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(lo, mask)), _mm256_castsi256_ps(_mm256_and_si256(hi, mask))};
}
#endif

inline float bf16_to_float(uint32_t bits) {  // bits: a bf16 already in the top half
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One tile of 64 outputs for ROWS rows of x. bf16: x is read as 32-bit pairs, each broadcast to 16 lanes and
// multiplied pairwise into the 16 accumulators (vdpbf16ps, or two FMAs on a CPU without AVX512-BF16: the same
// bytes read, so decoding runs at the same speed); fp32: one element broadcast and fused-multiply-added.
template <int ROWS, bool BF16, bool F32_OUT = !BF16>
inline void tile_rows(const void* x, int64_t x_stride, const void* tile, int64_t steps, const float* bias,
                      void* out, int64_t out_stride, int64_t cols) {
  Lanes16 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = bias ? load_lanes(bias + 16 * v) : splat(0.0f);
  const char* w = static_cast<const char*>(tile);
  for (int64_t s = 0; s < steps; ++s, w += 256) {  // one step: 64 outputs x (a bf16 pair or one fp32) = 256 bytes
    // AVX-512 CPUs: the whole step 16 steps ahead into L2, a core keeps more misses in flight through L2 than
    // through its few L1 slots. On a Xeon (AVX-512, session 13) this with a line into L1 4 steps ahead made batch-1
    // layers ~4% faster in bf16 and ~1.5% in fp32 than no hints; on a Zen 4 (session 25) dropping the L1 line
    // made them 5-10% faster again (all 30 layers and the LM head of a 135M model from memory: fp32 18.2 -> 16.4
    // ms, bf16 11.0 -> 10.3; 8 and 64 rows 4-8%). On the AVX2 Zen 3 measured, hints cost a quarter of the speed:
    // its own prefetchers do better alone.
    if constexpr (kPrefetch) {
      for (int line = 0; line < 256; line += 64) _mm_prefetch(w + 4096 + line, _MM_HINT_T1);
    }
    for (int r = 0; r < ROWS; ++r) {
      if constexpr (BF16) {
        uint32_t pair;
        std::memcpy(&pair, static_cast<const char*>(x) + (r * x_stride + 2 * s) * 2, 4);
#ifdef __AVX512BF16__
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int v = 0; v < 4; ++v)
          acc[r][v].v = _mm512_dpbf16_ps(acc[r][v].v, (__m512bh)_mm512_loadu_si512(w + 64 * v), xb);
#else
        // no vdpbf16ps: each pair widens to two fp32 and two fused multiply-adds do what vdpbf16ps does in one
        const Lanes16 x_even = splat(bf16_to_float(pair << 16)), x_odd = splat(bf16_to_float(pair & 0xFFFF0000u));
        for (int v = 0; v < 4; ++v) {
          Lanes16 even, odd;
          widen_pairs(w + 64 * v, even, odd);
          acc[r][v] = fma(odd, x_odd, fma(even, x_even, acc[r][v]));
        }
#endif
      } else {
        const Lanes16 xb = splat(static_cast<const float*>(x)[r * x_stride + s]);
        for (int v = 0; v < 4; ++v)
          acc[r][v] = fma(load_lanes(reinterpret_cast<const float*>(w) + 16 * v), xb, acc[r][v]);
      }
    }
  }
  // the tile's last columns may lie past N (the weight was padded to whole tiles): only `cols` are written, bf16
  // rounded to nearest even as torch rounds
  for (int r = 0; r < ROWS; ++r) {
    float sums[kTile];
    for (int v = 0; v < 4; ++v) store_lanes(sums + 16 * v, acc[r][v]);
    if constexpr (F32_OUT) {
      std::memcpy(static_cast<float*>(out) + r * out_stride, sums, cols * sizeof(float));
    } else {
      at::BFloat16* o = static_cast<at::BFloat16*>(out) + r * out_stride;
      for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<at::BFloat16>(sums[c]);
    }
  }
}

template <bool BF16, bool F32_OUT = !BF16>
void tile_any_rows(int rows, const void* x, int64_t x_stride, const void* tile, int64_t steps, const float* bias,
                   void* out, int64_t out_stride, int64_t cols) {
#ifdef __AVX512F__  // 32 registers: 4 rows' accumulators for the whole tile
  switch (rows) {
    case 1: return tile_rows<1, BF16, F32_OUT>(x, x_stride, tile, steps, bias, out, out_stride, cols);
    case 2: return tile_rows<2, BF16, F32_OUT>(x, x_stride, tile, steps, bias, out, out_stride, cols);
    case 3: return tile_rows<3, BF16, F32_OUT>(x, x_stride, tile, steps, bias, out, out_stride, cols);
    default: return tile_rows<4, BF16, F32_OUT>(x, x_stride, tile, steps, bias, out, out_stride, cols);
  }
#else  // 16 registers hold one row's 8 accumulators: a pass per row, the tile read again from L2 (several fp32
       // rows take block_rows below instead)
  const int64_t x_bytes = BF16 ? 2 : 4, out_bytes = F32_OUT ? 4 : 2;
  for (int r = 0; r < rows; ++r)
    tile_rows<1, BF16, F32_OUT>(static_cast<const char*>(x) + r * x_stride * x_bytes, x_stride, tile, steps, bias,
                                static_cast<char*>(out) + r * out_stride * out_bytes, out_stride, cols);
#endif
}

#ifndef __AVX512F__
// AVX2, fp32, several rows: a block of up to 6 rows x 16 outputs held in 12 registers (two loads of the weight
// and six broadcasts of x feed 12 fused multiply-adds, so the FMA units, not the loads, set the pace). A tile's
// four groups of 16 outputs take turns; each group's weights (K x 64 bytes) stay in L1 while every block of rows
// in a panel multiplies them. Per output the sum runs over K in order, as in tile_rows: the same bits.
constexpr int64_t kBlockRows = 6;    // rows of x per block: 12 accumulators
constexpr int64_t kPanelRows = 96;   // rows of x kept in L2 while the tile's four groups pass over them
constexpr int64_t kBlockSteps = 256;  // K per run: a group's weights for a run (16 KB) stay in L1 across a panel

// While it multiplies, a block asks for its share of the weights the next group will read (`ahead`, steps
// [ahead_from, ahead_to)), one line a step: the first block of a group otherwise waited on its weights from L3 or
// memory. Measured on the Zen 3 with a decode step's 25 layers cycling through a cold cache: 1.1-1.25x at 2-64 rows.
template <int ROWS>
inline void block_rows(const float* x, int64_t x_stride, const float* w, int64_t steps, const float* bias,
                       float* out, int64_t out_stride, int64_t cols, bool resume, const float* ahead,
                       int64_t ahead_from, int64_t ahead_to) {
  // every loop over the block unrolled before GCC decides where acc lives: else it kept acc in memory too, and
  // 12 stores a step halved the speed
  __m256 acc[ROWS][2];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    if (resume) {  // the sums so far of an earlier run of steps, from out
      float sums[16] = {};
      std::memcpy(sums, out + r * out_stride, cols * sizeof(float));
      acc[r][0] = _mm256_loadu_ps(sums), acc[r][1] = _mm256_loadu_ps(sums + 8);
    } else {
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) acc[r][v] = bias ? _mm256_loadu_ps(bias + 8 * v) : _mm256_setzero_ps();
    }
  }
  const auto step = [&](int64_t s) __attribute__((always_inline)) {
    const __m256 w0 = _mm256_loadu_ps(w + s * kTile), w1 = _mm256_loadu_ps(w + s * kTile + 8);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + s);
      acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]);
    }
  };
  // three loops, not a test in one: a branch in this loop cost more than the prefetches gained at 64 rows
  int64_t s = 0;
  for (; s < ahead_from; ++s) step(s);
  for (; s < ahead_to; ++s) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + s * kTile), _MM_HINT_T0);
    step(s);
  }
  for (; s < steps; ++s) step(s);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    if (cols == 16) {
      _mm256_storeu_ps(out + r * out_stride, acc[r][0]);
      _mm256_storeu_ps(out + r * out_stride + 8, acc[r][1]);
    } else {  // the weight's padding: only `cols` outputs are real
      float sums[16];
      _mm256_storeu_ps(sums, acc[r][0]);
      _mm256_storeu_ps(sums + 8, acc[r][1]);
      std::memcpy(out + r * out_stride, sums, cols * sizeof(float));
    }
  }
}

// Every block of `rows`; the first `ahead_steps` (<= steps) steps of the weights read next (`ahead`, or nullptr:
// none) prefetched a slice a block
void block_any_rows(int64_t rows, const float* x, int64_t x_stride, const float* w, int64_t steps,
                    const float* bias, float* out, int64_t out_stride, int64_t cols, bool resume,
                    const float* ahead, int64_t ahead_steps) {
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows, ahead_total = ahead ? ahead_steps : 0;
  for (int64_t r = 0, b = 0; r < rows; r += kBlockRows, ++b) {
    const float* xr = x + r * x_stride;
    float* o = out + r * out_stride;
    const int64_t lo = ahead_total * b / blocks, hi = ahead_total * (b + 1) / blocks;
    switch (std::min(kBlockRows, rows - r)) {
      case 1: block_rows<1>(xr, x_stride, w, steps, bias, o, out_stride, cols, resume, ahead, lo, hi); break;
      case 2: block_rows<2>(xr, x_stride, w, steps, bias, o, out_stride, cols, resume, ahead, lo, hi); break;
      case 3: block_rows<3>(xr, x_stride, w, steps, bias, o, out_stride, cols, resume, ahead, lo, hi); break;
      case 4: block_rows<4>(xr, x_stride, w, steps, bias, o, out_stride, cols, resume, ahead, lo, hi); break;
      case 5: block_rows<5>(xr, x_stride, w, steps, bias, o, out_stride, cols, resume, ahead, lo, hi); break;
      default: block_rows<6>(xr, x_stride, w, steps, bias, o, out_stride, cols, resume, ahead, lo, hi);
    }
  }
}
#endif

// All `rows` rows of x against one tile (`cols` of its 64 outputs written); `next_tile`: the tile this thread
// takes next, if it is another (the blocked kernel prefetches it).
template <bool BF16, bool F32_OUT = !BF16>
void tile_all_rows(int64_t rows, const void* x, int64_t x_stride, const void* tile, int64_t steps,
                   const float* bias, void* out, int64_t out_stride, int64_t cols,
                   [[maybe_unused]] const void* next_tile = nullptr) {
#ifndef __AVX512F__
  if constexpr (!BF16) {
    if (rows > 1) {  // runs of steps, then panels of rows, then the tile's four 16-output groups in turn
      const float* w = static_cast<const float*>(tile);
      for (int64_t s = 0; s < steps; s += kBlockSteps)
        for (int64_t p = 0; p < rows; p += kPanelRows)
          for (int64_t g = 0; g < kTile && g < cols; g += 16) {
            // what is read next, and how many of its steps this run's blocks prefetch
            const int64_t run = std::min(kBlockSteps, steps - s);
            const float* ahead;
            int64_t ahead_steps = run;
            if (g + 16 < kTile) {  // the tile's next group in this run
              ahead = w + s * kTile + g + 16;
            } else if (s + kBlockSteps < steps) {  // the next run's first group, maybe a shorter last run
              ahead = w + (s + kBlockSteps) * kTile;
              ahead_steps = std::min(run, steps - s - kBlockSteps);
            } else {  // the next tile's first group (none: no prefetch)
              ahead = static_cast<const float*>(next_tile);
            }
            block_any_rows(std::min(kPanelRows, rows - p), static_cast<const float*>(x) + p * x_stride + s,
                           x_stride, w + s * kTile + g, run, bias ? bias + g : nullptr,
                           static_cast<float*>(out) + p * out_stride + g, out_stride, std::min<int64_t>(16, cols - g),
                           s > 0, ahead, ahead_steps);
          }
      return;
    }
  }
#endif
  const int64_t x_bytes = BF16 ? 2 : 4, out_bytes = F32_OUT ? 4 : 2;
  for (int64_t r = 0; r < rows; r += kRows)
    tile_any_rows<BF16, F32_OUT>(static_cast<int>(std::min(kRows, rows - r)),
                                 static_cast<const char*>(x) + r * x_stride * x_bytes, x_stride, tile, steps, bias,
                                 static_cast<char*>(out) + r * out_stride * out_bytes, out_stride, cols);
}

// Threads split the weight's bytes evenly. Whole tiles do when their count divides among the threads closely enough;
// else (a 576-output layer is 9 tiles: 5 and 4 on two threads, one thread idle for a ninth of the call) each tile is
// cut into `parts`, each part an item of the split, the most `most` parts. With many rows of x the parts are runs
// of rows, each multiplying the whole tile; with a few (decoding, where reading the weight is the time) they are
// runs of steps, whose fp32 partial sums are added after. Those cost a buffer and a pass of their own: at 15 tiles
// on two threads (8 and 7, 7% idle) whole tiles measured 10-15% faster on a Zen 3.
int64_t parts_per_tile(int64_t tiles, int64_t most, int64_t threads) {
  const int64_t busiest = (tiles + threads - 1) / threads;  // tiles on the busiest thread
  if (threads <= 1 || 10 * busiest * threads <= 11 * tiles) return 1;  // even, or imbalance <= 1/10
  return std::max<int64_t>(1, std::min(threads / std::gcd(tiles, threads), most));
}
#endif  // MINIVLLM_TILED

}  // namespace

namespace minivllm_cpu {

// x [M, K] (any M; meant for up to cpu_unquantized.py's TILED_MAX_ROWS), packed as pack_small_linear left it,
// bias [N] or None -> [M, N].
at::Tensor small_linear(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias_in,
                        int64_t n) {
#ifndef MINIVLLM_TILED
  TORCH_CHECK(false, "small_linear needs AVX-512 or AVX2 with FMA");
#endif
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x_in.scalar_type() == packed.scalar_type(), "x and the weight must share a dtype");
  const int64_t pack = packed.size(3), k_padded = packed.size(1) * pack, tiles = packed.size(0);
  const int64_t k = x_in.size(-1), m = x_in.numel() / std::max<int64_t>(k, 1);
  TORCH_CHECK(k <= k_padded && k_padded - k < pack && n <= tiles * kTile, "x, the weight and n disagree");
  // a decode step's x is already [M, K] and contiguous: no reshape, no copy (each an op dispatch, ~120 a step)
  const bool flat = x_in.dim() == 2 && x_in.is_contiguous();
  at::Tensor x = flat ? x_in : x_in.reshape({m, k});
  if (k != k_padded) x = at::constant_pad_nd(x, {0, k_padded - k});  // an odd K in bf16: one zero input
  if (!x.is_contiguous()) x = x.contiguous();
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined())
    bias = at::constant_pad_nd(bias_in->to(at::kFloat), {0, tiles * kTile - n}).contiguous();
  auto y = at::empty({m, n}, x.options());
#ifdef MINIVLLM_TILED
  const char* w = static_cast<const char*>(packed.data_ptr());
  const int64_t tile_bytes = packed.stride(0) * packed.element_size(), steps = k_padded / pack;
  const char* xs = static_cast<const char*>(x.data_ptr());
  char* ys = static_cast<char*>(y.data_ptr());
  const int64_t x_row_bytes = k_padded * x.element_size(), y_row_bytes = n * y.element_size();
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t threads = at::get_num_threads(), row_parts = parts_per_tile(tiles, m / kRowsPerPart, threads);
  const int64_t slices = row_parts > 1 ? 1 : parts_per_tile(tiles, steps / 32, threads);
  if (slices == 1) {  // item i: tile i / row_parts, its run of rows i % row_parts
    at::parallel_for(0, tiles * row_parts, 1, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) {
        const int64_t t = i / row_parts, begin = m * (i % row_parts) / row_parts;
        const int64_t rows = m * (i % row_parts + 1) / row_parts - begin;
        const char* xr = xs + begin * x_row_bytes;
        void* o = ys + begin * y_row_bytes + t * kTile * y.element_size();
        const float* bt = b ? b + t * kTile : nullptr;
        const int64_t cols = std::min(kTile, n - t * kTile);
        if (bf16)
          tile_all_rows<true>(rows, xr, k_padded, w + t * tile_bytes, steps, bt, o, n, cols);
        else
          tile_all_rows<false>(rows, xr, k_padded, w + t * tile_bytes, steps, bt, o, n, cols,
                               i + 1 < last && (i + 1) / row_parts != t ? w + (t + 1) * tile_bytes : nullptr);
      }
    });
  } else {  // item i: tile i / slices, its run of steps i % slices, summed into partial[run] [m, tiles * 64]
    const int64_t width = tiles * kTile, x_elem = x.element_size();
    auto partial = at::empty({slices, m, width}, x.options().dtype(at::kFloat));
    float* p = partial.data_ptr<float>();
    at::parallel_for(0, tiles * slices, 1, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) {
        const int64_t t = i / slices, run = i % slices;
        const int64_t begin = steps * run / slices, end = steps * (run + 1) / slices;
        const char* tile = w + t * tile_bytes + begin * kTile * pack * packed.element_size();
        const void* xr = xs + begin * pack * x_elem;
        float* o = p + run * m * width + t * kTile;
        const float* bt = b && run == 0 ? b + t * kTile : nullptr;
        if (bf16)
          tile_all_rows<true, true>(m, xr, k_padded, tile, end - begin, bt, o, width, kTile);
        else
          tile_all_rows<false>(m, xr, k_padded, tile, end - begin, bt, o, width, kTile);
      }
    });
    at::BFloat16* y_bf16 = bf16 ? y.data_ptr<at::BFloat16>() : nullptr;
    float* y_f32 = bf16 ? nullptr : y.data_ptr<float>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t o = 0; o < n; ++o) {
        float sum = p[r * width + o];
        for (int64_t run = 1; run < slices; ++run) sum += p[(run * m + r) * width + o];
        if (bf16)
          y_bf16[r * n + o] = static_cast<at::BFloat16>(sum);  // nearest even, as torch
        else
          y_f32[r * n + o] = sum;
      }
  }
#endif
  if (x_in.dim() == 2) return y;
  auto shape = x_in.sizes().vec();
  shape.back() = n;
  return y.view(shape);
}

}  // namespace minivllm_cpu

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("pack_small_linear(Tensor weight) -> Tensor");
  m.def("small_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.impl("pack_small_linear", c10::DispatchKey::CPU, TORCH_FN(pack_small_linear));
  m.impl("small_linear", c10::DispatchKey::CPU, TORCH_FN(minivllm_cpu::small_linear));
}
