// y[M, N] = x[M, K] @ W[N, K]^T with W in ggml's Q4_0 / Q4_1 / Q8_0 blocks, as the file stores them.
//
// Each block of 32 weights is dequantised in registers right before the multiply-adds that
// use it, so the weight is read once, in its 4.5 / 5 / 8.5 bits per value, and no float copy
// is ever written. Rows of W are split over torch's intra-op threads; x is walked in tiles
// of up to kTileRows rows so that the accumulators stay in registers and a block is
// dequantised once per tile. Block layouts (little-endian, packed, no padding):
//   Q4_0: f16 d, u8 qs[16]          w[j] = d * ((qs[j % 16] >> 4 * (j >= 16)) & 15) - 8 * d
//   Q4_1: f16 d, f16 m, u8 qs[16]   w[j] = d * nibble + m
//   Q8_0: f16 d, i8 qs[32]          w[j] = d * qs[j]
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kTileRows = 8;
enum GGMLType : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

int block_bytes(int type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: return 0;
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

#if defined(__AVX512F__)
// The block's 32 weights as two vectors of 16 floats.
template <int Type>
inline void dequantize_block(const uint8_t* block, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(half_at(block));
  if constexpr (Type == Q8_0) {
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(block + 2)))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(block + 18)))));
  } else {
    const uint8_t* qs = block + (Type == Q4_1 ? 4 : 2);
    const __m128i packed = _mm_loadu_si128((const __m128i*)qs);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, mask)));
    const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), mask)));
    if constexpr (Type == Q4_1) {
      const __m512 m = _mm512_set1_ps(half_at(block + 2));
      lo = _mm512_fmadd_ps(d, q_lo, m);
      hi = _mm512_fmadd_ps(d, q_hi, m);
    } else {
      const __m512 eight = _mm512_set1_ps(8.0f);
      lo = _mm512_mul_ps(d, _mm512_sub_ps(q_lo, eight));
      hi = _mm512_mul_ps(d, _mm512_sub_ps(q_hi, eight));
    }
  }
}

// y[m, n] for rows m0 .. m0 + rows of x and one weight row.
template <int Type>
void dot_tile(const float* x, int64_t ldx, int64_t rows, const uint8_t* wrow, int64_t blocks, float* y, int64_t ldy) {
  __m512 acc[kTileRows][2];
  for (int r = 0; r < kTileRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  constexpr int bytes = Type == Q8_0 ? 34 : (Type == Q4_1 ? 20 : 18);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 w_lo, w_hi;
    dequantize_block<Type>(wrow + b * bytes, w_lo, w_hi);
    const float* xb = x + b * kBlock;
    for (int r = 0; r < kTileRows; ++r) {
      if (r >= rows) break;
      acc[r][0] = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(xb + r * ldx), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(xb + r * ldx + 16), acc[r][1]);
    }
  }
  for (int r = 0; r < rows; ++r) y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
const char* kIsa = "avx512";
#else
// Portable: the block into 32 floats on the stack (the compiler vectorises both loops).
template <int Type>
inline void dequantize_block(const uint8_t* block, float* w) {
  const float d = half_at(block);
  if constexpr (Type == Q8_0) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < kBlock; ++j) w[j] = d * qs[j];
  } else {
    const uint8_t* qs = block + (Type == Q4_1 ? 4 : 2);
    const float m = Type == Q4_1 ? half_at(block + 2) : -8.0f * d;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * (qs[j] & 15) + m;
      w[j + 16] = d * (qs[j] >> 4) + m;
    }
  }
}

template <int Type>
void dot_tile(const float* x, int64_t ldx, int64_t rows, const uint8_t* wrow, int64_t blocks, float* y, int64_t ldy) {
  float acc[kTileRows][kBlock] = {};
  constexpr int bytes = Type == Q8_0 ? 34 : (Type == Q4_1 ? 20 : 18);
  for (int64_t b = 0; b < blocks; ++b) {
    float w[kBlock];
    dequantize_block<Type>(wrow + b * bytes, w);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xb = x + r * ldx + b * kBlock;
      for (int j = 0; j < kBlock; ++j) acc[r][j] += w[j] * xb[j];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.0f;
    for (int j = 0; j < kBlock; ++j) sum += acc[r][j];
    y[r * ldy] = sum;
  }
}
const char* kIsa = "generic C++";
#endif

template <int Type>
void matmul(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_stride, float* y) {
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, M - m0);
      for (int64_t n = begin; n < end; ++n) {
        dot_tile<Type>(x + m0 * K, K, rows, w + n * row_stride, blocks, y + m0 * N + n, N);
      }
    }
  });
}

torch::Tensor gguf_matmul(const torch::Tensor& x, const torch::Tensor& qweight, int64_t type, int64_t in_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "gguf_matmul: x must be a contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) == in_features, "gguf_matmul: x has ", x.size(1), " features, the weight ", in_features);
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kUInt8 && qweight.is_contiguous(),
              "gguf_matmul: qweight must be contiguous uint8 [N, bytes per row]");
  const int bytes = block_bytes(static_cast<int>(type));
  TORCH_CHECK(bytes > 0, "gguf_matmul: ggml type ", type, " has no kernel (Q4_0, Q4_1, Q8_0 do)");
  TORCH_CHECK(in_features % kBlock == 0 && qweight.size(1) == in_features / kBlock * bytes,
              "gguf_matmul: rows of ", qweight.size(1), " bytes do not hold ", in_features, " values of type ", type);
  const int64_t M = x.size(0), N = qweight.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (type) {
    case Q4_0: matmul<Q4_0>(xp, M, in_features, wp, N, qweight.size(1), yp); break;
    case Q4_1: matmul<Q4_1>(xp, M, in_features, wp, N, qweight.size(1), yp); break;
    default: matmul<Q8_0>(xp, M, in_features, wp, N, qweight.size(1), yp); break;
  }
  return y;
}

std::string isa() { return kIsa; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_matmul", &gguf_matmul, "x @ dequantize(qweight).T for Q4_0/Q4_1/Q8_0 block rows (float32)");
  m.def("isa", &isa, "the instruction set the kernel was built for");
}
