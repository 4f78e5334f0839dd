// Paged attention on the CPU, reading K and V in place from the block table.
//
// One task per query token (split over its KV heads when there are too few
// tokens to keep every thread busy). A task walks the keys block by block and
// scores each row against all of its query heads, takes the softmax of each
// head's scores in one vectorised pass (exp over a whole row, not per key as an
// online softmax would), then accumulates the value rows weighted by the
// probabilities with the sums in registers: the AVX-512 bodies for up to 6
// query heads of 64 (3 of 128) in one pass over the rows, the others one query
// head at a time.
// Head sizes 64 and 128 get AVX-512 bodies (AVX2+FMA ones where the build has
// no AVX-512: 8 lanes, four query heads per key slice, the values 64 columns at a
// time so that the sums fit the 16 registers); others run portable loops.
// float32 and bfloat16 (query, cache and output of one dtype): the arithmetic is
// float32 either way, bfloat16 rows are widened as they are loaded.
// The kernel is memory bound: a decode batch reads every cached K/V row once.
// Shapes: query [T, H, D]; key_cache, value_cache [num_blocks, block_size, H_kv, D];
// block_table [B, max_blocks]; token_request [T] and token_position [T] say which
// request a query token belongs to and its position in that sequence.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "thread_pool.h"
#include "vector_avx2.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "vector_expf.h"

namespace {

// probabilities in place; returns their sum
inline float softmax_numerators(float* scores, int64_t n) {
  float m = scores[0];
  // vectorised in any order: a NaN score that the max skips still makes its exp, and the sum, NaN
#pragma omp simd reduction(max : m)
  for (int64_t j = 1; j < n; ++j) m = std::max(m, scores[j]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - m);
    sum += scores[j];
  }
  return sum;
}

// One task: one query token and a range of its KV heads. Keys and values are
// walked block by block, row by row, so each task reads whole contiguous rows
// (all its KV heads) in address order.
template <typename T>
struct Task {
  const T* keys;
  const T* values;
  const int64_t* blocks;
  int64_t block_size, row_stride, block_stride;
  int64_t first, last;      // visible key positions, inclusive
  int64_t kv_begin, kv_end; // KV heads of this task
  int64_t group, head_size;
  float scale;
};

// Calls fn(j, row) for each visible row of `base` (keys or values) in order.
// While it walks a block it prefetches the same rows of the next block in the
// table (`width` elements from `offset`: the slice the pass reads). Blocks
// are scattered, so the hardware prefetcher loses the stream at every block
// boundary; prefetching one block ahead measured 10-35% faster on keys and
// values that come from DRAM (batch 64, 192 tokens: float32 19 -> 21.5 GB/s,
// bfloat16 14.7 -> 22.5 GB/s).
template <typename T, typename RowFn>
inline void for_each_row(const Task<T>& t, const T* base, int64_t offset, int64_t width, RowFn fn) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  int64_t j = t.first;
  while (j <= t.last) {
    const int64_t b = j / t.block_size;
    const int64_t r0 = j - b * t.block_size;
    const int64_t r1 = std::min(t.block_size, t.last - b * t.block_size + 1);
    const T* block = base + t.blocks[b] * t.block_stride;
    const bool has_next = (b + 1) * t.block_size <= t.last;
    const T* next = has_next ? base + t.blocks[b + 1] * t.block_stride + offset : nullptr;
    for (int64_t r = r0; r < r1; ++r, ++j) {
      if (has_next)
        for (int64_t e = 0; e < width; e += kLine) __builtin_prefetch(next + r * t.row_stride + e, 0, 3);
      fn(j - t.first, block + r * t.row_stride);
    }
  }
}

// Head sizes known at compile time get AVX-512 bodies; kDynamic runs the generic loops.
constexpr int kDynamic = 0;

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// bfloat16 is the top half of a float32: widen by shifting into place
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// a: the query head (float32), b: a key row of the cache's type. The portable
// loop: attend's AVX-512 body scores keys itself, sharing each key between heads.
template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += a[i] * widen(b[i]);
  return sum;
}

template <typename T>
inline void axpy(float p, const T* v, float* a, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) a[i] += p * widen(v[i]);
}

// out[0:d] = scale * sum_j p[j] * value_row_j[offset : offset + d]   (out: float32)
// (The AVX-512 bodies take weighted_sums below instead, several query heads a pass.)
template <int D, typename T>
inline void weighted_sum(const Task<T>& t, const float* p, int64_t offset, int64_t d, float scale, float* out) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if constexpr (D != kDynamic && D % 8 == 0) {
    // 64 columns at a time in 8 registers; a head of 128 walks its rows twice (from cache the second time)
    constexpr int kColumns = D < 64 ? D : 64;
    static_assert(D % kColumns == 0, "whole 64-column passes");
    const __m256 factor = _mm256_set1_ps(scale);
    for (int c = 0; c < D; c += kColumns) {
      __m256 acc[kColumns / 8];
      for (int i = 0; i < kColumns / 8; ++i) acc[i] = _mm256_setzero_ps();
      for_each_row(t, t.values, offset + c, kColumns, [&](int64_t j, const T* row) {
        const __m256 w = _mm256_set1_ps(p[j]);
        for (int i = 0; i < kColumns / 8; ++i)
          acc[i] = _mm256_fmadd_ps(w, tokenmill::avx2::load8(row + offset + c + 8 * i), acc[i]);
      });
      for (int i = 0; i < kColumns / 8; ++i) _mm256_storeu_ps(out + c + 8 * i, _mm256_mul_ps(acc[i], factor));
    }
    return;
  }
#endif
  std::fill(out, out + d, 0.f);
  for_each_row(t, t.values, offset, d, [&](int64_t j, const T* row) { axpy(p[j], row + offset, out, d); });
  for (int64_t i = 0; i < d; ++i) out[i] *= scale;
}

#ifdef __AVX512F__
// Query heads whose value sums one pass over the rows keeps in registers (24 of the 32), at
// most the 6 that weighted_sums_pass dispatches.
template <int D>
constexpr int kPassHeads = std::min(6, 24 / (D / 16));

// Values for query heads [first, first + Heads) of the task at once: each row's slices of their
// KV heads (adjacent in the row) stream past once, the Heads x D/16 sums in registers. One
// pass per query head read each KV head's slice of every row once per query head sharing it,
// walking the blocks at a 128- or 256-byte stride: a batch-64 decode over 192 tokens (the 100M
// model's 12 heads on 4, bfloat16) took 0.71-0.72 ms a layer against 0.61-0.64 now, at best of
// 15, where a plain read of the same bytes would take ~0.3. Each head's sum is taken in the
// same order as before (row by row, one fma per row), so the outputs are unchanged.
template <int D, int Heads, typename T>
inline void weighted_sums(const Task<T>& t, const float* s, int64_t n, const float* inv, int64_t first, float* out) {
  constexpr int kVectors = D / 16;
  static_assert(Heads >= 1 && Heads * kVectors <= 24, "a pass's sums fit the registers");
  __m512 acc[Heads * kVectors];
  for (int i = 0; i < Heads * kVectors; ++i) acc[i] = _mm512_setzero_ps();
  int64_t slice[Heads];  // each head's value slice in a row (elements)
  for (int i = 0; i < Heads; ++i) slice[i] = (t.kv_begin + (first + i) / t.group) * D;
  const int64_t width = slice[Heads - 1] + D - slice[0];
  for_each_row(t, t.values, slice[0], width, [&](int64_t j, const T* row) {
#pragma GCC unroll 24
    for (int i = 0; i < Heads; ++i) {
      const __m512 w = _mm512_set1_ps(s[(first + i) * n + j]);
#pragma GCC unroll 8
      for (int c = 0; c < kVectors; ++c)
        acc[i * kVectors + c] = _mm512_fmadd_ps(w, load16(row + slice[i] + 16 * c), acc[i * kVectors + c]);
    }
  });
  for (int i = 0; i < Heads; ++i) {
    const __m512 factor = _mm512_set1_ps(inv[first + i]);
    for (int c = 0; c < kVectors; ++c)
      _mm512_storeu_ps(out + (first + i) * D + 16 * c, _mm512_mul_ps(acc[i * kVectors + c], factor));
  }
}

// One pass: kPassHeads<D> heads from `first`, or the fewer that are left of `heads`.
template <int D, typename T>
inline void weighted_sums_pass(const Task<T>& t, const float* s, int64_t n, const float* inv, int64_t first,
                               int64_t heads, float* out) {
  switch (std::min<int64_t>(heads - first, kPassHeads<D>)) {
    case 1: return weighted_sums<D, 1>(t, s, n, inv, first, out);
    case 2: return weighted_sums<D, 2>(t, s, n, inv, first, out);
    case 3: return weighted_sums<D, 3>(t, s, n, inv, first, out);
    case 4: if constexpr (kPassHeads<D> >= 4) return weighted_sums<D, 4>(t, s, n, inv, first, out); break;
    case 5: if constexpr (kPassHeads<D> >= 5) return weighted_sums<D, 5>(t, s, n, inv, first, out); break;
    case 6: if constexpr (kPassHeads<D> >= 6) return weighted_sums<D, 6>(t, s, n, inv, first, out); break;
    default: break;
  }
}
#endif

template <int D, typename T>
void attend(const Task<T>& t, const float* q, float* out, std::vector<float>& scores) {
  const int64_t n = t.last - t.first + 1;
  const int64_t heads = (t.kv_end - t.kv_begin) * t.group;  // query heads of this task
  const int64_t d = D == kDynamic ? t.head_size : D;
  scores.resize(heads * n);
  float* s = scores.data();
  for_each_row(t, t.keys, t.kv_begin * d, (t.kv_end - t.kv_begin) * d, [&](int64_t j, const T* row) {
    for (int64_t h = t.kv_begin; h < t.kv_end; ++h) {
      const T* k = row + h * d;
      const int64_t first_head = (h - t.kv_begin) * t.group;
#ifdef __AVX512F__
      if constexpr (D != kDynamic && D % 16 == 0) {
        // the key is loaded (and, for bfloat16, widened) once for the query heads that share it
        __m512 key[D / 16];
        for (int i = 0; i < D / 16; ++i) key[i] = load16(k + 16 * i);
        for (int64_t g = 0; g < t.group; ++g) {
          const float* qg = q + (first_head + g) * d;
          __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qg), key[0]);
          for (int i = 1; i < D / 16; ++i) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * i), key[i], sum);
          s[(first_head + g) * n + j] = _mm512_reduce_add_ps(sum) * t.scale;
        }
        continue;
      }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
      if constexpr (D != kDynamic && D % 8 == 0) {
        // four query heads at a time: each 8-lane slice of the key is loaded (and widened) once for them
        for (int64_t g0 = 0; g0 < t.group; g0 += 4) {
          const int64_t count = std::min<int64_t>(4, t.group - g0);
          const float* qg = q + (first_head + g0) * d;
          __m256 sum[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
          for (int i = 0; i < D; i += 8) {
            const __m256 key = tokenmill::avx2::load8(k + i);
            for (int g = 0; g < 4; ++g)
              if (g < count) sum[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + g * d + i), key, sum[g]);
          }
          for (int g = 0; g < count; ++g)
            s[(first_head + g0 + g) * n + j] = tokenmill::avx2::reduce_add8(sum[g]) * t.scale;
        }
        continue;
      }
#endif
      for (int64_t g = 0; g < t.group; ++g)
        s[(first_head + g) * n + j] = dot(q + (first_head + g) * d, k, d) * t.scale;
    }
  });
  std::vector<float> inv(heads);
  for (int64_t qh = 0; qh < heads; ++qh) inv[qh] = 1.f / softmax_numerators(s + qh * n, n);
#ifdef __AVX512F__
  if constexpr (D != kDynamic && D % 16 == 0) {
    for (int64_t first = 0; first < heads; first += kPassHeads<D>)
      weighted_sums_pass<D>(t, s, n, inv.data(), first, heads, out);
    return;
  }
#endif
  // Values: one query head at a time, its accumulator held in registers while
  // the rows stream past (a row's KV heads are adjacent, so the next head's
  // pass finds the block in cache).
  for (int64_t h = t.kv_begin; h < t.kv_end; ++h) {
    for (int64_t g = 0; g < t.group; ++g) {
      const int64_t qh = (h - t.kv_begin) * t.group + g;
      weighted_sum<D>(t, s + qh * n, h * d, d, inv[qh], out + qh * d);
    }
  }
}

template <typename T>
void attend_any(const Task<T>& t, const float* q, float* out, std::vector<float>& scores) {
  switch (t.head_size) {
    case 64: return attend<64>(t, q, out, scores);
    case 128: return attend<128>(t, q, out, scores);
    default: return attend<kDynamic>(t, q, out, scores);
  }
}

template <typename T>
void run(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& table, const at::Tensor& req, const at::Tensor& pos, float scale,
         int64_t sliding_window, at::Tensor& out) {
  const int64_t tokens = query.size(0), heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads;
  const T* q_ptr = query.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  const int64_t* req_ptr = req.data_ptr<int64_t>();
  const int64_t* pos_ptr = pos.data_ptr<int64_t>();
  const int64_t max_blocks = table.size(1);
  const int64_t row_stride = kv_heads * head_size;
  // Enough tasks to keep every thread busy, as few KV-head splits as that allows.
  const int64_t want = 4 * at::get_num_threads();
  const int64_t splits = std::min<int64_t>(kv_heads, std::max<int64_t>(1, (want + tokens - 1) / tokens));
  const int64_t per_split = (kv_heads + splits - 1) / splits;
  tokenmill::parallel_for(0, tokens * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, q32, out32;  // float32 copies of a bfloat16 task's query and output
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / splits, part = task % splits;
      Task<T> job{key_cache.data_ptr<T>(), value_cache.data_ptr<T>(), table_ptr + req_ptr[t] * max_blocks,
                  block_size, row_stride, block_size * row_stride, 0, pos_ptr[t], part * per_split,
                  std::min(kv_heads, (part + 1) * per_split), group, head_size, scale};
      if (job.kv_begin >= job.kv_end) continue;
      job.first = sliding_window > 0 ? std::max<int64_t>(0, job.last - sliding_window + 1) : 0;
      const int64_t head0 = (t * heads + job.kv_begin * group) * head_size;
      if constexpr (std::is_same_v<T, float>) {
        attend_any(job, q_ptr + head0, out_ptr + head0, scores);
      } else {
        const int64_t count = (job.kv_end - job.kv_begin) * group * head_size;
        q32.resize(count);
        out32.resize(count);
        for (int64_t i = 0; i < count; ++i) q32[i] = widen(q_ptr[head0 + i]);
        attend_any(job, q32.data(), out32.data(), scores);
        for (int64_t i = 0; i < count; ++i) out_ptr[head0 + i] = static_cast<T>(out32[i]);
      }
    }
  });
}

}  // namespace

// As paged_attention, into out (contiguous, the query's shape and dtype): a step graph
// replays it on its own buffers.
void paged_attention_out(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& block_table, const at::Tensor& token_request,
                         const at::Tensor& token_position, double scale, int64_t sliding_window, at::Tensor& out) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "paged_attention: float32 or bfloat16 only");
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "paged_attention: the cache must have the query's dtype");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous());
  TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous() && out.sizes() == query.sizes(),
              "paged_attention: out must be a contiguous tensor of the query's shape and dtype");
  auto table = block_table.contiguous();
  auto req = token_request.contiguous();
  auto pos = token_position.contiguous();
  if (dtype == at::kFloat)
    run<float>(query, key_cache, value_cache, table, req, pos, static_cast<float>(scale), sliding_window, out);
  else
    run<c10::BFloat16>(query, key_cache, value_cache, table, req, pos, static_cast<float>(scale), sliding_window,
                       out);
}

at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                           at::Tensor block_table, at::Tensor token_request,
                           at::Tensor token_position, double scale, int64_t sliding_window) {
  auto out = at::empty(query.sizes(), query.options());
  paged_attention_out(query, key_cache, value_cache, block_table, token_request, token_position, scale,
                      sliding_window, out);
  return out;
}
