// A mixture-of-experts layer's experts in one call (float32 and bfloat16): every
// token-expert pair grouped by expert, each expert's weights streamed from memory
// once for all its rows.
//
// What it computes is the reference loop's (tokenmill.layers.NativeLayerOps.fused_moe):
// for each pair (token t, its s-th expert e, routing weight w),
//   h = silu(x[t] . gate_e) * (x[t] . up_e),   y = w * (h . down_e),
// and out[t] = sum over its k pairs of y. Three passes:
//  1. a counting sort of the pairs by expert (stable: pairs keep their token order);
//  2. gate/up: work items are (expert, block of intermediate columns); a micro-tile
//     takes two columns' gate and up weight rows (four rows, side by side) against
//     four of the expert's pair rows and applies silu(gate) * up to its sums at once,
//     so the [pairs, 2I] product is never stored, only h [pairs, I];
//  3. down: items are (expert, block of hidden columns), four weight rows against four
//     h rows, each sum scaled by its pair's routing weight into a float32 [pairs, H]
//     buffer indexed by pair (not by sorted position), which a last pass sums over each
//     token's k pairs (no atomics, a fixed order) and rounds once to x's dtype.
// Inside an item the weight rows of a tile stay in L1 while every row tile of the
// expert passes over them, so each weight is read from memory once per call (per
// block of kRowBlock rows for long prefills, from L2 then).
//
// The products are dot products along the weights' rows, as the checkpoint lays them
// out (no packed copy): AVX-512F FMAs for float32, AVX512-BF16 dot products
// (vdpbf16ps, exact products summed in float32) for bfloat16; a masked load takes a
// row's tail. An AVX2+FMA build (an AVX2-only CPU) has 8-lane FMA bodies for both dtypes,
// bfloat16 widened to float32 as it is loaded (moe_lane_tiles.h says how its lane tiles
// fit 16 registers). Without either a scalar loop stands in (correct, slow).
//
// Threads: the items are cut so that each costs about the same (a weight row's load
// plus a row product per pair), an expert with most of the pairs getting more, narrower
// items; threads claim them in turn (tokenmill::parallel_for), so both stay busy when
// one expert has most tokens.
//
// Rounding (bfloat16): gate, up and each down product are rounded to bfloat16 where
// the reference's matmuls round them, h too; the weighted top-k sum is kept in float32
// and rounded once (the reference adds the pairs into a bfloat16 output one by one).
//
// moe_route (softmax, top-k, optional renormalisation, the per-expert load counter) is
// here as well, so that routed_moe runs a whole MoE layer from its router logits: a
// step graph records that as one call (step_graph.cpp).
#include <ATen/ATen.h>

#include "moe_lane_tiles.h"
#include "thread_pool.h"
#include "vector_expf.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TOKENMILL_MOE_AVX2 1  // an AVX2-only CPU: the 8-lane bodies
#include "vector_avx2.h"
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int kTileRows = 4;       // pair rows per micro-tile
constexpr int kTileWeights = 4;    // weight rows per micro-tile (gate/up: two columns' gate and up rows)
constexpr int64_t kRowBlock = 64;  // pair rows per pass over an item's weights (they stay in L2 between passes)
constexpr int64_t kItemsPerThread = 16;
// Experts with at least this many pair rows take the lane tiles (moe_lane_tiles.h) where the
// weights were packed for them; fewer rows would leave most of a 16-lane block empty.
constexpr int64_t kLaneMinRows = 6;
namespace lanes = tokenmill::moe_lanes;

inline float widen(float v) { return v; }
inline float widen(bf16 v) { return static_cast<float>(v); }
// a value rounded as the reference's matmul in dtype T rounds it
template <typename T>
inline float as_stored(float v) {
  return std::is_same_v<T, float> ? v : static_cast<float>(static_cast<bf16>(v));
}

// An AVX2+FMA build (TOKENMILL_MOE_AVX2) has bodies for both dtypes; an AVX-512 build keeps its
// own, and runs bfloat16 through them only with AVX512-BF16.
template <typename T>
constexpr bool has_vector_body() {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) return true;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, bf16>) return true;
#endif
#if defined(TOKENMILL_MOE_AVX2)
  return true;
#endif
  return false;
}

#if defined(__AVX512F__)
// lane i = the sum of a[i]'s lanes: sixteen reductions in 15 adds and 30 shuffles, by
// transposing as it adds (pairs of rows, then pairs of pairs, then 128-bit lanes).
inline __m512 reduce16(const __m512 (&a)[16]) {
  __m512 pairs[8], quads[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = a[2i], b = a[2i+1]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sum of a[4i], ..., a[4i + 3]
    const __m512d lo = _mm512_castps_pd(pairs[2 * i]), hi = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(q01, q23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(__AVX512F__)
// acc[r][m] += w[r][i : i + lanes] . x[m][i : i + lanes] (lanes: 16 float32, 32 bfloat16;
// `mask` keeps the lanes within the row, the others load as zeros)
template <typename T, int R, int M, typename Mask>
inline void multiply_add(__m512 (&acc)[R][M], const T* const* w, const T* const* x, int64_t i, Mask mask) {
  if constexpr (std::is_same_v<T, float>) {
    __m512 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w[r] + i);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x[m] + i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  } else {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    __m512bh wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i v = _mm512_maskz_loadu_epi16(mask, w[r] + i);
      std::memcpy(&wv[r], &v, sizeof(v));
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512i v = _mm512_maskz_loadu_epi16(mask, x[m] + i);
      __m512bh xv;
      std::memcpy(&xv, &v, sizeof(v));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
    }
#endif
  }
}
#endif

#if defined(TOKENMILL_MOE_AVX2)
// dot_tile's AVX2 body for M <= 2 rows, into sums[r][m0 + m]: R x M sums, R weight vectors and
// a row vector in 13 of the 16 registers (four rows' 16 sums would not fit); a row's tail past
// the last whole vector is summed as scalars.
template <typename T, int R, int M>
__attribute__((always_inline)) inline void avx2_dot_rows(const T* const* w, const T* const* x, int64_t k,
                                                         float (&sums)[R][kTileRows], int m0) {
  __m256 acc[R][M];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = tokenmill::avx2::load8(w[r] + i);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m256 xv = tokenmill::avx2::load8(x[m] + i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float sum = tokenmill::avx2::reduce_add8(acc[r][m]);
      for (int64_t j = i; j < k; ++j) sum += widen(w[r][j]) * widen(x[m][j]);
      sums[r][m0 + m] = sum;
    }
}
#endif

// sums[r][m] = w[r][0:k] . x[m][0:k] for r < R, m < M. Not inlined: inside the tile loops
// the compiler ran short of registers (pointers moved through vector registers, each x
// vector loaded once per weight row).
template <typename T, int R, int M>
__attribute__((noinline)) void dot_tile(const T* const* w, const T* const* x, int64_t k, float (&sums)[R][kTileRows]) {
#if defined(__AVX512F__)
  if constexpr (has_vector_body<T>()) {
    __m512 acc[R][M];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    constexpr int64_t lanes = std::is_same_v<T, float> ? 16 : 32;
    using Mask = std::conditional_t<std::is_same_v<T, float>, __mmask16, __mmask32>;
    int64_t i = 0;
    for (; i + lanes <= k; i += lanes) multiply_add<T, R, M>(acc, w, x, i, static_cast<Mask>(~0u));
    if (i < k) multiply_add<T, R, M>(acc, w, x, i, static_cast<Mask>((1u << (k - i)) - 1));
    if constexpr (R * M == 16) {
      // copied out rather than cast: an accumulator array whose address is taken is kept
      // in memory, one store per accumulator per step of the loop above
      __m512 flat[16];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
  #pragma GCC unroll 8
        for (int m = 0; m < M; ++m) flat[r * M + m] = acc[r][m];
      alignas(64) float reduced[16];
      _mm512_store_ps(reduced, reduce16(flat));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
  #pragma GCC unroll 8
        for (int m = 0; m < M; ++m) sums[r][m] = reduced[r * M + m];
    } else {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
  #pragma GCC unroll 8
        for (int m = 0; m < M; ++m) sums[r][m] = _mm512_reduce_add_ps(acc[r][m]);
    }
    return;
  }
#endif
#if defined(TOKENMILL_MOE_AVX2)
  avx2_dot_rows<T, R, (M < 2 ? M : 2)>(w, x, k, sums, 0);
  if constexpr (M > 2) avx2_dot_rows<T, R, M - 2>(w, x + 2, k, sums, 2);
  return;
#endif
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t i = 0; i < k; ++i) sum += widen(w[r][i]) * widen(x[m][i]);
      sums[r][m] = sum;
    }
}

// dot_tile for the tile's first `rows` pair rows (a short tile, such as an expert's only row
// at batch 1, does no work for the missing ones)
template <typename T>
inline void tile_sums(const T* const* w, const T* const* x, int rows, int64_t k,
                      float (&sums)[kTileWeights][kTileRows]) {
  switch (rows) {
    case 1: return dot_tile<T, kTileWeights, 1>(w, x, k, sums);
    case 2: return dot_tile<T, kTileWeights, 2>(w, x, k, sums);
    case 3: return dot_tile<T, kTileWeights, 3>(w, x, k, sums);
    default: return dot_tile<T, kTileWeights, kTileRows>(w, x, k, sums);
  }
}

// The pairs sorted by expert: pair p = t * k + s is token t's s-th expert.
struct Groups {
  std::vector<int64_t> start;       // [E + 1]: expert e's rows are sorted positions [start[e], start[e + 1])
  std::vector<int64_t> pair_at;     // [P]: the pair at each sorted position
};

Groups group_pairs(const int64_t* ids, int64_t pairs, int64_t experts) {
  Groups g;
  g.start.assign(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) ++g.start[ids[p] + 1];
  for (int64_t e = 0; e < experts; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> cursor(g.start.begin(), g.start.end() - 1);
  g.pair_at.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) g.pair_at[cursor[ids[p]]++] = p;
  return g;
}

struct Item {
  int64_t expert, begin, end;  // output columns [begin, end) of the expert
};

// Each expert with rows cut into column blocks of about equal cost (a weight row read from
// memory ~ kLoadCost row products), at least step_of(expert) columns wide (a multiple of it).
std::vector<Item> balanced_items(const Groups& g, int64_t columns, const std::function<int64_t(int64_t)>& step_of) {
  constexpr int64_t kLoadCost = 8;
  const int64_t experts = static_cast<int64_t>(g.start.size()) - 1;
  int64_t total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = g.start[e + 1] - g.start[e];
    if (rows) total += columns * (kLoadCost + rows);
  }
  const int64_t target = std::max<int64_t>(1, total / (kItemsPerThread * tokenmill::pool_threads()));
  std::vector<Item> items;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = g.start[e + 1] - g.start[e];
    if (!rows) continue;
    const int64_t cost = columns * (kLoadCost + rows), step = step_of(e);
    const int64_t blocks = std::clamp<int64_t>(cost / target, 1, (columns + step - 1) / step);
    const int64_t width = ((columns + blocks - 1) / blocks + step - 1) / step * step;
    for (int64_t c = 0; c < columns; c += width) items.push_back({e, c, std::min(columns, c + width)});
  }
  return items;
}

// The pair rows of sorted positions [p, min(p + kTileRows, end)); returns how many.
template <typename T>
inline int tile_rows(const T* base, int64_t row_stride, const int64_t* row_of, int64_t p, int64_t end,
                     const T* (&rows)[kTileRows]) {
  const int valid = static_cast<int>(std::min<int64_t>(kTileRows, end - p));
  for (int m = 0; m < valid; ++m) rows[m] = base + row_of[p + m] * row_stride;
  return valid;
}

template <typename T>
struct Problem {
  const T* x;            // [T, H]
  const T* w13;          // [E, 2I, H]
  const T* w2;           // [E, H, I]
  const float* weights;  // [P] routing weight of each pair
  int64_t top_k, hidden, inter;
  int64_t experts = 0;
  const T* packed = nullptr;  // pack_moe_experts(w13, w2), or none
};

// The experts that take the lane tiles: their rows packed in blocks of lanes::kLanes.
template <typename T>
struct LaneBlocks {
  std::vector<int64_t> first;  // [E]: the expert's first block; -1: the expert takes the dot tiles
  at::Tensor x;                // [blocks, block_size(H)]: the gathered token rows
  at::Tensor h;                // [blocks, block_size(I)]: silu(gate) * up, written by the gate/up pass
  bool takes(int64_t expert) const { return first[expert] >= 0; }
};

template <typename T>
LaneBlocks<T> lane_blocks(const Problem<T>& pb, const Groups& g, const std::vector<int64_t>& token_at) {
  const int64_t E = static_cast<int64_t>(g.start.size()) - 1, H = pb.hidden;
  LaneBlocks<T> lb;
  lb.first.assign(E, -1);
  int64_t blocks = 0;
  for (int64_t e = 0; e < E && pb.packed != nullptr && has_vector_body<T>(); ++e) {
    const int64_t rows = g.start[e + 1] - g.start[e];
    if (rows < kLaneMinRows) continue;
    lb.first[e] = blocks;
    blocks += lanes::tiles(rows, lanes::kLanes);
  }
  const auto dtype = std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
  lb.x = at::empty({blocks * lanes::block_size<T>(H)}, at::TensorOptions().dtype(dtype));
  lb.h = at::zeros({blocks * lanes::block_size<T>(pb.inter)}, at::TensorOptions().dtype(dtype));
  T* x = lb.x.template data_ptr<T>();
  for (int64_t e = 0; e < E; ++e) {
    if (!lb.takes(e)) continue;
    for (int64_t p = g.start[e], b = lb.first[e]; p < g.start[e + 1]; p += lanes::kLanes, ++b) {
      const T* rows[lanes::kLanes];
      const int count = static_cast<int>(std::min<int64_t>(lanes::kLanes, g.start[e + 1] - p));
      for (int m = 0; m < count; ++m) rows[m] = pb.x + token_at[p + m] * H;
      lanes::pack_rows(rows, count, H, x + b * lanes::block_size<T>(H));
    }
  }
  return lb;
}

#if defined(__AVX512F__) || defined(TOKENMILL_MOE_AVX2)
// The lane tiles' gate/up for an item (columns a multiple of kGateCols): h in blocks.
template <typename T>
void gate_up_lane_item(const Problem<T>& pb, const Groups& g, const LaneBlocks<T>& lb, const Item& item) {
  constexpr int kCols = lanes::kGateCols, kLanes = lanes::kLanes;
  constexpr int64_t width = lanes::step_width<T>();
  const int64_t H = pb.hidden, I = pb.inter;
  const int64_t rows = g.start[item.expert + 1] - g.start[item.expert], blocks = lanes::tiles(rows, kLanes);
  const T* panels = pb.packed + item.expert * lanes::gate_up_expert_size<T>(H, I);
  const T* x = lb.x.template data_ptr<T>() + lb.first[item.expert] * lanes::block_size<T>(H);
  T* h = lb.h.template data_ptr<T>() + lb.first[item.expert] * lanes::block_size<T>(I);
  for (int64_t t = item.begin / kCols; t * kCols < item.end; ++t) {
    const T* panel = panels + t * lanes::gate_up_tile_size<T>(H);
    const int columns = static_cast<int>(std::min<int64_t>(kCols, I - t * kCols));
    for (int64_t b = 0; b < blocks; ++b) {
      auto activate = [&](auto& acc) {
        alignas(64) float gate[kCols * kLanes], up[kCols * kLanes];
#pragma GCC unroll 16
        for (int j = 0; j < kCols; ++j) {
          lanes::store_lanes(gate + j * kLanes, acc[j]);
          lanes::store_lanes(up + j * kLanes, acc[kCols + j]);
        }
#pragma omp simd
        for (int i = 0; i < kCols * kLanes; ++i) {
          const float gi = as_stored<T>(gate[i]);
          gate[i] = gi / (1.f + std::exp(-gi)) * as_stored<T>(up[i]);
        }
        T* dst = h + b * lanes::block_size<T>(I);
        for (int j = 0; j < columns; ++j) {
          const int64_t c = t * kCols + j;
          T* column = dst + c / width * kLanes * width + c % width;
          for (int m = 0; m < kLanes; ++m) column[m * width] = static_cast<T>(gate[j * kLanes + m]);
        }
      };
      const T* xb = x + b * lanes::block_size<T>(H);
      if (rows - b * kLanes <= kLanes / 2)
        lanes::half_lane_tile<T, 2 * kCols, 2 * kCols>(panel, 0, xb, lanes::steps<T>(H), activate);
      else
        lanes::lane_tile<T, 2 * kCols, 2 * kCols>(panel, 0, xb, lanes::steps<T>(H), activate);
    }
  }
}

// The lane tiles' down for an item (columns a multiple of kDownCols): by_pair as down_item's.
template <typename T>
void down_lane_item(const Problem<T>& pb, const Groups& g, const LaneBlocks<T>& lb, const Item& item,
                    float* by_pair) {
  constexpr int kCols = lanes::kDownCols, kLanes = lanes::kLanes;
  const int64_t H = pb.hidden, I = pb.inter;
  const int64_t first = g.start[item.expert], rows = g.start[item.expert + 1] - first;
  const T* panels = pb.packed + pb.experts * lanes::gate_up_expert_size<T>(H, I) +
                    item.expert * lanes::down_expert_size<T>(H, I);
  const T* h = lb.h.template data_ptr<T>() + lb.first[item.expert] * lanes::block_size<T>(I);
  for (int64_t t = item.begin / kCols; t * kCols < item.end; ++t) {
    const T* panel = panels + t * lanes::down_tile_size<T>(I);
    const int columns = static_cast<int>(std::min<int64_t>(kCols, H - t * kCols));
    for (int64_t b = 0; b * kLanes < rows; ++b) {
      auto scatter = [&](auto& acc) {
        alignas(64) float sums[kCols * kLanes];
#pragma GCC unroll 24
        for (int j = 0; j < kCols; ++j) lanes::store_lanes(sums + j * kLanes, acc[j]);
        const int count = static_cast<int>(std::min<int64_t>(kLanes, rows - b * kLanes));
        for (int m = 0; m < count; ++m) {
          const int64_t pair = g.pair_at[first + b * kLanes + m];
          float* dst = by_pair + pair * H + t * kCols;
          for (int j = 0; j < columns; ++j) dst[j] = pb.weights[pair] * as_stored<T>(sums[j * kLanes + m]);
        }
      };
      const T* hb = h + b * lanes::block_size<T>(I);
      if (rows - b * kLanes <= kLanes / 2)
        lanes::half_lane_tile<T, kCols, kCols>(panel, 0, hb, lanes::steps<T>(I), scatter);
      else
        lanes::lane_tile<T, kCols, kCols>(panel, 0, hb, lanes::steps<T>(I), scatter);
    }
  }
}
#endif

// h[position, begin:end] = silu(gate) * up for the expert's rows. A row block's gate and
// up sums are kept (float32, the item's width) and activated in one vectorised pass:
// one expf per tile element from the tile loop would be scalar.
template <typename T>
void gate_up_item(const Problem<T>& pb, const Groups& g, const std::vector<int64_t>& token_at, const Item& item,
                  T* h) {
  const int64_t H = pb.hidden, I = pb.inter, width = item.end - item.begin;
  const T* w = pb.w13 + item.expert * 2 * I * H;
  const int64_t first = g.start[item.expert], last = g.start[item.expert + 1];
  thread_local std::vector<float> gates, ups;
  gates.resize(static_cast<size_t>(kRowBlock * width));
  ups.resize(static_cast<size_t>(kRowBlock * width));
  for (int64_t block = first; block < last; block += kRowBlock) {
    const int64_t block_end = std::min(last, block + kRowBlock);
    for (int64_t c = item.begin; c < item.end; c += 2) {
      const int64_t c1 = std::min(c + 1, item.end - 1);
      const T* const rows_w[kTileWeights] = {w + c * H, w + c1 * H, w + (I + c) * H, w + (I + c1) * H};
      const int columns = static_cast<int>(c1 - c + 1);
      for (int64_t p = block; p < block_end; p += kTileRows) {
        const T* rows_x[kTileRows];
        const int valid = tile_rows(pb.x, H, token_at.data(), p, block_end, rows_x);
        float sums[kTileWeights][kTileRows];
        tile_sums<T>(rows_w, rows_x, valid, H, sums);
        for (int m = 0; m < valid; ++m)
          for (int j = 0; j < columns; ++j) {
            const int64_t at = (p - block + m) * width + c - item.begin + j;
            gates[at] = as_stored<T>(sums[j][m]);
            ups[at] = as_stored<T>(sums[2 + j][m]);
          }
      }
    }
    for (int64_t r = 0; r < block_end - block; ++r) {
      const float* gate = gates.data() + r * width;
      const float* up = ups.data() + r * width;
      T* dst = h + (block + r) * I + item.begin;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) dst[j] = static_cast<T>(gate[j] / (1.f + std::exp(-gate[j])) * up[j]);
    }
  }
}

// by_pair[pair, begin:end] = weight * (h . down) for the expert's rows
template <typename T>
void down_item(const Problem<T>& pb, const Groups& g, const std::vector<int64_t>& position, const Item& item,
               const T* h, float* by_pair) {
  const int64_t H = pb.hidden, I = pb.inter;
  const T* w = pb.w2 + item.expert * H * I;
  const int64_t first = g.start[item.expert], last = g.start[item.expert + 1];
  for (int64_t block = first; block < last; block += kRowBlock) {
    const int64_t block_end = std::min(last, block + kRowBlock);
    for (int64_t c = item.begin; c < item.end; c += kTileWeights) {
      const T* rows_w[kTileWeights];
      const int columns = static_cast<int>(std::min<int64_t>(kTileWeights, item.end - c));
      for (int j = 0; j < kTileWeights; ++j) rows_w[j] = w + (c + std::min(j, columns - 1)) * I;
      for (int64_t p = block; p < block_end; p += kTileRows) {
        const T* rows_h[kTileRows];
        const int valid = tile_rows(h, I, position.data(), p, block_end, rows_h);
        float sums[kTileWeights][kTileRows];
        tile_sums<T>(rows_w, rows_h, valid, I, sums);
        for (int m = 0; m < valid; ++m) {
          const int64_t pair = g.pair_at[p + m];
          for (int j = 0; j < columns; ++j) by_pair[pair * H + c + j] = pb.weights[pair] * as_stored<T>(sums[j][m]);
        }
      }
    }
  }
}

template <typename T>
void run_experts(const Problem<T>& pb, const int64_t* ids, int64_t tokens, int64_t experts, T* out) {
  const int64_t pairs = tokens * pb.top_k, H = pb.hidden, I = pb.inter;
  const Groups g = group_pairs(ids, pairs, experts);
  std::vector<int64_t> token_at(pairs), position(pairs);  // by sorted position: its token; its own index
  for (int64_t p = 0; p < pairs; ++p) {
    token_at[p] = g.pair_at[p] / pb.top_k;
    position[p] = p;
  }
  const LaneBlocks<T> lb = lane_blocks(pb, g, token_at);
  // left uninitialised (a vector's zeros were a serial pass over both before the threads start):
  // the passes write every element they read, h's rows of the dot-tile experts, all of by_pair
  const std::unique_ptr<T[]> h(new T[pairs * I]);
  const std::unique_ptr<float[]> by_pair(new float[pairs * H]);
  const auto up_items = balanced_items(g, I, [&](int64_t e) -> int64_t { return lb.takes(e) ? lanes::kGateCols : 2; });
  tokenmill::parallel_for(0, static_cast<int64_t>(up_items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
#if defined(__AVX512F__) || defined(TOKENMILL_MOE_AVX2)
      if constexpr (has_vector_body<T>())
        if (lb.takes(up_items[i].expert)) {
          gate_up_lane_item(pb, g, lb, up_items[i]);
          continue;
        }
#endif
      gate_up_item(pb, g, token_at, up_items[i], h.get());
    }
  });
  const auto down_items =
      balanced_items(g, H, [&](int64_t e) -> int64_t { return lb.takes(e) ? lanes::kDownCols : kTileWeights; });
  tokenmill::parallel_for(0, static_cast<int64_t>(down_items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
#if defined(__AVX512F__) || defined(TOKENMILL_MOE_AVX2)
      if constexpr (has_vector_body<T>())
        if (lb.takes(down_items[i].expert)) {
          down_lane_item(pb, g, lb, down_items[i], by_pair.get());
          continue;
        }
#endif
      down_item(pb, g, position, down_items[i], h.get(), by_pair.get());
    }
  });
  const int64_t k = pb.top_k;
  tokenmill::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H * k)),
                          [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < H; ++c) {
        float sum = 0.f;
        for (int64_t s = 0; s < k; ++s) sum += by_pair[(t * k + s) * H + c];
        out[t * H + c] = static_cast<T>(sum);
      }
  });
}

int64_t packed_experts_size(at::ScalarType dtype, int64_t E, int64_t H, int64_t I) {
  if (dtype == at::kFloat)
    return E * (lanes::gate_up_expert_size<float>(H, I) + lanes::down_expert_size<float>(H, I));
  return E * (lanes::gate_up_expert_size<bf16>(H, I) + lanes::down_expert_size<bf16>(H, I));
}

template <typename T>
void pack_experts(const T* w13, const T* w2, int64_t E, int64_t H, int64_t I, T* dst) {
  T* down = dst + E * lanes::gate_up_expert_size<T>(H, I);
  tokenmill::parallel_for(0, E, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const T* gate_up = w13 + e * 2 * I * H;
      for (int64_t t = 0; t < lanes::tiles(I, lanes::kGateCols); ++t) {
        const T* rows[2 * lanes::kGateCols];
        for (int j = 0; j < lanes::kGateCols; ++j) {
          const int64_t c = t * lanes::kGateCols + j;
          rows[j] = c < I ? gate_up + c * H : nullptr;
          rows[lanes::kGateCols + j] = c < I ? gate_up + (I + c) * H : nullptr;
        }
        lanes::pack_tile(rows, 2 * lanes::kGateCols, H,
                         dst + e * lanes::gate_up_expert_size<T>(H, I) + t * lanes::gate_up_tile_size<T>(H));
      }
      for (int64_t t = 0; t < lanes::tiles(H, lanes::kDownCols); ++t) {
        const T* rows[lanes::kDownCols];
        for (int j = 0; j < lanes::kDownCols; ++j) {
          const int64_t c = t * lanes::kDownCols + j;
          rows[j] = c < H ? w2 + (e * H + c) * I : nullptr;
        }
        lanes::pack_tile(rows, lanes::kDownCols, I,
                         down + e * lanes::down_expert_size<T>(H, I) + t * lanes::down_tile_size<T>(I));
      }
    }
  });
}

void check_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "grouped_moe: float32 or bfloat16 x");
  TORCH_CHECK(w13.scalar_type() == dtype && w2.scalar_type() == dtype, "grouped_moe: experts of x's dtype");
  TORCH_CHECK(x.device().is_cpu() && w13.device().is_cpu() && w2.device().is_cpu(), "grouped_moe: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, "grouped_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I]");
  const int64_t H = x.size(1), E = w13.size(0), I = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H,
              "grouped_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I] do not agree");
}

void check_out(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.sizes() == x.sizes(),
              "grouped_moe: out must be a contiguous tensor of x's shape and dtype");
}

// packed: pack_moe_experts(w13, w2) or an undefined tensor (the dot tiles for every expert)
void experts_out(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& weights,
                 const at::Tensor& ids, const at::Tensor& packed, at::Tensor& out) {
  const int64_t tokens = x.size(0), E = w13.size(0);
  const int64_t* id_ptr = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < ids.numel(); ++p)
    TORCH_CHECK(id_ptr[p] >= 0 && id_ptr[p] < E, "grouped_moe: expert id ", id_ptr[p], " outside 0..", E - 1);
  if (packed.defined())
    TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.is_contiguous() &&
                    packed.numel() == packed_experts_size(x.scalar_type(), E, x.size(1), w2.size(2)),
                "grouped_moe: packed is not pack_moe_experts(w13, w2) of these experts");
  if (tokens == 0) return;
  auto xs = x.contiguous();
  auto a = w13.contiguous();
  auto b = w2.contiguous();
  if (x.scalar_type() == at::kFloat) {
    const Problem<float> pb{xs.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), weights.data_ptr<float>(),
                            ids.size(1), x.size(1), w2.size(2), E,
                            packed.defined() ? packed.data_ptr<float>() : nullptr};
    run_experts(pb, id_ptr, tokens, E, out.data_ptr<float>());
  } else {
    const Problem<bf16> pb{xs.data_ptr<bf16>(), a.data_ptr<bf16>(), b.data_ptr<bf16>(), weights.data_ptr<float>(),
                           ids.size(1), x.size(1), w2.size(2), E,
                           packed.defined() ? packed.data_ptr<bf16>() : nullptr};
    run_experts(pb, id_ptr, tokens, E, out.data_ptr<bf16>());
  }
}

// Softmax over each row's E logits (float32), its top_k (largest first, the lower expert
// first on a tie), renormalised to sum to one if asked; load[e] += the pairs routed to e.
void route(const at::Tensor& logits, int64_t top_k, bool renormalize, float* weights, int64_t* ids, int64_t* load) {
  auto l = logits.to(at::kFloat).contiguous();
  const int64_t tokens = l.size(0), E = l.size(1);
  const float* src = l.data_ptr<float>();
  std::vector<float> p(E);
  std::vector<char> taken(E);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = src + t * E;
    const float top = *std::max_element(row, row + E);
    float total = 0.f;
    for (int64_t e = 0; e < E; ++e) total += p[e] = std::exp(row[e] - top);
    for (int64_t e = 0; e < E; ++e) p[e] /= total;
    std::fill(taken.begin(), taken.end(), 0);
    float chosen = 0.f;
    for (int64_t s = 0; s < top_k; ++s) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best] || (std::isnan(p[e]) && !std::isnan(p[best])))) best = e;
      taken[best] = 1;
      ids[t * top_k + s] = best;
      weights[t * top_k + s] = p[best];
      chosen += p[best];
    }
    if (renormalize)
      for (int64_t s = 0; s < top_k; ++s) weights[t * top_k + s] /= chosen;
  }
  if (load != nullptr)
    for (int64_t p_index = 0; p_index < tokens * top_k; ++p_index) ++load[ids[p_index]];
}

}  // namespace

bool grouped_moe_available() { return has_vector_body<float>(); }

std::vector<std::string> grouped_moe_dtypes() {
  std::vector<std::string> fast;
  if (has_vector_body<float>()) fast.emplace_back("float32");
  if (has_vector_body<bf16>()) fast.emplace_back("bfloat16");
  return fast;
}

// As grouped_moe, into out (a contiguous tensor of x's shape and dtype).
void grouped_moe_out(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids, const at::Tensor& packed, at::Tensor& out) {
  check_experts(x, w13, w2);
  check_out(x, out);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_weights.sizes() == topk_ids.sizes(),
              "grouped_moe: topk_weights and topk_ids [T, k]");
  experts_out(x, w13, w2, topk_weights.to(at::kFloat).contiguous(), topk_ids.to(at::kLong).contiguous(), packed, out);
}

// x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_weights [T, k],
// topk_ids [T, k] -> [T, H]: what LayerOps.fused_moe computes. packed: pack_moe_experts(w13, w2)
// if the caller keeps one (experts with a block of rows then take the lane tiles).
at::Tensor grouped_moe(at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor topk_weights, at::Tensor topk_ids,
                       c10::optional<at::Tensor> packed) {
  auto out = at::empty(x.sizes(), x.options());
  grouped_moe_out(x, w13, w2, topk_weights, topk_ids, packed.value_or(at::Tensor()), out);
  return out;
}

// The whole layer from the router's logits [T, E]: softmax routing to top_k experts
// (renormalised if asked), expert_load [E] (int64) += the pairs of each expert, then the experts.
void routed_moe_out(const at::Tensor& x, const at::Tensor& router_logits, const at::Tensor& w13, const at::Tensor& w2,
                    int64_t top_k, bool renormalize, at::Tensor& expert_load, const at::Tensor& packed,
                    at::Tensor& out) {
  check_experts(x, w13, w2);
  check_out(x, out);
  const int64_t E = w13.size(0);
  TORCH_CHECK(router_logits.dim() == 2 && router_logits.size(0) == x.size(0) && router_logits.size(1) == E,
              "routed_moe: router_logits [T, E]");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "routed_moe: top_k between 1 and the number of experts");
  TORCH_CHECK(expert_load.scalar_type() == at::kLong && expert_load.is_contiguous() && expert_load.numel() == E,
              "routed_moe: expert_load a contiguous int64 [E]");
  auto weights = at::empty({x.size(0), top_k}, x.options().dtype(at::kFloat));
  auto ids = at::empty({x.size(0), top_k}, x.options().dtype(at::kLong));
  route(router_logits, top_k, renormalize, weights.data_ptr<float>(), ids.data_ptr<int64_t>(),
        expert_load.data_ptr<int64_t>());
  experts_out(x, w13, w2, weights, ids, packed, out);
}

at::Tensor routed_moe(at::Tensor x, at::Tensor router_logits, at::Tensor w13, at::Tensor w2, int64_t top_k,
                      bool renormalize, at::Tensor expert_load, c10::optional<at::Tensor> packed) {
  auto out = at::empty(x.sizes(), x.options());
  routed_moe_out(x, router_logits, w13, w2, top_k, renormalize, expert_load, packed.value_or(at::Tensor()), out);
  return out;
}

// Routing alone (tests): (weights [T, k] float32, ids [T, k] int64), softmax then top-k.
std::tuple<at::Tensor, at::Tensor> moe_route(at::Tensor router_logits, int64_t top_k, bool renormalize) {
  TORCH_CHECK(router_logits.dim() == 2 && top_k >= 1 && top_k <= router_logits.size(1),
              "moe_route: router_logits [T, E] and 1 <= top_k <= E");
  auto weights = at::empty({router_logits.size(0), top_k}, router_logits.options().dtype(at::kFloat));
  auto ids = at::empty({router_logits.size(0), top_k}, router_logits.options().dtype(at::kLong));
  route(router_logits, top_k, renormalize, weights.data_ptr<float>(), ids.data_ptr<int64_t>(), nullptr);
  return {weights, ids};
}

// The experts' weights in the lane tiles' packed layout (moe_lane_tiles.h), once at load: a
// copy beside them of the same size (plus padding to whole tiles).
at::Tensor pack_moe_experts(at::Tensor w13, at::Tensor w2) {
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.scalar_type() == w2.scalar_type() &&
                  (w13.scalar_type() == at::kFloat || w13.scalar_type() == at::kBFloat16),
              "pack_moe_experts: float32 or bfloat16 w13 [E, 2I, H] and w2 [E, H, I]");
  const int64_t E = w13.size(0), H = w13.size(2), I = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w2.size(0) == E && w2.size(1) == H,
              "pack_moe_experts: w13 [E, 2I, H] and w2 [E, H, I] do not agree");
  auto a = w13.contiguous();
  auto b = w2.contiguous();
  auto packed = at::empty({packed_experts_size(w13.scalar_type(), E, H, I)}, w13.options());
  if (w13.scalar_type() == at::kFloat)
    pack_experts(a.data_ptr<float>(), b.data_ptr<float>(), E, H, I, packed.data_ptr<float>());
  else
    pack_experts(a.data_ptr<bf16>(), b.data_ptr<bf16>(), E, H, I, packed.data_ptr<bf16>());
  return packed;
}
