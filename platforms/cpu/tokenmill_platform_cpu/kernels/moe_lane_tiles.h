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

#if defined(__AVX512F__)
// the panel's cache lines kPrefetchSteps k-steps past `w` (a step of `bytes`, at most two lines;
// past the panel's end this is the next panel's start, which an item reads next)
inline void prefetch_ahead(const void* w, int64_t bytes) {
  const char* ahead = static_cast<const char*>(w) + kPrefetchSteps * bytes;
  __builtin_prefetch(ahead, 0, 3);
  if (bytes > 64) __builtin_prefetch(ahead + 64, 0, 3);
}

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
#endif

}  // namespace tokenmill::moe_lanes
