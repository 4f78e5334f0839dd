// float32 linear layers at decode batch sizes (the platform sends 3 to 256 rows),
// on weights packed once into column panels: y = x @ W.T (+ bias).
//
// Why not MKL: its packed GEMM (cblas_sgemm_compute) reaches the machine's peak
// while the weights sit in cache, but a decode step streams every weight from
// DRAM, and there it ran 20-30% slower, waiting on memory. This kernel prefetches
// the next panel into L2 while it computes the current one. Measured on a 100m
// model's weights (400 MB, DRAM), two threads: 8 rows 60 -> 81 GFLOP/s, 32 rows
// 164 -> 217, 64 rows 252 -> 284, 256 rows 273 -> 284 (512 rows: 268 -> 258, and
// MKL's plain sgemm is ahead of both from ~256 rows on); in cache both run at ~350.
//
// Layout: W [N, K] becomes panels [ceil(N / 32), K, 32] (zero padded past N): for
// each k, the 32 outputs' weights are adjacent, two AVX-512 vectors. A micro-tile
// keeps 8 rows x 32 outputs of sums in 16 registers; each k step loads the panel's
// two vectors once and broadcasts one x value per row. A panel (K x 128 bytes)
// stays in L2 while every tile of x passes over it, and each tile prefetches its
// share of the next panel's rows, spread over its k steps, so that the panel is
// in L2 when its turn comes. Threads take contiguous ranges of panels.
// With AVX2 and FMA only (16 ymm registers of 8 floats), panels are 16 outputs
// wide (one cache line per k, two ymm vectors) and a micro-tile is 6 rows x 16
// outputs: 12 registers of sums, two of weights, one broadcast.
// Without either (packed_linear_available() false) the platform keeps torch's
// matmul; the scalar loop here only keeps the kernel correct.
//
// bfloat16 panels (the AVX2 build only): on a CPU without AVX-512, torch's own bfloat16
// matmul is a scalar loop (0.9 GFLOP/s on two Zen 3 cores, against 124 for float32), so a
// bfloat16 model's linear layers would run ~100x slower than float32 ones. There the weights
// are packed as bfloat16 panels (the same layout, half the bytes), each weight vector widened
// to float32 as the tile loads it (a shift), x widened once per call; the sums are float32,
// the bias added, and each output rounded once to bfloat16, as torch's bfloat16 matmul rounds.
// An AVX-512 build keeps bfloat16 on torch (oneDNN's kernels, AMX where there is one).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "thread_pool.h"
#include "vector_avx2.h"

#include <immintrin.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TOKENMILL_BF16_PANELS 1
constexpr bool kBf16Panels = true;
#else
constexpr bool kBf16Panels = false;
#endif

#ifdef __AVX512F__
constexpr int64_t kPanel = 32;  // outputs per panel
constexpr int kTileRows = 8;    // rows of x per micro-tile
#else
constexpr int64_t kPanel = 16;  // AVX2: two ymm vectors per k
constexpr int kTileRows = 6;    // 6 x 2 vectors of sums: 12 of the 16 ymm registers
#endif

template <typename T>  // float, or (kBf16Panels) bfloat16
struct Panel {
  const T* weights;  // [K, kPanel]
  const T* next;     // the next panel of this thread, or nullptr
  int64_t k;
  int64_t columns;      // real outputs in this panel (the last one may be short)
  const float* bias;    // this panel's first bias, or nullptr
};

#ifdef __AVX512F__
// out[r, 0:columns] = x[r, :] . panel + bias for R rows of x (row stride k),
// prefetching the next panel's rows [prefetch, prefetch_end), one every `every` k steps.
template <int R>
void tile(const float* x, const Panel<float>& p, float* out, int64_t out_stride, const float* prefetch,
          const float* prefetch_end, int64_t every) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  int64_t countdown = 0;
  for (int64_t i = 0; i < p.k; ++i) {
    if (prefetch < prefetch_end && --countdown <= 0) {
      countdown = every;
      _mm_prefetch(reinterpret_cast<const char*>(prefetch), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + 16), _MM_HINT_T1);
      prefetch += kPanel;
    }
    const __m512 w_lo = _mm512_loadu_ps(p.weights + i * kPanel);
    const __m512 w_hi = _mm512_loadu_ps(p.weights + i * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * p.k + i]);
      lo[r] = _mm512_fmadd_ps(xv, w_lo, lo[r]);
      hi[r] = _mm512_fmadd_ps(xv, w_hi, hi[r]);
    }
  }
  alignas(64) float row[kPanel];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(row, lo[r]);
    _mm512_store_ps(row + 16, hi[r]);
    for (int64_t j = 0; j < p.columns; ++j) out[r * out_stride + j] = row[j] + (p.bias != nullptr ? p.bias[j] : 0.f);
  }
}

using TileFn = void (*)(const float*, const Panel<float>&, float*, int64_t, const float*, const float*, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                          tile<5>, tile<6>, tile<7>, tile<8>};

void panel_rows(const float* x, int64_t m, const Panel<float>& p, float* out, int64_t n) {
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t share = (p.k + tiles - 1) / tiles;  // next-panel rows each tile prefetches
  const int64_t every = std::max<int64_t>(1, p.k / std::max<int64_t>(1, share));
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r = t * kTileRows, rows = std::min<int64_t>(kTileRows, m - r);
    const float* prefetch = p.next != nullptr ? p.next + std::min(p.k, t * share) * kPanel : nullptr;
    const float* prefetch_end = p.next != nullptr ? p.next + std::min(p.k, (t + 1) * share) * kPanel : nullptr;
    kTiles[rows](x + r * p.k, p, out + r * n, n, prefetch, prefetch_end, every);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// As the AVX-512 tile, 16 outputs (one cache line of float32 weights per k step) for R <= 6
// rows; bfloat16 weights are widened as loaded and the outputs rounded to bfloat16.
template <typename T, int R>
void tile(const float* x, const Panel<T>& p, T* out, int64_t out_stride, const T* prefetch, const T* prefetch_end,
          int64_t every) {
  // Every loop over r unrolled, so that GCC keeps the sums in registers: a loop it does not
  // unroll (a memset, the epilogue's column loops) indexes them, which puts them in memory,
  // stored back on every k step (then 1.5-2x slower than torch's matmul).
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_setzero_ps();
    hi[r] = _mm256_setzero_ps();
  }
  int64_t countdown = 0;
  for (int64_t i = 0; i < p.k; ++i) {
    if (prefetch < prefetch_end && --countdown <= 0) {
      countdown = every;
      _mm_prefetch(reinterpret_cast<const char*>(prefetch), _MM_HINT_T1);
      prefetch += kPanel;
    }
    const __m256 w_lo = tokenmill::avx2::load8(p.weights + i * kPanel);
    const __m256 w_hi = tokenmill::avx2::load8(p.weights + i * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * p.k + i);
      lo[r] = _mm256_fmadd_ps(xv, w_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w_hi, hi[r]);
    }
  }
  alignas(32) float rows[R][kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(rows[r], lo[r]);
    _mm256_store_ps(rows[r] + 8, hi[r]);
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < p.columns; ++j)
      out[r * out_stride + j] = static_cast<T>(rows[r][j] + (p.bias != nullptr ? p.bias[j] : 0.f));
}

template <typename T>
using TileFn = void (*)(const float*, const Panel<T>&, T*, int64_t, const T*, const T*, int64_t);
template <typename T>
constexpr TileFn<T> kTiles[kTileRows + 1] = {nullptr, tile<T, 1>, tile<T, 2>, tile<T, 3>, tile<T, 4>, tile<T, 5>, tile<T, 6>};

// the AVX-512 panel_rows, over 6-row tiles
template <typename T>
void panel_rows(const float* x, int64_t m, const Panel<T>& p, T* out, int64_t n) {
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t share = (p.k + tiles - 1) / tiles;  // next-panel rows each tile prefetches
  const int64_t every = std::max<int64_t>(1, p.k / std::max<int64_t>(1, share));
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r = t * kTileRows, rows = std::min<int64_t>(kTileRows, m - r);
    const T* prefetch = p.next != nullptr ? p.next + std::min(p.k, t * share) * kPanel : nullptr;
    const T* prefetch_end = p.next != nullptr ? p.next + std::min(p.k, (t + 1) * share) * kPanel : nullptr;
    kTiles<T>[rows](x + r * p.k, p, out + r * n, n, prefetch, prefetch_end, every);
  }
}
#else
void panel_rows(const float* x, int64_t m, const Panel<float>& p, float* out, int64_t n) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < p.columns; ++j) {
      float sum = p.bias != nullptr ? p.bias[j] : 0.f;
      for (int64_t i = 0; i < p.k; ++i) sum += x[r * p.k + i] * p.weights[i * kPanel + j];
      out[r * n + j] = sum;
    }
}
#endif

// The panels of the weight [N, K] (rows [p * kPanel, ...) each) through threads taking ranges of
// them; x [M, K] float32 (a bfloat16 x is widened by the caller), out [M, N].
template <typename T>
void run_panels(const float* x, const T* panels, const float* bias, T* out, int64_t m, int64_t k, int64_t n,
                int64_t count) {
  tokenmill::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const Panel<T> panel{panels + p * k * kPanel, p + 1 < end ? panels + (p + 1) * k * kPanel : nullptr, k,
                           std::min(kPanel, n - p * kPanel), bias != nullptr ? bias + p * kPanel : nullptr};
      panel_rows(x, m, panel, out + p * kPanel, n);
    }
  });
}

bool packs(at::ScalarType dtype) { return dtype == at::kFloat || (kBf16Panels && dtype == at::kBFloat16); }

}  // namespace

bool packed_linear_available() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

// The weight dtypes pack_linear_weight packs (none without a vector body).
std::vector<std::string> packed_linear_dtypes() {
  if (!packed_linear_available()) return {};
  if (kBf16Panels) return {"float32", "bfloat16"};
  return {"float32"};
}

namespace {

template <typename T>
void pack_panels(const T* src, int64_t n, int64_t k, T* dst) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  tokenmill::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      // written in order, read from the panel's kPanel rows side by side (their lines stay in L1)
      const int64_t columns = std::min(kPanel, n - p * kPanel);
      T* out_row = dst + p * k * kPanel;
      const T* rows = src + p * kPanel * k;
      for (int64_t i = 0; i < k; ++i, out_row += kPanel) {
        for (int64_t j = 0; j < columns; ++j) out_row[j] = rows[j * k + i];
        for (int64_t j = columns; j < kPanel; ++j) out_row[j] = T(0);  // the last panel's padding
      }
    }
  });
}

}  // namespace

// weight [N, K] float32 (or bfloat16: packed_linear_dtypes) -> panels [ceil(N / kPanel), K, kPanel]
// of its dtype (kPanel: 32 with AVX-512, else 16)
at::Tensor pack_linear_weight(at::Tensor weight) {
  TORCH_CHECK(packs(weight.scalar_type()) && weight.dim() == 2,
              "pack_linear_weight: a [N, K] weight of one of packed_linear_dtypes(), not ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  auto w = weight.contiguous();
  auto out = at::empty({panels, k, kPanel}, w.options());
  if (w.scalar_type() == at::kFloat)
    pack_panels(w.data_ptr<float>(), n, k, out.data_ptr<float>());
  else
    pack_panels(w.data_ptr<bf16>(), n, k, out.data_ptr<bf16>());
  return out;
}

namespace {

void check_packed_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  TORCH_CHECK(packs(panels.scalar_type()) && x.scalar_type() == panels.scalar_type(),
              "packed_linear: x and panels of one of packed_linear_dtypes(), not ", x.scalar_type(), " and ",
              panels.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "packed_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel && x.size(1) == panels.size(1),
              "packed_linear: x [M, K] and panels [P, K, ", kPanel, "]");
  TORCH_CHECK(n > (panels.size(0) - 1) * kPanel && n <= panels.size(0) * kPanel,
              "packed_linear: n does not match the panels");
}

}  // namespace

// As packed_linear, into out [M, N] (contiguous float32): a step graph replays it on its own buffers.
void packed_linear_out(const at::Tensor& x, const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias,
                       at::Tensor& out) {
  check_packed_linear(x, panels, n);
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == n,
              "packed_linear: out must be a contiguous [M, N] tensor of x's dtype");
  auto xs = x.to(at::kFloat).contiguous();  // (bfloat16: widened once here, not per broadcast)
  auto ps = panels.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "packed_linear: one bias per output");
  }
  const int64_t m = xs.size(0), k = xs.size(1), count = ps.size(0);
  if (m == 0) return;
  const float* x_ptr = xs.data_ptr<float>();
  const float* b_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  if (ps.scalar_type() == at::kFloat) {
    run_panels(x_ptr, ps.data_ptr<float>(), b_ptr, out.data_ptr<float>(), m, k, n, count);
    return;
  }
#if defined(TOKENMILL_BF16_PANELS)
  run_panels(x_ptr, ps.data_ptr<bf16>(), b_ptr, out.data_ptr<bf16>(), m, k, n, count);
#endif
}

// x [M, K], panels from pack_linear_weight of an [N, K] weight of x's dtype, bias [N] -> [M, N]
at::Tensor packed_linear(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias) {
  check_packed_linear(x, panels, n);
  auto out = at::empty({x.size(0), n}, x.options());
  packed_linear_out(x, panels, n, bias, out);
  return out;
}
