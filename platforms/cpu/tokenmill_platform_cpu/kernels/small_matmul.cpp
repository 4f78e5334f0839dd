// Linear layers of one to six rows (batch-1 and small-batch decode), float32
// and bfloat16: y[m, n] = x[m, :] . W[n, :] (+ bias[n]), accumulated in float32,
// rounded once to the output's dtype.
// At these sizes a matmul only streams the weights, so what counts is how many
// bytes per second reach the cores; each weight row is read once, for all rows
// of x. How the stream is kept busy differs by dtype (measured on the weights of
// whole models, tiny 166 MB float32 partly from L3, 100m 400 MB from DRAM):
//  - float32 reads eight weight rows side by side, eight concurrent streams the
//    hardware prefetcher follows: one row: tiny 4.7 -> 4.2 ms, 100m 14.0 -> 12.8
//    ms against torch's matmul (MKL's sgemv); software prefetching on top of it
//    made it slower.
//  - bfloat16 reads a row at a time and prefetches eight rows ahead (200 MB from
//    DRAM: ~22 -> ~24 GB/s; torch reads them at ~14); several rows side by side
//    did as well at one row of x but worse at three.
// Vector bodies: AVX-512F for float32, AVX512-BF16 dot products for bfloat16
// (vdpbf16ps: 32 products per instruction, exact in float32). Without them, AVX2
// and FMA bodies (8 lanes): float32 reads 8 weight rows side by side at one row of
// x, fewer at more rows (12 accumulators of the 16 ymm registers); bfloat16 widens
// x to float32 once per call and each weight vector as it is loaded. Without AVX2 a
// scalar loop stands in (correct, slow): small_linear_dtypes() says which dtypes
// have a vector body, and the platform keeps torch's matmul for the others.
// The platform sends float32 here up to two rows (from three on, the packed-panel
// kernel is faster: this one's eight weight rows times three rows of x run out of
// registers) and bfloat16 up to six (at eight, oneDNN's matmul catches up).
// Shapes: x [M, K] (1 <= M <= 6), weight [N, K], bias [N].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "thread_pool.h"
#include "vector_avx2.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kMaxRows = 6;
template <typename T>
constexpr int kRowsPerPass = std::is_same_v<T, float> ? 8 : 1;  // weight rows read side by side
template <typename T>
constexpr int64_t kPrefetchRows = std::is_same_v<T, float> ? 0 : 8;  // how far ahead to prefetch (0: not)

template <typename T>
constexpr bool has_avx512_body() {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) return true;
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) return true;
#endif
  return false;
}

// AVX2+FMA: where the build has no AVX-512 body for T (an AVX2 CPU; bfloat16 without AVX512-BF16)
template <typename T>
constexpr bool has_avx2_body() {
#if defined(__AVX2__) && defined(__FMA__)
  return !has_avx512_body<T>();
#else
  return false;
#endif
}

template <typename T>
constexpr bool has_vector_body() {
  return has_avx512_body<T>() || has_avx2_body<T>();
}

// Weight rows read side by side with M rows of x: the AVX2 float32 body keeps R x M
// sums in at most 12 of its 16 registers.
template <typename T, int M>
constexpr int rows_per_pass() {
  if constexpr (std::is_same_v<T, float> && has_avx2_body<float>()) return std::max(1, std::min(8, 12 / M));
  return kRowsPerPass<T>;
}

// x as the dot products read it: the AVX2 bfloat16 body reads float32 (widened once per call)
template <typename T>
using XType = std::conditional_t<std::is_same_v<T, bf16> && has_avx2_body<bf16>(), float, T>;

#ifdef __AVX512F__
template <typename T>
constexpr int64_t kLanes = std::is_same_v<T, float> ? 16 : 32;  // elements per vector step

// acc += w[0:lanes] . x[0:lanes], pairwise for bfloat16
template <typename T>
inline __m512 multiply_add(__m512 acc, const T* w, const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_loadu_ps(x), acc);
  } else {
#ifdef __AVX512BF16__
    __m512bh a, b;
    const __m512i wa = _mm512_loadu_si512(w), xb = _mm512_loadu_si512(x);
    std::memcpy(&a, &wa, sizeof(a));
    std::memcpy(&b, &xb, sizeof(b));
    return _mm512_dpbf16_ps(acc, a, b);
#else
    return acc;  // unreachable: has_vector_body<bf16>() is false without AVX512-BF16
#endif
  }
}
#endif

// sums[r][m] = W[r] . x[m] for R weight rows starting at w (row stride k)
template <typename T, typename X, int M, int R>
inline void dot_rows(const T* w, const X* x, int64_t k, float (&sums)[R][M]) {
  int64_t i = 0;
#ifdef __AVX512F__
  if constexpr (has_avx512_body<T>()) {
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    for (; i + kLanes<T> <= k; i += kLanes<T>)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) acc[r][m] = multiply_add(acc[r][m], w + r * k + i, x + m * k + i);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) sums[r][m] = _mm512_reduce_add_ps(acc[r][m]);
  } else
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (has_avx2_body<T>()) {
    static_assert(std::is_same_v<X, float>, "the AVX2 body reads x as float32");
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8)
      for (int r = 0; r < R; ++r) {
        const __m256 wv = tokenmill::avx2::load8(w + r * k + i);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * k + i), acc[r][m]);
      }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) sums[r][m] = tokenmill::avx2::reduce_add8(acc[r][m]);
  } else
#endif
  {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) sums[r][m] = 0.f;
  }
  for (; i < k; ++i)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        sums[r][m] += static_cast<float>(w[r * k + i]) * static_cast<float>(x[m * k + i]);
}

template <typename T, int M, int R>
inline void rows_out(const XType<T>* x, const T* weight, const T* bias, T* out, int64_t n, int64_t k, int64_t j) {
  float sums[R][M];
  dot_rows<T, XType<T>, M, R>(weight + j * k, x, k, sums);
  for (int r = 0; r < R; ++r) {
    const float b = bias != nullptr ? static_cast<float>(bias[j + r]) : 0.f;
    for (int m = 0; m < M; ++m) out[m * n + j + r] = static_cast<T>(sums[r][m] + b);
  }
}

template <typename T, int M>
void run(const T* x_in, const T* weight, const T* bias, T* out, int64_t n, int64_t k) {
  std::vector<float> widened;  // the AVX2 bfloat16 body's float32 x
  const XType<T>* x;
  if constexpr (std::is_same_v<XType<T>, T>) {
    x = x_in;
  } else {
    widened.resize(M * k);
    for (int64_t i = 0; i < M * k; ++i) widened[i] = static_cast<float>(x_in[i]);
    x = widened.data();
  }
  // ~64 KiB of weights per task: enough to pay for the threads, fine enough to balance them
  constexpr int rows = rows_per_pass<T, M>();
  constexpr int64_t ahead = kPrefetchRows<T>;
  const int64_t grain = std::max<int64_t>(rows, 65536 / sizeof(T) / std::max<int64_t>(1, k));
  tokenmill::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    int64_t j = begin;
    for (; j + rows <= end; j += rows) {
      if (ahead > 0 && j + ahead + rows <= end)
        for (int64_t e = 0; e < rows * k; e += 64 / sizeof(T)) __builtin_prefetch(weight + (j + ahead) * k + e, 0, 3);
      rows_out<T, M, rows>(x, weight, bias, out, n, k, j);
    }
    for (; j < end; ++j) rows_out<T, M, 1>(x, weight, bias, out, n, k, j);
  });
}

template <typename T>
void dispatch_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& out) {
  const int64_t n = w.size(0), k = w.size(1);
  const T* b_ptr = b.defined() ? b.data_ptr<T>() : nullptr;
  switch (x.size(0)) {
    case 1: return run<T, 1>(x.data_ptr<T>(), w.data_ptr<T>(), b_ptr, out.data_ptr<T>(), n, k);
    case 2: return run<T, 2>(x.data_ptr<T>(), w.data_ptr<T>(), b_ptr, out.data_ptr<T>(), n, k);
    case 3: return run<T, 3>(x.data_ptr<T>(), w.data_ptr<T>(), b_ptr, out.data_ptr<T>(), n, k);
    case 4: return run<T, 4>(x.data_ptr<T>(), w.data_ptr<T>(), b_ptr, out.data_ptr<T>(), n, k);
    case 5: return run<T, 5>(x.data_ptr<T>(), w.data_ptr<T>(), b_ptr, out.data_ptr<T>(), n, k);
    default: return run<T, 6>(x.data_ptr<T>(), w.data_ptr<T>(), b_ptr, out.data_ptr<T>(), n, k);
  }
}

void check_small_linear(const at::Tensor& x, const at::Tensor& weight) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "small_linear: float32 or bfloat16 x and weight of one dtype");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "small_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_linear: 1 to ", kMaxRows, " rows");
}

}  // namespace

// The dtypes this build has a vector body for; for the others torch's matmul is the faster choice.
std::vector<std::string> small_linear_dtypes() {
  std::vector<std::string> fast;
  if (has_vector_body<float>()) fast.emplace_back("float32");
  if (has_vector_body<bf16>()) fast.emplace_back("bfloat16");
  return fast;
}

// As small_linear, into out [M, N] (contiguous, x's dtype): a step graph replays it on its own buffers.
void small_linear_out(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      at::Tensor& out) {
  check_small_linear(x, weight);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == weight.size(0),
              "small_linear: out must be a contiguous [M, N] tensor of x's dtype");
  auto xs = x.contiguous();
  auto w = weight.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(dtype).contiguous();
    TORCH_CHECK(b.numel() == w.size(0), "small_linear: one bias per output");
  }
  if (dtype == at::kFloat)
    dispatch_rows<float>(xs, w, b, out);
  else
    dispatch_rows<bf16>(xs, w, b, out);
}

at::Tensor small_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  check_small_linear(x, weight);
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  small_linear_out(x, weight, bias, out);
  return out;
}
