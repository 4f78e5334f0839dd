// The INT8 W8A8 linear layer in one call on a CPU with AVX-512 VNNI (the bodies here) or AVX2
// (w8a8_avx2.h, the same operations and bits; its header says how it multiplies without vpdpbusd):
//   y[M, N] = (((x_q @ W^T) as float) * x_scale[m]) * w_scale[n] (+ bias[n]), in x's dtype,
// where x_q = clamp(round(x / x_scale), -127, 127) and x_scale = max(max|x[m, :]|, 1e-12) / 127
// (dynamic per-token symmetric quantisation). Every step is the torch path's own operation in
// the same order (kernels.py: quantize_per_token, int8_matmul, scale_output): true division,
// round half to even, the exact int32 product, float32 products without fused multiply-adds
// (the build passes -ffp-contract=off), round to nearest even into bfloat16 / float16. So the
// output is the torch path's to the last bit; what changes is that x is read once to quantise
// it and the int32 product once to scale it, instead of once per torch op.
//
// A loaded layer keeps its weight as panels packed once (w8a8_pack_panels) and multiplies by
// them for every row count (w8a8_linear_packed): one sequential stream through the weight,
// prefetched ahead, no reduction across lanes and no packing per call. Against the row-major
// forms below, over a tiny Llama's 32 layers cycled as a step reads them (weights from memory,
// not the cache; the AMD EPYC (Zen 4) VM, two threads, wall time): 1 row 1.14 ms against the
// tiles' 3.3 (bfloat16 2.2), 64 rows 3.1 ms against the per-call panels' 8.3 (bfloat16 7.6).
//
// The row-major weight's product (w8a8_linear, kept for layers not packed and for the tests
// and benchmarks of each form) has three forms, all exact:
// - "tiles" (few rows: decode): the weight is read in place, row-major int8 [N, K], in tiles of
//   4 input rows by 4 weight rows, 16 accumulators of 16 lanes along K (64 bytes a step, the
//   tail masked), reduced together and scaled in registers. vpdpbusd multiplies unsigned by
//   signed bytes, so each quantised value is read shifted by +128 (xor 0x80) and 128 * rowsum(W)
//   taken back out: the sums wrap modulo 2^32 and the true result fits in int32, so the
//   difference is exact.
// - "int_mm" (many rows: prefill, large batches): torch._int_mm (oneDNN's int8 GEMM, blocked
//   for the cache) into an int32 [M, N], then one pass that scales it.
// - "panels" (many rows): the weight packed per call, 64 rows at a time, into vpdpbusd's broadcast
//   layout, 6 input rows by 64 weight rows in registers, scaled in registers (see product_by_panels).
// "auto" takes tiles below kManyRowsFrom (8) rows, panels from there on (on the benchmark Llamas'
// shapes, scripts/bench_int8_linear.py, the AMD EPYC (Zen 4) VM, one thread, CPU time: panels /
// int_mm / tiles at 12 rows 136 / 168 / 159 us on tiny gate_up [512 -> 3072], at 64 rows 627 / 896
// / 1301, and 206 / 204 on qkv, 97 / 114 on o, 273 / 307 on down; panel_tile's comment says why
// it is compiled on its own).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <tokenmill/parallel.h>  // tokenmill::parallel_for: the platform's pool where one is published
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TOKENMILL_INT8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TOKENMILL_INT8_AVX2 1
#endif
#if defined(TOKENMILL_INT8_VNNI) || defined(TOKENMILL_INT8_AVX2)
#define TOKENMILL_INT8_KERNEL 1
#endif

namespace {

#if defined(TOKENMILL_INT8_KERNEL)
constexpr float kMinScale = 1e-12f;  // an all-zero row still gets a finite scale
constexpr float kInt8Max = 127.0f;

struct Operands {
  const int8_t* xq;          // [M, K]
  const float* x_scale;      // [M]
  const int8_t* w;           // [N, K]
  const float* w_scale;      // [N]
  const int32_t* w_row_sum;  // [N]
  const float* bias;         // [N] or nullptr
  int64_t M, K, N;
};

// The panels' layout, the same for both bodies (see "panels" below): 64 weight rows a panel, K
// padded to 64, each k-step of 4 input columns 64 words (a word: a row's 4 bytes).
constexpr int kPanelVectors = 4;                     // 16 weight rows each (a VNNI vector): 64 a panel
constexpr int64_t kPanelCols = 16 * kPanelVectors;
constexpr int64_t kPanelK = 64;                      // K padded to this (one 16 x 16 transpose of words)

int64_t panel_words(int64_t Kp) { return Kp / 4 * kPanelVectors * 16; }
int64_t panel_count(int64_t N) { return (N + kPanelCols - 1) / kPanelCols; }
int64_t padded_k(int64_t K) { return (K + kPanelK - 1) / kPanelK * kPanelK; }
#endif

#if defined(TOKENMILL_INT8_VNNI)

constexpr bool kHasTiles = true;
constexpr int kTile = 4;             // input rows and weight rows of one register tile
constexpr int64_t kRowChunk = 64;    // input rows a thread walks per weight tile
constexpr int64_t kManyRowsFrom = 8;  // from here on, "auto" multiplies by kManyRows

inline __mmask16 lanes16(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

// Up to 16 values as float32 (lanes past the mask read as 0).
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 mask) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p)); }

// 16 float32 into the output type, rounding to nearest even (c10's conversions, NaN kept a NaN).
inline void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 mask) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(rounded));
}
inline void store16(c10::Half* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// One row of x: its scale, and its values quantised into out[0 .. K).
template <typename In>
float quantize_row(const In* x, int64_t K, int8_t* out) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, load16(x + k, lanes16(K - k))));
  const float scale = std::max(_mm512_reduce_max_ps(amax), kMinScale) / kInt8Max;
  const __m512 divisor = _mm512_set1_ps(scale);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = lanes16(K - k);
    // the default rounding mode rounds half to even, as torch.round
    const __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(load16(x + k, mask), divisor));
    _mm_mask_storeu_epi8(out + k, mask, _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(q, low), high)));
  }
  return scale;
}

// The 16 lanes of each of a, b, c, d summed: [sum a, sum b, sum c, sum d].
inline __m128i sum4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

// Row m of y, columns [n0, n0 + cols), from its four accumulators (one per weight row).
template <typename Out>
inline void scale_tile_row(const Operands& op, int64_t m, int64_t n0, int cols, __m512i a0, __m512i a1, __m512i a2,
                           __m512i a3, Out* y) {
  const __mmask8 valid = static_cast<__mmask8>((1u << cols) - 1);
  const __m128i offset = _mm_slli_epi32(_mm_maskz_loadu_epi32(valid, op.w_row_sum + n0), 7);  // 128 * rowsum
  const __m128i sums = _mm_sub_epi32(sum4(a0, a1, a2, a3), offset);
  __m128 v = _mm_mul_ps(_mm_cvtepi32_ps(sums), _mm_set1_ps(op.x_scale[m]));
  v = _mm_mul_ps(v, _mm_maskz_loadu_ps(valid, op.w_scale + n0));
  if (op.bias != nullptr) v = _mm_add_ps(v, _mm_maskz_loadu_ps(valid, op.bias + n0));
  store16(y + m * op.N + n0, _mm512_castps128_ps512(v), static_cast<__mmask16>(valid));
}

// y[m0 .. m0 + Rows, n0 .. n0 + cols) for cols <= 4 weight rows (missing ones read as zeros).
// The accumulators are named variables, as panel_tile's are (an array of them stayed on the stack).
template <int Rows, typename Out>
void tile(const Operands& op, int64_t m0, int64_t n0, int cols, Out* y) {
  static_assert(Rows >= 1 && Rows <= kTile, "a register tile has 1 to kTile input rows");
  const __m512i zero = _mm512_setzero_si512();
  __m512i a00 = zero, a01 = zero, a02 = zero, a03 = zero, a10 = zero, a11 = zero, a12 = zero, a13 = zero;
  __m512i a20 = zero, a21 = zero, a22 = zero, a23 = zero, a30 = zero, a31 = zero, a32 = zero, a33 = zero;
  const int8_t* w0 = op.w + n0 * op.K;
  const int8_t* w1 = op.w + (n0 + std::min(1, cols - 1)) * op.K;
  const int8_t* w2 = op.w + (n0 + std::min(2, cols - 1)) * op.K;
  const int8_t* w3 = op.w + (n0 + std::min(3, cols - 1)) * op.K;
  const __m512i shift = _mm512_set1_epi8(static_cast<char>(0x80));  // x_q + 128, as unsigned bytes
  for (int64_t k = 0; k < op.K; k += 64) {
    const __mmask64 mask = op.K - k >= 64 ? ~0ULL : (1ULL << (op.K - k)) - 1;
    const __m512i wv0 = _mm512_maskz_loadu_epi8(mask, w0 + k);
    const __m512i wv1 = cols > 1 ? _mm512_maskz_loadu_epi8(mask, w1 + k) : zero;
    const __m512i wv2 = cols > 2 ? _mm512_maskz_loadu_epi8(mask, w2 + k) : zero;
    const __m512i wv3 = cols > 3 ? _mm512_maskz_loadu_epi8(mask, w3 + k) : zero;
#define TOKENMILL_TILE_ROW(r)                                                                            \
  if constexpr (Rows > r) {                                                                              \
    const __m512i xv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, op.xq + (m0 + r) * op.K + k), shift); \
    a##r##0 = _mm512_dpbusd_epi32(a##r##0, xv, wv0);                                                     \
    a##r##1 = _mm512_dpbusd_epi32(a##r##1, xv, wv1);                                                     \
    a##r##2 = _mm512_dpbusd_epi32(a##r##2, xv, wv2);                                                     \
    a##r##3 = _mm512_dpbusd_epi32(a##r##3, xv, wv3);                                                     \
  }
    TOKENMILL_TILE_ROW(0) TOKENMILL_TILE_ROW(1) TOKENMILL_TILE_ROW(2) TOKENMILL_TILE_ROW(3)
#undef TOKENMILL_TILE_ROW
  }
  scale_tile_row(op, m0, n0, cols, a00, a01, a02, a03, y);
  if constexpr (Rows > 1) scale_tile_row(op, m0 + 1, n0, cols, a10, a11, a12, a13, y);
  if constexpr (Rows > 2) scale_tile_row(op, m0 + 2, n0, cols, a20, a21, a22, a23, y);
  if constexpr (Rows > 3) scale_tile_row(op, m0 + 3, n0, cols, a30, a31, a32, a33, y);
}

template <typename Out>
void product_by_tiles(const Operands& op, Out* y) {
  const int64_t tiles = (op.N + kTile - 1) / kTile;
  // the weight rows split over the threads; each walks its rows once per chunk of input rows
  tokenmill::parallel_for(0, tiles, std::max<int64_t>(1, 4096 / std::max<int64_t>(op.K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < op.M; m0 += kRowChunk) {
      const int64_t m1 = std::min(op.M, m0 + kRowChunk);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kTile;
        const int cols = static_cast<int>(std::min<int64_t>(kTile, op.N - n0));
        for (int64_t m = m0; m < m1; m += kTile) {
          switch (std::min<int64_t>(kTile, m1 - m)) {
            case 1: tile<1>(op, m, n0, cols, y); break;
            case 2: tile<2>(op, m, n0, cols, y); break;
            case 3: tile<3>(op, m, n0, cols, y); break;
            default: tile<4>(op, m, n0, cols, y); break;
          }
        }
      }
    }
  });
}

// The int32 product of torch._int_mm, scaled row by row.
template <typename Out>
void scale_rows(const Operands& op, const int32_t* acc, Out* y) {
  tokenmill::parallel_for(0, op.M, std::max<int64_t>(1, 16384 / std::max<int64_t>(op.N, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const __m512 x_scale = _mm512_set1_ps(op.x_scale[m]);
      for (int64_t n = 0; n < op.N; n += 16) {
        const __mmask16 mask = lanes16(op.N - n);
        const __m512i sums = _mm512_maskz_loadu_epi32(mask, acc + m * op.N + n);
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), x_scale), _mm512_maskz_loadu_ps(mask, op.w_scale + n));
        if (op.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, op.bias + n));
        store16(y + m * op.N + n, v, mask);
      }
    }
  });
}

// "panels": the weight's rows packed, 64 at a time, into a panel where each 4 input columns of
// 16 weight rows are one vector (vpdpbusd's signed operand), while each input row's 4 quantised
// values are broadcast (the unsigned one, stored shifted by +128). 6 input rows by 64 weight rows
// then accumulate in 24 registers with no reduction across lanes at the end, so the scaling (the
// same operations as scale_rows, in the same order) runs in registers on the finished sums. Here
// each thread packs the panels it multiplies (16 x 16 transposes of 4-byte words) into its own
// buffer in every call; a loaded layer packs them once instead (w8a8_pack_panels) and keeps only them.
constexpr int kPanelRows = 6;                        // input rows of one register tile
constexpr int64_t kPrefetchBytes = 4096;             // how far ahead of its reads panel_tile asks for the panel

// r[0 .. 16) (each 16 words) transposed in place: r[t] lane j = the old r[j] lane t.
inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + q] lane L: word 4L + q of rows 4i .. 4i + 3
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int q = 0; q < 4; ++q) {  // the 4 x 4 transpose of 128-bit lanes of b[q], b[4 + q], b[8 + q], b[12 + q]
    const __m512i c0 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0x88), c1 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0xdd);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0x88);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0xdd);
    r[q] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    r[8 + q] = _mm512_shuffle_i32x4(c0, c2, 0xdd);
    r[4 + q] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    r[12 + q] = _mm512_shuffle_i32x4(c1, c3, 0xdd);
  }
}

// Weight rows [n0, n0 + 64) into panel[k4][v][j] (words: W[n0 + 16 v + j][4 k4 .. 4 k4 + 4)),
// k4 < Kp / 4; rows past N and columns past K read as zeros.
void pack_panel(const Operands& op, int64_t n0, int64_t Kp, int32_t* panel) {
  __m512i r[16];
  for (int v = 0; v < kPanelVectors; ++v) {
    for (int64_t k = 0; k < Kp; k += kPanelK) {
      const __mmask64 mask = op.K - k >= 64 ? ~0ULL : (op.K > k ? (1ULL << (op.K - k)) - 1 : 0ULL);
      for (int j = 0; j < 16; ++j) {
        const int64_t n = n0 + 16 * v + j;
        r[j] = n < op.N ? _mm512_maskz_loadu_epi8(mask, op.w + n * op.K + k) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int t = 0; t < 16; ++t) _mm512_storeu_si512(panel + ((k / 4 + t) * kPanelVectors + v) * 16, r[t]);
    }
  }
}

// Row m of y, columns [n0, n0 + 64) (those past N not stored), from its four finished int32 sums.
template <typename Out>
inline void scale_panel_row(const Operands& op, int64_t m, int64_t n0, __m512i s0, __m512i s1, __m512i s2, __m512i s3,
                            Out* y) {
  const __m512i sums[kPanelVectors] = {s0, s1, s2, s3};
  const __m512 x_scale = _mm512_set1_ps(op.x_scale[m]);
#pragma GCC unroll 4
  for (int v = 0; v < kPanelVectors; ++v) {
    const int64_t n = n0 + 16 * v;
    const __mmask16 mask = n < op.N ? lanes16(op.N - n) : static_cast<__mmask16>(0);  // masked-off lanes never fault
    const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, op.w_row_sum + n), 7);  // 128 * rowsum
    __m512 out = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[v], offset)), x_scale),
                               _mm512_maskz_loadu_ps(mask, op.w_scale + n));
    if (op.bias != nullptr) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, op.bias + n));
    store16(y + m * op.N + n, out, mask);
  }
}

// y[m0 .. m0 + Rows, n0 .. n0 + 64) (columns past N not stored) from one packed panel; xu: the
// quantised rows shifted to unsigned, Kp bytes apart. Compiled on its own (noinline) with the
// 4 x Rows accumulators as named variables: inlined into product_by_panels' loop, or with the
// accumulators in an array, GCC 12 kept them on the stack, a store and a load around every
// vpdpbusd, which made the panels 2.6x slower (slower than torch._int_mm, and than bfloat16, on
// the AMD EPYC (Zen 4) VM at 64 rows). Rows past `Rows` are never touched and compiled away.
template <int Rows, typename Out>
__attribute__((noinline)) void panel_tile(const Operands& op, const uint8_t* xu, int64_t Kp, const int32_t* panel,
                                          int64_t m0, int64_t n0, Out* y) {
  static_assert(Rows >= 1 && Rows <= kPanelRows, "a register tile has 1 to kPanelRows input rows");
  const __m512i zero = _mm512_setzero_si512();
  __m512i c00 = zero, c01 = zero, c02 = zero, c03 = zero, c10 = zero, c11 = zero, c12 = zero, c13 = zero;
  __m512i c20 = zero, c21 = zero, c22 = zero, c23 = zero, c30 = zero, c31 = zero, c32 = zero, c33 = zero;
  __m512i c40 = zero, c41 = zero, c42 = zero, c43 = zero, c50 = zero, c51 = zero, c52 = zero, c53 = zero;
  const uint8_t* rows = xu + m0 * Kp;
  for (int64_t k4 = 0; k4 < Kp / 4; ++k4) {
    const int32_t* words = panel + k4 * kPanelVectors * 16;
    // a panel packed at load streams from memory (few rows read it once): its next bytes asked
    // for ahead of the hardware prefetcher, which stops at each 4 KiB page (a hit in the cache
    // when the rows come back to the same panel)
    const char* ahead = reinterpret_cast<const char*>(words) + kPrefetchBytes;
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    _mm_prefetch(ahead + 192, _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(words), w1 = _mm512_loadu_si512(words + 16);
    const __m512i w2 = _mm512_loadu_si512(words + 32), w3 = _mm512_loadu_si512(words + 48);
    // input row r's 4 quantised values broadcast, times the panel's 64 weight rows
#define TOKENMILL_PANEL_ROW(r)                                              \
  if constexpr (Rows > r) {                                                 \
    int32_t four;                                                           \
    std::memcpy(&four, rows + r * Kp + 4 * k4, sizeof(four));               \
    const __m512i xv = _mm512_set1_epi32(four);                             \
    c##r##0 = _mm512_dpbusd_epi32(c##r##0, xv, w0);                         \
    c##r##1 = _mm512_dpbusd_epi32(c##r##1, xv, w1);                         \
    c##r##2 = _mm512_dpbusd_epi32(c##r##2, xv, w2);                         \
    c##r##3 = _mm512_dpbusd_epi32(c##r##3, xv, w3);                         \
  }
    TOKENMILL_PANEL_ROW(0) TOKENMILL_PANEL_ROW(1) TOKENMILL_PANEL_ROW(2)
    TOKENMILL_PANEL_ROW(3) TOKENMILL_PANEL_ROW(4) TOKENMILL_PANEL_ROW(5)
#undef TOKENMILL_PANEL_ROW
  }
  scale_panel_row(op, m0, n0, c00, c01, c02, c03, y);
  if constexpr (Rows > 1) scale_panel_row(op, m0 + 1, n0, c10, c11, c12, c13, y);
  if constexpr (Rows > 2) scale_panel_row(op, m0 + 2, n0, c20, c21, c22, c23, y);
  if constexpr (Rows > 3) scale_panel_row(op, m0 + 3, n0, c30, c31, c32, c33, y);
  if constexpr (Rows > 4) scale_panel_row(op, m0 + 4, n0, c40, c41, c42, c43, y);
  if constexpr (Rows > 5) scale_panel_row(op, m0 + 5, n0, c50, c51, c52, c53, y);
}

// Every row of y, columns [n0, n0 + 64), from one packed panel.
template <typename Out>
void rows_by_panel(const Operands& op, const uint8_t* xu, int64_t Kp, const int32_t* panel, int64_t n0, Out* y) {
  int64_t m = 0;
  for (; m + kPanelRows <= op.M; m += kPanelRows) panel_tile<kPanelRows>(op, xu, Kp, panel, m, n0, y);
  switch (op.M - m) {
    case 1: panel_tile<1>(op, xu, Kp, panel, m, n0, y); break;
    case 2: panel_tile<2>(op, xu, Kp, panel, m, n0, y); break;
    case 3: panel_tile<3>(op, xu, Kp, panel, m, n0, y); break;
    case 4: panel_tile<4>(op, xu, Kp, panel, m, n0, y); break;
    case 5: panel_tile<5>(op, xu, Kp, panel, m, n0, y); break;
    default: break;
  }
}

// The rows of x quantised, shifted to unsigned and padded (with 128: times the panels' zero words)
// to Kp bytes a row, for the panels.
template <typename In>
void quantize_panel_rows(const In* x, int64_t M, int64_t K, int64_t Kp, uint8_t* xu, float* x_scale) {
  tokenmill::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    const __m512i shift = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t m = begin; m < end; ++m) {
      uint8_t* row = xu + m * Kp;
      x_scale[m] = quantize_row(x + m * K, K, reinterpret_cast<int8_t*>(row));
      std::memset(row + K, 0, static_cast<size_t>(Kp - K));
      for (int64_t k = 0; k < Kp; k += 64) _mm512_storeu_si512(row + k, _mm512_xor_si512(_mm512_loadu_si512(row + k), shift));
    }
  });
}

#elif defined(TOKENMILL_INT8_AVX2)
#include "w8a8_avx2.h"
#endif

#if defined(TOKENMILL_INT8_KERNEL)
// What follows runs on either body's quantize_row, quantize_panel_rows, pack_panel, rows_by_panel
// and scale_rows.

template <typename Out>
void product_by_panels(const Operands& op, const uint8_t* xu, int64_t Kp, Out* y) {
  tokenmill::parallel_for(0, panel_count(op.N), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<int32_t> panel;
    panel.resize(static_cast<size_t>(panel_words(Kp)));
    for (int64_t p = begin; p < end; ++p) {
      pack_panel(op, p * kPanelCols, Kp, panel.data());
      rows_by_panel(op, xu, Kp, panel.data(), p * kPanelCols, y);
    }
  });
}

// The same product over panels packed once, at load (w8a8_pack_panels): one stream of the
// weight's bytes in the order the tiles read them, and no packing per call.
template <typename Out>
void product_by_packed_panels(const Operands& op, const uint8_t* xu, int64_t Kp, const int32_t* packed, Out* y) {
  tokenmill::parallel_for(0, panel_count(op.N), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) rows_by_panel(op, xu, Kp, packed + p * panel_words(Kp), p * kPanelCols, y);
  });
}

enum class Product { kTiles, kIntMm, kPanels };
constexpr Product kManyRows = Product::kPanels;  // what "auto" takes from kManyRowsFrom rows on

// x quantised for the panels (quantize_panel_rows) into tensors of this call: [M, Kp] bytes and [M] scales.
struct PanelRows {
  torch::Tensor rows, scales;
};

template <typename In>
PanelRows panel_rows(const torch::Tensor& x, int64_t Kp) {
  const int64_t M = x.size(0), K = x.size(1);
  PanelRows quantized{torch::empty({M, Kp}, x.options().dtype(torch::kUInt8)),
                      torch::empty({M}, x.options().dtype(torch::kFloat32))};
  quantize_panel_rows(reinterpret_cast<const In*>(x.data_ptr()), M, K, Kp, quantized.rows.data_ptr<uint8_t>(),
                      quantized.scales.data_ptr<float>());
  return quantized;
}

template <typename In>
void linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& weight_scale,
            const torch::Tensor& row_sum, const float* bias, Product product, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const In* xp = reinterpret_cast<const In*>(x.data_ptr());
  In* yp = reinterpret_cast<In*>(y.data_ptr());  // y has x's dtype
  if (product == Product::kPanels) {
    const int64_t Kp = padded_k(K);
    const PanelRows quantized = panel_rows<In>(x, Kp);
    const Operands op{nullptr, quantized.scales.data_ptr<float>(), weight.data_ptr<int8_t>(),
                      weight_scale.data_ptr<float>(), row_sum.data_ptr<int32_t>(), bias, M, K, N};
    product_by_panels(op, quantized.rows.data_ptr<uint8_t>(), Kp, yp);
    return;
  }
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto x_scale = torch::empty({M}, x.options().dtype(torch::kFloat32));
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* xsp = x_scale.data_ptr<float>();
  tokenmill::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) xsp[m] = quantize_row(xp + m * K, K, xqp + m * K);
  });
  const Operands op{xqp, xsp, weight.data_ptr<int8_t>(), weight_scale.data_ptr<float>(), row_sum.data_ptr<int32_t>(),
                    bias, M, K, N};
#if defined(TOKENMILL_INT8_VNNI)
  if (product == Product::kTiles) {
    product_by_tiles(op, yp);
    return;
  }
#endif
  const auto acc = at::_int_mm(xq, weight.t()).contiguous();
  scale_rows(op, acc.data_ptr<int32_t>(), yp);
}

// The layer over panels packed at load: x quantised (padded to Kp), then the panels.
template <typename In>
void linear_packed(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& weight_scale,
                   const torch::Tensor& row_sum, const float* bias, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = weight_scale.size(0), Kp = panels.size(1) * 4;
  const PanelRows quantized = panel_rows<In>(x, Kp);
  const Operands op{nullptr, quantized.scales.data_ptr<float>(), nullptr, weight_scale.data_ptr<float>(),
                    row_sum.data_ptr<int32_t>(), bias, M, K, N};
  product_by_packed_panels(op, quantized.rows.data_ptr<uint8_t>(), Kp,
                           reinterpret_cast<const int32_t*>(panels.data_ptr<int8_t>()), reinterpret_cast<In*>(y.data_ptr()));
}

#endif  // TOKENMILL_INT8_KERNEL

// A row-major int8 weight [N, K] as the panels the kernel multiplies by: int8 [ceil(N / 64),
// ceil(K / 64) * 16, 4, 64], panel p holding rows [64 p, 64 p + 64) (pack_panel's layout of
// 4-byte words, 16 to a vector; rows past N and columns past K zero). The weight's own bytes,
// reordered, and padded to whole panels.
torch::Tensor w8a8_pack_panels(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kInt8 && weight.is_contiguous() &&
                  weight.device().is_cpu(), "w8a8_pack_panels: weight must be a contiguous CPU int8 [N, K]");
#if defined(TOKENMILL_INT8_KERNEL)
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = panel_count(N), Kp = padded_k(K);
  auto packed = torch::empty({panels, Kp / 4, kPanelVectors, 64}, weight.options());
  const Operands op{nullptr, nullptr, weight.data_ptr<int8_t>(), nullptr, nullptr, nullptr, 0, K, N};
  int32_t* out = reinterpret_cast<int32_t*>(packed.data_ptr<int8_t>());
  tokenmill::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) pack_panel(op, p * kPanelCols, Kp, out + p * panel_words(Kp));
  });
  return packed;
#else
  TORCH_CHECK(false, "w8a8_pack_panels: this build has no vector kernel: the CPU has neither AVX-512 VNNI nor AVX2 (isa() is 'none')");
#endif
}

std::string isa() {
#if defined(TOKENMILL_INT8_VNNI)
  return "avx512_vnni";
#elif defined(TOKENMILL_INT8_AVX2)
  return "avx2";
#else
  return "none";
#endif
}

void check_activations(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "w8a8_linear: x must be a contiguous CPU [M, K]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
              "w8a8_linear: x must be float32, bfloat16 or float16, not ", dtype);
}

// The per-channel scales, row sums and bias of an N-output layer (the bias, if any, as a pointer).
const float* check_scales(const torch::Tensor& weight_scale, const torch::Tensor& weight_row_sum,
                          const c10::optional<torch::Tensor>& bias, int64_t N) {
  TORCH_CHECK(weight_scale.dim() == 1 && weight_scale.size(0) == N && weight_scale.scalar_type() == torch::kFloat32 &&
                  weight_scale.is_contiguous(), "w8a8_linear: weight_scale must be a contiguous float32 [N]");
  TORCH_CHECK(weight_row_sum.dim() == 1 && weight_row_sum.size(0) == N &&
                  weight_row_sum.scalar_type() == torch::kInt32 && weight_row_sum.is_contiguous(),
              "w8a8_linear: weight_row_sum must be a contiguous int32 [N]");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous(),
              "w8a8_linear: bias must be a contiguous float32 [N]");
  return bias->data_ptr<float>();
}

// The layer of x into y over packed panels (checked by the callers: y [M, N] of x's dtype, contiguous).
// in_features: the packed weight's K (its panels hold it rounded up to 64, so x is checked against it);
// N is weight_scale's length, which the row sums and the bias must share.
void w8a8_linear_packed_into(const torch::Tensor& x, const torch::Tensor& panels, int64_t in_features,
                             const torch::Tensor& weight_scale, const torch::Tensor& weight_row_sum,
                             const c10::optional<torch::Tensor>& bias, torch::Tensor& y) {
  check_activations(x);
  TORCH_CHECK(x.size(1) == in_features, "w8a8_linear_packed: x has ", x.size(1), " features, the weight ", in_features);
  const int64_t N = weight_scale.dim() == 1 ? weight_scale.size(0) : -1;
  const float* bias_ptr = check_scales(weight_scale, weight_row_sum, bias, N);
#if defined(TOKENMILL_INT8_KERNEL)
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == torch::kInt8 && panels.is_contiguous() &&
                  panels.size(0) == panel_count(N) && panels.size(1) * 4 == padded_k(in_features) &&
                  panels.size(2) == kPanelVectors && panels.size(3) == 64,
              "w8a8_linear_packed: panels must be w8a8_pack_panels' packing of an int8 [", N, ", ", in_features,
              "] weight, not ", panels.sizes(), " ", panels.scalar_type());
  if (x.size(0) == 0 || N == 0) return;
  if (x.scalar_type() == torch::kFloat32) {
    linear_packed<float>(x, panels, weight_scale, weight_row_sum, bias_ptr, y);
  } else if (x.scalar_type() == torch::kBFloat16) {
    linear_packed<c10::BFloat16>(x, panels, weight_scale, weight_row_sum, bias_ptr, y);
  } else {
    linear_packed<c10::Half>(x, panels, weight_scale, weight_row_sum, bias_ptr, y);
  }
#else
  TORCH_CHECK(false, "w8a8_linear_packed: this build has no vector kernel: the CPU has neither AVX-512 VNNI nor AVX2 (isa() is 'none')");
#endif
}

torch::Tensor w8a8_linear_packed(const torch::Tensor& x, const torch::Tensor& panels, int64_t in_features,
                                 const torch::Tensor& weight_scale, const torch::Tensor& weight_row_sum,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "w8a8_linear_packed: x must be a contiguous CPU [M, K]");
  auto y = torch::empty({x.size(0), weight_scale.dim() == 1 ? weight_scale.size(0) : 0}, x.options());
  w8a8_linear_packed_into(x, panels, in_features, weight_scale, weight_row_sum, bias, y);
  return y;
}

torch::Tensor& w8a8_linear_packed_out(const torch::Tensor& x, const torch::Tensor& panels, int64_t in_features,
                                      const torch::Tensor& weight_scale, const torch::Tensor& weight_row_sum,
                                      const c10::optional<torch::Tensor>& bias, torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && weight_scale.dim() == 1, "w8a8_linear_packed: x [M, K], weight_scale [N]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == weight_scale.size(0) &&
                  out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.device().is_cpu(),
              "w8a8_linear_packed.out: out must be a contiguous CPU [", x.size(0), ", ", weight_scale.size(0),
              "] of x's dtype, not ", out.sizes(), " ", out.scalar_type());
  w8a8_linear_packed_into(x, panels, in_features, weight_scale, weight_row_sum, bias, out);
  return out;
}

// The layer of x into y (checked by the callers: [M, N], x's dtype, contiguous).
void w8a8_linear_into(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& weight_scale,
                      const torch::Tensor& weight_row_sum, const c10::optional<torch::Tensor>& bias,
                      c10::string_view product, torch::Tensor& y) {
  check_activations(x);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kInt8 && weight.is_contiguous(),
              "w8a8_linear: weight must be a contiguous int8 [N, K]");
  TORCH_CHECK(weight.size(1) == x.size(1), "w8a8_linear: x has ", x.size(1), " features, the weight ", weight.size(1));
  const int64_t N = weight.size(0);
  const float* bias_ptr = check_scales(weight_scale, weight_row_sum, bias, N);
  TORCH_CHECK(product == "auto" || product == "tiles" || product == "int_mm" || product == "panels",
              "w8a8_linear: product must be 'auto', 'tiles', 'int_mm' or 'panels', not '", std::string(product), "'");
#if defined(TOKENMILL_INT8_KERNEL)
  TORCH_CHECK(kHasTiles || product != "tiles", "w8a8_linear: this build (", isa(), ") has no 'tiles' product");
  if (x.size(0) > 0 && N > 0) {
    const Product chosen = product == "tiles" ? Product::kTiles
                           : product == "int_mm" ? Product::kIntMm
                           : product == "panels" ? Product::kPanels
                           : x.size(0) < kManyRowsFrom ? Product::kTiles : kManyRows;
    if (dtype == torch::kFloat32) {
      linear<float>(x, weight, weight_scale, weight_row_sum, bias_ptr, chosen, y);
    } else if (dtype == torch::kBFloat16) {
      linear<c10::BFloat16>(x, weight, weight_scale, weight_row_sum, bias_ptr, chosen, y);
    } else {
      linear<c10::Half>(x, weight, weight_scale, weight_row_sum, bias_ptr, chosen, y);
    }
  }
#else
  TORCH_CHECK(false, "w8a8_linear: this build has no vector kernel: the CPU has neither AVX-512 VNNI nor AVX2 (isa() is 'none')");
#endif
}

torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& weight_scale,
                          const torch::Tensor& weight_row_sum, const c10::optional<torch::Tensor>& bias,
                          c10::string_view product) {
  TORCH_CHECK(weight.dim() == 2, "w8a8_linear: weight must be a contiguous int8 [N, K]");
  auto y = torch::empty({x.dim() > 0 ? x.size(0) : 0, weight.size(0)}, x.options());
  w8a8_linear_into(x, weight, weight_scale, weight_row_sum, bias, product, y);
  return y;
}

// The out overload (what a step graph records): `out` must be [M, N] of x's dtype, contiguous; it is not resized.
torch::Tensor& w8a8_linear_out(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& weight_scale,
                               const torch::Tensor& weight_row_sum, const c10::optional<torch::Tensor>& bias,
                               c10::string_view product, torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "w8a8_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == weight.size(0) &&
                  out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.device().is_cpu(),
              "w8a8_linear.out: out must be a contiguous CPU [", x.size(0), ", ", weight.size(0), "] of x's dtype, not ",
              out.sizes(), " ", out.scalar_type());
  w8a8_linear_into(x, weight, weight_scale, weight_row_sum, bias, product, out);
  return out;
}


}  // namespace

// A torch op (torch.ops.tokenmill_int8.w8a8_linear), so that torch function modes see the call:
// the CPU platform's step-graph capture records it as a call of the out overload into one of the
// graph's buffers, replayed from C++ (the convention for plugin kernels in step graphs).
// Registered from C++, a call costs the dispatcher's few microseconds.
TORCH_LIBRARY(tokenmill_int8, m) {
  m.def("w8a8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor weight_row_sum, Tensor? bias, "
        "str product='auto') -> Tensor");
  m.def("w8a8_linear.out(Tensor x, Tensor weight, Tensor weight_scale, Tensor weight_row_sum, Tensor? bias, "
        "str product='auto', *, Tensor(a!) out) -> Tensor(a!)");
  m.def("w8a8_pack_panels(Tensor weight) -> Tensor");
  m.def("w8a8_linear_packed(Tensor x, Tensor panels, int in_features, Tensor weight_scale, Tensor weight_row_sum, "
        "Tensor? bias) -> Tensor");
  m.def("w8a8_linear_packed.out(Tensor x, Tensor panels, int in_features, Tensor weight_scale, "
        "Tensor weight_row_sum, Tensor? bias, *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(tokenmill_int8, CPU, m) {
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("w8a8_linear.out", &w8a8_linear_out);
  m.impl("w8a8_pack_panels", &w8a8_pack_panels);
  m.impl("w8a8_linear_packed", &w8a8_linear_packed);
  m.impl("w8a8_linear_packed.out", &w8a8_linear_packed_out);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction set the kernel was built for: 'avx512_vnni', 'avx2' or 'none'");
}
