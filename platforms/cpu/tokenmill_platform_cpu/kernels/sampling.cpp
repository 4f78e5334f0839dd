// Temperature sampling for float32 logits on the CPU, one row at a time: the
// row's max, the sums of exp((x - max) / t) over 64-token chunks, then the
// inverse-CDF walk (over the chunk sums, then inside the one chunk it lands in).
// Two reads of each row and no [B, V] writes, where the torch version makes
// five passes over the whole batch and writes three.
// With AVX-512 the exponential is our own (a Cody-Waite reduction and a
// degree-6 polynomial, ~2 ulp): glibc's vector expf, which the portable loop
// compiles to, made the kernel 5x slower per element than torch's exp (a
// 64 x 32,000 draw: 1.64 ms, against 0.31 ms for torch.exp over the same logits).
// With AVX2 and FMA only, the same exponential on 8 lanes (2^n built in the
// exponent bits: AVX2 has no scalef).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "thread_pool.h"
#include "vector_avx2.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vector_expf.h"

namespace {

constexpr int64_t kChunk = 64;

#ifdef __AVX512F__
// e^x, elementwise; exactly 0 below -87 (so -inf, a masked token, has no mass)
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);  // e^r on [-ln2/2, ln2/2]
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_scalef_ps(p, n));
}

// (x[i] - m) * inv_t for i in [begin, end), end - begin <= 16; lanes past end -inf (e^ of them: 0)
inline __m512 scaled_logits16(const float* x, int64_t begin, int64_t end, __m512 m, __m512 inv_t) {
  const __mmask16 lanes = end - begin >= 16 ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << (end - begin)) - 1);
  const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), lanes, x + begin);
  return _mm512_mul_ps(_mm512_sub_ps(v, m), inv_t);
}

inline float row_max(const float* x, int64_t v) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= v; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  float out = _mm512_reduce_max_ps(m);
  for (; i < v; ++i) out = std::max(out, x[i]);
  return out;
}

// probs[0:end-begin] = e^((x - m) * inv_t) over [begin, end), end - begin <= kChunk; returns their sum
inline float chunk_probs(const float* x, int64_t begin, int64_t end, float m, float inv_t, float* probs) {
  const __m512 mv = _mm512_set1_ps(m), tv = _mm512_set1_ps(inv_t);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = begin; i < end; i += 16) {
    const __m512 e = exp16(scaled_logits16(x, i, std::min(end, i + 16), mv, tv));
    if (probs != nullptr) _mm512_storeu_ps(probs + (i - begin), e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp16's 8-lane twin; 2^n from its exponent bits, in range wherever x >= -87 (n >= -126)
inline __m256 exp8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);  // e^r on [-ln2/2, ln2/2]
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);  // NaN lanes stay NaN
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

// (x[i] - m) * inv_t for i in [begin, end), end - begin <= 8; lanes past end -inf (e^ of them: 0)
inline __m256 scaled_logits8(const float* x, int64_t begin, int64_t end, __m256 m, __m256 inv_t) {
  const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(8, end - begin))),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                                    _mm256_maskload_ps(x + begin, lanes), _mm256_castsi256_ps(lanes));
  return _mm256_mul_ps(_mm256_sub_ps(v, m), inv_t);
}

inline float row_max(const float* x, int64_t v) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float out = *std::max_element(lanes, lanes + 8);
  for (; i < v; ++i) out = std::max(out, x[i]);
  return out;
}

// probs[0:end-begin] = e^((x - m) * inv_t) over [begin, end), end - begin <= kChunk; returns their sum
inline float chunk_probs(const float* x, int64_t begin, int64_t end, float m, float inv_t, float* probs) {
  const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = begin; i < end; i += 8) {
    const __m256 e = exp8(scaled_logits8(x, i, std::min(end, i + 8), mv, tv));
    if (probs != nullptr) _mm256_storeu_ps(probs + (i - begin), e);
    sum = _mm256_add_ps(sum, e);
  }
  return tokenmill::avx2::reduce_add8(sum);
}
#else
inline float row_max(const float* x, int64_t v) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < v; ++i) m = std::max(m, x[i]);
  return m;
}

inline float chunk_probs(const float* x, int64_t begin, int64_t end, float m, float inv_t, float* probs) {
  float sum = 0.f;
  for (int64_t i = begin; i < end; ++i) {
    const float e = std::exp((x[i] - m) * inv_t);
    if (probs != nullptr) probs[i - begin] = e;
    sum += e;
  }
  return sum;
}
#endif

int64_t sample_row(const float* x, int64_t v, float temperature, float uniform, std::vector<float>& chunk_sums) {
  const float m = row_max(x, v);
  const float inv_t = 1.f / temperature;
  const int64_t chunks = (v + kChunk - 1) / kChunk;
  chunk_sums.resize(chunks);
  float total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    chunk_sums[c] = chunk_probs(x, c * kChunk, std::min(v, (c + 1) * kChunk), m, inv_t, nullptr);
    total += chunk_sums[c];
  }
  const float threshold = uniform * total;
  float before = 0.f;
  int64_t c = 0;
  while (c + 1 < chunks && before + chunk_sums[c] <= threshold) before += chunk_sums[c++];
  // Inside the chunk (its probabilities recomputed, the same way): the first token
  // whose cumulative mass exceeds the threshold. A zero-mass token never raises the
  // running sum, so it is never the one chosen.
  const int64_t begin = c * kChunk, end = std::min(v, begin + kChunk);
  float probs[kChunk + 16];  // the vector body writes whole vectors
  chunk_probs(x, begin, end, m, inv_t, probs);
  float running = before;
  for (int64_t i = begin; i < end; ++i) {
    running += probs[i - begin];
    if (running > threshold) return i;
  }
  // Float error left the threshold past this chunk's sum: its last token with mass.
  for (int64_t i = end - 1; i >= begin; --i)
    if (probs[i - begin] > 0.f) return i;
  return begin;  // no token has mass (a NaN or all -inf row): the caller reports the row
}

// The row's first maximum, or its first NaN where it has one (torch.max's index: NaN propagates).
// Two reads of the row, both vectorised: its max (and whether any lane was NaN), then the first
// lane equal to it. torch's max(dim=-1) and argmax keep an index beside the value in one scalar
// pass: 55 us for a 32,000-token row here, against 3-4 us.
int64_t first_nan(const float* x, int64_t v) {
  for (int64_t i = 0; i < v; ++i)
    if (std::isnan(x[i])) return i;
  return 0;
}

#ifdef __AVX512F__
int64_t row_argmax(const float* x, int64_t v) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= v; i += 16) {
    const __m512 a = _mm512_loadu_ps(x + i);
    m = _mm512_max_ps(m, a);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  }
  float best = _mm512_reduce_max_ps(m);
  bool any_nan = nan != 0;
  for (int64_t j = i; j < v; ++j) {
    any_nan |= std::isnan(x[j]);
    best = std::max(best, x[j]);
  }
  if (any_nan) return first_nan(x, v);
  const __m512 target = _mm512_set1_ps(best);
  for (i = 0; i + 16 <= v; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (hit != 0) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < v; ++i)
    if (x[i] == best) return i;
  return 0;
}
#elif defined(__AVX2__)
int64_t row_argmax(const float* x, int64_t v) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    m = _mm256_max_ps(m, a);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = *std::max_element(lanes, lanes + 8);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < v; ++j) {
    any_nan |= std::isnan(x[j]);
    best = std::max(best, x[j]);
  }
  if (any_nan) return first_nan(x, v);
  const __m256 target = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= v; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (hit != 0) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < v; ++i)
    if (x[i] == best) return i;
  return 0;
}
#else
int64_t row_argmax(const float* x, int64_t v) {
  int64_t at = 0;
  for (int64_t i = 0; i < v; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[at]) at = i;
  }
  return at;
}
#endif

}  // namespace

// logits [B, V] float32 -> tokens [B] int64: each row's first maximum (its first NaN where it has one)
at::Tensor greedy_sample(at::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0,
              "greedy_sample: float32 [B, V] logits, V > 0");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), v = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* x_ptr = x.data_ptr<float>();
  int64_t* out_ptr = out.data_ptr<int64_t>();
  tokenmill::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out_ptr[r] = row_argmax(x_ptr + r * v, v);
  });
  return out;
}

// logits [B, V] float32; temperature [B] (> 0); uniform [B] in [0, 1) -> tokens [B] int64
at::Tensor temperature_sample(at::Tensor logits, at::Tensor temperature, at::Tensor uniform) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2, "temperature_sample: float32 [B, V] logits");
  auto x = logits.contiguous();
  auto t = temperature.to(at::kFloat).contiguous();
  auto u = uniform.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), v = x.size(1);
  TORCH_CHECK(t.numel() == rows && u.numel() == rows, "temperature_sample: one temperature and uniform per row");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* x_ptr = x.data_ptr<float>();
  const float* t_ptr = t.data_ptr<float>();
  const float* u_ptr = u.data_ptr<float>();
  int64_t* out_ptr = out.data_ptr<int64_t>();
  tokenmill::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> chunk_sums;
    for (int64_t r = begin; r < end; ++r) out_ptr[r] = sample_row(x_ptr + r * v, v, t_ptr[r], u_ptr[r], chunk_sums);
  });
  return out;
}
