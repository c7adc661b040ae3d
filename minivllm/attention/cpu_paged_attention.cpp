// Paged attention on CPU that reads K and V straight out of the paged cache (minivllm/attention/cpu_kernel.py).
//
// The torch reference copies every request's blocks into a padded tensor, then runs SDPA with a padding mask:
// the cache is read once, written once and read again. Here each work item, one (request, KV head, tile of
// query rows), walks its block table and reads each key and value once, in place. The query heads that share a
// KV head (GQA) are extra rows of the same item, so a key loaded for one serves them all. Scores, softmax and
// sums are fp32, whatever the cache holds.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRowsPerTile = 16;  // query rows per work item: bounds the scores buffer for long prompts

// exp for x <= 0 (a score minus its row's max), written so the compiler vectorises the loop that calls it:
// the libm call does not. Cephes' expf: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n from the exponent.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // e^-87 is ~1e-38, still a normal float; smaller weights vanish anyway
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

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

// Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the next one: ask for the row at the
// same offset one block ahead while this block is read (without it the loads of K and V were ~70% of the time).
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < n * static_cast<int64_t>(sizeof(scalar_t)); byte += 64) __builtin_prefetch(p + byte);
}

// A dot product of fp32 rows. GCC reduces its vector sum through memory, one lane at a time, which cost more than
// the multiplies: with AVX-512 (-march=native says so) the 16 lanes are summed in registers instead.
inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), sum);
    return _mm512_reduce_add_ps(sum);
  }
#endif
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

#ifdef __AVX512BF16__
// bf16 query and key as they are: vdpbf16ps multiplies pairs exactly and sums them in fp32, 32 per instruction
inline float dot_bf16(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 32)
    sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
  return _mm512_reduce_add_ps(sum);
}
#endif

struct WorkItem {
  int64_t seq, kv_head, first_row;  // rows are (query, head of the group) pairs, query-major
};

template <typename scalar_t>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
            double scale, at::Tensor& out) {
  const int64_t num_seqs = seq_lens.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), group = num_heads / num_kv_heads;
  const int64_t q_token_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const int64_t table_stride = block_tables.stride(0);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();

  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = (starts[s + 1] - starts[s]) * group;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t r = 0; r < rows; r += kRowsPerTile) items.push_back({s, h, r});
  }
  const float fscale = static_cast<float>(scale);
  const int64_t num_items = static_cast<int64_t>(items.size());

#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> qf, acc, scores, sums;  // this thread's: query rows, output rows, scores [rows, context]
    std::vector<float> row(head_dim);          // the key or value being read, in fp32
    std::vector<const scalar_t*> q_rows;     // per row: the query as it is
    std::vector<int64_t> visible;        // per row: how many keys it may see (causal)
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const WorkItem& w = items[i];
      const int64_t first_token = starts[w.seq], q_len = starts[w.seq + 1] - first_token, ctx = lens[w.seq];
      const int64_t rows = std::min(kRowsPerTile, q_len * group - w.first_row);
      const int32_t* table = tables + w.seq * table_stride;
      qf.resize(rows * head_dim);
      acc.assign(rows * head_dim, 0.0f);
      visible.resize(rows);
      q_rows.resize(rows);
      int64_t max_visible = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t query = (w.first_row + r) / group, head = w.kv_head * group + (w.first_row + r) % group;
        const scalar_t* src = q_ptr + (first_token + query) * q_token_stride + head * q_head_stride;
        q_rows[r] = src;
        for (int64_t d = 0; d < head_dim; ++d) qf[r * head_dim + d] = static_cast<float>(src[d]) * fscale;
        visible[r] = ctx - q_len + query + 1;  // query `query` sits at position ctx - q_len + query
        max_visible = std::max(max_visible, visible[r]);
      }
      scores.resize(rows * max_visible);
      // scores: each key is loaded once for all the rows that see it
      for (int64_t t = 0; t < max_visible; ++t) {
        const scalar_t* key = k_ptr + table[t / block_size] * block_stride + (t % block_size) * token_stride +
                              w.kv_head * head_dim;
        if (t + block_size < max_visible)
          prefetch_row(k_ptr + table[t / block_size + 1] * block_stride + (t % block_size) * token_stride +
                           w.kv_head * head_dim, head_dim);
#ifdef __AVX512BF16__
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (head_dim % 32 == 0) {
            for (int64_t r = 0; r < rows; ++r)
              if (t < visible[r]) scores[r * max_visible + t] = fscale * dot_bf16(q_rows[r], key, head_dim);
            continue;
          }
        }
#endif
        widen(key, row.data(), head_dim);
        for (int64_t r = 0; r < rows; ++r) {
          if (t >= visible[r]) continue;
          scores[r * max_visible + t] = dot(qf.data() + r * head_dim, row.data(), head_dim);
        }
      }
      // softmax weights, unnormalised: e^(s - max); the sum divides at the end
      sums.resize(rows);
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * max_visible;
        const int64_t n = visible[r];
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
          s[t] = exp_nonpositive(s[t] - mx);
          sum += s[t];
        }
        sums[r] = sum;
      }
      // weighted sum of values: again each value is loaded once for all its rows
      for (int64_t t = 0; t < max_visible; ++t) {
        const scalar_t* value = v_ptr + table[t / block_size] * block_stride + (t % block_size) * token_stride +
                                w.kv_head * head_dim;
        if (t + block_size < max_visible)
          prefetch_row(v_ptr + table[t / block_size + 1] * block_stride + (t % block_size) * token_stride +
                           w.kv_head * head_dim, head_dim);
        widen(value, row.data(), head_dim);
        for (int64_t r = 0; r < rows; ++r) {
          if (t >= visible[r]) continue;
          const float p = scores[r * max_visible + t];
          float* a = acc.data() + r * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t query = (w.first_row + r) / group, head = w.kv_head * group + (w.first_row + r) % group;
        scalar_t* dst = out_ptr + ((first_token + query) * num_heads + head) * head_dim;
        const float inv = 1.0f / sums[r];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[r * head_dim + d] * inv);
      }
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
  const int64_t row_bytes = k_cache.size(3) * k_cache.element_size();
  const index_t* slots = slot_mapping.data_ptr<index_t>();
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  const char* k_src = static_cast<const char*>(k.data_ptr());
  const char* v_src = static_cast<const char*>(v.data_ptr());
  const int64_t elem = k.element_size();
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

// Stores k and v [T', kv_heads, dim] at slot_mapping [T'] (int64 or int32; T' may be 0: nothing to store), then
// attends. q [T, heads, dim] and k, v with their last dim contiguous; caches [blocks, block_size, kv_heads, dim]
// contiguous; block_tables [B, width], seq_lens [B], query_start_loc [B + 1]: int32. Returns [T, heads, dim].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale) {
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
  if (slots.scalar_type() == at::kLong) {
    store<int64_t>(k, v, k_cache, v_cache, slots);
  } else {
    TORCH_CHECK(slots.scalar_type() == at::kInt, "slot_mapping must be int64 or int32");
    store<int32_t>(k, v, k_cache, v_cache, slots);
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(),
                     query_start_loc.contiguous(), scale, out);
  });
  return out;
}

// a dispatcher op (torch.ops.minivllm_cpu.paged_attention): the profiler sees it, like any aten op. The caches are
// written in place, and the schema says so (a!, b!) so that torch.compile's functionalization knows.
TORCH_LIBRARY(minivllm_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
