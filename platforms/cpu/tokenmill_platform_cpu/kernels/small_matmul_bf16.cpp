// bfloat16 linear layers at one to three rows (batch-1 and small-batch decode):
// y[m, n] = x[m, :] . W[n, :] (+ bias[n]), float32 accumulation, rounded once.
// At these sizes the matmul only streams the weights, and torch's bfloat16
// matmul read them at ~14 GB/s here against ~25 GB/s for float32's: each weight
// row is read once, for all rows of x, with AVX512-BF16 dot products
// (vdpbf16ps: 32 products per instruction, exact in float32) where the CPU has
// them; elsewhere a scalar loop stands in (correct, slow: the platform then keeps
// torch's matmul, see small_linear_bf16_fast).
// Shapes: x [M, K] (M <= 3, contiguous), weight [N, K] (contiguous), bias [N].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kMaxRows = 3;
constexpr int64_t kPrefetchRows = 8;  // weight rows ahead of the one being read

#ifdef __AVX512BF16__
inline __m512bh load_pairs(const bf16* p) {
  __m512bh out;
  const __m512i raw = _mm512_loadu_si512(p);
  std::memcpy(&out, &raw, sizeof(out));
  return out;
}
#endif

// sums[m] = x[m] . w over k elements
template <int M>
inline void dot_rows(const bf16* w, const bf16* x, int64_t k, float* sums) {
  int64_t i = 0;
#ifdef __AVX512BF16__
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    const __m512bh weights = load_pairs(w + i);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], weights, load_pairs(x + m * k + i));
  }
  for (int m = 0; m < M; ++m) sums[m] = _mm512_reduce_add_ps(acc[m]);
#else
  for (int m = 0; m < M; ++m) sums[m] = 0.f;
#endif
  for (; i < k; ++i)
    for (int m = 0; m < M; ++m) sums[m] += static_cast<float>(w[i]) * static_cast<float>(x[m * k + i]);
}

template <int M>
void run(const bf16* x, const bf16* weight, const bf16* bias, bf16* out, int64_t n, int64_t k) {
  // ~64 KiB of weights per task: enough to pay for the threads, fine enough to balance them
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, k));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float sums[M];
    for (int64_t j = begin; j < end; ++j) {
      // Prefetching a few rows ahead keeps more of the stream in flight than the
      // hardware prefetcher does alone: a 100m model's weights (200 MB, from DRAM)
      // went from ~22 to ~24 GB/s; weights that stay in L3 gain nothing measurable.
      if (j + kPrefetchRows < end)
        for (int64_t e = 0; e < k; e += 32) __builtin_prefetch(weight + (j + kPrefetchRows) * k + e, 0, 3);
      dot_rows<M>(weight + j * k, x, k, sums);
      const float b = bias != nullptr ? static_cast<float>(bias[j]) : 0.f;
      for (int m = 0; m < M; ++m) out[m * n + j] = static_cast<bf16>(sums[m] + b);
    }
  });
}

}  // namespace

// Whether this build has the AVX512-BF16 body; without it torch's matmul is the faster choice.
bool small_linear_bf16_fast() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

at::Tensor small_linear_bf16(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "small_linear_bf16: bfloat16 x and weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "small_linear_bf16: x [M, K], weight [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_linear_bf16: 1 to ", kMaxRows, " rows");
  auto xs = x.contiguous();
  auto w = weight.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kBFloat16).contiguous();
    TORCH_CHECK(b.numel() == w.size(0), "small_linear_bf16: one bias per output");
  }
  const int64_t m = xs.size(0), n = w.size(0), k = w.size(1);
  auto out = at::empty({m, n}, xs.options());
  const bf16* b_ptr = b.defined() ? b.data_ptr<bf16>() : nullptr;
  switch (m) {
    case 1: run<1>(xs.data_ptr<bf16>(), w.data_ptr<bf16>(), b_ptr, out.data_ptr<bf16>(), n, k); break;
    case 2: run<2>(xs.data_ptr<bf16>(), w.data_ptr<bf16>(), b_ptr, out.data_ptr<bf16>(), n, k); break;
    default: run<3>(xs.data_ptr<bf16>(), w.data_ptr<bf16>(), b_ptr, out.data_ptr<bf16>(), n, k); break;
  }
  return out;
}
