// Batched LoRA on a linear layer's output, float32: out[t] += B_s (A_s x[t]) for each token t
// whose adapter slot s = token_slots[t] is not -1 (-1: the base model, left untouched).
//
// A and B are a wrapped layer's slot-stacked matrices (tokenmill.lora.layers): lora_a
// [num_slots * C, K] (slot s owns rows s*C .. s*C+C, C = slices * rank), lora_b_t
// [num_slots * C, N] (B transposed, so a rank row's output columns are contiguous). A merged
// layer's output slices (offset, size) each take their own `rank` rows of the slot's C: the
// expand touches only the slice's columns, not the zeros of a block-diagonal B.
//
// Why a kernel: a decode step of 32 requests on 4 adapters runs this on every wrapped layer
// (32 in an 8-layer Llama). As torch ops from Python (gather, two grouped matmuls, index_add)
// such small calls cost more than their arithmetic (docs/benchmarks.md, "LoRA adapters"); and
// torch ops cannot be replayed by a step graph (step_graph.cpp), which records this kernel
// instead, so LoRA steps keep their step graphs. The slots tensor is read at every run: a
// replay sees the slots the caller wrote into it since.
//
// Tokens are grouped by slot in blocks of four: with AVX-512, four A rows meet the four tokens
// at once (16 accumulators: each loaded vector feeds four multiply-adds), and 64 output columns
// of the four stay in registers across the rank rows of B (each B vector loaded once for the
// four); without it, loops the compiler vectorises. The blocks run in parallel
// (tokenmill::parallel_for); each writes only its own tokens' rows.
#include <ATen/ATen.h>

#include "thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kBlock = 4;            // tokens of one slot computed together
constexpr int64_t kOutChunk = 256;   // output columns per pass (a block's rows stay in L1)

struct Block {
  int64_t slot;
  int count;
  int64_t tokens[kBlock];
};

// y[b * y_stride + c] = A[c] . x_b for the block's (up to four) tokens; x[b] repeats x[0] past count.
void shrink(const float* a, int64_t columns, int64_t k, const float* const (&x)[kBlock], float* y, int64_t y_stride) {
  const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
  for (int64_t c = 0; c < columns; ++c) {
    const float* row = a + c * k;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < k; ++i) {
      const float w = row[i];
      s0 += w * x0[i];
      s1 += w * x1[i];
      s2 += w * x2[i];
      s3 += w * x3[i];
    }
    y[c] = s0;
    y[y_stride + c] = s1;
    y[2 * y_stride + c] = s2;
    y[3 * y_stride + c] = s3;
  }
}

// out_b[offset + o] += sum_j y_b[j] * Bt[j][offset + o] over the slice's rank rows, for o in [start, size)
void expand(const float* bt, int64_t n, int64_t rank, int64_t offset, int64_t size, const float* y,
            int64_t columns, int count, float* const (&out)[kBlock], int64_t start = 0) {
  for (int64_t o0 = start; o0 < size; o0 += kOutChunk) {
    const int64_t len = std::min(kOutChunk, size - o0);
    for (int b = 0; b < count; ++b) {
      float* row = out[b] + offset + o0;
      const float* yb = y + b * columns;
      for (int64_t j = 0; j < rank; ++j) {
        const float coefficient = yb[j];
        if (coefficient == 0.f) continue;  // a smaller rank's zero padding (NaN still goes through)
        const float* b_row = bt + j * n + offset + o0;
#pragma omp simd
        for (int64_t o = 0; o < len; ++o) row[o] += coefficient * b_row[o];
      }
    }
  }
}

#ifdef __AVX512F__
// As shrink, with AVX-512: four A rows against the four tokens at once (16 accumulators), so
// each loaded vector feeds four multiply-adds.
void shrink_avx512(const float* a, int64_t columns, int64_t k, const float* const (&x)[kBlock], float* y) {
  int64_t c = 0;
  for (; c + 4 <= columns; c += 4) {
    __m512 acc[4][kBlock];
    for (auto& row : acc)
      for (auto& v : row) v = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
      __m512 xv[kBlock];
      for (int b = 0; b < kBlock; ++b) xv[b] = _mm512_loadu_ps(x[b] + i);
      for (int r = 0; r < 4; ++r) {
        const __m512 w = _mm512_loadu_ps(a + (c + r) * k + i);
        for (int b = 0; b < kBlock; ++b) acc[r][b] = _mm512_fmadd_ps(w, xv[b], acc[r][b]);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int b = 0; b < kBlock; ++b) {
        float sum = _mm512_reduce_add_ps(acc[r][b]);
        for (int64_t tail = i; tail < k; ++tail) sum += a[(c + r) * k + tail] * x[b][tail];
        y[b * columns + c + r] = sum;
      }
  }
  if (c < columns) shrink(a + c * k, columns - c, k, x, y + c, columns);
}

// As expand, with AVX-512: 64 output columns of the four tokens held in registers across the
// slice's rank rows, each B vector loaded once for the four.
void expand_avx512(const float* bt, int64_t n, int64_t rank, int64_t offset, int64_t size, const float* y,
                   int64_t columns, int count, float* const (&out)[kBlock]) {
  constexpr int kVectors = 4;
  int64_t o = 0;
  for (; o + 16 * kVectors <= size; o += 16 * kVectors) {
    __m512 acc[kBlock][kVectors];
    for (int b = 0; b < kBlock; ++b)
      for (int v = 0; v < kVectors; ++v)
        acc[b][v] = b < count ? _mm512_loadu_ps(out[b] + offset + o + 16 * v) : _mm512_setzero_ps();
    for (int64_t j = 0; j < rank; ++j) {
      bool any = false;
      for (int b = 0; b < count; ++b) any |= y[b * columns + j] != 0.f;
      if (!any) continue;  // a smaller rank's zero padding
      const float* b_row = bt + j * n + offset + o;
      __m512 bv[kVectors];
      for (int v = 0; v < kVectors; ++v) bv[v] = _mm512_loadu_ps(b_row + 16 * v);
      for (int b = 0; b < kBlock; ++b) {
        const __m512 coefficient = _mm512_set1_ps(y[b * columns + j]);
        for (int v = 0; v < kVectors; ++v) acc[b][v] = _mm512_fmadd_ps(coefficient, bv[v], acc[b][v]);
      }
    }
    for (int b = 0; b < count; ++b)
      for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(out[b] + offset + o + 16 * v, acc[b][v]);
  }
  if (o < size) expand(bt, n, rank, offset, size, y, columns, count, out, o);
}
#endif

// The vector bodies where the build has AVX-512, else the loops the compiler vectorises as it can.
void shrink_block(const float* a, int64_t columns, int64_t k, const float* const (&x)[kBlock], float* y) {
#ifdef __AVX512F__
  shrink_avx512(a, columns, k, x, y);
#else
  shrink(a, columns, k, x, y, columns);
#endif
}

void expand_block(const float* bt, int64_t n, int64_t rank, int64_t offset, int64_t size, const float* y,
                  int64_t columns, int count, float* const (&out)[kBlock]) {
#ifdef __AVX512F__
  expand_avx512(bt, n, rank, offset, size, y, columns, count, out);
#else
  expand(bt, n, rank, offset, size, y, columns, count, out);
#endif
}

std::vector<Block> slot_blocks(const int32_t* slots, int64_t tokens, int64_t num_slots) {
  std::vector<std::vector<int64_t>> by_slot(num_slots);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    TORCH_CHECK(s < num_slots, "lora_delta_: token ", t, " has slot ", s, " of ", num_slots);
    by_slot[s].push_back(t);
  }
  std::vector<Block> blocks;
  for (int64_t s = 0; s < num_slots; ++s)
    for (size_t first = 0; first < by_slot[s].size(); first += kBlock) {
      Block block{s, static_cast<int>(std::min<size_t>(kBlock, by_slot[s].size() - first)), {}};
      for (int b = 0; b < block.count; ++b) block.tokens[b] = by_slot[s][first + b];
      blocks.push_back(block);
    }
  return blocks;
}

}  // namespace

// In place on out [T, N] (rows may be strided, columns contiguous); slices: (offset, size) per
// output slice, flattened.
void lora_delta_out(const at::Tensor& x, at::Tensor& out, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
                    const at::Tensor& token_slots, int64_t num_slots, const std::vector<int64_t>& slices) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && lora_a.scalar_type() == at::kFloat &&
                  lora_b_t.scalar_type() == at::kFloat,
              "lora_delta_: float32 tensors");
  TORCH_CHECK(token_slots.scalar_type() == at::kInt && token_slots.dim() == 1 && token_slots.is_contiguous(),
              "lora_delta_: token_slots is a contiguous int32 [T]");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && token_slots.size(0) == x.size(0),
              "lora_delta_: x [T, K], out [T, N], token_slots [T]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "lora_delta_: x and out need contiguous rows");
  TORCH_CHECK(lora_a.is_contiguous() && lora_b_t.is_contiguous() && lora_a.size(1) == x.size(1) &&
                  lora_b_t.size(1) == out.size(1) && lora_a.size(0) == lora_b_t.size(0),
              "lora_delta_: lora_a [S*C, K], lora_b_t [S*C, N], contiguous");
  TORCH_CHECK(num_slots > 0 && lora_a.size(0) % num_slots == 0, "lora_delta_: lora_a's rows are num_slots blocks");
  TORCH_CHECK(!slices.empty() && slices.size() % 2 == 0, "lora_delta_: slices are (offset, size) pairs");
  const int64_t n_slices = static_cast<int64_t>(slices.size()) / 2;
  const int64_t columns = lora_a.size(0) / num_slots, k = x.size(1), n = out.size(1);
  TORCH_CHECK(columns % n_slices == 0, "lora_delta_: each slice has rank rows per slot");
  const int64_t rank = columns / n_slices;
  for (int64_t i = 0; i < n_slices; ++i)
    TORCH_CHECK(slices[2 * i] >= 0 && slices[2 * i + 1] >= 0 && slices[2 * i] + slices[2 * i + 1] <= n,
                "lora_delta_: slice ", i, " lies outside the output");

  const std::vector<Block> blocks = slot_blocks(token_slots.data_ptr<int32_t>(), x.size(0), num_slots);
  if (blocks.empty()) return;  // no adapter token: the base output as it is
  const float* xs = x.data_ptr<float>();
  float* outs = out.data_ptr<float>();
  const float* a = lora_a.data_ptr<float>();
  const float* bt = lora_b_t.data_ptr<float>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  // enough multiply-adds per task to pay for the threads (~256k, as the other kernels' grains),
  // and a slot's blocks together where there are slots enough for the threads: the blocks of one
  // slot read the same A and B, which a second thread would read from memory again (the step's
  // adapters are ~10% of the weights a tiny Llama's decode step reads, at 4 x rank 16 on every projection)
  const int64_t per_block = kBlock * (columns * k + rank * n);
  int64_t slots_used = 0;
  for (size_t i = 0; i < blocks.size(); ++i) slots_used += i == 0 || blocks[i].slot != blocks[i - 1].slot;
  const int64_t parts = std::max<int64_t>(slots_used, tokenmill::pool_threads());
  const int64_t per_part = static_cast<int64_t>(blocks.size()) / parts;
  const int64_t grain = std::max<int64_t>({1, (int64_t{1} << 18) / std::max<int64_t>(1, per_block), per_part});
  tokenmill::parallel_for(0, static_cast<int64_t>(blocks.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> y(kBlock * columns);
    for (int64_t index = begin; index < end; ++index) {
      const Block& block = blocks[index];
      const float* rows[kBlock];
      float* targets[kBlock];
      for (int b = 0; b < kBlock; ++b) {
        const int64_t t = block.tokens[b < block.count ? b : 0];
        rows[b] = xs + t * x_stride;
        targets[b] = outs + t * out_stride;
      }
      shrink_block(a + block.slot * columns * k, columns, k, rows, y.data());
      for (int64_t i = 0; i < n_slices; ++i)
        expand_block(bt + (block.slot * columns + i * rank) * n, n, rank, slices[2 * i], slices[2 * i + 1],
                     y.data() + i * rank, columns, block.count, targets);
    }
  });
}

at::Tensor lora_delta_(at::Tensor x, at::Tensor out, at::Tensor lora_a, at::Tensor lora_b_t, at::Tensor token_slots,
                       int64_t num_slots, std::vector<int64_t> slices) {
  lora_delta_out(x, out, lora_a, lora_b_t, token_slots, num_slots, slices);
  return out;
}
