// Fused layer ops for the CPU: RMSNorm (alone and after the residual add),
// SiLU-and-multiply and the rotary embedding, for float32 and bfloat16 tensors
// (bfloat16 is widened to float32 for the arithmetic and rounded once on the way
// out; the rotary tables stay float32). Each is one pass over its rows instead
// of the five to eight torch ops (and temporaries) of the reference in
// tokenmill.layers.ops, which at decode batch sizes cost more in dispatch than
// in arithmetic. Rows are spread over threads only when there are enough of
// them to pay for waking the threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vector_expf.h"

namespace {

// Rows per task: at least ~16K elements of work.
inline int64_t grain(int64_t row_length) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_length)); }

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// float32 into T, rounding to nearest even as c10's conversion does (a NaN becomes 0x7FC0), but
// without its branch: c10's scalar conversion kept every bfloat16 loop here from vectorising
// (a 64 x 512 add-and-norm took ~50 us, ~5x the float32 one).
template <typename T>
inline T narrow(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>, "narrow: float32 or bfloat16");
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
  }
}

// Runs fn with a value of the element type of `dtype` (float or c10::BFloat16).
template <typename Fn>
void with_element_type(const at::Tensor& t, const char* name, Fn fn) {
  TORCH_CHECK(t.device().is_cpu(), name, ": CPU tensors only");
  if (t.scalar_type() == at::kFloat) return fn(float{});
  if (t.scalar_type() == at::kBFloat16) return fn(c10::BFloat16{});
  TORCH_CHECK(false, name, ": float32 or bfloat16 tensors only");
}

void check_same_type(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), name, ": tensors of one dtype");
}

// out = weight * (x / sqrt(mean(x^2) + eps)), the reference's order of operations
template <typename T>
inline void norm_row(const T* x, const T* weight, T* out, int64_t d, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < d; ++i) squares += widen(x[i]) * widen(x[i]);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = narrow<T>(widen(weight[i]) * (widen(x[i]) * inv));
}

}  // namespace

// The *_out forms write into a given contiguous tensor of the result's shape and dtype:
// a step graph replays them on its own buffers.
void rms_norm_out(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_same_type(x, weight, "rms_norm");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.sizes() == x.sizes(),
              "rms_norm: out must be a contiguous tensor of x's shape and dtype");
  const int64_t d = x.size(-1);
  auto rows = x.reshape({-1, d}).contiguous();
  auto w = weight.contiguous();
  with_element_type(x, "rms_norm", [&](auto element) {
    using T = decltype(element);
    const T* in_ptr = rows.data_ptr<T>();
    const T* w_ptr = w.data_ptr<T>();
    T* out_ptr = out.data_ptr<T>();
    tokenmill::parallel_for(0, rows.size(0), grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(in_ptr + r * d, w_ptr, out_ptr + r * d, d, static_cast<float>(eps));
    });
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  auto out = at::empty(x.sizes(), x.options());
  rms_norm_out(x, weight, eps, out);
  return out;
}

// residual += x, then x = rms_norm(residual), both in place; returns x.
at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_same_type(x, residual, "add_rms_norm_");
  check_same_type(x, weight, "add_rms_norm_");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(),
              "add_rms_norm_: contiguous tensors of one shape");
  const int64_t d = x.size(-1), n = x.numel() / d;
  auto w = weight.contiguous();
  with_element_type(x, "add_rms_norm_", [&](auto element) {
    using T = decltype(element);
    T* x_ptr = x.data_ptr<T>();
    T* res_ptr = residual.data_ptr<T>();
    const T* w_ptr = w.data_ptr<T>();
    tokenmill::parallel_for(0, n, grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* res = res_ptr + r * d;
        T* row = x_ptr + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) res[i] = narrow<T>(widen(res[i]) + widen(row[i]));
        norm_row(res, w_ptr, row, d, static_cast<float>(eps));
      }
    });
  });
  return x;
}

// [T, 2I] -> [T, I]: silu(first half) * second half
void silu_and_mul_out(const at::Tensor& x, at::Tensor& out) {
  auto in = x.contiguous();
  const int64_t width = in.size(-1), half = width / 2, n = in.numel() / width;
  auto sizes = in.sizes().vec();
  sizes.back() = half;
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.sizes() == at::IntArrayRef(sizes),
              "silu_and_mul: out must be a contiguous [..., I] tensor of x's dtype");
  with_element_type(x, "silu_and_mul", [&](auto element) {
    using T = decltype(element);
    const T* in_ptr = in.data_ptr<T>();
    T* out_ptr = out.data_ptr<T>();
    tokenmill::parallel_for(0, n, grain(width), [&](int64_t begin, int64_t end) {
      std::vector<float> wide;  // bfloat16: the row widened, so that the exp loop vectorises
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = in_ptr + r * width;
        T* o = out_ptr + r * half;
        const float* g32;
        float* o32;
        if constexpr (std::is_same_v<T, float>) {
          g32 = gate;
          o32 = o;
        } else {
          wide.resize(width);
#pragma omp simd
          for (int64_t i = 0; i < width; ++i) wide[i] = widen(gate[i]);
          g32 = wide.data();
          o32 = wide.data();  // written over the gate half as it is read, element by element
        }
        const float* u32 = g32 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) o32[i] = g32[i] / (1.f + std::exp(-g32[i])) * u32[i];
        if constexpr (!std::is_same_v<T, float>)
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) o[i] = narrow<T>(o32[i]);
      }
    });
  });
}

at::Tensor silu_and_mul(at::Tensor x) {
  auto sizes = x.sizes().vec();
  TORCH_CHECK(!sizes.empty(), "silu_and_mul: x must have a last dimension");
  sizes.back() /= 2;
  auto out = at::empty(sizes, x.options());
  silu_and_mul_out(x, out);
  return out;
}

namespace {

// Rotates every head of one token in place (GPT-NeoX layout: the two halves of
// the head are the pair), with cos/sin rows that repeat their first half.
template <typename T>
inline void rotate_token(T* x, int64_t heads, int64_t head_stride, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + h * head_stride;
    T* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = widen(x1[i]), b = widen(x2[i]);
      x1[i] = narrow<T>(a * cos[i] - b * sin[i]);
      x2[i] = narrow<T>(b * cos[half + i] + a * sin[half + i]);
    }
  }
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name, ": [tokens, heads, head_size] with contiguous heads");
}

}  // namespace

// q [T, H, D] and k [T, H_kv, D] (token stride free, e.g. views of the fused
// qkv output) rotated in place at positions [T]; cos/sin tables float32.
void rotary_embedding_(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache,
                       at::Tensor sin_cache) {
  check_heads(q, "rotary_embedding_ q");
  check_heads(k, "rotary_embedding_ k");
  check_same_type(q, k, "rotary_embedding_");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat,
              "rotary_embedding_: float32 cos/sin tables");
  auto pos = positions.contiguous();
  auto cos_c = cos_cache.contiguous();
  auto sin_c = sin_cache.contiguous();
  const int64_t d = q.size(2);
  const int64_t* pos_ptr = pos.data_ptr<int64_t>();
  const float* cos_ptr = cos_c.data_ptr<float>();
  const float* sin_ptr = sin_c.data_ptr<float>();
  const int64_t q_heads = q.size(1), k_heads = k.size(1);
  with_element_type(q, "rotary_embedding_", [&](auto element) {
    using T = decltype(element);
    T* q_ptr = q.data_ptr<T>();
    T* k_ptr = k.data_ptr<T>();
    tokenmill::parallel_for(0, q.size(0), grain((q_heads + k_heads) * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cos_ptr + pos_ptr[t] * d;
        const float* sin = sin_ptr + pos_ptr[t] * d;
        rotate_token(q_ptr + t * q.stride(0), q_heads, q.stride(1), d, cos, sin);
        rotate_token(k_ptr + t * k.stride(0), k_heads, k.stride(1), d, cos, sin);
      }
    });
  });
}
