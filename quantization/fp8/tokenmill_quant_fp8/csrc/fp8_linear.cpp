// The FP8 weight-only linear layer on a CPU with AVX-512 (or AVX2 with F16C: the same widening and
// sums on 8-lane vectors, in the section below): y[M, N] = x[M, K] @ W^T (+ bias),
// W[n, k] = fp8(weight[n, k]) * scales[n, k / group_size], from the checkpoint's own [N, K]
// float8_e4m3fn (or float8_e5m2) bytes: the weight stays one byte a value in memory and is widened
// in registers, 16 values at a time, never written out as floats.
//
// Widening without a table: an e5m2 byte is the high byte of a float16 (same exponent width and
// bias), so (byte << 8) is its float16 bits, NaN, inf and subnormals included. An e4m3 byte
// s.eeee.mmm sign-extended to 16 bits and shifted left by 7, with bit 14 cleared, is the float16
// s.0eeee.mmm0000000: the same digits with a float16 exponent bias of 15 instead of 7, that is the
// e4m3 value times 2^-8, subnormals included (both formats' subnormals sit below exponent field
// 1). vcvtph2ps widens the float16 exactly to float32, and the 2^8 is folded into the scale. The
// e4m3fn NaN codes (s.1111.111) come out as +-480 instead: a layer whose weight holds one is left
// to the torch path at load (tokenmill_quant_fp8/cpu_kernel.py), so no per-value test is paid here.
//
// Each product of a widened weight and a float32 x is summed in float32 per scale group (K for one
// scale a row; the block's columns for block-wise scales), the group's sum multiplied by its scale:
// the dequantised weight's product up to the order and rounding of the float32 sums. Activations
// are not quantized (x from bfloat16 or float16 is widened to float32 once per call).
//
// Blocking: panels of 8 output rows split over the threads; within one, 1 row of x at a time runs
// against all 8 weight rows (8 independent sums: decode is not one chain of FMAs), 2 or 3 rows of
// x against 4 weight rows at a time (the widened weights reused across the rows of x). Each weight row
// is only K bytes, too short a stream for the hardware prefetcher, so the rows 32 ahead are
// prefetched into L2 as these are read (in a decode step the weights come from DRAM: measured in
// the tiny Llama's step graph, 6.3 ms of fp8 kernels a step without, 4.0 ms with).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <tokenmill/parallel.h>  // tokenmill::parallel_for: the platform's pool where one is published

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TOKENMILL_FP8_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TOKENMILL_FP8_AVX2 1
#endif
#if defined(TOKENMILL_FP8_AVX512) || defined(TOKENMILL_FP8_AVX2)
#define TOKENMILL_FP8_KERNEL 1
#endif

namespace {

constexpr int64_t kPanel = 8;  // output rows one task of the thread pool computes
constexpr int kMaxRows = 3;    // rows of x sharing one pass over the widened weights
constexpr int64_t kPrefetchRows = 4 * kPanel;  // how far ahead (in weight rows) the loads are prefetched

#if defined(TOKENMILL_FP8_KERNEL)
struct Operands {
  const float* x;        // [M, K]
  const uint8_t* w;      // [N, K] fp8 codes
  const float* scales;   // [N, G]
  const float* bias;     // [N] or nullptr
  float* y;              // [M, N]
  int64_t m, k, n, groups, group_size;
  float unit;            // what the widened value is multiplied by: 2^8 for e4m3, 1 for e5m2
};
#endif

#if defined(TOKENMILL_FP8_AVX512)

// 16 fp8 codes as 16 float32 (an e4m3 value times 2^-8, an e5m2 value exactly).
template <bool E4M3>
inline __m512 widen(__m128i codes) {
  if constexpr (E4M3) {
    const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(shifted, _mm256_set1_epi16(static_cast<int16_t>(0xBF80))));
  } else {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 8));
  }
}

// 32 codes as two registers of 16 float32: one sign extension and shift for all 32 (the same
// widening as widen's, on a register twice the width).
template <bool E4M3>
inline void widen32(__m256i codes, __m512& lo, __m512& hi) {
  __m512i halves;
  if constexpr (E4M3) {
    halves = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(codes), 7),
                              _mm512_set1_epi16(static_cast<int16_t>(0xBF80)));
  } else {
    halves = _mm512_slli_epi16(_mm512_cvtepu8_epi16(codes), 8);
  }
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
}

// y[m0 .. m0 + Rows, n0 .. n0 + Outs) (the rows past N are computed on the last row, not stored).
template <bool E4M3, int Outs, int Rows>
void block(const Operands& op, int64_t n0, int64_t m0) {
  const uint8_t* w[Outs];
  const float* scale_row[Outs];
  for (int i = 0; i < Outs; ++i) {
    const int64_t row = std::min(n0 + i, op.n - 1);
    w[i] = op.w + row * op.k;
    scale_row[i] = op.scales + row * op.groups;
  }
  const float* x[Rows];
  for (int r = 0; r < Rows; ++r) x[r] = op.x + (m0 + r) * op.k;
  const int64_t ahead = kPrefetchRows * op.k;  // bytes from a weight row to the one prefetched for it
  __m512 total[Outs][Rows];
  for (int i = 0; i < Outs; ++i)
    for (int r = 0; r < Rows; ++r) total[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < op.groups; ++g) {
    const int64_t k0 = g * op.group_size, k1 = std::min(op.k, k0 + op.group_size);
    __m512 acc[Outs][Rows];
    for (int i = 0; i < Outs; ++i)
      for (int r = 0; r < Rows; ++r) acc[i][r] = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {  // 32 codes of each weight row widened in one register
      __m512 xlo[Rows], xhi[Rows];
      for (int r = 0; r < Rows; ++r) {
        xlo[r] = _mm512_loadu_ps(x[r] + k);
        xhi[r] = _mm512_loadu_ps(x[r] + k + 16);
      }
      if ((k & 63) == 0) {  // rows 32 on, one line each, into L2: short rows (K bytes) train no prefetcher
        for (int i = 0; i < Outs; ++i) _mm_prefetch(reinterpret_cast<const char*>(w[i] + ahead + k), _MM_HINT_T1);
      }
      for (int i = 0; i < Outs; ++i) {
        __m512 lo, hi;
        widen32<E4M3>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i] + k)), lo, hi);
        for (int r = 0; r < Rows; ++r) acc[i][r] = _mm512_fmadd_ps(hi, xhi[r], _mm512_fmadd_ps(lo, xlo[r], acc[i][r]));
      }
    }
    for (; k < k1; k += 16) {
      const int64_t left = k1 - k;
      const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      __m512 xv[Rows];
      for (int r = 0; r < Rows; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, x[r] + k);
      for (int i = 0; i < Outs; ++i) {
        const __m512 wv = widen<E4M3>(_mm_maskz_loadu_epi8(mask, w[i] + k));
        for (int r = 0; r < Rows; ++r) acc[i][r] = _mm512_fmadd_ps(wv, xv[r], acc[i][r]);
      }
    }
    for (int i = 0; i < Outs; ++i) {
      const __m512 scale = _mm512_set1_ps(scale_row[i][g] * op.unit);
      for (int r = 0; r < Rows; ++r) total[i][r] = _mm512_fmadd_ps(acc[i][r], scale, total[i][r]);
    }
  }
  const int outs = static_cast<int>(std::min<int64_t>(Outs, op.n - n0));
  for (int i = 0; i < outs; ++i) {
    const float bias = op.bias != nullptr ? op.bias[n0 + i] : 0.0f;
    for (int r = 0; r < Rows; ++r) op.y[(m0 + r) * op.n + n0 + i] = _mm512_reduce_add_ps(total[i][r]) + bias;
  }
}

template <bool E4M3>
void panel(const Operands& op, int64_t n0) {
  for (int64_t m0 = 0; m0 < op.m;) {
    const int64_t rows = std::min<int64_t>(kMaxRows, op.m - m0);
    if (rows == 1) {
      block<E4M3, 8, 1>(op, n0, m0);
    } else {
      for (int64_t n = n0; n < std::min(op.n, n0 + kPanel); n += 4)
        rows == 2 ? block<E4M3, 4, 2>(op, n, m0) : block<E4M3, 4, 3>(op, n, m0);
    }
    m0 += rows;
  }
}

#elif defined(TOKENMILL_FP8_AVX2)
// AVX2 (an AVX2-only CPU with F16C): the AVX-512 body's widening on 16-bit lanes of a 256-bit
// register, vcvtph2ps 8 values at a time. With 16 registers a row of x runs against 8 weight rows
// (8 sums, 2 registers of x a 16-value step), 2 rows against 4 (8 sums, 8-value steps); each
// group's sums are reduced and scaled into float totals (the AVX-512 body keeps them as vectors).

constexpr int kAvx2Rows = 2;  // rows of x sharing one pass over 4 widened weight rows

inline __m256 widen_halves(__m128i halves) { return _mm256_cvtph_ps(halves); }

// 16 fp8 codes as float16 bits in 16-bit lanes (e4m3: its value times 2^-8).
template <bool E4M3>
inline __m256i as_halves(__m128i codes) {
  if constexpr (E4M3) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7),
                            _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  } else {
    return _mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 8);
  }
}

// 16 codes as two registers of 8 float32.
template <bool E4M3>
inline void widen16(const uint8_t* w, __m256& lo, __m256& hi) {
  const __m256i halves = as_halves<E4M3>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  lo = widen_halves(_mm256_castsi256_si128(halves));
  hi = widen_halves(_mm256_extracti128_si256(halves, 1));
}

// 8 codes (the low 8 bytes) as 8 float32.
template <bool E4M3>
inline __m256 widen8(__m128i codes) {
  return widen_halves(_mm256_castsi256_si128(as_halves<E4M3>(codes)));
}

inline float reduce_add8(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}

// Up to 8 codes (zeros past `left`) without reading past them.
inline __m128i load_codes(const uint8_t* w, int64_t left) {
  if (left >= 8) return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  alignas(16) uint8_t part[16] = {};
  std::memcpy(part, w, static_cast<size_t>(left));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(part));
}

// Up to 8 float32 of x (zeros past `left`).
inline __m256 load_x(const float* x, int64_t left) {
  if (left >= 8) return _mm256_loadu_ps(x);
  const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(x, lanes);
}

// y[m0 .. m0 + Rows, n0 .. n0 + Outs) (the rows past N are computed on the last row, not stored).
template <bool E4M3, int Outs, int Rows>
void block(const Operands& op, int64_t n0, int64_t m0) {
  const uint8_t* w[Outs];
  const float* scale_row[Outs];
  for (int i = 0; i < Outs; ++i) {
    const int64_t row = std::min(n0 + i, op.n - 1);
    w[i] = op.w + row * op.k;
    scale_row[i] = op.scales + row * op.groups;
  }
  const float* x[Rows];
  for (int r = 0; r < Rows; ++r) x[r] = op.x + (m0 + r) * op.k;
  const int64_t ahead = kPrefetchRows * op.k;
  float total[Outs][Rows] = {};
  for (int64_t g = 0; g < op.groups; ++g) {
    const int64_t k0 = g * op.group_size, k1 = std::min(op.k, k0 + op.group_size);
    __m256 acc[Outs][Rows];
#pragma GCC unroll 8
    for (int i = 0; i < Outs; ++i)
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) acc[i][r] = _mm256_setzero_ps();
    int64_t k = k0;
    if constexpr (Rows == 1) {
      for (; k + 16 <= k1; k += 16) {  // 16 codes of each weight row widened at once
        const __m256 xlo = _mm256_loadu_ps(x[0] + k), xhi = _mm256_loadu_ps(x[0] + k + 8);
        if ((k & 63) == 0) {
#pragma GCC unroll 8
          for (int i = 0; i < Outs; ++i) _mm_prefetch(reinterpret_cast<const char*>(w[i] + ahead + k), _MM_HINT_T1);
        }
#pragma GCC unroll 8
        for (int i = 0; i < Outs; ++i) {
          __m256 lo, hi;
          widen16<E4M3>(w[i] + k, lo, hi);
          acc[i][0] = _mm256_fmadd_ps(hi, xhi, _mm256_fmadd_ps(lo, xlo, acc[i][0]));
        }
      }
    }
    for (; k < k1; k += 8) {
      const int64_t left = k1 - k;
      __m256 xv[Rows];
#pragma GCC unroll 4
      for (int r = 0; r < Rows; ++r) xv[r] = load_x(x[r] + k, left);
      if (Rows > 1 && (k & 63) == 0) {
#pragma GCC unroll 8
        for (int i = 0; i < Outs; ++i) _mm_prefetch(reinterpret_cast<const char*>(w[i] + ahead + k), _MM_HINT_T1);
      }
#pragma GCC unroll 8
      for (int i = 0; i < Outs; ++i) {
        const __m256 wv = widen8<E4M3>(load_codes(w[i] + k, left));
#pragma GCC unroll 4
        for (int r = 0; r < Rows; ++r) acc[i][r] = _mm256_fmadd_ps(wv, xv[r], acc[i][r]);
      }
    }
    for (int i = 0; i < Outs; ++i)
      for (int r = 0; r < Rows; ++r) total[i][r] += reduce_add8(acc[i][r]) * (scale_row[i][g] * op.unit);
  }
  const int outs = static_cast<int>(std::min<int64_t>(Outs, op.n - n0));
  for (int i = 0; i < outs; ++i) {
    const float bias = op.bias != nullptr ? op.bias[n0 + i] : 0.0f;
    for (int r = 0; r < Rows; ++r) op.y[(m0 + r) * op.n + n0 + i] = total[i][r] + bias;
  }
}

template <bool E4M3>
void panel(const Operands& op, int64_t n0) {
  for (int64_t m0 = 0; m0 < op.m;) {
    const int64_t rows = std::min<int64_t>(kAvx2Rows, op.m - m0);
    if (rows == 1) {
      block<E4M3, 8, 1>(op, n0, m0);
    } else {
      for (int64_t n = n0; n < std::min(op.n, n0 + kPanel); n += 4) block<E4M3, 4, 2>(op, n, m0);
    }
    m0 += rows;
  }
}
#endif

#if defined(TOKENMILL_FP8_KERNEL)
template <bool E4M3>
void product(const Operands& op) {
  const int64_t panels = (op.n + kPanel - 1) / kPanel;
  tokenmill::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) panel<E4M3>(op, p * kPanel);
  });
}
#endif  // TOKENMILL_FP8_KERNEL

void check_operands(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                    int64_t group_size, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "fp8_linear: x must be a contiguous CPU [M, K]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
              "fp8_linear: x must be float32, bfloat16 or float16, not ", dtype);
  const auto format = weight.scalar_type();
  TORCH_CHECK(format == at::ScalarType::Float8_e4m3fn || format == at::ScalarType::Float8_e5m2,
              "fp8_linear: weight must be float8_e4m3fn or float8_e5m2, not ", format);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "fp8_linear: weight must be a contiguous [N, ", x.size(1), "]");
  TORCH_CHECK(group_size > 0, "fp8_linear: group_size must be positive, not ", group_size);
  const int64_t n = weight.size(0), groups = (x.size(1) + group_size - 1) / group_size;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == std::max<int64_t>(groups, 1) &&
                  scales.scalar_type() == torch::kFloat32 && scales.is_contiguous(),
              "fp8_linear: scales must be a contiguous float32 [", n, ", ", std::max<int64_t>(groups, 1), "]");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous(),
                "fp8_linear: bias must be a contiguous float32 [N]");
  }
}

torch::Tensor& fp8_linear_out(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                              int64_t group_size, const c10::optional<torch::Tensor>& bias, torch::Tensor& out) {
  check_operands(x, weight, scales, group_size, bias);
  const int64_t m = x.size(0), n = weight.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.scalar_type() == x.scalar_type() &&
                  out.is_contiguous(),
              "fp8_linear: out must be a contiguous [", m, ", ", n, "] of x's dtype");
#if defined(TOKENMILL_FP8_KERNEL)
  if (m == 0 || n == 0) return out;
  if (x.size(1) == 0) {
    bias.has_value() ? out.copy_(bias->unsqueeze(0).expand({m, n})) : out.zero_();
    return out;
  }
  const torch::Tensor xf = x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32);
  const bool in_place = out.scalar_type() == torch::kFloat32;
  torch::Tensor y = in_place ? out : torch::empty({m, n}, x.options().dtype(torch::kFloat32));
  const bool e4m3 = weight.scalar_type() == at::ScalarType::Float8_e4m3fn;
  const Operands op{xf.data_ptr<float>(), static_cast<const uint8_t*>(weight.data_ptr()), scales.data_ptr<float>(),
                    bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
                    m, x.size(1), n, scales.size(1), group_size, e4m3 ? 256.0f : 1.0f};
  e4m3 ? product<true>(op) : product<false>(op);
  if (!in_place) out.copy_(y);  // round to nearest even into bfloat16 / float16
#else
  TORCH_CHECK(false, "fp8_linear: this build has no vector kernel: the CPU has neither AVX-512 F/BW/VL nor AVX2 "
                     "with F16C (isa() is 'none')");
#endif
  return out;
}

torch::Tensor fp8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                         int64_t group_size, const c10::optional<torch::Tensor>& bias) {
  auto out = torch::empty({x.size(0), weight.size(0)}, x.options());
  fp8_linear_out(x, weight, scales, group_size, bias, out);
  return out;
}

std::string isa() {
#if defined(TOKENMILL_FP8_AVX512)
  return "avx512";
#elif defined(TOKENMILL_FP8_AVX2)
  return "avx2";
#else
  return "none";
#endif
}

}  // namespace

// torch.ops.tokenmill_fp8.fp8_linear and its .out overload: the CPU platform's step-graph capture
// records a call of the functional op as one of .out into a pooled buffer.
TORCH_LIBRARY(tokenmill_fp8, m) {
  m.def("fp8_linear(Tensor x, Tensor weight, Tensor scales, int group_size, Tensor? bias) -> Tensor");
  m.def("fp8_linear.out(Tensor x, Tensor weight, Tensor scales, int group_size, Tensor? bias, *, "
        "Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(tokenmill_fp8, CPU, m) {
  m.impl("fp8_linear", &fp8_linear);
  m.impl("fp8_linear.out", &fp8_linear_out);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction set the kernel was built for ('none': neither AVX-512 F/BW/VL nor AVX2)");
}
