// The grouped MoE kernel's "lane tiles" (grouped_moe.cpp): an expert's pair rows along
// the vector lanes, its weights pre-packed at load, for experts with a block of rows
// or more (a decode batch of 64 and up, prefill chunks).
//
// Why: the row-dot-product tiles of grouped_moe.cpp load a weight vector and a row vector
// for every FMA pair and reduce each sum across lanes at the end; at 16 rows an expert
// they ran a core at ~40 GFLOP/s float32 (a third of its FMA rate). Here 16 pair rows
// are one vector (transposed once per call: x's rows are few), a weight is a scalar
// broadcast from a packed panel (embedded in the FMA), so each FMA is one broadcast
// load, and the sums need no reduction: lane m of accumulator j is row m's column j.
//
// Packed layout (pack_moe_experts, once at load), per k-step s (float32: one k;
// bfloat16: a pair k = 2s, 2s + 1, side by side, the operand pair of vdpbf16ps):
//   gate/up of expert e, tile t of kGateCols intermediate columns:
//     [steps(H)][2 * kGateCols][pair], columns 0..kGateCols-1 gate rows t*kGateCols + j,
//     then the same columns' up rows; columns past I and the odd k past H are zeros;
//   down of expert e, tile t of kDownCols hidden columns: [steps(I)][kDownCols][pair].
// All experts' gate/up tiles first, then all down tiles, in one tensor of the weights' dtype.
//
// The pair rows, transposed per block of kLanes rows: [steps(K)][kLanes][pair] (zeros
// for the missing rows and the odd k), for x (by the gathered token) and for h (written
// so by the gate/up pass, read so by the down pass).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tokenmill::moe_lanes {

using bf16 = c10::BFloat16;
constexpr int kLanes = 16;      // pair rows per block: one float32 vector
constexpr int kGateCols = 12;   // intermediate columns per gate/up tile (24 accumulators)
constexpr int kDownCols = 24;   // hidden columns per down tile
// How far ahead along a panel the tiles prefetch its weights. At a decode batch an expert's
// panels are read once per call, from DRAM (a Mixtral layer's bfloat16 experts are 25 MB), and
// the hardware prefetcher alone left a core waiting on them: a 24-column bfloat16 tile over
// 25 MB of panels measured ~25% faster with 32 steps (3 KB) of lead on a quiet Zen 4 core
// (the hot-cache tile's rate is the floor it approaches).
constexpr int64_t kPrefetchSteps = 32;

// elements of one k-step of one column: 1 (float32) or a pair (bfloat16)
template <typename T>
constexpr int64_t step_width() {
  return std::is_same_v<T, float> ? 1 : 2;
}
template <typename T>
constexpr int64_t steps(int64_t k) {
  return (k + step_width<T>() - 1) / step_width<T>();
}
inline int64_t tiles(int64_t columns, int64_t per_tile) { return (columns + per_tile - 1) / per_tile; }

template <typename T>
int64_t gate_up_tile_size(int64_t hidden) { return steps<T>(hidden) * 2 * kGateCols * step_width<T>(); }
template <typename T>
int64_t down_tile_size(int64_t inter) { return steps<T>(inter) * kDownCols * step_width<T>(); }
template <typename T>
int64_t gate_up_expert_size(int64_t hidden, int64_t inter) { return tiles(inter, kGateCols) * gate_up_tile_size<T>(hidden); }
template <typename T>
int64_t down_expert_size(int64_t hidden, int64_t inter) { return tiles(hidden, kDownCols) * down_tile_size<T>(inter); }
// one [steps(K)][kLanes][pair] block of rows
template <typename T>
int64_t block_size(int64_t k) { return steps<T>(k) * kLanes * step_width<T>(); }

// dst[s][column][pair] = rows[column][k] for a tile of `columns` weight rows (a null row: zeros)
template <typename T>
void pack_tile(const T* const* rows, int columns, int64_t k, T* dst) {
  const int64_t width = step_width<T>();
  for (int64_t i = 0; i < k; ++i)
    for (int j = 0; j < columns; ++j)
      dst[(i / width * columns + j) * width + i % width] = rows[j] ? rows[j][i] : T(0);
  if (k % width)  // the odd k's partner
    for (int j = 0; j < columns; ++j) dst[(k / width * columns + j) * width + 1] = T(0);
}

// dst[s][m][pair] = rows[m][k] for m < count, zeros for the block's other lanes
template <typename T>
void pack_rows(const T* const* rows, int count, int64_t k, T* dst) {
  std::memset(static_cast<void*>(dst), 0, sizeof(T) * block_size<T>(k));
  const int64_t width = step_width<T>();
  for (int m = 0; m < count; ++m)
    for (int64_t i = 0; i < k; ++i) dst[(i / width * kLanes + m) * width + i % width] = rows[m][i];
}

// the panel's cache lines kPrefetchSteps k-steps past `w` (a step of `bytes`, at most two lines;
// past the panel's end this is the next panel's start, which an item reads next)
inline void prefetch_ahead(const void* w, int64_t bytes) {
  const char* ahead = static_cast<const char*>(w) + kPrefetchSteps * bytes;
  __builtin_prefetch(ahead, 0, 3);
  if (bytes > 64) __builtin_prefetch(ahead + 64, 0, 3);
}

#if defined(__AVX512F__)

// acc[j] lane m = sum over k of w[column j][k] * x[row m][k], for `panel` a tile packed as
// above, `columns` its width (the stride of a k-step), N of them from `first`; x a
// block of rows. Calls epilogue(acc) with the sums (inlined: the accumulators stay in
// registers).
template <typename T, int N, int Columns, typename Epilogue>
__attribute__((always_inline)) inline void lane_tile(const T* panel, int first, const T* x, int64_t k_steps,
                                                     Epilogue&& epilogue) {
  __m512 acc[N];
#pragma GCC unroll 32
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    const float* w = panel + first;
    for (int64_t s = 0; s < k_steps; ++s, w += Columns) {
      prefetch_ahead(w, Columns * sizeof(float));
      const __m512 xv = _mm512_load_ps(x + s * kLanes);
#pragma GCC unroll 32
      for (int j = 0; j < N; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), xv, acc[j]);
    }
  } else {
#if defined(__AVX512BF16__)
    const bf16* w = panel + 2 * first;
    for (int64_t s = 0; s < k_steps; ++s, w += 2 * Columns) {
      prefetch_ahead(w, 2 * Columns * sizeof(bf16));
      __m512bh xv;
      const __m512i xi = _mm512_load_si512(x + s * 2 * kLanes);
      std::memcpy(&xv, &xi, sizeof(xv));
#pragma GCC unroll 32
      for (int j = 0; j < N; ++j) {
        int32_t pair;
        std::memcpy(&pair, w + 2 * j, sizeof(pair));
        const __m512i wi = _mm512_set1_epi32(pair);
        __m512bh wv;
        std::memcpy(&wv, &wi, sizeof(wv));
        acc[j] = _mm512_dpbf16_ps(acc[j], wv, xv);
      }
    }
#endif
  }
  epilogue(acc);
}

// lane_tile for a block whose rows all lie in its first 8 lanes (an expert's last few rows):
// 256-bit vectors, which a Zen 4 core issues two a cycle, so such a block costs about half.
template <typename T, int N, int Columns, typename Epilogue>
__attribute__((always_inline)) inline void half_lane_tile(const T* panel, int first, const T* x, int64_t k_steps,
                                                          Epilogue&& epilogue) {
  __m256 acc[N];
#pragma GCC unroll 32
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    const float* w = panel + first;
    for (int64_t s = 0; s < k_steps; ++s, w += Columns) {
      prefetch_ahead(w, Columns * sizeof(float));
      const __m256 xv = _mm256_loadu_ps(x + s * kLanes);
#pragma GCC unroll 32
      for (int j = 0; j < N; ++j) acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), xv, acc[j]);
    }
  } else {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    const bf16* w = panel + 2 * first;
    for (int64_t s = 0; s < k_steps; ++s, w += 2 * Columns) {
      prefetch_ahead(w, 2 * Columns * sizeof(bf16));
      __m256bh xv;
      const __m256i xi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + s * 2 * kLanes));
      std::memcpy(&xv, &xi, sizeof(xv));
#pragma GCC unroll 32
      for (int j = 0; j < N; ++j) {
        int32_t pair;
        std::memcpy(&pair, w + 2 * j, sizeof(pair));
        const __m256i wi = _mm256_set1_epi32(pair);
        __m256bh wv;
        std::memcpy(&wv, &wi, sizeof(wv));
        acc[j] = _mm256_dpbf16_ps(acc[j], wv, xv);
      }
    }
#endif
  }
  epilogue(acc);
}

// a tile's sums as 16 lanes (a half tile's upper lanes zeros)
inline void store_lanes(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store_lanes(float* dst, __m256 v) {
  _mm256_storeu_ps(dst, v);
  _mm256_storeu_ps(dst + 8, _mm256_setzero_ps());
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2+FMA (an AVX2-only CPU: 16 registers of 8 float32). A block's 16 lanes are two vectors
// (Lanes16), and the registers hold the sums of only a few of a tile's columns at a time, so
// lane_tile sums the tile in passes of pass_columns() columns over the block's k-steps, each
// into an array the epilogue then reads as the AVX-512 body's accumulators: the block of x
// (lane-major, a few KB) stays in L1 across the passes, the panel's other columns come from
// L2. bfloat16 has no dot-product instruction here: each pair (k = 2s in the low half of a
// 32-bit word, 2s + 1 in the high half) is widened to two float32 vectors by a shift and a
// mask, and each is multiplied and added as float32 (the products are exact, as vdpbf16ps's).

struct Lanes16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline __m256 even_of(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 odd_of(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m256i load_words(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m256i broadcast_pair(const bf16* w) {
  int32_t pair;
  std::memcpy(&pair, w, sizeof(pair));
  return _mm256_set1_epi32(pair);
}

// columns a pass sums, within 16 registers: float32 2 per column (lo, hi) + x's 2 + a weight;
// bfloat16 2 per column + x's 4 (even and odd k, lo and hi) + the weight's 2 + the mask
template <typename T>
constexpr int pass_columns() { return std::is_same_v<T, float> ? 6 : 4; }
// a half block: 1 per column + x's 1 (bfloat16: 2) + the weight's 1 (2) + the mask
template <typename T>
constexpr int half_pass_columns() { return std::is_same_v<T, float> ? 12 : 8; }

// out[j] = the sums of the block's 16 rows for columns first + j, j < G; a tile's first pass
// prefetches the panel ahead (it reads the panel from memory; the later passes from L2)
template <typename T, int G, int Columns>
__attribute__((noinline)) void lane_pass(const T* panel, int first, const T* x, int64_t k_steps, Lanes16* out,
                                         bool prefetch) {
  __m256 lo[G], hi[G];
#pragma GCC unroll 16
  for (int j = 0; j < G; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    const float* w = panel + first;
    for (int64_t s = 0; s < k_steps; ++s, w += Columns) {
      if (prefetch) prefetch_ahead(w, Columns * sizeof(float));
      const __m256 x_lo = _mm256_loadu_ps(x + s * kLanes), x_hi = _mm256_loadu_ps(x + s * kLanes + 8);
#pragma GCC unroll 16
      for (int j = 0; j < G; ++j) {
        const __m256 wv = _mm256_broadcast_ss(w + j);
        lo[j] = _mm256_fmadd_ps(wv, x_lo, lo[j]);
        hi[j] = _mm256_fmadd_ps(wv, x_hi, hi[j]);
      }
    }
  } else {
    const bf16* w = panel + 2 * first;
    for (int64_t s = 0; s < k_steps; ++s, w += 2 * Columns) {
      if (prefetch) prefetch_ahead(w, 2 * Columns * sizeof(bf16));
      const __m256i a = load_words(x + s * 2 * kLanes), b = load_words(x + s * 2 * kLanes + 16);
      const __m256 even_lo = even_of(a), odd_lo = odd_of(a), even_hi = even_of(b), odd_hi = odd_of(b);
#pragma GCC unroll 16
      for (int j = 0; j < G; ++j) {
        const __m256i pair = broadcast_pair(w + 2 * j);
        const __m256 we = even_of(pair), wo = odd_of(pair);
        lo[j] = _mm256_fmadd_ps(wo, odd_lo, _mm256_fmadd_ps(we, even_lo, lo[j]));
        hi[j] = _mm256_fmadd_ps(wo, odd_hi, _mm256_fmadd_ps(we, even_hi, hi[j]));
      }
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < G; ++j) out[j] = {lo[j], hi[j]};
}

// As lane_pass, for a block whose rows all lie in its first 8 lanes: one vector a column.
template <typename T, int G, int Columns>
__attribute__((noinline)) void half_lane_pass(const T* panel, int first, const T* x, int64_t k_steps, __m256* out,
                                              bool prefetch) {
  __m256 acc[G];
#pragma GCC unroll 16
  for (int j = 0; j < G; ++j) acc[j] = _mm256_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    const float* w = panel + first;
    for (int64_t s = 0; s < k_steps; ++s, w += Columns) {
      if (prefetch) prefetch_ahead(w, Columns * sizeof(float));
      const __m256 xv = _mm256_loadu_ps(x + s * kLanes);
#pragma GCC unroll 16
      for (int j = 0; j < G; ++j) acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + j), xv, acc[j]);
    }
  } else {
    const bf16* w = panel + 2 * first;
    for (int64_t s = 0; s < k_steps; ++s, w += 2 * Columns) {
      if (prefetch) prefetch_ahead(w, 2 * Columns * sizeof(bf16));
      const __m256i a = load_words(x + s * 2 * kLanes);
      const __m256 even = even_of(a), odd = odd_of(a);
#pragma GCC unroll 16
      for (int j = 0; j < G; ++j) {
        const __m256i pair = broadcast_pair(w + 2 * j);
        acc[j] = _mm256_fmadd_ps(odd_of(pair), odd, _mm256_fmadd_ps(even_of(pair), even, acc[j]));
      }
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < G; ++j) out[j] = acc[j];
}

// The passes of a tile's N columns from `first`, G at a time (the last may be narrower).
template <typename T, int N, int G, int Columns, bool Half, int J0 = 0, typename V>
inline void passes(const T* panel, int first, const T* x, int64_t k_steps, V* acc) {
  if constexpr (J0 < N) {
    constexpr int width = G < N - J0 ? G : N - J0;
    if constexpr (Half)
      half_lane_pass<T, width, Columns>(panel, first + J0, x, k_steps, acc + J0, J0 == 0);
    else
      lane_pass<T, width, Columns>(panel, first + J0, x, k_steps, acc + J0, J0 == 0);
    passes<T, N, G, Columns, Half, J0 + G>(panel, first, x, k_steps, acc);
  }
}

// The AVX-512 body's lane_tile and half_lane_tile, their epilogues given acc[N] of Lanes16 / __m256.
template <typename T, int N, int Columns, typename Epilogue>
inline void lane_tile(const T* panel, int first, const T* x, int64_t k_steps, Epilogue&& epilogue) {
  Lanes16 acc[N];
  passes<T, N, pass_columns<T>(), Columns, false>(panel, first, x, k_steps, acc);
  epilogue(acc);
}

template <typename T, int N, int Columns, typename Epilogue>
inline void half_lane_tile(const T* panel, int first, const T* x, int64_t k_steps, Epilogue&& epilogue) {
  __m256 acc[N];
  passes<T, N, half_pass_columns<T>(), Columns, true>(panel, first, x, k_steps, acc);
  epilogue(acc);
}

inline void store_lanes(float* dst, const Lanes16& v) {
  _mm256_storeu_ps(dst, v.lo);
  _mm256_storeu_ps(dst + 8, v.hi);
}
inline void store_lanes(float* dst, __m256 v) {
  _mm256_storeu_ps(dst, v);
  _mm256_storeu_ps(dst + 8, _mm256_setzero_ps());
}
#endif

}  // namespace tokenmill::moe_lanes
