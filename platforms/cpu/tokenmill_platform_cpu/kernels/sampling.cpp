// Temperature sampling for float32 logits on the CPU, one row at a time: the
// row's max, the sums of exp((x - max) / t) over 64-token chunks, then the
// inverse-CDF walk (over the chunk sums, then inside the one chunk it lands in).
// Two reads of each row and no [B, V] writes, where the torch version makes
// five passes over the whole batch and writes three.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 64;

int64_t sample_row(const float* x, int64_t v, float temperature, float uniform, std::vector<float>& chunk_sums) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < v; ++i) m = std::max(m, x[i]);
  const float inv_t = 1.f / temperature;
  const int64_t chunks = (v + kChunk - 1) / kChunk;
  chunk_sums.resize(chunks);
  float total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = std::min(v, (c + 1) * kChunk);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = c * kChunk; i < end; ++i) sum += std::exp((x[i] - m) * inv_t);
    chunk_sums[c] = sum;
    total += sum;
  }
  const float threshold = uniform * total;
  float before = 0.f;
  int64_t c = 0;
  while (c + 1 < chunks && before + chunk_sums[c] <= threshold) before += chunk_sums[c++];
  // Inside the chunk (its probabilities recomputed, the same way): the first token
  // whose cumulative mass exceeds the threshold. A zero-mass token never raises the
  // running sum, so it is never the one chosen.
  const int64_t begin = c * kChunk, end = std::min(v, begin + kChunk);
  float probs[kChunk];
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) probs[i - begin] = std::exp((x[i] - m) * inv_t);
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

}  // namespace

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
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> chunk_sums;
    for (int64_t r = begin; r < end; ++r) out_ptr[r] = sample_row(x_ptr + r * v, v, t_ptr[r], u_ptr[r], chunk_sums);
  });
  return out;
}
