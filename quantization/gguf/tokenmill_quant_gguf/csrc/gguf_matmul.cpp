// y[M, N] = x[M, K] @ W[N, K]^T with W in ggml's Q4_0 / Q4_1 / Q8_0 blocks (AVX-512 intrinsics),
// or Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks (portable loops), as the file stores them.
//
// Each block of 32 weights is dequantised in registers right before the multiply-adds that
// use it, so the weight is read once, in its 4.5 / 5 / 8.5 bits per value, and no float copy
// is ever written. Rows of W are split over torch's intra-op threads; x is walked in tiles
// of up to kTileRows rows so that the accumulators stay in registers and a block is
// dequantised once per tile. Block layouts (little-endian, packed, no padding):
//   Q4_0: f16 d, u8 qs[16]          w[j] = d * ((qs[j % 16] >> 4 * (j >= 16)) & 15) - 8 * d
//   Q4_1: f16 d, f16 m, u8 qs[16]   w[j] = d * nibble + m
//   Q8_0: f16 d, i8 qs[32]          w[j] = d * qs[j]
//   Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: see dequantize_values below (and kquants.py / blocks.py).
// The portable path decodes one block into floats on the stack, then multiplies it by every
// row of the tile; its loops are plain C++ that -march=native vectorises for the CPU the
// kernel is built on (AVX-512 or AVX2; the build is keyed by the CPU's flags).
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
enum GGMLType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

int block_bytes(int type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

constexpr int block_values(int type) { return type == Q4_K || type == Q5_K || type == Q6_K ? 256 : 32; }

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

// ---- The portable path: Q5_0, Q5_1 and the K-quants -------------------------------------

// Q4_K / Q5_K's 6-bit scale and min of sub-block j from their 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* q, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The block_values(Type) weights of one block, into w.
template <int Type>
inline void dequantize_values(const uint8_t* block, float* w) {
  if constexpr (Type == Q5_0 || Type == Q5_1) {
    // f16 d, [f16 m,] u32 qh, u8 qs[16]: w[j] = d * (nibble | fifth bit << 4) + m (m = -16 d for Q5_0)
    const float d = half_at(block);
    const float m = Type == Q5_1 ? half_at(block + 2) : -16.0f * d;
    const uint8_t* rest = block + (Type == Q5_1 ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, rest, 4);
    const uint8_t* qs = rest + 4;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>((qs[j] & 15) | (((qh >> j) & 1) << 4)) + m;
      w[j + 16] = d * static_cast<float>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
    }
  } else if constexpr (Type == Q4_K || Type == Q5_K) {
    // f16 d, f16 dmin, u8 scales[12], [u8 qh[32],] u8 qs[128]; 8 sub-blocks of 32:
    // w = d * scale_j * q - dmin * min_j, q the nibble of bytes 32 * (j / 2) .. (high ones for odd j).
    const float d = half_at(block), dmin = half_at(block + 2);
    const uint8_t* scales = block + 4;
    const uint8_t* qh = block + 16;
    const uint8_t* qs = block + (Type == Q5_K ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      int scale, min;
      scale_min_k4(j, scales, scale, min);
      const float d1 = d * scale, m1 = dmin * min;
      const uint8_t* chunk = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        int q = (chunk[l] >> shift) & 15;
        if constexpr (Type == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
        w[32 * j + l] = d1 * static_cast<float>(q) - m1;
      }
    }
  } else {  // Q6_K: u8 ql[128], u8 qh[64], i8 scales[16], f16 d; w = d * scale_(e / 16) * (q - 32)
    const uint8_t* ql = block;
    const uint8_t* qh = block + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_at(block + 208);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* lo = ql + 64 * half;
      const uint8_t* hi = qh + 32 * half;
      for (int i = 0; i < 4; ++i) {
        const float s = d * scales[8 * half + 2 * i], s2 = d * scales[8 * half + 2 * i + 1];
        for (int l = 0; l < 32; ++l) {
          const int q = ((lo[32 * (i % 2) + l] >> (4 * (i / 2))) & 15) | (((hi[l] >> (2 * i)) & 3) << 4);
          w[128 * half + 32 * i + l] = (l < 16 ? s : s2) * static_cast<float>(q - 32);
        }
      }
    }
  }
}

// y[m, n] for rows m0 .. m0 + rows of x and one weight row: each block decoded once per tile.
template <int Type>
void dot_tile_portable(const float* x, int64_t ldx, int64_t rows, const uint8_t* wrow, int64_t blocks, float* y,
                       int64_t ldy) {
  constexpr int values = block_values(Type);
  constexpr int lanes = 16;
  const int bytes = block_bytes(Type);
  alignas(64) float acc[kTileRows][lanes] = {};
  alignas(64) float w[values];
  for (int64_t b = 0; b < blocks; ++b) {
    dequantize_values<Type>(wrow + b * bytes, w);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xb = x + r * ldx + b * values;
      for (int j = 0; j < values; j += lanes) {
        for (int t = 0; t < lanes; ++t) acc[r][t] += w[j + t] * xb[j + t];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.0f;
    for (int t = 0; t < lanes; ++t) sum += acc[r][t];
    y[r * ldy] = sum;
  }
}

#if defined(__AVX512F__)
const char* kPortableIsa = "avx512 (compiler-vectorised)";
#elif defined(__AVX2__)
const char* kPortableIsa = "avx2 (compiler-vectorised)";
#else
const char* kPortableIsa = "generic C++";
#endif

template <int Type>
void matmul(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_stride, float* y) {
  const int64_t blocks = K / block_values(Type);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, M - m0);
      for (int64_t n = begin; n < end; ++n) {
        if constexpr (Type == Q4_0 || Type == Q4_1 || Type == Q8_0) {
          dot_tile<Type>(x + m0 * K, K, rows, w + n * row_stride, blocks, y + m0 * N + n, N);
        } else {
          dot_tile_portable<Type>(x + m0 * K, K, rows, w + n * row_stride, blocks, y + m0 * N + n, N);
        }
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
  TORCH_CHECK(bytes > 0, "gguf_matmul: ggml type ", type,
              " has no kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K do)");
  const int values = block_values(static_cast<int>(type));
  TORCH_CHECK(in_features % values == 0 && qweight.size(1) == in_features / values * bytes,
              "gguf_matmul: rows of ", qweight.size(1), " bytes do not hold ", in_features, " values of type ", type);
  const int64_t M = x.size(0), N = qweight.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (type) {
    case Q4_0: matmul<Q4_0>(xp, M, in_features, wp, N, qweight.size(1), yp); break;
    case Q4_1: matmul<Q4_1>(xp, M, in_features, wp, N, qweight.size(1), yp); break;
    case Q5_0: matmul<Q5_0>(xp, M, in_features, wp, N, qweight.size(1), yp); break;
    case Q5_1: matmul<Q5_1>(xp, M, in_features, wp, N, qweight.size(1), yp); break;
    case Q4_K: matmul<Q4_K>(xp, M, in_features, wp, N, qweight.size(1), yp); break;
    case Q5_K: matmul<Q5_K>(xp, M, in_features, wp, N, qweight.size(1), yp); break;
    case Q6_K: matmul<Q6_K>(xp, M, in_features, wp, N, qweight.size(1), yp); break;
    default: matmul<Q8_0>(xp, M, in_features, wp, N, qweight.size(1), yp); break;
  }
  return y;
}

std::string isa() { return std::string(kIsa) + " for Q4_0/Q4_1/Q8_0, " + kPortableIsa + " for Q5 and K-quants"; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_matmul", &gguf_matmul, "x @ dequantize(qweight).T for GGUF block rows (float32)");
  m.def("isa", &isa, "the instruction set the kernel was built for");
}
