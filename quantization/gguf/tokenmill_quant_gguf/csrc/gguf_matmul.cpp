// y[M, N] = x[M, K] @ W[N, K]^T with W in ggml's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K /
// Q6_K blocks as the file stores them: AVX-512 intrinsics where the build CPU has AVX-512 (AVX2
// ones for Q4_0 / Q4_1 / Q8_0 on an AVX2-only CPU), else portable loops (which stay, for every
// type, as the reference the tests compare with).
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
// kernel is built on (AVX-512 or AVX2; the build is keyed by the CPU's flags). The AVX-512
// path of Q5_0 / Q5_1 and the K-quants instead decodes 32 values at a time (one sub-block)
// into two float vectors, the 6-bit scales and mins of a super-block once per super-block,
// and accumulates in float32 FMAs as Q4_0 does, two weight rows at a time so that each load
// of x feeds both; kernel_path(type) says which path a type takes.
//
// The torch op tokenmill_gguf::matmul (and its .out overload) runs this float path, or, asked for
// quantised activations ("q8", "q8x2"), gguf_q8_matmul.cpp's integer path where the build has it
// for the type (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 with AVX-512 VNNI); kernel_path(type, activations)
// names the loop. From kGemmRows rows of x on, the op instead dequantises panels of weight rows to
// float32 and multiplies them by torch's GEMM (every type and mode: the exact float product).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <tokenmill/parallel.h>  // tokenmill::parallel_for: the platform's pool where one is published
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

// The quantised-activation path (gguf_q8_matmul.cpp).
namespace tokenmill_gguf {
const char* q8_path(int type);
void q8_matmul(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_stride, int type,
               int planes, const float* bias, float* y);
}  // namespace tokenmill_gguf

namespace {

constexpr int kBlock = 32;
constexpr int kTileRows = 8;
enum GGMLType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int block_bytes(int type) {
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

// y[n] for one row of x (a batch-1 decode) and one Q8_0 weight row, the scale applied per block
// after the products: d * (q_lo . x_lo + q_hi . x_hi) is one multiply and two FMAs a block where
// dequantising first ((d * q) . x) takes two multiplies and two FMAs. The decode step streams every
// weight once, and one thread's loop is bound by the conversions' and FMAs' issue, not the bytes: the
// multiply saved took a one-thread sweep of the tiny model's matmuls from 0.58-0.60 of the read bound to
// 0.65-0.70 (CPU time on a shared machine; scripts/bench-gguf-matmul.py).
// The products round as d * (q . x) rather than (d * q) . x: both the dequantised float product
// within float32 summation error (d * q is exact in float32).
inline float dot_row_q8_0(const float* x, const uint8_t* wrow, int64_t blocks) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = wrow + b * 34;
    const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(block + 2))));
    const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(block + 18))));
    const __m512 dot = _mm512_fmadd_ps(q_hi, _mm512_loadu_ps(x + b * kBlock + 16),
                                       _mm512_mul_ps(q_lo, _mm512_loadu_ps(x + b * kBlock)));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(half_at(block)), dot, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// y[m, n] for rows m0 .. m0 + rows of x and one weight row.
template <int Type>
void dot_tile(const float* x, int64_t ldx, int64_t rows, const uint8_t* wrow, int64_t blocks, float* y, int64_t ldy) {
  if constexpr (Type == Q8_0) {
    // from two rows on, the block dequantised once (two multiplies) serves every row's FMAs
    if (rows == 1) {
      y[0] = dot_row_q8_0(x, wrow, blocks);
      return;
    }
  }
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
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (an AVX2-only CPU): the AVX-512 path's loops on 8-lane vectors. A block's 32 quants become
// four vectors of float32 (Q4_0: nibble - 8 in bytes first; Q4_1 the nibble, its min added through
// the sum of x; Q8_0 the byte); one row of x takes d * (q . x) a block, two blocks' sums in flight
// (the AVX-512 Q8_0 row's form, for every type: one FMA by d a block instead of four multiplies);
// more rows take the block dequantised once, (d * q + m), against up to four rows at a time
// (8 registers of sums).

constexpr int kAvx2Rows = 4;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// The block's 32 quants as four vectors of 8 floats, in the order of the block's values.
template <int Type>
inline void block_quants(const uint8_t* block, __m256 (&q)[4]) {
  if constexpr (Type == Q8_0) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(block + 2 + 8 * i))));
  } else {
    const __m128i packed = _mm_loadu_si128((const __m128i*)(block + (Type == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(packed, mask), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    if constexpr (Type == Q4_0) {
      lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
      hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
  }
}

inline float reduce_add8(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}

// acc += d * (q . x) (+ m * sum x) for block b of one weight row and one row of x.
template <int Type>
inline __m256 add_block(const float* x, const uint8_t* block, __m256 acc) {
  __m256 q[4];
  block_quants<Type>(block, q);
  const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8), x2 = _mm256_loadu_ps(x + 16),
               x3 = _mm256_loadu_ps(x + 24);
  const __m256 dot = _mm256_add_ps(_mm256_fmadd_ps(q[2], x2, _mm256_mul_ps(q[0], x0)),
                                   _mm256_fmadd_ps(q[3], x3, _mm256_mul_ps(q[1], x1)));
  acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(block)), dot, acc);
  if constexpr (Type == Q4_1)
    acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(block + 2)),
                          _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)), acc);
  return acc;
}

template <int Type>
inline float dot_row(const float* x, const uint8_t* wrow, int64_t blocks) {
  constexpr int bytes = Type == Q8_0 ? 34 : (Type == Q4_1 ? 20 : 18);
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    even = add_block<Type>(x + b * kBlock, wrow + b * bytes, even);
    odd = add_block<Type>(x + (b + 1) * kBlock, wrow + (b + 1) * bytes, odd);
  }
  if (b < blocks) even = add_block<Type>(x + b * kBlock, wrow + b * bytes, even);
  return reduce_add8(_mm256_add_ps(even, odd));
}

// y[r * ldy] for R rows of x: each block dequantised once for the R rows.
template <int Type, int R>
void dot_rows(const float* x, int64_t ldx, const uint8_t* wrow, int64_t blocks, float* y, int64_t ldy) {
  constexpr int bytes = Type == Q8_0 ? 34 : (Type == Q4_1 ? 20 : 18);
  __m256 acc[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = wrow + b * bytes;
    __m256 w[4];
    block_quants<Type>(block, w);
    const __m256 d = _mm256_set1_ps(half_to_float(block));
    const __m256 m = _mm256_set1_ps(Type == Q4_1 ? half_to_float(block + 2) : 0.f);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) w[i] = Type == Q4_1 ? _mm256_fmadd_ps(d, w[i], m) : _mm256_mul_ps(d, w[i]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * ldx + b * kBlock;
      acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[r][1]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) y[r * ldy] = reduce_add8(_mm256_add_ps(acc[r][0], acc[r][1]));
}

// y[m, n] for rows m0 .. m0 + rows of x and one weight row.
template <int Type>
void dot_tile(const float* x, int64_t ldx, int64_t rows, const uint8_t* wrow, int64_t blocks, float* y, int64_t ldy) {
  if (rows == 1) {
    y[0] = dot_row<Type>(x, wrow, blocks);
    return;
  }
  for (int64_t r = 0; r < rows; r += kAvx2Rows) {
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    switch (std::min<int64_t>(kAvx2Rows, rows - r)) {
      case 1: dot_rows<Type, 1>(xr, ldx, wrow, blocks, yr, ldy); break;
      case 2: dot_rows<Type, 2>(xr, ldx, wrow, blocks, yr, ldy); break;
      case 3: dot_rows<Type, 3>(xr, ldx, wrow, blocks, yr, ldy); break;
      default: dot_rows<Type, 4>(xr, ldx, wrow, blocks, yr, ldy); break;
    }
  }
}
const char* kIsa = "avx2";
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
  if constexpr (Type == Q4_0 || Type == Q4_1 || Type == Q8_0) {
    const float d = half_at(block);
    if constexpr (Type == Q8_0) {
      const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
      for (int j = 0; j < kBlock; ++j) w[j] = d * static_cast<float>(qs[j]);
    } else {
      const uint8_t* qs = block + (Type == Q4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        if constexpr (Type == Q4_1) {
          const float m = half_at(block + 2);
          w[j] = d * static_cast<float>(qs[j] & 15) + m;
          w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
        } else {
          w[j] = d * static_cast<float>((qs[j] & 15) - 8);
          w[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
        }
      }
    }
  } else if constexpr (Type == Q5_0 || Type == Q5_1) {
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

#if defined(__AVX512F__)
// ---- The AVX-512 path of Q5_0, Q5_1 and the K-quants -----------------------------------

// Bytes 0..31 of a sub-block's quants (values 0..63) as two vectors of 16 floats.
inline void bytes_to_floats(__m128i first, __m128i second, __m512& lo, __m512& hi) {
  lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second));
}

// Each byte's bits shift .. shift + width - 1 (16-bit lanes shift, the mask then drops what
// crossed from the neighbouring byte).
inline __m128i bit_field(__m128i bytes, int shift, int mask) {
  return _mm_and_si128(_mm_srl_epi16(bytes, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(static_cast<char>(mask)));
}

// One Q5_0 / Q5_1 block (32 values).
template <int Type>
struct FiveBitBlock {
  static constexpr int kCount = 1;
  const uint8_t* block;
  explicit FiveBitBlock(const uint8_t* b) : block(b) {}
  // d * q + m (Q5_1) or d * (q - 16) (Q5_0), q = nibble | qh bit j << 4.
  void decode(int, __m512& lo, __m512& hi) const {
    const __m512 d = _mm512_set1_ps(half_at(block));
    const uint8_t* rest = block + (Type == Q5_1 ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, rest, 4);
    const __m128i packed = _mm_loadu_si128((const __m128i*)(rest + 4));
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i q_lo = _mm512_cvtepu8_epi32(bit_field(packed, 0, 15));
    __m512i q_hi = _mm512_cvtepu8_epi32(bit_field(packed, 4, 15));
    q_lo = _mm512_mask_or_epi32(q_lo, static_cast<__mmask16>(qh & 0xFFFF), q_lo, sixteen);
    q_hi = _mm512_mask_or_epi32(q_hi, static_cast<__mmask16>(qh >> 16), q_hi, sixteen);
    if constexpr (Type == Q5_1) {
      const __m512 m = _mm512_set1_ps(half_at(block + 2));
      lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q_lo), m);
      hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q_hi), m);
    } else {
      lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(q_lo, sixteen)));
      hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(q_hi, sixteen)));
    }
  }
};

// One Q4_K / Q5_K super-block (8 sub-blocks of 32 values).
template <int Type>
struct ScaleMinSuperBlock {
  static constexpr int kCount = 8;
  const uint8_t* qs;
  const uint8_t* qh;
  float scale[8], offset[8];  // d * sc_j and dmin * m_j, the 6-bit fields unpacked once
  explicit ScaleMinSuperBlock(const uint8_t* block) : qs(block + (Type == Q5_K ? 48 : 16)), qh(block + 16) {
    const float d = half_at(block), dmin = half_at(block + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(j, block + 4, sc, mn);
      scale[j] = d * static_cast<float>(sc);
      offset[j] = dmin * static_cast<float>(mn);
    }
  }
  // Sub-block j: the low (even j) or high (odd j) nibbles of bytes 32 * (j / 2) .., plus bit j
  // of qh[l] as the fifth bit (Q5_K); d * sc_j * q - dmin * m_j.
  void decode(int j, __m512& lo, __m512& hi) const {
    const uint8_t* chunk = qs + 32 * (j / 2);
    __m128i first = bit_field(_mm_loadu_si128((const __m128i*)chunk), 4 * (j % 2), 15);
    __m128i second = bit_field(_mm_loadu_si128((const __m128i*)(chunk + 16)), 4 * (j % 2), 15);
    if constexpr (Type == Q5_K) {
      const __m128i four = _mm_cvtsi32_si128(4);
      first = _mm_or_si128(first, _mm_sll_epi16(bit_field(_mm_loadu_si128((const __m128i*)qh), j, 1), four));
      second = _mm_or_si128(second, _mm_sll_epi16(bit_field(_mm_loadu_si128((const __m128i*)(qh + 16)), j, 1), four));
    }
    __m512 q_lo, q_hi;
    bytes_to_floats(first, second, q_lo, q_hi);
    const __m512 s = _mm512_set1_ps(scale[j]), m = _mm512_set1_ps(offset[j]);
    lo = _mm512_fmsub_ps(s, q_lo, m);
    hi = _mm512_fmsub_ps(s, q_hi, m);
  }
};

// One Q6_K super-block (8 sub-blocks of 32 values).
struct SixBitSuperBlock {
  static constexpr int kCount = 8;
  const uint8_t* block;
  float d;
  explicit SixBitSuperBlock(const uint8_t* b) : block(b), d(half_at(b + 208)) {}
  // Sub-block j = 4 * half + i: low 4 bits from ql[64 * half + 32 * (i % 2) ..] (shifted by
  // 4 * (i / 2)), high 2 bits from qh[32 * half ..] (shifted by 2 * i); d * scale * (q - 32),
  // one int8 scale per 16 values.
  void decode(int j, __m512& lo, __m512& hi) const {
    const int half = j / 4, i = j % 4;
    const uint8_t* ql = block + 64 * half + 32 * (i % 2);
    const uint8_t* qh = block + 128 + 32 * half;
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192) + 8 * half + 2 * i;
    const __m128i four = _mm_cvtsi32_si128(4);
    const __m128i first = _mm_or_si128(bit_field(_mm_loadu_si128((const __m128i*)ql), 4 * (i / 2), 15),
                                       _mm_sll_epi16(bit_field(_mm_loadu_si128((const __m128i*)qh), 2 * i, 3), four));
    const __m128i second =
        _mm_or_si128(bit_field(_mm_loadu_si128((const __m128i*)(ql + 16)), 4 * (i / 2), 15),
                     _mm_sll_epi16(bit_field(_mm_loadu_si128((const __m128i*)(qh + 16)), 2 * i, 3), four));
    __m512 q_lo, q_hi;
    bytes_to_floats(first, second, q_lo, q_hi);
    // s * q - 32 s in one FMA: 32 s is exact, so this rounds once, as s * (q - 32) does.
    const float s0 = d * static_cast<float>(scales[0]), s1 = d * static_cast<float>(scales[1]);
    lo = _mm512_fmsub_ps(_mm512_set1_ps(s0), q_lo, _mm512_set1_ps(32.0f * s0));
    hi = _mm512_fmsub_ps(_mm512_set1_ps(s1), q_hi, _mm512_set1_ps(32.0f * s1));
  }
};

// The decoder of Type's blocks, 32 values at a time into (lo, hi).
template <int Type>
using SubBlocks = std::conditional_t<Type == Q6_K, SixBitSuperBlock,
                                     std::conditional_t<Type == Q4_K || Type == Q5_K, ScaleMinSuperBlock<Type>,
                                                        FiveBitBlock<Type>>>;

// y[m, n .. n + Cols] for rows m0 .. m0 + rows of x and Cols consecutive weight rows (row_stride
// bytes apart): each sub-block decoded once per tile, each load of x used by Cols weight rows.
template <int Type, int Cols>
void dot_tile_sub_blocks(const float* x, int64_t ldx, int64_t rows, const uint8_t* wrow, int64_t row_stride,
                         int64_t blocks, float* y, int64_t ldy) {
  constexpr int values = block_values(Type), bytes = block_bytes(Type);
  __m512 acc[kTileRows][Cols];
  for (int r = 0; r < kTileRows; ++r)
    for (int c = 0; c < Cols; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* first = wrow + b * bytes;
    const SubBlocks<Type> block0(first);
    const SubBlocks<Type> block1(Cols > 1 ? first + row_stride : first);
#pragma GCC unroll 8
    for (int j = 0; j < SubBlocks<Type>::kCount; ++j) {
      __m512 w_lo[Cols], w_hi[Cols];
      block0.decode(j, w_lo[0], w_hi[0]);
      if constexpr (Cols > 1) block1.decode(j, w_lo[1], w_hi[1]);
      const float* xb = x + b * values + j * kBlock;
      for (int r = 0; r < kTileRows; ++r) {
        if (r >= rows) break;
        const __m512 x_lo = _mm512_loadu_ps(xb + r * ldx), x_hi = _mm512_loadu_ps(xb + r * ldx + 16);
        for (int c = 0; c < Cols; ++c) {
          acc[r][c] = _mm512_fmadd_ps(w_lo[c], x_lo, acc[r][c]);
          acc[r][c] = _mm512_fmadd_ps(w_hi[c], x_hi, acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < Cols; ++c) y[r * ldy + c] = _mm512_reduce_add_ps(acc[r][c]);
}
constexpr bool kSubBlocksVectorised = true;
#else
constexpr bool kSubBlocksVectorised = false;
#endif

// Which loop multiplies a row of Type: dot_tile (Q4_0 / Q4_1 / Q8_0, intrinsics or generic),
// dot_tile_sub_blocks (AVX-512 builds) or dot_tile_portable.
enum class Path { kLegacy, kSubBlocks, kPortable };

template <int Type>
constexpr Path path_of() {
  if constexpr (Type == Q4_0 || Type == Q4_1 || Type == Q8_0) return Path::kLegacy;
  return kSubBlocksVectorised ? Path::kSubBlocks : Path::kPortable;
}

template <int Type, bool Portable>
void matmul(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_stride, float* y) {
  const int64_t blocks = K / block_values(Type);
  tokenmill::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, M - m0);
      for (int64_t n = begin; n < end; ++n) {
        const float* xt = x + m0 * K;
#if defined(__AVX512F__)
        if constexpr (!Portable && path_of<Type>() == Path::kSubBlocks) {
          // Two weight rows at a time where two are left, so each load of x serves both.
          if (n + 1 < end) {
            dot_tile_sub_blocks<Type, 2>(xt, K, rows, w + n * row_stride, row_stride, blocks, y + m0 * N + n, N);
            ++n;
            continue;
          }
        }
#endif
        const uint8_t* wrow = w + n * row_stride;
        float* yt = y + m0 * N + n;
        if constexpr (Portable || path_of<Type>() == Path::kPortable) {
          dot_tile_portable<Type>(xt, K, rows, wrow, blocks, yt, N);
        } else if constexpr (path_of<Type>() == Path::kLegacy) {
          dot_tile<Type>(xt, K, rows, wrow, blocks, yt, N);
        } else {
#if defined(__AVX512F__)
          dot_tile_sub_blocks<Type, 1>(xt, K, rows, wrow, row_stride, blocks, yt, N);
#endif
        }
      }
    }
  });
}

void check_operands(const torch::Tensor& x, const torch::Tensor& qweight, int64_t type, int64_t in_features) {
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
}

// From this many rows of x on, Q4_0 / Q4_1's float path takes the portable loop: at M = 64 it
// beats the intrinsics (bench-gguf-kernels.py), whose tiles dequantise a block per weight row
// and row tile into two vectors only.
constexpr int64_t kLegacyPortableRows = 16;

// y = x @ W^T with float32 activations (the weights dequantised in registers).
template <bool Portable>
void float_matmul(const torch::Tensor& x, const torch::Tensor& qweight, int64_t type, int64_t in_features, float* yp) {
  const int64_t M = x.size(0), N = qweight.size(0);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const int64_t stride = qweight.size(1);
  const bool portable_rows = M >= kLegacyPortableRows;
  switch (type) {
    case Q4_0:
      if (Portable || portable_rows) matmul<Q4_0, true>(xp, M, in_features, wp, N, stride, yp);
      else matmul<Q4_0, false>(xp, M, in_features, wp, N, stride, yp);
      break;
    case Q4_1:
      if (Portable || portable_rows) matmul<Q4_1, true>(xp, M, in_features, wp, N, stride, yp);
      else matmul<Q4_1, false>(xp, M, in_features, wp, N, stride, yp);
      break;
    case Q5_0: matmul<Q5_0, Portable>(xp, M, in_features, wp, N, stride, yp); break;
    case Q5_1: matmul<Q5_1, Portable>(xp, M, in_features, wp, N, stride, yp); break;
    case Q4_K: matmul<Q4_K, Portable>(xp, M, in_features, wp, N, stride, yp); break;
    case Q5_K: matmul<Q5_K, Portable>(xp, M, in_features, wp, N, stride, yp); break;
    case Q6_K: matmul<Q6_K, Portable>(xp, M, in_features, wp, N, stride, yp); break;
    default: matmul<Q8_0, Portable>(xp, M, in_features, wp, N, stride, yp); break;
  }
}

template <bool Portable>
torch::Tensor gguf_matmul_on(const torch::Tensor& x, const torch::Tensor& qweight, int64_t type, int64_t in_features) {
  check_operands(x, qweight, type, in_features);
  auto y = torch::empty({x.size(0), qweight.size(0)}, x.options());
  float_matmul<Portable>(x, qweight, type, in_features, y.data_ptr<float>());
  return y;
}

// From this many rows of x on (prefill chunks, large batches), the op dequantises panels of
// kPanelRows weight rows into float32 and multiplies each by torch's blocked GEMM: at M = 64 that
// beats every in-register path by 1.5-4x (bench-gguf-kernels.py), and the product is the
// dequantised float one.
constexpr int64_t kGemmRows = 32;
constexpr int64_t kPanelRows = 256;

template <int Type>
void dequantize_panel(const uint8_t* w, int64_t row_stride, int64_t rows, int64_t K, float* out) {
  constexpr int values = block_values(Type);
  const int bytes = block_bytes(Type);
  tokenmill::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < K / values; ++b)
        dequantize_values<Type>(w + r * row_stride + b * bytes, out + r * K + b * values);
  });
}

void dequantize_panel_of(int64_t type, const uint8_t* w, int64_t row_stride, int64_t rows, int64_t K, float* out) {
  switch (type) {
    case Q4_0: dequantize_panel<Q4_0>(w, row_stride, rows, K, out); break;
    case Q4_1: dequantize_panel<Q4_1>(w, row_stride, rows, K, out); break;
    case Q5_0: dequantize_panel<Q5_0>(w, row_stride, rows, K, out); break;
    case Q5_1: dequantize_panel<Q5_1>(w, row_stride, rows, K, out); break;
    case Q4_K: dequantize_panel<Q4_K>(w, row_stride, rows, K, out); break;
    case Q5_K: dequantize_panel<Q5_K>(w, row_stride, rows, K, out); break;
    case Q6_K: dequantize_panel<Q6_K>(w, row_stride, rows, K, out); break;
    default: dequantize_panel<Q8_0>(w, row_stride, rows, K, out); break;
  }
}

// out = x @ W^T panel by panel: dequantise kPanelRows rows, then at::mm.
void gemm_matmul(const torch::Tensor& x, const torch::Tensor& qweight, int64_t type, int64_t K, torch::Tensor& out) {
  const int64_t M = x.size(0), N = qweight.size(0), stride = qweight.size(1);
  const int64_t panel = std::min(N, kPanelRows);
  auto weight = torch::empty({panel, K}, x.options());
  auto part = torch::empty({M, panel}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += panel) {
    const int64_t rows = std::min(panel, N - n0);
    auto w = weight.narrow(0, 0, rows);
    dequantize_panel_of(type, qweight.data_ptr<uint8_t>() + n0 * stride, stride, rows, K, w.data_ptr<float>());
    if (rows == N) {
      at::mm_out(out, x, w.t());
    } else {
      auto p = part.narrow(1, 0, rows);
      at::mm_out(p, x, w.t());
      out.narrow(1, n0, rows).copy_(p);
    }
  }
}

// How the activations enter the product: "float32" as they are (the weights dequantised into
// float FMAs), "q8" quantised to 8-bit blocks of 32 as llama.cpp does, "q8x2" and "q8x3" with a
// second and third 8-bit plane for the previous one's rounding error (~15, ~22 bits; see gguf_q8_matmul.cpp).
int activation_planes(c10::string_view activations) {
  if (activations == "float32") return 0;
  if (activations == "q8") return 1;
  if (activations == "q8x2") return 2;
  if (activations == "q8x3") return 3;
  TORCH_CHECK(false, "gguf matmul: activations must be 'float32', 'q8', 'q8x2' or 'q8x3', not '",
              std::string(activations), "'");
  return 0;
}

// Whether this build multiplies `type` with quantised activations (the VNNI path).
bool takes_q8_path(int64_t type, int planes) {
  return planes > 0 && tokenmill_gguf::q8_path(static_cast<int>(type)) != nullptr;
}

// The op's out form: out[M, N] = x @ dequantize(qweight)^T (+ bias), by the path `activations` asks
// for where this build has it for the type, else by the float path.
torch::Tensor& matmul_out(const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype, int64_t in_features,
                          const c10::optional<torch::Tensor>& bias, c10::string_view activations, torch::Tensor& out) {
  check_operands(x, qweight, qtype, in_features);
  const int64_t M = x.size(0), N = qweight.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.scalar_type() == torch::kFloat32 &&
                  out.is_contiguous(), "gguf matmul: out must be a contiguous float32 [", M, ", ", N, "]");
  TORCH_CHECK(M == 0 || N == 0 || out.data_ptr() != x.data_ptr(), "gguf matmul: out may not be x");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous(),
                "gguf matmul: bias must be a contiguous float32 [", N, "]");
    bias_ptr = bias->data_ptr<float>();
  }
  const int planes = activation_planes(activations);
  if (M >= kGemmRows) {
    gemm_matmul(x, qweight, qtype, in_features, out);
    if (bias_ptr != nullptr) out.add_(*bias);
  } else if (takes_q8_path(qtype, planes)) {
    tokenmill_gguf::q8_matmul(x.data_ptr<float>(), M, in_features, qweight.data_ptr<uint8_t>(), N, qweight.size(1),
                              static_cast<int>(qtype), planes, bias_ptr, out.data_ptr<float>());
  } else {
    float_matmul<false>(x, qweight, qtype, in_features, out.data_ptr<float>());
    if (bias_ptr != nullptr) out.add_(*bias);
  }
  return out;
}

torch::Tensor matmul_op(const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype, int64_t in_features,
                        const c10::optional<torch::Tensor>& bias, c10::string_view activations) {
  check_operands(x, qweight, qtype, in_features);
  auto out = torch::empty({x.size(0), qweight.size(0)}, x.options());
  return matmul_out(x, qweight, qtype, in_features, bias, activations, out);
}

// The embedding lookup on a table kept in its blocks: out[i] = dequantize(qweight[ids[i]]), the
// rows asked for only. An op of its own (not an index then a dequantise in torch) so that a decode
// step's capture records the lookup too.
torch::Tensor& embedding_out(const torch::Tensor& qweight, const torch::Tensor& ids, int64_t qtype, int64_t dim,
                             torch::Tensor& out) {
  TORCH_CHECK(block_bytes(static_cast<int>(qtype)) > 0, "gguf embedding: ggml type ", qtype, " has no kernel");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kUInt8 && qweight.is_contiguous(),
              "gguf embedding: qweight must be contiguous uint8 [rows, bytes per row]");
  TORCH_CHECK(dim % block_values(static_cast<int>(qtype)) == 0 &&
                  qweight.size(1) == dim / block_values(static_cast<int>(qtype)) * block_bytes(static_cast<int>(qtype)),
              "gguf embedding: ", qweight.size(1), " bytes per row do not hold ", dim, " values of type ", qtype);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "gguf embedding: ids must be 1-d int64");
  const int64_t T = ids.size(0), rows = qweight.size(0), stride = qweight.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == dim && out.scalar_type() == torch::kFloat32 &&
                  out.is_contiguous(), "gguf embedding: out must be a contiguous float32 [", T, ", ", dim, "]");
  auto id = ids.contiguous();
  const int64_t* id_ptr = id.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i)
    TORCH_CHECK(id_ptr[i] >= 0 && id_ptr[i] < rows, "gguf embedding: id ", id_ptr[i], " outside the table's ", rows,
                " rows");
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  for (int64_t i = 0; i < T; ++i) dequantize_panel_of(qtype, w + id_ptr[i] * stride, stride, 1, dim, y + i * dim);
  return out;
}

torch::Tensor embedding_op(const torch::Tensor& qweight, const torch::Tensor& ids, int64_t qtype, int64_t dim) {
  auto out = torch::empty({ids.size(0), dim}, qweight.options().dtype(torch::kFloat32));
  return embedding_out(qweight, ids, qtype, dim, out);
}

// The loop that multiplies `type` with these activations: "avx512_vnni" (quantised activations,
// integer dot products), "avx512" (float intrinsics), "avx2" (Q4_0 / Q4_1 / Q8_0 on an AVX2-only CPU),
// "generic C++" (the same without either) or "portable" for `rows` rows of x, or from kGemmRows rows on "dequantize + gemm" (every
// type and mode). The float path's Q4_0 / Q4_1 take the portable loop from kLegacyPortableRows rows on.
std::string kernel_path(int64_t type, const std::string& activations, int64_t rows) {
  TORCH_CHECK(block_bytes(static_cast<int>(type)) > 0, "kernel_path: ggml type ", type, " has no kernel");
  const int planes = activation_planes(c10::string_view(activations.data(), activations.size()));
  if (rows >= kGemmRows) return "dequantize + gemm";
  if (takes_q8_path(type, planes)) return tokenmill_gguf::q8_path(static_cast<int>(type));
  const bool legacy = type == Q4_0 || type == Q4_1 || type == Q8_0;
  if (legacy) return kIsa;
  return kSubBlocksVectorised ? "avx512" : "portable";
}

std::string isa() {
  const std::string vnni = tokenmill_gguf::q8_path(Q4_0) != nullptr ? "; avx512_vnni for quantised activations" : "";
  if (kSubBlocksVectorised) return std::string(kIsa) + " for every type" + vnni;
  return std::string(kIsa) + " for Q4_0/Q4_1/Q8_0, " + kPortableIsa + " for Q5 and K-quants" + vnni;
}

}  // namespace

// Torch ops (torch.ops.tokenmill_gguf.matmul, .embedding), each with an out overload, so that torch function modes
// see the call and the CPU platform's step-graph capture can record it into a pooled buffer.
TORCH_LIBRARY(tokenmill_gguf, m) {
  m.def("matmul(Tensor x, Tensor qweight, int qtype, int in_features, Tensor? bias=None, "
        "str activations='float32') -> Tensor");
  m.def("matmul.out(Tensor x, Tensor qweight, int qtype, int in_features, Tensor? bias=None, "
        "str activations='float32', *, Tensor(a!) out) -> Tensor(a!)");
  m.def("embedding(Tensor qweight, Tensor ids, int qtype, int dim) -> Tensor");
  m.def("embedding.out(Tensor qweight, Tensor ids, int qtype, int dim, *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(tokenmill_gguf, CPU, m) {
  m.impl("matmul", &matmul_op);
  m.impl("matmul.out", &matmul_out);
  m.impl("embedding", &embedding_op);
  m.impl("embedding.out", &embedding_out);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_matmul", &gguf_matmul_on<false>, "x @ dequantize(qweight).T for GGUF block rows (float32 activations)");
  m.def("gguf_matmul_portable", &gguf_matmul_on<true>,
        "gguf_matmul by the portable loop for every type (the reference and fallback; tests and benchmarks)");
  m.def("kernel_path", &kernel_path, "which loop multiplies a ggml type with these activations", pybind11::arg("type"),
        pybind11::arg("activations") = "float32", pybind11::arg("rows") = 1);
  m.def("isa", &isa, "the instruction sets the kernel was built for");
}
