// Paged attention on the CPU, reading K and V in place from the block table.
//
// One task per (query token, KV head). The task scores every visible key for
// each of the query heads sharing that KV head (each key row read once), takes
// the softmax of the scores in one vectorised pass (exp over a whole row, not
// per key as an online softmax would), then accumulates the value rows (each
// read once) weighted by the probabilities.
// Shapes: query [T, H, D]; key_cache, value_cache [num_blocks, block_size, H_kv, D];
// block_table [B, max_blocks]; token_request [T] and token_position [T] say which
// request a query token belongs to and its position in that sequence.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

struct Layout {
  const float* keys;
  const float* values;
  const int64_t* blocks;  // this request's row of the block table
  int64_t block_size, row_stride, block_stride, head_offset;

  inline int64_t offset(int64_t j) const {
    return blocks[j / block_size] * block_stride + (j % block_size) * row_stride + head_offset;
  }
};

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// probabilities in place; returns their sum
inline float softmax_numerators(float* scores, int64_t n) {
  float m = scores[0];
  for (int64_t j = 1; j < n; ++j) m = std::max(m, scores[j]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - m);
    sum += scores[j];
  }
  return sum;
}

void attend(const Layout& kv, const float* q, float* out, int64_t first, int64_t last, int64_t group,
            int64_t head_size, float scale, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t n = last - first + 1;
  scores.resize(group * n);
  for (int64_t j = 0; j < n; ++j) {
    const float* k = kv.keys + kv.offset(first + j);
    for (int64_t g = 0; g < group; ++g) scores[g * n + j] = dot(q + g * head_size, k, head_size) * scale;
  }
  std::vector<float> inv(group);
  for (int64_t g = 0; g < group; ++g) inv[g] = 1.f / softmax_numerators(scores.data() + g * n, n);
  acc.assign(group * head_size, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = kv.values + kv.offset(first + j);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + j];
      float* a = acc.data() + g * head_size;
#pragma omp simd
      for (int64_t i = 0; i < head_size; ++i) a[i] += p * v[i];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < head_size; ++i) out[g * head_size + i] = acc[g * head_size + i] * inv[g];
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_table, torch::Tensor token_request,
                              torch::Tensor token_position, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "paged_attention: float32 only");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous());
  const int64_t tokens = query.size(0), heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads;
  auto out = torch::empty_like(query);
  auto table = block_table.contiguous();
  auto req = token_request.contiguous();
  auto pos = token_position.contiguous();
  const float* q_ptr = query.data_ptr<float>();
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  const int64_t* req_ptr = req.data_ptr<int64_t>();
  const int64_t* pos_ptr = pos.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t max_blocks = table.size(1);
  const int64_t row_stride = kv_heads * head_size;
  Layout base{key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), nullptr, block_size, row_stride,
              block_size * row_stride, 0};

  at::parallel_for(0, tokens * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / kv_heads, kv = task % kv_heads;
      Layout layout = base;
      layout.blocks = table_ptr + req_ptr[t] * max_blocks;
      layout.head_offset = kv * head_size;
      const int64_t last = pos_ptr[t];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, last - sliding_window + 1) : 0;
      const int64_t head0 = (t * heads + kv * group) * head_size;
      attend(layout, q_ptr + head0, out_ptr + head0, first, last, group, head_size, static_cast<float>(scale),
             scores, acc);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over a block table (float32, CPU)");
}
