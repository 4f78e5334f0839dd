// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with W in ggml's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks and x
// quantised first, once per call, to 8-bit blocks of 32 (llama.cpp's way on a CPU with AVX-512 VNNI):
// the products are then integer dot products of the unpacked weights' bytes with the activations'
// (vpdpbusd: 64 unsigned by signed byte products a call), scaled per block in float32.
//
// The activations of a block of 32 are quantised as in llama.cpp's Q8_0 (one float scale
// d = amax * (1 / 127), q = round-half-even(x * (1 / d))); one plane is llama.cpp's numerics. With more
// planes each next 8-bit plane holds the rounding error of the one before at 1 / 128 of its scale:
// x ~ d * q1 + (d / 128) * q2 (+ (d / 128^2) * q3), about 15 (22) bits a value. The planes' integer
// products are combined exactly (128 * dot1 + dot2, then 128 * that + dot3, fit in int32: each next
// vpdpbusd accumulates onto the shifted sum) before the one conversion to float, so a plane costs one
// more vpdpbusd and shift.
//
// vpdpbusd multiplies unsigned by signed bytes: the weights give the unsigned bytes (the 4 / 5-bit
// quants as they are, Q8_0's signed ones xor 0x80), and what their offset (8 for Q4_0, 16 for Q5_0,
// 128 for Q8_0) owes is taken out by one integer add of -offset * (the activations' value over the
// lane's four bytes, the planes combined), precomputed with the activations (with one plane, the
// accumulator starts there). Q4_1 / Q5_1's min m instead adds m * d_x * sum(q_x) per block, also
// precomputed (llama.cpp's Q8_1 sums).
//
// Two blocks (64 values) fill a 512-bit register. The 16 int32 lanes of a product each sum four
// bytes, and the activations are stored in the order the weights unpack to, so each lane belongs to
// one block: Q8_0's 32 + 32 bytes in order (lanes 0-7 block A, 8-15 block B); the 4 / 5-bit types'
// low nibbles then high nibbles ([A 0-15, B 0-15, A 16-31, B 16-31]: lanes 0-3 and 8-11 A). A row's
// last block, when their count is odd, is paired with zeros.
//
// Tiles of up to 4 rows of x by 4 weight rows: each weight pair is unpacked once per tile and each
// load of activations serves 4 weight rows. The tile's float16 block scales (and mins) are gathered
// into one vector of 8 (4 rows by 2 blocks) and converted and multiplied by the activations' block
// scales there, once per tile, then spread to each row's lanes by one permute: at batch 1 the
// per-block scale work is what bounded the loop (vector operations, not bytes: the weights stream at
// a third of what the memory gives), and a scale converted and broadcast per row and block cost more
// than its integer product. The mins' share is accumulated per block in that 8-wide form too. Each
// row's bytes two tiles ahead are prefetched. Weight rows are split over torch's intra-op threads;
// x is walked in chunks of kRowChunk rows so that a chunk's quantised activations stay in cache
// while the weight rows pass.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <tokenmill/parallel.h>  // tokenmill::parallel_for: the platform's pool where one is published
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TOKENMILL_GGUF_VNNI 1
#endif

namespace tokenmill_gguf {

namespace {

enum GGMLType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8 };

constexpr bool has_q8_path(int type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0;
}

#if defined(TOKENMILL_GGUF_VNNI)

constexpr int kBlock = 32;
constexpr int kTile = 4;             // rows of x and weight rows of one register tile
constexpr int64_t kRowChunk = 32;    // rows of x a thread walks per weight tile
constexpr float kInverse127 = 1.0f / 127.0f;
constexpr float kPlaneRatio = 128.0f;  // each plane's scale is the previous one's / 128
constexpr int kMaxPlanes = 3;

// Two blocks of one row of x, quantised for one weight type's byte order.
struct alignas(64) ActivationPair {
  int8_t q[kMaxPlanes][64];  // planes 1, 2, 3 (those past the call's planes unused)
  int32_t start[16];    // the accumulator start: -offset * (the lane's 4 values as one integer, planes combined)
  float pair_scale[8];  // [d_x A, d_x B] four times (in units of the last plane: d, d / 128 or d / 128^2)
  float pair_sum[8];    // [sum A, sum B] four times: d_x * sum(q_x) of each whole block, likewise
};

constexpr int block_bytes(int type) {
  return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : type == Q5_1 ? 24 : 34;
}
constexpr bool has_min(int type) { return type == Q4_1 || type == Q5_1; }
constexpr int offset_of(int type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q8_0 ? 128 : 0; }
constexpr bool nibble_order(int type) { return type != Q8_0; }

// 1 / d by the division instruction (a builtin, which -ffast-math's reciprocal rewrites leave alone);
// 0 for an all-zero block.
inline float inverse(float d) { return d == 0.0f ? 0.0f : _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(1.0f), _mm_set_ss(d))); }

// The lanes of block b of a pair in the weight type's byte order (see the top).
inline __mmask16 b_lanes(bool nibbles) { return nibbles ? 0xF0F0 : 0xFF00; }

// 16 bytes of each of four parts of a pair (values 0-15, 16-31 of block A, then of B) as the
// 64 bytes of the type's order: in order, or [A 0-15, B 0-15, A 16-31, B 16-31].
inline __m512i in_order(const __m128i (&part)[4], bool nibbles) {
  __m512i v = _mm512_castsi128_si512(part[0]);
  v = _mm512_inserti32x4(v, part[nibbles ? 2 : 1], 1);
  v = _mm512_inserti32x4(v, part[nibbles ? 1 : 2], 2);
  return _mm512_inserti32x4(v, part[3], 3);
}

// The values x[0 .. count) (count 32 or 64: one block and zeros, or two) into one ActivationPair.
template <int Planes>
void quantize_pair(const float* x, int count, int type, ActivationPair& out) {
  const bool nibbles = nibble_order(type);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
  __m128i part[kMaxPlanes][4];
  float block_scale[2] = {0.0f, 0.0f};
  for (int b = 0; b < 2; ++b) {
    const __mmask16 present = b * kBlock < count ? 0xFFFF : 0;
    const __m512 half[2] = {_mm512_maskz_loadu_ps(present, x + b * kBlock),
                            _mm512_maskz_loadu_ps(present, x + b * kBlock + 16)};
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, half[0]), _mm512_andnot_ps(sign, half[1])));
    const float d = amax * kInverse127;
    const float inv = inverse(d);
    for (int h = 0; h < 2; ++h) {
      __m512 residual = half[h];
      float step = d, inv_step = inv;
      for (int p = 0; p < Planes; ++p) {
        // the default rounding mode rounds half to even, as torch.round
        const __m512i q = _mm512_min_epi32(
            _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(residual, _mm512_set1_ps(inv_step))), low), high);
        part[p][2 * b + h] = _mm512_cvtepi32_epi8(q);
        // what this plane left, rounded once (residual - step * q in one FMA), for the next one
        if (p + 1 < Planes) residual = _mm512_fnmadd_ps(_mm512_set1_ps(step), _mm512_cvtepi32_ps(q), residual);
        step /= kPlaneRatio;
        inv_step *= kPlaneRatio;
      }
      block_scale[b] = step * kPlaneRatio;  // the last plane's
    }
  }
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i offset = _mm512_set1_epi32(-offset_of(type));
  __m512i value = _mm512_setzero_si512();
  for (int p = 0; p < Planes; ++p) {
    const __m512i q = in_order(part[p], nibbles);
    _mm512_store_si512(out.q[p], q);
    const __m512i lane_sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, q);  // 1 * q over 4 bytes
    value = p == 0 ? lane_sum : _mm512_add_epi32(_mm512_slli_epi32(value, 7), lane_sum);
  }
  _mm512_store_si512(out.start, _mm512_mullo_epi32(value, offset));
  const __mmask16 b_mask = b_lanes(nibbles);
  const float sum_a = block_scale[0] * static_cast<float>(_mm512_mask_reduce_add_epi32(~b_mask, value));
  const float sum_b = block_scale[1] * static_cast<float>(_mm512_mask_reduce_add_epi32(b_mask, value));
  for (int i = 0; i < 4; ++i) {
    out.pair_scale[2 * i] = block_scale[0];
    out.pair_scale[2 * i + 1] = block_scale[1];
    out.pair_sum[2 * i] = sum_a;
    out.pair_sum[2 * i + 1] = sum_b;
  }
}

// Every row of x[M, K] into M * pairs ActivationPairs.
template <int Planes>
void quantize_rows(const float* x, int64_t M, int64_t K, int type, ActivationPair* out) {
  const int64_t pairs = (K / kBlock + 1) / 2;
  tokenmill::parallel_for(0, M * pairs, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / pairs, p = i % pairs;
      const int count = static_cast<int>(std::min<int64_t>(2 * kBlock, K - p * 2 * kBlock));
      quantize_pair<Planes>(x + m * K + p * 2 * kBlock, count, type, out[i]);
    }
  });
}

// Blocks a and b (b == nullptr: zeros) of Type, their quants unpacked: the bytes in the activations'
// order (see the top).
template <int Type>
inline __m512i unpack_quants(const uint8_t* a, const uint8_t* b) {
  if constexpr (Type == Q8_0) {
    const __m256i qa = _mm256_loadu_si256((const __m256i*)(a + 2));
    const __m256i qb = b != nullptr ? _mm256_loadu_si256((const __m256i*)(b + 2)) : _mm256_set1_epi8(static_cast<char>(0x80));
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1), _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    constexpr int qs = Type == Q4_0 ? 2 : Type == Q4_1 ? 4 : Type == Q5_0 ? 6 : 8;
    const __m128i qa = _mm_loadu_si128((const __m128i*)(a + qs));
    const __m128i qb = b != nullptr ? _mm_loadu_si128((const __m128i*)(b + qs)) : _mm_setzero_si128();
    // [a, b] of 16 bytes each, its low nibbles then its high ones (256-bit operations: on CPUs
    // that split 512-bit ones in two, half the cost)
    const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(ab, mask)),
                                   _mm256_and_si256(_mm256_srli_epi16(ab, 4), mask), 1);
    if constexpr (Type == Q5_0 || Type == Q5_1) {
      // the fifth bits: qh bit j belongs to value j, bytes 0-15 then 16-31 of each block
      uint32_t ha, hb = 0;
      std::memcpy(&ha, a + qs - 4, 4);
      if (b != nullptr) std::memcpy(&hb, b + qs - 4, 4);
      const uint64_t bits = (ha & 0xFFFFull) | (static_cast<uint64_t>(hb & 0xFFFF) << 16) |
                            (static_cast<uint64_t>(ha >> 16) << 32) | (static_cast<uint64_t>(hb >> 16) << 48);
      v = _mm512_mask_add_epi8(v, _cvtu64_mask64(bits), v, _mm512_set1_epi8(0x10));  // bit 4 is clear: adding sets it
    }
    return v;
  }
}

// The float16 field at byte `field` (the scale d at 0, Q4_1 / Q5_1's min m at 2) of blocks a[c] and
// a[c] + bytes (zero where !has_b) of a tile's 4 weight rows, as 8 floats [row 0 A, row 0 B, row 1 A,
// ...]: the halves gathered in two 64-bit integers and converted at once (per block and row, two
// conversions and broadcasts would cost more vector operations than the products they scale).
inline __m256 tile_halves(const uint8_t* const (&a)[4], bool has_b, int bytes, int field) {
  uint64_t word[2];
  for (int i = 0; i < 2; ++i) {
    uint64_t v = 0;
    for (int c = 0; c < 2; ++c) {
      const uint8_t* block = a[2 * i + c] + field;
      uint16_t ha, hb = 0;
      std::memcpy(&ha, block, 2);
      if (has_b) std::memcpy(&hb, block + bytes, 2);
      v |= (static_cast<uint64_t>(ha) | static_cast<uint64_t>(hb) << 16) << (32 * c);
    }
    word[i] = v;
  }
  return _mm256_cvtph_ps(_mm_set_epi64x(static_cast<int64_t>(word[1]), static_cast<int64_t>(word[0])));
}

// Row c's 16 lanes of an [row 0 A, row 0 B, row 1 A, ...] vector: each lane its block's value.
template <bool Nibbles>
inline __m512 row_lanes(__m256 v, int c) {
  const __m512i block_b = Nibbles ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                  : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(_mm512_add_epi32(block_b, _mm512_set1_epi32(2 * c)), _mm512_castps256_ps512(v));
}

// The 16 lanes of each of a, b, c, d summed: [sum a, sum b, sum c, sum d].
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// [row 0 A + row 0 B, row 1 A + row 1 B, ...] of an [row 0 A, row 0 B, row 1 A, ...] vector.
inline __m128 sum_pairs(__m256 v) {
  const __m256 h = _mm256_hadd_ps(v, v);  // [r0 r1 r0 r1 | r2 r3 r2 r3]
  return _mm_shuffle_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1), _MM_SHUFFLE(1, 0, 1, 0));
}

struct Operands {
  const ActivationPair* x;  // [M, pairs]
  const uint8_t* w;         // [N, row_stride]
  const float* bias;        // [N] or nullptr
  float* y;                 // [M, N]
  int64_t M, N, blocks, pairs, row_stride;
};

// How many weight rows ahead (two tiles) each row's bytes are prefetched: a tile's rows are
// contiguous, so this streams the next tiles in while one is multiplied; the hardware
// prefetchers alone leave the interleaved rows waiting on memory once the weights outgrow the cache.
constexpr int64_t kPrefetchRows = 2 * kTile;

// One pair of blocks of Rows rows of x against 4 weight rows, into acc (and the mins' share, for
// Q4_1 / Q5_1, into min_acc: [row 0 A, row 0 B, row 1 A, ...] per row of x).
template <int Type, int Planes, int Rows>
inline void multiply_pair(const Operands& op, const ActivationPair* x, const uint8_t* const* w, int64_t p, bool has_b,
                          __m512 (&acc)[Rows][kTile], __m256 (&min_acc)[Rows]) {
  constexpr int bytes = block_bytes(Type);
  constexpr bool nibbles = nibble_order(Type);
  const uint8_t* a[kTile];
  __m512i q[kTile];
  for (int c = 0; c < kTile; ++c) {
    a[c] = w[c] + 2 * p * bytes;
    const char* ahead = reinterpret_cast<const char*>(a[c] + kPrefetchRows * op.row_stride);
    _mm_prefetch(ahead, _MM_HINT_T0);
    if constexpr (2 * bytes > 64) _mm_prefetch(ahead + 64, _MM_HINT_T0);  // a Q8_0 pair spans two lines
    q[c] = unpack_quants<Type>(a[c], has_b ? a[c] + bytes : nullptr);
  }
  const __m256 d = tile_halves(a, has_b, bytes, 0);
  const __m256 m = has_min(Type) ? tile_halves(a, has_b, bytes, 2) : _mm256_setzero_ps();
  for (int r = 0; r < Rows; ++r) {
    const ActivationPair& xp = x[r * op.pairs + p];
    const __m512i q1 = _mm512_load_si512(xp.q[0]);
    const __m512i start = offset_of(Type) != 0 ? _mm512_load_si512(xp.start) : _mm512_setzero_si512();
    const __m256 scales = _mm256_mul_ps(d, _mm256_load_ps(xp.pair_scale));  // d_w * d_x per row and block
    for (int c = 0; c < kTile; ++c) {
      __m512i dot;
      if constexpr (Planes == 1) {
        dot = _mm512_dpbusd_epi32(start, q[c], q1);
      } else {
        // 128 * dot + the next plane's, then the offsets' share (all planes' at once): exact in int32
        dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], q1);
        for (int plane = 1; plane < Planes; ++plane)
          dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dot, 7), q[c], _mm512_load_si512(xp.q[plane]));
        if constexpr (offset_of(Type) != 0) dot = _mm512_add_epi32(dot, start);
      }
      acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), row_lanes<nibbles>(scales, c), acc[r][c]);
    }
    if constexpr (has_min(Type)) min_acc[r] = _mm256_fmadd_ps(m, _mm256_load_ps(xp.pair_sum), min_acc[r]);
  }
}

// y[m0 .. m0 + Rows, n0 .. n0 + cols) for cols <= 4 weight rows (missing ones repeat the last).
template <int Type, int Planes, int Rows>
void tile(const Operands& op, int64_t m0, int64_t n0, int cols) {
  __m512 acc[Rows][kTile];
  __m256 min_acc[Rows];
  for (int r = 0; r < Rows; ++r) {
    for (int c = 0; c < kTile; ++c) acc[r][c] = _mm512_setzero_ps();
    min_acc[r] = _mm256_setzero_ps();
  }
  const uint8_t* w[kTile];
  for (int c = 0; c < kTile; ++c) w[c] = op.w + (n0 + std::min(c, cols - 1)) * op.row_stride;
  const ActivationPair* x = op.x + m0 * op.pairs;
  const int64_t full = op.blocks / 2;
  for (int64_t p = 0; p < full; ++p) multiply_pair<Type, Planes, Rows>(op, x, w, p, true, acc, min_acc);
  if (op.blocks % 2) multiply_pair<Type, Planes, Rows>(op, x, w, full, false, acc, min_acc);
  const __mmask8 valid = static_cast<__mmask8>((1u << cols) - 1);
  const __m128 bias = op.bias != nullptr ? _mm_maskz_loadu_ps(valid, op.bias + n0) : _mm_setzero_ps();
  for (int r = 0; r < Rows; ++r) {
    __m128 v = _mm_add_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), bias);
    if constexpr (has_min(Type)) v = _mm_add_ps(v, sum_pairs(min_acc[r]));
    _mm_mask_storeu_ps(op.y + (m0 + r) * op.N + n0, valid, v);
  }
}

template <int Type, int Planes>
void product(const Operands& op) {
  const int64_t tiles = (op.N + kTile - 1) / kTile;
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(op.blocks * kBlock, 1));
  // Rows of x a tile takes: 4 where the 16 accumulators, the 4 unpacked weight rows and a row's
  // activations fit the 32 registers; 2 where several planes or the mins would spill them.
  constexpr int64_t rows = Planes == 1 && !has_min(Type) ? kTile : 2;
  tokenmill::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < op.M; m0 += kRowChunk) {
      const int64_t m1 = std::min(op.M, m0 + kRowChunk);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kTile;
        const int cols = static_cast<int>(std::min<int64_t>(kTile, op.N - n0));
        for (int64_t m = m0; m < m1; m += rows) {
          switch (std::min<int64_t>(rows, m1 - m)) {
            case 1: tile<Type, Planes, 1>(op, m, n0, cols); break;
            case 2: tile<Type, Planes, 2>(op, m, n0, cols); break;
            case 3: tile<Type, Planes, 3>(op, m, n0, cols); break;
            default: tile<Type, Planes, 4>(op, m, n0, cols); break;
          }
        }
      }
    }
  });
}

template <int Planes>
void run(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_stride, int type,
         const float* bias, float* y) {
  const int64_t blocks = K / kBlock, pairs = (blocks + 1) / 2;
  // torch's CPU allocator aligns to 64 bytes, as ActivationPair needs; every byte is written
  auto buffer = torch::empty({static_cast<int64_t>(M * pairs * sizeof(ActivationPair))}, torch::kUInt8);
  auto* quantised = reinterpret_cast<ActivationPair*>(buffer.data_ptr<uint8_t>());
  quantize_rows<Planes>(x, M, K, type, quantised);
  const Operands op{quantised, w, bias, y, M, N, blocks, pairs, row_stride};
  switch (type) {
    case Q4_0: product<Q4_0, Planes>(op); break;
    case Q4_1: product<Q4_1, Planes>(op); break;
    case Q5_0: product<Q5_0, Planes>(op); break;
    case Q5_1: product<Q5_1, Planes>(op); break;
    default: product<Q8_0, Planes>(op); break;
  }
}

#endif  // TOKENMILL_GGUF_VNNI

}  // namespace

// "avx512_vnni" where this build multiplies `type` with quantised activations, else nullptr.
const char* q8_path(int type) {
#if defined(TOKENMILL_GGUF_VNNI)
  if (has_q8_path(type)) return "avx512_vnni";
#endif
  (void)type;
  return nullptr;
}

// y[M, N] = x @ W^T (+ bias) with x quantised to `planes` (1, 2 or 3) 8-bit planes; only where
// q8_path(type) is not null. y may not alias x.
void q8_matmul(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_stride, int type,
               int planes, const float* bias, float* y) {
  TORCH_CHECK(q8_path(type) != nullptr, "gguf q8_matmul: no quantised-activation kernel for ggml type ", type);
#if defined(TOKENMILL_GGUF_VNNI)
  if (M == 0 || N == 0) return;
  switch (planes) {
    case 1: run<1>(x, M, K, w, N, row_stride, type, bias, y); break;
    case 2: run<2>(x, M, K, w, N, row_stride, type, bias, y); break;
    default: run<3>(x, M, K, w, N, row_stride, type, bias, y); break;
  }
#else
  (void)x, (void)M, (void)K, (void)w, (void)N, (void)row_stride, (void)planes, (void)bias, (void)y;
#endif
}

}  // namespace tokenmill_gguf
