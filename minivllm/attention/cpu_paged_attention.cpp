// Paged attention on CPU that reads K and V straight out of the paged cache (minivllm/attention/cpu_attention.py). The
// torch reference copies every request's blocks into a padded tensor, then runs SDPA with a padding mask: the cache is
// read once, written once and read again. Here each work item, one (request, KV head, tile of query rows), walks its
// block table and reads each key and value once, in place. The query heads that share a KV head (GQA) are extra rows of
// the same item, so a key loaded for one serves them all. Keys are scored and values summed a chunk of 16 positions at
// a time, the vector code's shape (one AVX-512 vector, or two AVX2 ones). Scores, softmax and sums are fp32, whatever
// the cache holds. Before attending, the op stores this step's keys and values in their slots (`store`): one op call
// a layer.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../platforms/cpu_ops.h"
#include "../platforms/cpu_vector_math.h"  // with <algorithm>, <cmath>, <cstring>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define MINIVLLM_VECTOR_ATTENTION 1  // the fp32 vector code below exists: AVX-512, or AVX2 at half the width
#endif

namespace {

constexpr int64_t kRowsPerTile = 16;  // query rows per work item: bounds the scores buffer for long prompts
constexpr int64_t kChunk = 16;        // keys scored (and values summed) together: one AVX-512 vector of scores
constexpr int64_t kAhead = 48;        // prefetch distance, in keys (measured: 16 too short, 64 no better)
constexpr int64_t kMinPart = 64;      // the fewest keys a decode step's part of a context gets (WorkItem)

using minivllm_cpu::exp_approx;  // ../cpu_vector_math.h: e^x for the softmax weights, vectorisable

// One cache row (a key or a value, head_dim elements) widened to fp32 in a loop the compiler vectorises.
template <typename scalar_t>
inline void widen(const scalar_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// bf16 is the top half of an fp32: a shift, spelled out so that it vectorises (c10's conversion may not)
template <>
inline void widen<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<uint32_t>(raw[d]) << 16;
}

// Asks for the cache line at p ahead of its use, into L2 (prefetcht1): into L1 (t0) the requests held the core's
// few L1 miss slots, and a cold batch-64 decode ran ~1.4x slower. Spelled out on x86 because GCC deleted loops whose
// only work was __builtin_prefetch (it counts as no side effect): the chunk prefetches had silently vanished.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

// The key (or value) rows of one KV head of one request, position by position. Blocks sit anywhere in the cache,
// so every position goes through the block table, and the hardware prefetcher cannot guess the next block:
// `prefetch` asks for rows ahead of the ones being read (without it the loads were ~70% of the time).
template <typename scalar_t>
struct PagedRows {
  const scalar_t* cache;  // the cache, offset to this KV head
  const int32_t* table;   // this request's block table
  int64_t block_size, block_stride, token_stride, row_bytes;
  int block_shift;        // log2(block_size) where it is a power of two (every size the engine takes), else -1

  // (block, offset) of position t: a shift and a mask, not a 64-bit division (~40 cycles, several per chunk)
  void locate(int64_t t, int64_t& block, int64_t& offset) const {
    if (block_shift >= 0) {
      block = t >> block_shift, offset = t & (block_size - 1);
    } else {
      block = t / block_size, offset = t % block_size;
    }
  }
  // f(j, row) for positions first + j < end, in order: one division for the lot, not one per row
  template <typename F>
  void walk(int64_t first, int64_t end, F&& f) const {
    int64_t block, offset;
    locate(first, block, offset);
    for (int64_t t = first; t < end; ++t) {
      f(t - first, cache + table[block] * block_stride + offset * token_stride);
      if (++offset == block_size) offset = 0, ++block;
    }
  }
  void prefetch(int64_t first, int64_t end) const {
    walk(first, end, [&](int64_t, const scalar_t* row) {
      for (int64_t byte = 0; byte < row_bytes; byte += 64) prefetch_line(reinterpret_cast<const char*>(row) + byte);
    });
  }
  // the rows of positions [t0, t0 + kChunk); from `end` on the last row repeats (scored, never used), so a chunk
  // is always kChunk real addresses and the vector code has no ragged edge. t0 is a multiple of kChunk, so where
  // blocks are whole chunks a chunk lies in one block: one table lookup, then a row every token_stride.
  void chunk(int64_t t0, int64_t end, const scalar_t** rows) const {
    const int64_t n = std::min(kChunk, end - t0);
    if (block_size % kChunk == 0) {
      int64_t block, offset;
      locate(t0, block, offset);
      const scalar_t* row = cache + table[block] * block_stride + offset * token_stride;
      for (int64_t j = 0; j < n; ++j) rows[j] = row + j * token_stride;
    } else {
      walk(t0, t0 + n, [&](int64_t j, const scalar_t* row) { rows[j] = row; });
    }
    std::fill(rows + n, rows + kChunk, rows[n - 1]);
  }
};

// ---- scores: q . key for kChunk keys at once -------------------------------------------------------------------
// A dot product ends in a sum across the vector's 16 lanes, which costs more than the multiplies of a 64-wide row.
// So each of the chunk's keys gets its own vector of partial sums, and one tree of shuffles and adds (15 adds)
// sums all 16 vectors together, key j's total landing in lane j: one vector of 16 scores.
#ifdef __AVX512F__
inline __m512 sum_lanes(const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // within each 128-bit lane: (v0, v1, v0, v1) partial sums
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // within each 128-bit lane: (v0, v1, v2, v3)
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // then across the 128-bit lanes: even lanes plus odd lanes, twice
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

inline __m512 dot_chunk(const float* q, const float* const* keys, int64_t n) {
  __m512 acc[kChunk];
  for (int j = 0; j < kChunk; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16) {
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int j = 0; j < kChunk; ++j) acc[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(keys[j] + d), acc[j]);
  }
  return sum_lanes(acc);
}

inline void score_chunk(const float* q, const float* const* keys, int64_t n, float* scores) {
  _mm512_storeu_ps(scores, dot_chunk(q, keys, n));
}
#elif defined(MINIVLLM_VECTOR_ATTENTION)
// AVX2: 8 lanes, so the chunk's 16 keys are scored as two halves of 8, each with one tree of horizontal adds
inline __m256 sum_lanes(const __m256* v) {  // lane j: the sum of v[j]'s 8 lanes
  __m256 pairs[4];
  for (int i = 0; i < 4; ++i) pairs[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);
  const __m256 low = _mm256_hadd_ps(pairs[0], pairs[1]), high = _mm256_hadd_ps(pairs[2], pairs[3]);
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

inline void score_chunk(const float* q, const float* const* keys, int64_t n, float* scores) {
  for (int half = 0; half < kChunk; half += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(keys[half + j] + d), acc[j]);
    }
    _mm256_storeu_ps(scores + half, sum_lanes(acc));
  }
}
#endif

#ifdef __AVX512BF16__
// bf16 query and keys as they are: vdpbf16ps multiplies pairs exactly and sums them in fp32, 32 per instruction
inline __m512 dot_chunk(const c10::BFloat16* q, const c10::BFloat16* const* keys, int64_t n) {
  __m512 acc[kChunk];
  for (int j = 0; j < kChunk; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 32) {
    const __m512bh qd = (__m512bh)_mm512_loadu_si512(q + d);
    for (int j = 0; j < kChunk; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], qd, (__m512bh)_mm512_loadu_si512(keys[j] + d));
  }
  return sum_lanes(acc);
}
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// ---- values: acc += p[j] * value_j over the chunk's kChunk values ---------------------------------------------
// A weight is 0 past the keys its row sees, so every chunk is whole. Each output vector gets its sum in two or four
// partial sums, not one: an FMA waits ~4 cycles for the previous one into the same register, and one chain of 16
// would stall on that latency rather than run at the FMA units' pace.
#ifdef __AVX512F__
inline void add_values(float* acc, const float* p, const float* const* values, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) {
    __m512 part[4] = {_mm512_loadu_ps(acc + d), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int j = 0; j < kChunk; ++j)
      part[j % 4] = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(values[j] + d), part[j % 4]);
    _mm512_storeu_ps(acc + d, _mm512_add_ps(_mm512_add_ps(part[0], part[1]), _mm512_add_ps(part[2], part[3])));
  }
}

// bf16 values without converting them: 32 bf16 are 16 pairs in 32-bit lanes, and an fp32 is a bf16 with 16 zero
// bits below it, so a shift gives the even elements as fp32 and a mask the odd ones. The output row is kept in
// that order (per 32 elements: 16 even, then 16 odd) until it is written.
inline void add_values(float* acc, const float* p, const c10::BFloat16* const* values, int64_t dim) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t d = 0; d < dim; d += 32) {
    __m512 even[2] = {_mm512_loadu_ps(acc + d), _mm512_setzero_ps()};
    __m512 odd[2] = {_mm512_loadu_ps(acc + d + 16), _mm512_setzero_ps()};
    for (int j = 0; j < kChunk; ++j) {
      const __m512i pairs = _mm512_loadu_si512(values[j] + d);
      const __m512 pj = _mm512_set1_ps(p[j]);
      even[j % 2] = _mm512_fmadd_ps(pj, _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)), even[j % 2]);
      odd[j % 2] = _mm512_fmadd_ps(pj, _mm512_castsi512_ps(_mm512_and_si512(pairs, high)), odd[j % 2]);
    }
    _mm512_storeu_ps(acc + d, _mm512_add_ps(even[0], even[1]));
    _mm512_storeu_ps(acc + d + 16, _mm512_add_ps(odd[0], odd[1]));
  }
}
constexpr bool kBf16Values = true;  // bf16 values summed in place, as 16 even and 16 odd per 32
#elif defined(MINIVLLM_VECTOR_ATTENTION)
// AVX2: 32 elements of the row at a time in four registers, each weight broadcast once for all four (the row's
// 8-wide vectors one by one broadcast every weight again: twice the loads), and a second set of four for the odd
// values, so that eight sums are in flight
inline void add_values(float* acc, const float* p, const float* const* values, int64_t dim) {
  int64_t d = 0;
  for (; d + 32 <= dim; d += 32) {
    __m256 even[4], odd[4];
    for (int v = 0; v < 4; ++v) even[v] = _mm256_loadu_ps(acc + d + 8 * v), odd[v] = _mm256_setzero_ps();
    for (int j = 0; j < kChunk; j += 2) {
      const __m256 pe = _mm256_broadcast_ss(p + j), po = _mm256_broadcast_ss(p + j + 1);
      for (int v = 0; v < 4; ++v) {
        even[v] = _mm256_fmadd_ps(pe, _mm256_loadu_ps(values[j] + d + 8 * v), even[v]);
        odd[v] = _mm256_fmadd_ps(po, _mm256_loadu_ps(values[j + 1] + d + 8 * v), odd[v]);
      }
    }
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc + d + 8 * v, _mm256_add_ps(even[v], odd[v]));
  }
  for (; d < dim; d += 8) {
    __m256 part[4] = {_mm256_loadu_ps(acc + d), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int j = 0; j < kChunk; ++j)
      part[j % 4] = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(values[j] + d), part[j % 4]);
    _mm256_storeu_ps(acc + d, _mm256_add_ps(_mm256_add_ps(part[0], part[1]), _mm256_add_ps(part[2], part[3])));
  }
}
constexpr bool kBf16Values = false;  // AVX2: bf16 values are widened per chunk
#endif
#ifdef MINIVLLM_VECTOR_ATTENTION
constexpr bool kVector = true;
#else
constexpr bool kVector = false;
constexpr bool kBf16Values = false;
#endif

// Which rows the vector code reads straight from the cache: fp32 ones, bf16 keys where vdpbf16ps exists, bf16
// values (the split needs AVX-512; with AVX2 they are widened), when head_dim is whole vectors (16 fp32, 32
// bf16). Other rows (fp16, an odd head_dim) are widened to fp32 per chunk, then summed by the fp32 vector code
// or, without AVX-512, plain loops.
template <typename T>
constexpr bool kIsBf16 = std::is_same_v<T, c10::BFloat16>;
template <typename T>
constexpr bool kScoresInPlace = kVector && (std::is_same_v<T, float> || (kIsBf16<T> && kBf16Dot));
template <typename T>
constexpr bool kValuesInPlace = kVector && (std::is_same_v<T, float> || (kIsBf16<T> && kBf16Values));

// The largest of n scores: GCC leaves a max loop scalar, one dependent vmaxss after another (it may not reorder
// float max without -ffast-math), which was 8% of a bf16 decode call.
inline float max_of(const float* s, int64_t n) {
  float mx = -INFINITY;
  int64_t t = 0;
#ifdef __AVX512F__
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  mx = _mm512_reduce_max_ps(m);
#elif defined(MINIVLLM_VECTOR_ATTENTION)
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  for (float lane : lanes) mx = std::max(mx, lane);
#endif
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

inline float plain_dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// A query row's output: its sums `acc` times `inv` (1 / the softmax's sum) in the cache's dtype. acc's element d sits
// at its place, or (split pairs) among the 16 even or 16 odd ones of its 32.
template <typename scalar_t>
inline void write_row(scalar_t* dst, const float* acc, float inv, int64_t head_dim, bool split_pairs) {
  for (int64_t d = 0; d < head_dim; ++d) {
    const int64_t from = split_pairs ? (d & ~int64_t{31}) + (d & 1) * 16 + (d & 31) / 2 : d;
    dst[d] = static_cast<scalar_t>(acc[from] * inv);
  }
}

// One work item: a request's rows of `heads` consecutive KV heads from `kv_head`, from row `first_row` of one KV
// head's (query, head of the group) pairs, query-major, over its keys [key_begin, key_end). A decode row set is
// small (a group of heads per query), so its items take several KV heads: a token's keys of those heads lie side by
// side in the cache, and one item reads the whole run, where one item per KV head read a quarter of each run, the
// rest left to other items (measured on a batch-64 decode from cache rows scattered past the L3: ~1.5x less time).
// A decode step of few requests instead splits each KV head's context into parts (`part` >= 0: where its
// unnormalised result waits for the merge), so that every thread has work: at batch 1, a 135M Llama's 3 KV heads on
// 2 threads left one thread idle a third of the time.
struct WorkItem { int64_t seq, kv_head, heads, first_row, key_begin, key_end, part; };

// A part's softmax for one query row, its running max and sum (its unnormalised output waits beside it)
struct Partial { float max, sum; };
// The items [first, first + count) of one split context: one KV head of one request
struct Split { int64_t first, count; };

template <typename scalar_t>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
            double scale, int64_t window, at::Tensor& out) {
  const int64_t num_seqs = seq_lens.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), group = num_heads / num_kv_heads;
  const int64_t q_token_stride = q.stride(0), q_head_stride = q.stride(1), table_stride = block_tables.stride(0);
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const int block_shift = (block_size & (block_size - 1)) == 0 ? __builtin_ctzll(block_size) : -1;
  const scalar_t *q_ptr = q.data_ptr<scalar_t>(), *k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int32_t *tables = block_tables.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  constexpr bool is_bf16 = kIsBf16<scalar_t>;
  const bool whole_vectors = head_dim % (is_bf16 ? 32 : 16) == 0;
  [[maybe_unused]] const bool vector = kVector && head_dim % 16 == 0;  // rows widened to fp32 take the vector code
  const bool scores_in_place = kScoresInPlace<scalar_t> && whole_vectors;
  const bool values_in_place = kValuesInPlace<scalar_t> && whole_vectors;
  // bf16 values summed in place leave each 32 output elements as 16 even then 16 odd ones (add_values)
  const bool split_pairs = values_in_place && is_bf16;

  std::vector<WorkItem> items;
  const int64_t threads = at::get_num_threads();
  const bool many = num_seqs >= 4 * threads;  // enough requests to keep every thread busy
  // a decode step (one query a request, the whole context) with fewer KV heads than 2 a thread: each head's keys in
  // parts of at least kMinPart, about 4 items a thread
  bool decode = window <= 0 && group <= kRowsPerTile && num_seqs * num_kv_heads < 2 * threads;
  for (int64_t s = 0; s < num_seqs && decode; ++s) decode = starts[s + 1] - starts[s] == 1;
  int64_t parts_made = 0;
  std::vector<Split> splits;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = (starts[s + 1] - starts[s]) * group;
    const int64_t heads = many ? std::clamp<int64_t>(kRowsPerTile / rows, 1, num_kv_heads) : 1;
    const int64_t chunks = (lens[s] + kChunk - 1) / kChunk;
    const int64_t parts = decode ? std::clamp<int64_t>(std::min(4 * threads / (num_seqs * num_kv_heads),
                                                                chunks * kChunk / kMinPart), 1, chunks) : 1;
    for (int64_t h = 0; h < num_kv_heads; h += heads)
      for (int64_t r = 0; r < rows; r += kRowsPerTile) {
        if (parts > 1) splits.push_back({static_cast<int64_t>(items.size()), parts});
        for (int64_t p = 0; p < parts; ++p)  // part p: chunks [p chunks / parts, (p + 1) chunks / parts)
          items.push_back({s, h, std::min(heads, num_kv_heads - h), r, p * chunks / parts * kChunk,
                           p + 1 == parts ? INT64_MAX : (p + 1) * chunks / parts * kChunk,
                           parts > 1 ? parts_made++ : -1});
      }
  }
  // the parts' results: per part, group rows (decode: one query, one KV head an item) of Partial and head_dim sums
  std::vector<Partial> partials(parts_made * group);
  std::vector<float> partial_acc(parts_made * group * head_dim);
  const float fscale = static_cast<float>(scale);
  const int64_t num_items = static_cast<int64_t>(items.size());

#pragma omp parallel num_threads(at::get_num_threads())
  {
    // this thread's: query rows, output rows, scores [rows, padded context], softmax denominators
    std::vector<float> qf, acc, scores, sums, maxes;
    std::vector<float> widened(kChunk * num_kv_heads * head_dim);  // a chunk's rows in fp32, where not in place
    std::vector<const scalar_t*> q_rows;  // per row: the query as it is
    std::vector<int64_t> row_query, row_head, row_kv;  // per row: its query, its head, its KV head in the item
    std::vector<int64_t> visible;         // per row: how many keys it may see (causal)
    std::vector<int64_t> lowest;          // per row: the first key it sees (0, or the window's start)
    int64_t slice_at[kRowsPerTile + 1];   // per row: where its slice of a chunk's prefetches starts
    const scalar_t* rows[kChunk];         // the chunk's keys or values of the item's first KV head, in the cache
    const scalar_t* head_rows[kRowsPerTile][kChunk];  // per KV head of the item: its rows, in the cache
    const float* head_rows_f[kRowsPerTile][kChunk];   // the same as fp32
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const WorkItem& w = items[i];
      const int64_t first_token = starts[w.seq], q_len = starts[w.seq + 1] - first_token, ctx = lens[w.seq];
      const int64_t per_head = std::min(kRowsPerTile, q_len * group - w.first_row);  // rows of each KV head
      const int64_t num_rows = per_head * w.heads, run = w.heads * head_dim;  // run: a token's elements read
      const int64_t row_bytes = run * static_cast<int64_t>(sizeof(scalar_t));
      const int32_t* table = tables + w.seq * table_stride;
      const PagedRows<scalar_t> keys{k_ptr + w.kv_head * head_dim, table, block_size, block_stride, token_stride,
                                     row_bytes, block_shift},
          values{v_ptr + w.kv_head * head_dim, table, block_size, block_stride, token_stride, row_bytes, block_shift};
      qf.resize(num_rows * head_dim);
      acc.assign(num_rows * head_dim, 0.0f);
      visible.resize(num_rows);
      lowest.resize(num_rows);
      q_rows.resize(num_rows);
      row_query.resize(num_rows);
      row_head.resize(num_rows);
      row_kv.resize(num_rows);
      int64_t max_visible = 0, min_lowest = ctx;
      for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t kv = r / per_head, pair = w.first_row + r % per_head;  // (query, head of the group) pair
        const int64_t query = pair / group, head = (w.kv_head + kv) * group + pair % group;
        row_query[r] = query, row_head[r] = head, row_kv[r] = kv;
        const scalar_t* src = q_ptr + (first_token + query) * q_token_stride + head * q_head_stride;
        q_rows[r] = src;
        for (int64_t d = 0; d < head_dim; ++d) qf[r * head_dim + d] = static_cast<float>(src[d]) * fscale;
        visible[r] = ctx - q_len + query + 1;  // query `query` sits at position ctx - q_len + query
        max_visible = std::max(max_visible, visible[r]);
        lowest[r] = window > 0 ? std::max<int64_t>(0, visible[r] - window) : 0;  // keys > position - window
        min_lowest = std::min(min_lowest, lowest[r]);
      }
      // chunks before every row's window (or this part) are skipped whole; the scores buffer keeps absolute positions
      const int64_t first_chunk = std::max(min_lowest / kChunk * kChunk, w.key_begin);
      const int64_t width = (max_visible + kChunk - 1) / kChunk * kChunk;  // scores rows padded to whole chunks
      const int64_t span = std::min(width, w.key_end);  // this part's end, a whole chunk (the last part's: width)
      const int64_t last = std::min(max_visible, span);  // its last key + 1
      scores.resize(num_rows * width);
      // The chunk's rows as the summing code takes them, per KV head of the item: in the cache, or widened to fp32
      // here (each token's run of heads at once).
      auto load_chunk = [&](const PagedRows<scalar_t>& cache, int64_t t0, bool in_place) {
        cache.chunk(t0, max_visible, rows);
        for (int64_t kv = 0; kv < w.heads; ++kv)
          for (int64_t j = 0; j < kChunk; ++j) {
            head_rows[kv][j] = rows[j] + kv * head_dim;
            head_rows_f[kv][j] = widened.data() + j * run + kv * head_dim;
          }
        if (in_place) return;
        for (int64_t j = 0; j < kChunk; ++j) widen(rows[j], widened.data() + j * run, run);
      };

      // The chunk kAhead keys ahead is prefetched a slice per row, between the rows' work: all its lines at once
      // stalled on the core's few slots for outstanding misses. The score pass runs on into the values.
      for (int64_t r = 0; r <= num_rows; ++r) slice_at[r] = r * kChunk / num_rows;  // divided once, not per chunk
      auto prefetch_slice = [&](const PagedRows<scalar_t>& cache, int64_t t, int64_t r) {
        cache.prefetch(t + slice_at[r], std::min(t + slice_at[r + 1], last));
      };

      // scores: each chunk of keys is loaded once for all the rows that see it
      keys.prefetch(first_chunk, std::min(first_chunk + kAhead, last));
      for (int64_t t0 = first_chunk; t0 < last; t0 += kChunk) {
        const int64_t ahead = t0 + kAhead;
        load_chunk(keys, t0, scores_in_place);
        for (int64_t r = 0; r < num_rows; ++r) {
          if (ahead < span) prefetch_slice(keys, ahead, r);
          else prefetch_slice(values, first_chunk + ahead - span, r);
          // a prompt's early queries see none of these keys; a window's row none before its start
          if (t0 >= visible[r] || t0 + kChunk <= lowest[r]) continue;
          float* s = scores.data() + r * width + t0;
#ifdef MINIVLLM_VECTOR_ATTENTION
          if constexpr (kScoresInPlace<scalar_t>) {
            if (scores_in_place) {
#ifdef __AVX512BF16__
              if constexpr (is_bf16)  // the raw bf16 query, scaled after
                _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_set1_ps(fscale),
                                                  dot_chunk(q_rows[r], head_rows[row_kv[r]], head_dim)));
              else
#endif
                score_chunk(qf.data() + r * head_dim, head_rows[row_kv[r]], head_dim, s);
              continue;
            }
          }
          if (vector) {
            score_chunk(qf.data() + r * head_dim, head_rows_f[row_kv[r]], head_dim, s);
            continue;
          }
#endif
          const float* const* keys_f = head_rows_f[row_kv[r]];
          for (int64_t j = 0; j < kChunk; ++j) s[j] = plain_dot(qf.data() + r * head_dim, keys_f[j], head_dim);
        }
      }
      // softmax weights, unnormalised: e^(s - max), over the keys each row sees, 0 after them to the chunk's end;
      // the sum divides at the end
      sums.resize(num_rows);
      maxes.resize(num_rows);
      for (int64_t r = 0; r < num_rows; ++r) {
        float* s = scores.data() + r * width;
        const int64_t n = std::min(visible[r], last), lo = std::max(lowest[r], first_chunk);  // (a part: in it)
        const float mx = max_of(s + lo, n - lo);
        float sum = 0.0f;
        std::fill(s + lo / kChunk * kChunk, s + lo, 0.0f);  // the window's first chunk, before its start
#pragma omp simd reduction(+ : sum)
        for (int64_t t = lo; t < n; ++t) {
          s[t] = exp_approx(s[t] - mx);
          sum += s[t];
        }
        std::fill(s + n, s + std::min(width, (n + kChunk - 1) / kChunk * kChunk), 0.0f);
        sums[r] = sum;
        maxes[r] = mx;
      }
      // weighted sum of values: again each chunk is loaded once for all its rows
      for (int64_t t0 = first_chunk; t0 < last; t0 += kChunk) {
        load_chunk(values, t0, values_in_place);
        for (int64_t r = 0; r < num_rows; ++r) {
          prefetch_slice(values, t0 + kAhead, r);
          if (t0 >= visible[r] || t0 + kChunk <= lowest[r]) continue;
          const float* p = scores.data() + r * width + t0;
          float* a = acc.data() + r * head_dim;
#ifdef MINIVLLM_VECTOR_ATTENTION
          if constexpr (kValuesInPlace<scalar_t>) {
            if (values_in_place) {
              add_values(a, p, head_rows[row_kv[r]], head_dim);
              continue;
            }
          }
          if (vector) {
            add_values(a, p, head_rows_f[row_kv[r]], head_dim);
            continue;
          }
#endif
          const float* const* values_f = head_rows_f[row_kv[r]];
          for (int64_t j = 0; j < kChunk; ++j) {
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p[j] * values_f[j][d];
          }
        }
      }
      if (w.part >= 0) {  // a part: its rows wait for the merge, unnormalised (num_rows == group)
        for (int64_t r = 0; r < num_rows; ++r) partials[w.part * group + r] = {maxes[r], sums[r]};
        std::copy(acc.begin(), acc.begin() + num_rows * head_dim, partial_acc.begin() + w.part * group * head_dim);
        continue;
      }
      for (int64_t r = 0; r < num_rows; ++r)
        write_row(out_ptr + ((first_token + row_query[r]) * num_heads + row_head[r]) * head_dim,
                  acc.data() + r * head_dim, 1.0f / sums[r], head_dim, split_pairs);
    }
  }
  // each query row of a split context: its parts' sums rescaled to the largest max, added, normalised
  std::vector<float> merged(head_dim);
  for (const Split& split : splits) {
    const WorkItem& w = items[split.first];
    const int64_t parts = split.count;
    for (int64_t r = 0; r < group; ++r) {
      float top = -INFINITY, total = 0.0f;
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, partials[(w.part + p) * group + r].max);
      std::fill(merged.begin(), merged.end(), 0.0f);
      for (int64_t p = 0; p < parts; ++p) {
        const Partial& part = partials[(w.part + p) * group + r];
        const float weight = std::exp(part.max - top);
        total += weight * part.sum;
        const float* a = partial_acc.data() + ((w.part + p) * group + r) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * a[d];
      }
      write_row(out_ptr + (starts[w.seq] * num_heads + w.kv_head * group + r) * head_dim, merged.data(),
                1.0f / total, head_dim, split_pairs);
    }
  }
}

// This step's keys and values into their cache slots, as store_kv in torch_backend.py (the readable reference)
// does: slot = block * block_size + offset, and a slot < 0 marks a padding row that stores nothing. Done here, in
// the op, because at batch 1 the separate torch ops (a mask, an any(), two index_copy_) cost more than the copy.
template <typename index_t>
void store(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
           const at::Tensor& slot_mapping) {
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t row_bytes = k_cache.size(3) * k_cache.element_size(), elem = k.element_size();
  const index_t* slots = slot_mapping.data_ptr<index_t>();
  char *k_dst = static_cast<char*>(k_cache.data_ptr()), *v_dst = static_cast<char*>(v_cache.data_ptr());
  const char *k_src = static_cast<const char*>(k.data_ptr()), *v_src = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < k.size(0); ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "slot ", slot, " is outside the cache (", num_slots, " slots)");
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t dst = (slot * kv_heads + h) * row_bytes;
      std::memcpy(k_dst + dst, k_src + (t * k.stride(0) + h * k.stride(1)) * elem, row_bytes);
      std::memcpy(v_dst + dst, v_src + (t * v.stride(0) + h * v.stride(1)) * elem, row_bytes);
    }
  }
}

}  // namespace

namespace minivllm_cpu {

// Stores k and v [T', kv_heads, dim] at slot_mapping [T'] (int64 or int32; T' may be 0: nothing to store), then
// attends. q [T, heads, dim] and k, v with their last dim contiguous; caches [blocks, block_size, kv_heads, dim]
// contiguous; block_tables [B, width], seq_lens [B], query_start_loc [B + 1]: int32. Returns [T, heads, dim].
// sliding_window w > 0: each query sees its w latest keys, its own included (<= 0: the whole context).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                           int64_t sliding_window) {
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(), "unsupported layout");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "cache and query dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "metadata must be contiguous int32");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
                  k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == k_cache.size(2) &&
                  k.size(2) == k_cache.size(3) && k.stride(2) == 1 && v.stride(2) == 1,
              "new keys and values must be [T, kv_heads, dim] in the cache's dtype, last dim contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0), "one slot per new key");
  const at::Tensor slots = slot_mapping.contiguous();
  AT_DISPATCH_INDEX_TYPES(slots.scalar_type(), "store", [&] { store<index_t>(k, v, k_cache, v_cache, slots); });
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(),
                     query_start_loc.contiguous(), scale, sliding_window, out);
  });
  return out;
}

}  // namespace minivllm_cpu

// a dispatcher op (torch.ops.minivllm_cpu.paged_attention): the profiler sees it, like any aten op. The caches are
// written in place, and the schema says so (a!, b!) so that torch.compile's functionalization knows.
TORCH_LIBRARY(minivllm_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "int sliding_window=-1) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(minivllm_cpu::paged_attention));
}
