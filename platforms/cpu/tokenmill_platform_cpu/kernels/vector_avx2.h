// AVX2 helpers the kernels' AVX2+FMA bodies share: 8-lane loads that widen bfloat16
// (the top half of a float32) and a horizontal sum. Only with __AVX2__ (an AVX-512
// build uses its own 16-lane forms).
#pragma once

#if defined(__AVX2__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace tokenmill::avx2 {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// bfloat16 is the top half of a float32: widen by shifting into place
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float reduce_add8(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

}  // namespace tokenmill::avx2
#endif
