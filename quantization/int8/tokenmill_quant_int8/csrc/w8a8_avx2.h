// The W8A8 kernel's bodies for an AVX2 CPU without AVX-512 VNNI (AVX2, FMA and F16C: x86-64-v3).
// Included by w8a8_linear.cpp inside its anonymous namespace, after Operands and the panel
// layout, as the VNNI bodies are defined there; both give the generic code the same functions:
// quantize_row, quantize_panel_rows, pack_panel, rows_by_panel and scale_rows.
//
// AVX2 has no vpdpbusd. vpmaddubsw multiplies unsigned by signed bytes and adds each pair into
// an int16 with saturation, which the VNNI body's +128 shift of x would overflow (2 * 255 * 128 >
// 32767). So the quantised rows stay signed here, and each product takes |w| as the unsigned
// operand and x with w's sign (vpsignb) as the signed one: |w| <= 128 and |x| <= 127 keep a pair
// within 2 * 128 * 127 = 32512, exact in int16, and vpmaddwd by ones widens the pairs into int32
// sums of four. The int32 sums are exact and the scaling is the VNNI body's (two float32 products
// and the bias, no fused multiply-add), so the output is the torch path's to the last bit here too.
//
// Products: the packed panels (w8a8_pack_panels' layout is the VNNI body's, so a layer packs the
// same bytes on either CPU) and "int_mm"; no "tiles" (w8a8_linear's "auto" takes the panels at
// every row count). A register tile is 2 input rows by 32 weight rows (4 vectors of 8 words) or
// 1 input row by the panel's 64, in 8 of the 16 registers: four operations a row and vector of
// 8 words (sign, vpmaddubsw, vpmaddwd, add) for 32 multiply-adds, twice float32's FMA rate.
#pragma once

constexpr bool kHasTiles = false;
constexpr int64_t kManyRowsFrom = 0;  // "auto" multiplies by kManyRows (the panels) at every row count
constexpr int kPairVectors = 4;       // vectors of 8 weight rows a 2-row tile takes (half a panel)
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of its reads a panel's first tile asks for it

// The first min(count, 8) lanes set, for AVX2's masked 32-bit loads and stores.
inline __m256i lanes8(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(count, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Up to 8 16-bit values (the rest zeros), without reading past the count.
inline __m128i load_halves(const void* p, int64_t count) {
  if (count >= 8) return _mm_loadu_si128(static_cast<const __m128i*>(p));
  alignas(16) uint16_t part[8] = {};
  std::memcpy(part, p, sizeof(uint16_t) * static_cast<size_t>(count));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(part));
}

inline void store_halves(void* p, __m128i v, int64_t count) {
  if (count >= 8) {
    _mm_storeu_si128(static_cast<__m128i*>(p), v);
    return;
  }
  alignas(16) uint16_t part[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(part), v);
  std::memcpy(p, part, sizeof(uint16_t) * static_cast<size_t>(count));
}

// Up to 8 values as float32 (lanes past the count read as 0).
inline __m256 load8(const float* p, int64_t count) {
  return count >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes8(count));
}
inline __m256 load8(const c10::BFloat16* p, int64_t count) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load_halves(p, count)), 16));
}
inline __m256 load8(const c10::Half* p, int64_t count) { return _mm256_cvtph_ps(load_halves(p, count)); }

// 8 float32 into the output type (the first `count`), rounding to nearest even as c10 does (NaN: 0x7FC0).
inline void store8(float* p, __m256 v, int64_t count) {
  if (count >= 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, lanes8(count), v);
}
inline void store8(c10::BFloat16* p, __m256 v, int64_t count) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  store_halves(p, _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)), count);
}
inline void store8(c10::Half* p, __m256 v, int64_t count) {
  store_halves(p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), count);
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// x / scale rounded half to even (the default rounding mode, as torch.round) and clamped to +-127.
inline __m256i quantize8(__m256 x, __m256 divisor) {
  const __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(x, divisor));
  return _mm256_min_epi32(_mm256_max_epi32(q, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
}

// One row of x: its scale, and its values quantised into out[0 .. K). A NaN in the row makes the
// scale NaN, as torch's amax does (vmaxps alone would drop it), so the row's outputs are NaN.
template <typename In>
float quantize_row(const In* x, int64_t K, int8_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = load8(x + k, K - k);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  const float top = _mm256_movemask_ps(unordered) ? std::numeric_limits<float>::quiet_NaN() : reduce_max8(amax);
  const float scale = std::max(top, kMinScale) / kInt8Max;
  const __m256 divisor = _mm256_set1_ps(scale);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {  // four vectors narrowed to 32 bytes; the packs interleave 128-bit lanes
    const __m256i a = _mm256_packs_epi32(quantize8(load8(x + k, 8), divisor), quantize8(load8(x + k + 8, 8), divisor));
    const __m256i b = _mm256_packs_epi32(quantize8(load8(x + k + 16, 8), divisor), quantize8(load8(x + k + 24, 8), divisor));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), bytes);
  }
  for (; k < K; k += 8) {
    alignas(32) int32_t q[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), quantize8(load8(x + k, K - k), divisor));
    for (int64_t i = 0; i < std::min<int64_t>(8, K - k); ++i) out[k + i] = static_cast<int8_t>(q[i]);
  }
  return scale;
}

// The rows of x quantised (signed) and padded with zeros to Kp bytes a row, for the panels.
template <typename In>
void quantize_panel_rows(const In* x, int64_t M, int64_t K, int64_t Kp, uint8_t* rows, float* x_scale) {
  tokenmill::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* row = reinterpret_cast<int8_t*>(rows + m * Kp);
      x_scale[m] = quantize_row(x + m * K, K, row);
      std::memset(row + K, 0, static_cast<size_t>(Kp - K));
    }
  });
}

// Weight rows [n0, n0 + 64) into the panel layout (the VNNI body's pack_panel, one byte at a time:
// a layer packs once, at load).
void pack_panel(const Operands& op, int64_t n0, int64_t Kp, int32_t* panel) {
  int8_t* bytes = reinterpret_cast<int8_t*>(panel);
  for (int64_t k4 = 0; k4 < Kp / 4; ++k4)
    for (int64_t j = 0; j < kPanelCols; ++j) {  // word j of k-step k4: row n0 + j (16 v + i in the VNNI words)
      const int64_t n = n0 + j;
      for (int64_t b = 0; b < 4; ++b) {
        const int64_t k = 4 * k4 + b;
        bytes[(k4 * kPanelCols + j) * 4 + b] = n < op.N && k < op.K ? op.w[n * op.K + k] : 0;
      }
    }
}

// Row m of y, columns [n, n + 8) (those past N not stored), from its finished int32 sums: the
// VNNI body's scaling, in the same order.
template <typename Out>
inline void scale_vector(const Operands& op, int64_t m, int64_t n, __m256i sums, Out* y) {
  if (n >= op.N) return;
  const int64_t count = op.N - n;
  __m256 out = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(op.x_scale[m])),
                             load8(op.w_scale + n, count));
  if (op.bias != nullptr) out = _mm256_add_ps(out, load8(op.bias + n, count));
  store8(y + m * op.N + n, out, count);
}

// y[m0 .. m0 + Rows, columns of vectors [first, first + Vectors) of the panel at n0) from one packed
// panel; rows: the quantised rows, Kp bytes apart. The k-step's 64 words are 8 vectors of 8
// weight rows' 4 bytes; each row's 4 bytes are broadcast against them. Compiled on its own
// (noinline), as the VNNI panel_tile is, so that its accumulators stay in registers.
template <int Rows, int Vectors, typename Out>
__attribute__((noinline)) void panel_tile(const Operands& op, const int8_t* rows, int64_t Kp, const int32_t* panel,
                                          int64_t m0, int64_t n0, int first, bool prefetch, Out* y) {
  __m256i acc[Rows][Vectors];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < Vectors; ++v) acc[r][v] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* x = rows + m0 * Kp;
  for (int64_t k4 = 0; k4 < Kp / 4; ++k4) {
    const int32_t* words = panel + k4 * kPanelCols + 8 * first;
    if (prefetch) {  // the panel's first tile reads it from memory (see the VNNI panel_tile)
      const char* ahead = reinterpret_cast<const char*>(words) + kPrefetchBytes;
      _mm_prefetch(ahead, _MM_HINT_T0);
      if (Vectors * 32 > 64) _mm_prefetch(ahead + 64, _MM_HINT_T0);
      if (Vectors * 32 > 128) _mm_prefetch(ahead + 128, _MM_HINT_T0);
      if (Vectors * 32 > 192) _mm_prefetch(ahead + 192, _MM_HINT_T0);
    }
    __m256i xb[Rows];
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * Kp + 4 * k4, sizeof(four));
      xb[r] = _mm256_set1_epi32(four);
    }
#pragma GCC unroll 8
    for (int v = 0; v < Vectors; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 8 * v));
      const __m256i magnitude = _mm256_abs_epi8(w);
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xb[r], w));
        acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < Vectors; ++v) scale_vector(op, m0 + r, n0 + 8 * (first + v), acc[r][v], y);
}

// Every row of y, columns [n0, n0 + 64), from one packed panel: rows in pairs, each pair over the
// panel's two halves; an odd last row over the whole panel at once.
template <typename Out>
void rows_by_panel(const Operands& op, const uint8_t* rows, int64_t Kp, const int32_t* panel, int64_t n0, Out* y) {
  const int8_t* x = reinterpret_cast<const int8_t*>(rows);
  constexpr int kVectors = static_cast<int>(kPanelCols / 8);
  int64_t m = 0;
  for (; m + 2 <= op.M; m += 2)
    for (int first = 0; first < kVectors; first += kPairVectors)
      panel_tile<2, kPairVectors>(op, x, Kp, panel, m, n0, first, m == 0, y);
  if (m < op.M) panel_tile<1, kVectors>(op, x, Kp, panel, m, n0, 0, m == 0, y);
}

// The int32 product of torch._int_mm, scaled row by row.
template <typename Out>
void scale_rows(const Operands& op, const int32_t* acc, Out* y) {
  tokenmill::parallel_for(0, op.M, std::max<int64_t>(1, 16384 / std::max<int64_t>(op.N, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t n = 0; n < op.N; n += 8) {
        const __m256i sums = _mm256_maskload_epi32(acc + m * op.N + n, lanes8(op.N - n));
        scale_vector(op, m, n, sums, y);
      }
  });
}
