// The grouped weight-only int linear layer (GPTQ, AWQ, compressed-tensors' pack-quantized) on a
// CPU with AVX-512 (or AVX2: the float path on 8-lane vectors, its section below says how): y[M, N] = x[M, K] @ W (+ bias), W[k, n] = scale[g, n] * (q[k, n] - zero[g, n]),
// g the group of input k, computed from the packed 4- or 8-bit values without ever writing W out.
//
// The layout (written once at load by tokenmill/layers/packed_int_cpu.py):
// - the inputs are reordered so that each group's are contiguous and padded to a multiple of 8
//   (x_index[p]: the input position p reads, -1 for padding; group_start[g]: group g's first
//   position, K_p = group_start[G] in all); without act order that is the identity, plus the
//   padding of a last, partial group;
// - the outputs are cut into tiles of 16 (one register of float32), the last one padded;
// - packed: int32 [tiles][K_p / rows][16], rows = 32 / bits: word c of a block holds column c of
//   the tile for `rows` consecutive positions, the first in the lowest bits (GPTQ's qweight
//   words, regrouped by tile);
// - scales float32 [G][tiles * 16], and the zeros as float32 2^23 + zero [G][tiles * 16].
//
// A value becomes a float with no conversion instruction: (word >> bits * r) & mask, or-ed
// into the bits of 2^23, is the float 2^23 + q, and subtracting 2^23 + zero leaves q - zero
// exactly. For each tile and up to 8 rows of x at a time, a block is loaded once and each of its
// rows of 16 values multiplied into one accumulator per row of x; at the end of a group the
// accumulators are scaled and summed. The only rounding is the float32 accumulation: the
// dequantised weight's product up to summation order. x is read once per call into a reordered
// float32 copy (from float32, bfloat16 or float16); bfloat16 x on a CPU with AVX512_BF16 into a
// bfloat16 copy instead, multiplied by vdpbf16ps on pairs of values (exact in bfloat16 too: small
// integers), two products an instruction, summed in float32 as the FMAs are; from 9 rows of such x
// on, each tile is dequantised once into bfloat16 pairs that every chunk of 8 rows then reads. Up
// to 3 rows of x keep 4 / rows independent sums each, so that decode is not one chain of FMAs.
// With AVX512_VNNI, decode's few rows take the integer path instead (below: x rounded to int8
// planes, the values multiplied as they are by vpdpbusd), within a bound stated there.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <tokenmill/parallel.h>  // tokenmill::parallel_for: the platform's pool where one is published
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TOKENMILL_PACKED_INT_AVX512 1
#if defined(__AVX512BF16__)
#define TOKENMILL_PACKED_INT_BF16 1  // bfloat16 x: vdpbf16ps on pairs of inputs
#endif
#if defined(__AVX512VNNI__)
#define TOKENMILL_PACKED_INT_VNNI 1  // decode rows: int8 planes of x times the unsigned values by vpdpbusd
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TOKENMILL_PACKED_INT_AVX2 1  // an AVX2-only CPU: the float path on 8-lane vectors (below)
#endif
#if defined(TOKENMILL_PACKED_INT_AVX512) || defined(TOKENMILL_PACKED_INT_AVX2)
#define TOKENMILL_PACKED_INT_KERNEL 1
#endif

namespace {

constexpr int64_t kTileCols = 16;
constexpr int64_t kPositionAlign = 8;  // group_start's unit: whole blocks of 4-bit (and 8-bit) values
constexpr int kMaxRows = 8;            // rows of x sharing one pass over a tile's weights

#if defined(TOKENMILL_PACKED_INT_KERNEL)
constexpr int32_t kMagic = 0x4B000000;  // the float 2^23: its low 23 bits hold an integer exactly

struct Operands {
  const void* x;               // [M, K_p], reordered and padded: float32, or bfloat16 (the dot-product form)
  const int32_t* packed;       // [tiles][K_p / rows][16]
  const float* scales;         // [G, tiles * 16]
  const float* zeros;          // [G, tiles * 16], 2^23 + zero
  const int32_t* group_start;  // [G + 1]
  const float* bias;           // [N] or nullptr
  float* y;                    // [M, N]
  int64_t groups, kp, n, padded_n;
};

// x[m, x_index[p]] (0 where x_index[p] < 0) as Out (float32, or bfloat16 from bfloat16) into staged[m, p].
template <typename In, typename Out>
void stage_rows(const torch::Tensor& x, const int32_t* x_index, int64_t kp, Out* staged) {
  const In* xp = reinterpret_cast<const In*>(x.data_ptr());
  const int64_t m = x.size(0), k = x.size(1);
  tokenmill::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(kp, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const In* in = xp + row * k;
      Out* out = staged + row * kp;
      for (int64_t p = 0; p < kp; ++p) out[p] = x_index[p] >= 0 ? static_cast<Out>(in[x_index[p]]) : Out(0.0f);
    }
  });
}

// Decode's few rows' staged x, planes, sums and float32 result live in buffers the calling thread
// keeps (grow-only, and small: 8 rows at most), so that the many small layers of a
// decode step allocate nothing.
enum DecodeSlot { kStagedSlot, kPlanesSlot, kSumsSlot, kResultSlot, kDecodeSlots };

float* decode_scratch(DecodeSlot slot, int64_t floats) {
  static thread_local std::vector<float> buffers[kDecodeSlots];
  auto& buffer = buffers[slot];
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

#endif  // TOKENMILL_PACKED_INT_KERNEL

#if defined(TOKENMILL_PACKED_INT_AVX512)

// Every path's epilogue: rows m0 .. m0 + Rows of one tile's 16 outputs, plus the bias, into y
// (the last tile's padding columns masked off).
template <int Rows>
inline void store_tile_rows(const Operands& op, const __m512 (&out)[kMaxRows], int64_t tile, int64_t m0) {
  const int64_t n0 = tile * kTileCols, cols = std::min(kTileCols, op.n - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 bias = op.bias != nullptr ? _mm512_maskz_loadu_ps(mask, op.bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < Rows; ++r) _mm512_mask_storeu_ps(op.y + (m0 + r) * op.n + n0, mask, _mm512_add_ps(out[r], bias));
}

// Value row `Row` of a block minus the zeros, as 16 float32 (exact small integers).
template <int Bits, int Row>
inline __m512 value_row(__m512i words, __m512 zero) {
  const __m512i mask = _mm512_set1_epi32((1 << Bits) - 1), magic = _mm512_set1_epi32(kMagic);
  const __m512i shifted = Row == 0 ? words : _mm512_srli_epi32(words, Bits * Row);
  // (shifted & mask) | magic: the float 2^23 + q
  return _mm512_sub_ps(_mm512_castsi512_ps(_mm512_ternarylogic_epi32(shifted, mask, magic, 0xEA)), zero);
}

// acc[r] += value row `Row` * x[r][k + Row], for the Rows rows of float32 x.
template <int Bits, int Rows, int Row>
inline void multiply_row(__m512 (&acc)[kMaxRows], __m512i words, __m512 zero, const float* const* x, int64_t k) {
  const __m512 w = value_row<Bits, Row>(words, zero);
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r][k + Row]), acc[r]);
}

#if defined(TOKENMILL_PACKED_INT_BF16)
// Value rows 2 Pair and 2 Pair + 1 as bfloat16 pairs (exact: integers below 2^8 in magnitude):
// the high halves of their floats, the odd row's in the high 16 bits of each word.
template <int Bits, int Pair>
inline __m512i value_pair(__m512i words, __m512 zero) {
  const __m512i even = _mm512_castps_si512(value_row<Bits, 2 * Pair>(words, zero));
  const __m512i odd = _mm512_castps_si512(value_row<Bits, 2 * Pair + 1>(words, zero));
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(even, 16), odd, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)),
                                   0xD8);
}

// acc[r] += a pair of value rows . x[r]'s pair of inputs: one vdpbf16ps, twice the products of an
// FMA, each exact, summed in float32.
template <int Rows>
inline void multiply_pairs(__m512 (&acc)[kMaxRows], __m512i pairs, const uint32_t* const* x, int64_t j) {
  for (int r = 0; r < Rows; ++r)
    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)pairs, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[r][j])));
}

template <int Bits, int Rows, int Pair>
inline void multiply_pair(__m512 (&acc)[kMaxRows], __m512i words, __m512 zero, const uint32_t* const* x, int64_t k) {
  multiply_pairs<Rows>(acc, value_pair<Bits, Pair>(words, zero), x, (k >> 1) + Pair);
}

template <int Bits, int... Pair>
inline void store_pairs(__m512i words, __m512 zero, int32_t* out, std::integer_sequence<int, Pair...>) {
  (_mm512_storeu_si512(out + Pair * kTileCols, value_pair<Bits, Pair>(words, zero)), ...);
}

// Many rows of bfloat16 x: one tile's values, dequantised once into bfloat16 pairs
// [K_p / 2][16], then every chunk of 8 rows of x multiplies them (instead of dequantising the
// tile again for each chunk).
template <int Bits>
void dequantise_tile(const Operands& op, int64_t tile, int32_t* pairs) {
  constexpr int rows_per_block = 32 / Bits;
  const int32_t* blocks = op.packed + tile * op.kp * kTileCols / rows_per_block;
  for (int64_t g = 0; g < op.groups; ++g) {
    const __m512 zero = _mm512_loadu_ps(op.zeros + g * op.padded_n + tile * kTileCols);
    for (int64_t k = op.group_start[g]; k < op.group_start[g + 1]; k += rows_per_block)
      store_pairs<Bits>(_mm512_loadu_si512(blocks + (k / rows_per_block) * kTileCols), zero,
                        pairs + (k >> 1) * kTileCols, std::make_integer_sequence<int, rows_per_block / 2>{});
  }
}

template <int Rows>
void tile_rows_from_pairs(const Operands& op, const int32_t* pairs, int64_t tile, int64_t m0) {
  const uint32_t* x[kMaxRows];
  for (int r = 0; r < kMaxRows; ++r) x[r] = static_cast<const uint32_t*>(op.x) + (m0 + std::min(r, Rows - 1)) * op.kp / 2;
  __m512 out[kMaxRows];
  for (int r = 0; r < Rows; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < op.groups; ++g) {
    __m512 acc[kMaxRows];
    for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t j = op.group_start[g] >> 1; j < op.group_start[g + 1] >> 1; ++j)
      multiply_pairs<Rows>(acc, _mm512_loadu_si512(pairs + j * kTileCols), x, j);
    const __m512 scale = _mm512_loadu_ps(op.scales + g * op.padded_n + tile * kTileCols);
    for (int r = 0; r < Rows; ++r) out[r] = _mm512_fmadd_ps(acc[r], scale, out[r]);
  }
  store_tile_rows<Rows>(op, out, tile, m0);
}

void rows_from_pairs(const Operands& op, const int32_t* pairs, int64_t tile, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: tile_rows_from_pairs<1>(op, pairs, tile, m0); break;
    case 2: tile_rows_from_pairs<2>(op, pairs, tile, m0); break;
    case 3: tile_rows_from_pairs<3>(op, pairs, tile, m0); break;
    case 4: tile_rows_from_pairs<4>(op, pairs, tile, m0); break;
    case 5: tile_rows_from_pairs<5>(op, pairs, tile, m0); break;
    case 6: tile_rows_from_pairs<6>(op, pairs, tile, m0); break;
    case 7: tile_rows_from_pairs<7>(op, pairs, tile, m0); break;
    default: tile_rows_from_pairs<8>(op, pairs, tile, m0); break;
  }
}
#endif

// Independent sums a row of x keeps, so that few rows (decode) do not wait on one chain of FMAs.
constexpr int kChains = 4;
constexpr int chains_for(int rows) { return rows >= kChains ? 1 : kChains / rows; }

template <int Bits, int Rows, bool Bf16, typename X, int... Index>
inline void multiply_block(__m512 (&acc)[kChains][kMaxRows], __m512i words, __m512 zero, const X* const* x, int64_t k,
                           std::integer_sequence<int, Index...>) {
  constexpr int chains = chains_for(Rows);
#if defined(TOKENMILL_PACKED_INT_BF16)
  if constexpr (Bf16) {
    (multiply_pair<Bits, Rows, Index>(acc[Index % chains], words, zero, x, k), ...);
    return;
  }
#endif
  if constexpr (!Bf16) (multiply_row<Bits, Rows, Index>(acc[Index % chains], words, zero, x, k), ...);
}

// y[m0 .. m0 + Rows, the tile's columns) for one tile of 16 outputs.
template <int Bits, int Rows, bool Bf16>
void tile_rows(const Operands& op, int64_t tile, int64_t m0) {
  using X = std::conditional_t<Bf16, uint32_t, float>;  // bfloat16 x: read by pairs of inputs
  constexpr int rows_per_block = 32 / Bits;
  constexpr int per_x = Bf16 ? 2 : 1;  // inputs in one X
  const int32_t* blocks = op.packed + tile * op.kp * kTileCols / rows_per_block;
  const X* x[kMaxRows];
  for (int r = 0; r < kMaxRows; ++r) x[r] = static_cast<const X*>(op.x) + (m0 + std::min(r, Rows - 1)) * op.kp / per_x;
  __m512 out[kMaxRows];
  for (int r = 0; r < Rows; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < op.groups; ++g) {
    const int64_t k0 = op.group_start[g], k1 = op.group_start[g + 1];
    if (k0 == k1) continue;
    const __m512 zero = _mm512_loadu_ps(op.zeros + g * op.padded_n + tile * kTileCols);
    constexpr int chains = chains_for(Rows);
    __m512 acc[kChains][kMaxRows];
    for (int c = 0; c < chains; ++c)
      for (int r = 0; r < Rows; ++r) acc[c][r] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += rows_per_block) {
      const __m512i words = _mm512_loadu_si512(blocks + (k / rows_per_block) * kTileCols);
      multiply_block<Bits, Rows, Bf16>(acc, words, zero, x, k,
                                       std::make_integer_sequence<int, rows_per_block / per_x>{});
    }
    const __m512 scale = _mm512_loadu_ps(op.scales + g * op.padded_n + tile * kTileCols);
    for (int c = 1; c < chains; ++c)
      for (int r = 0; r < Rows; ++r) acc[0][r] = _mm512_add_ps(acc[0][r], acc[c][r]);
    for (int r = 0; r < Rows; ++r) out[r] = _mm512_fmadd_ps(acc[0][r], scale, out[r]);
  }
  store_tile_rows<Rows>(op, out, tile, m0);
}

template <int Bits, bool Bf16>
void rows_of_tile(const Operands& op, int64_t tile, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: tile_rows<Bits, 1, Bf16>(op, tile, m0); break;
    case 2: tile_rows<Bits, 2, Bf16>(op, tile, m0); break;
    case 3: tile_rows<Bits, 3, Bf16>(op, tile, m0); break;
    case 4: tile_rows<Bits, 4, Bf16>(op, tile, m0); break;
    case 5: tile_rows<Bits, 5, Bf16>(op, tile, m0); break;
    case 6: tile_rows<Bits, 6, Bf16>(op, tile, m0); break;
    case 7: tile_rows<Bits, 7, Bf16>(op, tile, m0); break;
    default: tile_rows<Bits, 8, Bf16>(op, tile, m0); break;
  }
}

template <int Bits, bool Bf16>
void product(const Operands& op, int64_t m) {
  const int64_t tiles = op.padded_n / kTileCols;
  // the tiles split over the threads; a tile's weights (K_p * 16 * Bits / 8 bytes) stay in the
  // cache while every chunk of 8 rows of x passes over them
  tokenmill::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
#if defined(TOKENMILL_PACKED_INT_BF16)
    if (Bf16 && m > kMaxRows) {
      std::vector<int32_t> pairs(op.kp / 2 * kTileCols);
      for (int64_t tile = begin; tile < end; ++tile) {
        dequantise_tile<Bits>(op, tile, pairs.data());
        for (int64_t m0 = 0; m0 < m; m0 += kMaxRows)
          rows_from_pairs(op, pairs.data(), tile, m0, std::min<int64_t>(kMaxRows, m - m0));
      }
      return;
    }
#endif
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t m0 = 0; m0 < m; m0 += kMaxRows)
        rows_of_tile<Bits, Bf16>(op, tile, m0, std::min<int64_t>(kMaxRows, m - m0));
  });
}

#if defined(TOKENMILL_PACKED_INT_VNNI)
// The integer decode path (AVX512_VNNI), for up to 8 rows of x (integer_rows_max). The float path spends
// ~36 vector instructions on a 64-byte block of 4-bit values (unpacking, converting, one FMA or
// dot product per row of them), so decode is compute-bound; here a block is two ands and a shift,
// and each row of x costs two vpdpbusd per plane (8-bit values: one, no unpacking at all).
//
// x is staged per (row, group) as int8 planes: x ≈ s * (p0 + p1 / 254 + p2 / 254^2), s = the
// group's largest |x| / 127, each plane the rounded remainder of the ones before (a remainder is at
// most half its step, so |p| <= 127 once the step is divided by 254). vpdpbusd multiplies the
// values q (0 .. 2^bits - 1, its unsigned operand) by a plane (the signed one) and sums four
// products into an int32 lane: no layout change, as w & 0x0F0F0F0F and (w >> 4) & 0x0F0F0F0F are
// four values of one column (positions 0 2 4 6, then 1 3 5 7 of the word), so each 8 positions of
// a 4-bit plane are staged in that order. At the end of a group, per plane, the int32 sum
// (exact), minus zero * the plane's sum over the group (exact integers in float32 below 2^24), is
// weighted by 254^-p, times s and the group's scale. So the result is the dequantised weight's
// product with x̂, x rounded to the planes: |x̂ - x| <= s / (2 * 254^(planes - 1)) per input, up to
// the float32 sums of the float path.
//
// Planes, by measured error against the float64 reference (tests/test_packed_int_cpu_kernel.py):
// bfloat16 / float16 x (8 / 11 significant bits, the output rounded to as many) take 2, a step of
// 2^-16 of the group's largest |x|: relative error ~3e-5, far below bfloat16's rounding (4e-3)
// and float16's (5e-4), where a third plane would cost a third more instructions for nothing
// visible. float32 x takes 3 (~1e-7, float32's own accumulation error): 2 planes' 3e-5 would
// break the float path's 1e-5 bound that float32 callers are promised.
// The crossover with the float path, measured (tiny Llama's layers, bfloat16 and float32 x, M = 1,
// 2, 4, 8): 2 planes win up to 8 rows (4-bit M = 8: ~25% faster; 8-bit: even), 3 planes up to 4
// (at 8 their 24 sums no longer fit the registers: ~30% slower than the float path).
constexpr int64_t integer_rows_max(bool half_x) { return half_x ? 8 : 4; }
constexpr float kPlaneRatio = 254.0f;    // each plane's step: the previous one's / 254
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of its reads the integer path asks for the weight

// Whether the int32 sums of a group cannot overflow: (2^bits - 1) * 127 * its inputs < 2^31.
bool integer_sums_fit(int64_t bits, const int32_t* group_start, int64_t groups) {
  int64_t longest = 0;
  for (int64_t g = 0; g < groups; ++g) longest = std::max<int64_t>(longest, group_start[g + 1] - group_start[g]);
  return ((int64_t{1} << bits) - 1) * 127 * longest < (int64_t{1} << 31);
}

struct IntegerX {
  const int32_t* planes;  // int8 [M][Planes][K_p] read as int32 words of 4 positions
  const float* sums;      // [M][G][1 + Planes]: s, then each plane's sum over the group
};

// One row's group [k0, k1) of the float32 staged x into planes (4-bit: each 8 positions in the
// nibbles' order 0 2 4 6 1 3 5 7) and its scale and sums.
template <int Bits, int Planes>
void quantise_group(const float* x, int64_t k0, int64_t k1, int64_t kp, int8_t* planes, float* sums) {
  __m512 largest = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t k = k0; k < k1; k += 8) {
    const __m512 v = _mm512_maskz_loadu_ps(0xFF, x + k);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    largest = _mm512_max_ps(largest, _mm512_abs_ps(v));
  }
  const float s = _mm512_reduce_max_ps(largest) / 127.0f;
  // max drops NaN, and a NaN rounds to a plane's -127: the group's scale carries it instead, so
  // that the row's outputs are NaN as the float product's are (a request's NaN logits are how the
  // engine finds the one request a bad input broke)
  sums[0] = nan ? std::numeric_limits<float>::quiet_NaN() : s;
  const __m128i order = Bits == 4 ? _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
                                  : _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i plane_sums[Planes];
  for (int p = 0; p < Planes; ++p) plane_sums[p] = _mm512_setzero_si512();
  for (int64_t k = k0; k < k1; k += 8) {
    __m512 rest = _mm512_maskz_loadu_ps(0xFF, x + k);
    float step = s;
    for (int p = 0; p < Planes; ++p, step /= kPlaneRatio) {
      // a step below the smallest normal float (x ~1e-32 and less, or all zero) has no finite
      // reciprocal: its plane stays 0, which loses at most that step
      const float reciprocal = step >= std::numeric_limits<float>::min() ? 1.0f / step : 0.0f;
      const __m512 rounded = _mm512_roundscale_ps(_mm512_mul_ps(rest, _mm512_set1_ps(reciprocal)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i q = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(rounded), _mm512_set1_epi32(127)),
                                         _mm512_set1_epi32(-127));
      rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(step), rest);
      plane_sums[p] = _mm512_add_epi32(plane_sums[p], q);
      _mm_mask_storeu_epi8(planes + p * kp + k, 0xFF, _mm_shuffle_epi8(_mm512_cvtepi32_epi8(q), order));
    }
  }
  for (int p = 0; p < Planes; ++p) sums[1 + p] = static_cast<float>(_mm512_reduce_add_epi32(plane_sums[p]));
}

// Every row's groups of the float32 staged x [M, K_p] into planes [M][Planes][K_p] and sums.
template <int Bits, int Planes>
void quantise_rows(const Operands& op, int64_t m, int8_t* planes, float* sums) {
  const float* x = static_cast<const float*>(op.x);
  tokenmill::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      for (int64_t g = 0; g < op.groups; ++g)
        quantise_group<Bits, Planes>(x + row * op.kp, op.group_start[g], op.group_start[g + 1], op.kp,
                                     planes + row * Planes * op.kp, sums + (row * op.groups + g) * (1 + Planes));
  });
}

// Blocks of one group multiplied at once into their own sums, so that a decode row's vpdpbusd
// are not one chain (their latency is several of their issue slots): about 8 independent sums.
constexpr int blocks_in_flight(int rows, int planes) { return std::max(1, 8 / (rows * planes)); }

// acc[p][r] += the block at position k times row r's plane p.
template <int Bits, int Rows, int Planes>
inline void multiply_block_int(__m512i (&acc)[Planes][kMaxRows], __m512i words, const int32_t* const* x,
                               int64_t plane_words, int64_t k) {
  if constexpr (Bits == 8) {
    for (int r = 0; r < Rows; ++r)
      for (int p = 0; p < Planes; ++p)
        acc[p][r] = _mm512_dpbusd_epi32(acc[p][r], words, _mm512_set1_epi32(x[r][p * plane_words + k / 4]));
  } else {
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
    const __m512i low = _mm512_and_si512(words, nibbles), high = _mm512_and_si512(_mm512_srli_epi32(words, 4), nibbles);
    for (int r = 0; r < Rows; ++r)
      for (int p = 0; p < Planes; ++p) {
        const int32_t* plane = x[r] + p * plane_words + k / 4;
        acc[p][r] = _mm512_dpbusd_epi32(acc[p][r], low, _mm512_set1_epi32(plane[0]));
        acc[p][r] = _mm512_dpbusd_epi32(acc[p][r], high, _mm512_set1_epi32(plane[1]));
      }
  }
}

// y[m0 .. m0 + Rows, the tile's columns) by the integer path.
template <int Bits, int Rows, int Planes>
void tile_rows_int(const Operands& op, const IntegerX& ix, int64_t tile, int64_t m0) {
  constexpr int rows_per_block = 32 / Bits, in_flight = blocks_in_flight(Rows, Planes);
  const int64_t plane_words = op.kp / 4;
  const int32_t* blocks = op.packed + tile * op.kp * kTileCols / rows_per_block;
  const int32_t* x[kMaxRows];
  for (int r = 0; r < Rows; ++r) x[r] = ix.planes + (m0 + r) * Planes * plane_words;
  __m512 out[kMaxRows];
  for (int r = 0; r < Rows; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < op.groups; ++g) {
    const int64_t k0 = op.group_start[g], k1 = op.group_start[g + 1];
    if (k0 == k1) continue;
    __m512i acc[in_flight][Planes][kMaxRows];
    for (int c = 0; c < in_flight; ++c)
      for (int p = 0; p < Planes; ++p)
        for (int r = 0; r < Rows; ++r) acc[c][p][r] = _mm512_setzero_si512();
    int64_t k = k0;
    for (; k + in_flight * rows_per_block <= k1; k += in_flight * rows_per_block)
      for (int c = 0; c < in_flight; ++c) {
        const int32_t* block = blocks + (k / rows_per_block + c) * kTileCols;
        // the tiles lie one after another and decode reads each once: the bytes kPrefetchBytes on
        // asked for now (the next tile's, past this one's page, where the hardware prefetcher stops)
        _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T0);
        multiply_block_int<Bits, Rows, Planes>(acc[c], _mm512_loadu_si512(block), x, plane_words, k + c * rows_per_block);
      }
    for (; k < k1; k += rows_per_block)
      multiply_block_int<Bits, Rows, Planes>(acc[0], _mm512_loadu_si512(blocks + (k / rows_per_block) * kTileCols), x,
                                             plane_words, k);
    const int64_t column = g * op.padded_n + tile * kTileCols;
    const __m512 zero = _mm512_sub_ps(_mm512_loadu_ps(op.zeros + column), _mm512_castsi512_ps(_mm512_set1_epi32(kMagic)));
    const __m512 scale = _mm512_loadu_ps(op.scales + column);
    for (int r = 0; r < Rows; ++r) {
      const float* sums = ix.sums + ((m0 + r) * op.groups + g) * (1 + Planes);
      __m512 dot = _mm512_setzero_ps();
      float weight = 1.0f;
      for (int p = 0; p < Planes; ++p, weight /= kPlaneRatio) {
        __m512i total = acc[0][p][r];
        for (int c = 1; c < in_flight; ++c) total = _mm512_add_epi32(total, acc[c][p][r]);
        // sum of (q - zero) * plane over the group
        const __m512 centred = _mm512_fnmadd_ps(zero, _mm512_set1_ps(sums[1 + p]), _mm512_cvtepi32_ps(total));
        dot = _mm512_fmadd_ps(centred, _mm512_set1_ps(weight), dot);
      }
      out[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_set1_ps(sums[0])), scale, out[r]);
    }
  }
  store_tile_rows<Rows>(op, out, tile, m0);
}

template <int Bits, int Planes>
void rows_of_tile_int(const Operands& op, const IntegerX& ix, int64_t tile, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: tile_rows_int<Bits, 1, Planes>(op, ix, tile, m0); break;
    case 2: tile_rows_int<Bits, 2, Planes>(op, ix, tile, m0); break;
    case 3: tile_rows_int<Bits, 3, Planes>(op, ix, tile, m0); break;
    case 4: tile_rows_int<Bits, 4, Planes>(op, ix, tile, m0); break;
    case 5: tile_rows_int<Bits, 5, Planes>(op, ix, tile, m0); break;
    case 6: tile_rows_int<Bits, 6, Planes>(op, ix, tile, m0); break;
    case 7: tile_rows_int<Bits, 7, Planes>(op, ix, tile, m0); break;
    default: tile_rows_int<Bits, 8, Planes>(op, ix, tile, m0); break;
  }
}

// y = x @ W by the integer path: op.x is x staged as float32 [M, K_p].
template <int Bits, int Planes>
void integer_product(const Operands& op, int64_t m) {
  auto* planes = reinterpret_cast<int8_t*>(decode_scratch(kPlanesSlot, m * Planes * op.kp / 4));
  float* sums = decode_scratch(kSumsSlot, m * op.groups * (1 + Planes));
  quantise_rows<Bits, Planes>(op, m, planes, sums);
  const IntegerX ix{reinterpret_cast<const int32_t*>(planes), sums};
  tokenmill::parallel_for(0, op.padded_n / kTileCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t m0 = 0; m0 < m; m0 += kMaxRows)
        rows_of_tile_int<Bits, Planes>(op, ix, tile, m0, std::min<int64_t>(kMaxRows, m - m0));
  });
}
#endif  // TOKENMILL_PACKED_INT_VNNI

// The float32 result into out's bfloat16 / float16, rounded to nearest even as Tensor.copy_
// rounds (bfloat16: the high half of the float after adding 0x7FFF plus its lowest kept bit; a
// NaN stays a quiet NaN), without a torch op per layer.
void round_into(const float* y, torch::Tensor& out) {
  const int64_t count = out.numel();
  auto* o = reinterpret_cast<int16_t*>(out.data_ptr());
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 mask = static_cast<__mmask16>(count - i >= 16 ? 0xFFFF : (1u << (count - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(mask, y + i);
    __m256i half;
    if (bf16) {
      const __m512i bits = _mm512_castps_si512(v);
      const __m512i kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(kept, _mm512_set1_epi32(0x7FFF))), 16);
      rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
      half = _mm512_cvtepi32_epi16(rounded);
    } else {
      half = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_mask_storeu_epi16(o + i, mask, half);
  }
}

#endif  // TOKENMILL_PACKED_INT_AVX512

#if defined(TOKENMILL_PACKED_INT_AVX2)
// The AVX2 body (an AVX2-only CPU): the AVX-512 body's float path on 8-lane vectors, a tile's 16
// outputs two of them (V16), values made floats by the same 2^23 trick (an and and an or where
// AVX-512 has one ternary op). With 16 registers a pass over a tile takes at most kAvx2Rows rows
// of x (8 registers of sums; fewer rows keep kAvx2Chains / rows independent sums each, as the
// AVX-512 body does); the sums across groups wait in memory (a load and a store per group). From
// kAvx2DequantiseFrom rows of x on (prefill chunks, large batches) each tile is dequantised once
// into float32 [K_p][16] that every kFloatPassRows rows then read, as the CPU platform's panels
// are read, instead of its values being unpacked again for every few rows. Decode's few rows of
// 4-bit values take the integer path instead (below).

struct V16 {
  __m256 lo, hi;  // outputs 0-7, 8-15 of a tile
};

constexpr int kAvx2Rows = 4;
constexpr int kAvx2Chains = 4;
constexpr int kFloatPassRows = 6;             // rows of x per pass over a dequantised tile: 12 registers of sums
constexpr int64_t kAvx2DequantiseFrom = 8;    // rows of x from which a tile is dequantised once

inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }

// Value row `Row` of 8 words minus their zeros, as 8 float32 (exact small integers).
template <int Bits, int Row>
inline __m256 value_row8(__m256i words, __m256 zero) {
  const __m256i shifted = Row == 0 ? words : _mm256_srli_epi32(words, Bits * Row);
  const __m256i q = _mm256_or_si256(_mm256_and_si256(shifted, _mm256_set1_epi32((1 << Bits) - 1)),
                                    _mm256_set1_epi32(kMagic));  // the float 2^23 + q
  return _mm256_sub_ps(_mm256_castsi256_ps(q), zero);
}

inline void multiply_add(V16& acc, const V16& w, __m256 x) {
  acc.lo = _mm256_fmadd_ps(w.lo, x, acc.lo);
  acc.hi = _mm256_fmadd_ps(w.hi, x, acc.hi);
}

// acc[Row % Chains][r] += value row `Row` * x[r][k + Row], for each of the Rows rows of x.
template <int Bits, int Rows, int Chains, int Row>
inline void multiply_row8(V16 (&acc)[Chains][Rows], __m256i lo, __m256i hi, const V16& zero, const float* const* x,
                          int64_t k) {
  const V16 w{value_row8<Bits, Row>(lo, zero.lo), value_row8<Bits, Row>(hi, zero.hi)};
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) multiply_add(acc[Row % Chains][r], w, _mm256_broadcast_ss(x[r] + k + Row));
}

template <int Bits, int Rows, int Chains, int... Row>
inline void multiply_block8(V16 (&acc)[Chains][Rows], __m256i lo, __m256i hi, const V16& zero, const float* const* x,
                            int64_t k, std::integer_sequence<int, Row...>) {
  (multiply_row8<Bits, Rows, Chains, Row>(acc, lo, hi, zero, x, k), ...);
}

// out[r] += sums[r] * the group's scales, out in memory ([Rows][16] floats).
template <int Rows>
inline void add_scaled(float (&out)[Rows][kTileCols], const V16 (&sums)[Rows], const V16& scale) {
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
    _mm256_storeu_ps(out[r], _mm256_fmadd_ps(sums[r].lo, scale.lo, _mm256_loadu_ps(out[r])));
    _mm256_storeu_ps(out[r] + 8, _mm256_fmadd_ps(sums[r].hi, scale.hi, _mm256_loadu_ps(out[r] + 8)));
  }
}

// Rows m0 .. m0 + Rows of one tile's outputs, plus the bias, into y (the padding columns dropped).
template <int Rows>
void store_tile_rows8(const Operands& op, const float (&out)[Rows][kTileCols], int64_t tile, int64_t m0) {
  const int64_t n0 = tile * kTileCols, cols = std::min(kTileCols, op.n - n0);
  for (int r = 0; r < Rows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      op.y[(m0 + r) * op.n + n0 + j] = out[r][j] + (op.bias != nullptr ? op.bias[n0 + j] : 0.f);
}

// y[m0 .. m0 + Rows, the tile's columns) for one tile, its values unpacked as they are read.
template <int Bits, int Rows>
__attribute__((noinline)) void tile_rows8(const Operands& op, int64_t tile, int64_t m0) {
  constexpr int rows_per_block = 32 / Bits, chains = Rows >= kAvx2Chains ? 1 : kAvx2Chains / Rows;
  const int32_t* blocks = op.packed + tile * op.kp * kTileCols / rows_per_block;
  const float* x[Rows];
  for (int r = 0; r < Rows; ++r) x[r] = static_cast<const float*>(op.x) + (m0 + r) * op.kp;
  float out[Rows][kTileCols] = {};
  for (int64_t g = 0; g < op.groups; ++g) {
    const int64_t k0 = op.group_start[g], k1 = op.group_start[g + 1];
    if (k0 == k1) continue;
    const float* zeros = op.zeros + g * op.padded_n + tile * kTileCols;
    const V16 zero = load16(zeros);
    V16 acc[chains][Rows];
#pragma GCC unroll 8
    for (int c = 0; c < chains; ++c)
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) acc[c][r] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k = k0; k < k1; k += rows_per_block) {
      const int32_t* words = blocks + (k / rows_per_block) * kTileCols;
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 8));
      multiply_block8<Bits, Rows, chains>(acc, lo, hi, zero, x, k, std::make_integer_sequence<int, rows_per_block>{});
    }
#pragma GCC unroll 8
    for (int c = 1; c < chains; ++c)
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        acc[0][r].lo = _mm256_add_ps(acc[0][r].lo, acc[c][r].lo);
        acc[0][r].hi = _mm256_add_ps(acc[0][r].hi, acc[c][r].hi);
      }
    add_scaled<Rows>(out, acc[0], load16(op.scales + g * op.padded_n + tile * kTileCols));
  }
  store_tile_rows8<Rows>(op, out, tile, m0);
}

template <int Bits, int... Row>
inline void store_value_rows(__m256i lo, __m256i hi, const V16& zero, float* w, std::integer_sequence<int, Row...>) {
  ((_mm256_storeu_ps(w + Row * kTileCols, value_row8<Bits, Row>(lo, zero.lo)),
    _mm256_storeu_ps(w + Row * kTileCols + 8, value_row8<Bits, Row>(hi, zero.hi))), ...);
}

// One tile's values minus their zeros, as float32 [K_p][16] (the scales applied per group later).
template <int Bits>
void dequantise_tile8(const Operands& op, int64_t tile, float* w) {
  constexpr int rows_per_block = 32 / Bits;
  const int32_t* blocks = op.packed + tile * op.kp * kTileCols / rows_per_block;
  for (int64_t g = 0; g < op.groups; ++g) {
    const V16 zero = load16(op.zeros + g * op.padded_n + tile * kTileCols);
    for (int64_t k = op.group_start[g]; k < op.group_start[g + 1]; k += rows_per_block) {
      const int32_t* words = blocks + (k / rows_per_block) * kTileCols;
      store_value_rows<Bits>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words)),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 8)), zero, w + k * kTileCols,
                             std::make_integer_sequence<int, rows_per_block>{});
    }
  }
}

// y[m0 .. m0 + Rows, the tile's columns) from the tile dequantised by dequantise_tile8.
template <int Rows>
__attribute__((noinline)) void tile_rows_from_floats(const Operands& op, const float* w, int64_t tile, int64_t m0) {
  const float* x[Rows];
  for (int r = 0; r < Rows; ++r) x[r] = static_cast<const float*>(op.x) + (m0 + r) * op.kp;
  float out[Rows][kTileCols] = {};
  for (int64_t g = 0; g < op.groups; ++g) {
    V16 acc[Rows];
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) acc[r] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t k = op.group_start[g]; k < op.group_start[g + 1]; ++k) {
      const V16 values = load16(w + k * kTileCols);
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) multiply_add(acc[r], values, _mm256_broadcast_ss(x[r] + k));
    }
    add_scaled<Rows>(out, acc, load16(op.scales + g * op.padded_n + tile * kTileCols));
  }
  store_tile_rows8<Rows>(op, out, tile, m0);
}

template <int Bits>
void rows_of_tile8(const Operands& op, int64_t tile, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return tile_rows8<Bits, 1>(op, tile, m0);
    case 2: return tile_rows8<Bits, 2>(op, tile, m0);
    case 3: return tile_rows8<Bits, 3>(op, tile, m0);
    default: return tile_rows8<Bits, 4>(op, tile, m0);
  }
}

void rows_from_floats(const Operands& op, const float* w, int64_t tile, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return tile_rows_from_floats<1>(op, w, tile, m0);
    case 2: return tile_rows_from_floats<2>(op, w, tile, m0);
    case 3: return tile_rows_from_floats<3>(op, w, tile, m0);
    case 4: return tile_rows_from_floats<4>(op, w, tile, m0);
    case 5: return tile_rows_from_floats<5>(op, w, tile, m0);
    default: return tile_rows_from_floats<6>(op, w, tile, m0);
  }
}

template <int Bits>
void product8(const Operands& op, int64_t m) {
  const int64_t tiles = op.padded_n / kTileCols;
  tokenmill::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    if (m >= kAvx2DequantiseFrom) {
      std::vector<float> w(static_cast<size_t>(op.kp * kTileCols));
      for (int64_t tile = begin; tile < end; ++tile) {
        dequantise_tile8<Bits>(op, tile, w.data());
        for (int64_t m0 = 0; m0 < m; m0 += kFloatPassRows)
          rows_from_floats(op, w.data(), tile, m0, std::min<int64_t>(kFloatPassRows, m - m0));
      }
      return;
    }
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t m0 = 0; m0 < m; m0 += kAvx2Rows) rows_of_tile8<Bits>(op, tile, m0, std::min<int64_t>(kAvx2Rows, m - m0));
  });
}

// The integer decode path on AVX2, 4-bit values only: the VNNI path's planes and sums (x rounded to
// int8 planes per row and group, 2 for bfloat16 / float16 x, 3 for float32; see there for the bound),
// with vpmaddubsw for vpdpbusd. It multiplies the unsigned values (0 .. 15) by a plane's signed
// bytes in pairs into int16 (2 * 15 * 127 = 3810 a pair, and the two nibble halves' pairs added,
// 7620: no saturation), vpmaddwd by ones widens them into int32 sums of four. 8-bit values would
// overflow the int16 pairs (2 * 255 * 127), so they keep the float path. A pass over a tile takes one
// row of x (its planes' int16 and int32 sums for the tile's two halves: 8 or 12 registers).
constexpr float kIntegerPlaneRatio = 254.0f;  // each plane's step: the previous one's / 254 (the VNNI path's)
constexpr int64_t integer_rows_max_avx2(bool half_x) { return half_x ? 4 : 2; }

// Whether the int32 sums of a group cannot overflow: 15 * 127 * its inputs < 2^31.
bool integer_sums_fit_avx2(const int32_t* group_start, int64_t groups) {
  int64_t longest = 0;
  for (int64_t g = 0; g < groups; ++g) longest = std::max<int64_t>(longest, group_start[g + 1] - group_start[g]);
  return 15 * 127 * longest < (int64_t{1} << 31);
}

// One row's group [k0, k1) of the float32 staged x into int8 planes (each 8 positions in the
// nibbles' order 0 2 4 6 1 3 5 7) and [s, each plane's sum over the group]: the VNNI quantise_group.
template <int Planes>
void quantise_group8(const float* x, int64_t k0, int64_t k1, int64_t kp, int8_t* planes, float* sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 largest = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  const float s = *std::max_element(lanes, lanes + 8) / 127.0f;
  sums[0] = _mm256_movemask_ps(unordered) ? std::numeric_limits<float>::quiet_NaN() : s;  // as the VNNI path's
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  __m256i plane_sums[Planes];
  for (int p = 0; p < Planes; ++p) plane_sums[p] = _mm256_setzero_si256();
  for (int64_t k = k0; k < k1; k += 8) {
    __m256 rest = _mm256_loadu_ps(x + k);
    float step = s;
    for (int p = 0; p < Planes; ++p, step /= kIntegerPlaneRatio) {
      const float reciprocal = step >= std::numeric_limits<float>::min() ? 1.0f / step : 0.0f;
      const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(rest, _mm256_set1_ps(reciprocal)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i q = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(rounded), _mm256_set1_epi32(127)),
                                         _mm256_set1_epi32(-127));
      rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(step), rest);
      plane_sums[p] = _mm256_add_epi32(plane_sums[p], q);
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(planes + p * kp + k), _mm_shuffle_epi8(_mm_packs_epi16(words, words), order));
    }
  }
  for (int p = 0; p < Planes; ++p) {
    alignas(32) int32_t part[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(part), plane_sums[p]);
    int64_t total = 0;
    for (int i = 0; i < 8; ++i) total += part[i];
    sums[1 + p] = static_cast<float>(total);
  }
}

struct IntegerX8 {
  const int32_t* planes;  // int8 [M][Planes][K_p] read as int32 words of 4 positions
  const float* sums;      // [M][G][1 + Planes]
};

// y[m, the tile's columns) by the integer path (4-bit values), one row of x: the int16 pairs of up
// to kInt16Blocks blocks are added before vpmaddwd widens them (4 * 7620 < 32767), a quarter of the
// widenings, which with the products are what bound this loop (one vector multiply unit a cycle).
constexpr int kInt16Blocks = 4;

template <int Planes>
__attribute__((noinline)) void tile_row_int8(const Operands& op, const IntegerX8& ix, int64_t tile, int64_t m) {
  const int64_t plane_words = op.kp / 4;
  const int32_t* blocks = op.packed + tile * op.kp * kTileCols / 8;
  const int32_t* x = ix.planes + m * Planes * plane_words;
  const __m256i nibbles = _mm256_set1_epi32(0x0F0F0F0F), ones = _mm256_set1_epi16(1);
  float out[1][kTileCols] = {};
  for (int64_t g = 0; g < op.groups; ++g) {
    const int64_t k0 = op.group_start[g], k1 = op.group_start[g + 1];
    if (k0 == k1) continue;
    __m256i acc[Planes][2];
#pragma GCC unroll 4
    for (int p = 0; p < Planes; ++p) acc[p][0] = acc[p][1] = _mm256_setzero_si256();
    const int32_t* block = blocks + (k0 / 8) * kTileCols;
    const int32_t* plane = x + k0 / 4;  // plane p's words of positions k .. k + 7: plane[p * plane_words], [+ 1]
    for (int64_t k = k0; k < k1;) {
      const int64_t run = std::min<int64_t>(kInt16Blocks, (k1 - k) / 8);
      __m256i pairs[Planes][2];
#pragma GCC unroll 4
      for (int p = 0; p < Planes; ++p) pairs[p][0] = pairs[p][1] = _mm256_setzero_si256();
      for (int64_t b = 0; b < run; ++b, block += kTileCols, plane += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(block) + 4096, _MM_HINT_T0);  // the VNNI path's look-ahead
        __m256i low[2], high[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 8 * h));
          low[h] = _mm256_and_si256(words, nibbles);
          high[h] = _mm256_and_si256(_mm256_srli_epi32(words, 4), nibbles);
        }
#pragma GCC unroll 4
        for (int p = 0; p < Planes; ++p) {
          const __m256i even = _mm256_set1_epi32(plane[p * plane_words]), odd = _mm256_set1_epi32(plane[p * plane_words + 1]);
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h)
            pairs[p][h] = _mm256_add_epi16(pairs[p][h], _mm256_add_epi16(_mm256_maddubs_epi16(low[h], even),
                                                                         _mm256_maddubs_epi16(high[h], odd)));
        }
      }
      k += run * 8;
#pragma GCC unroll 4
      for (int p = 0; p < Planes; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) acc[p][h] = _mm256_add_epi32(acc[p][h], _mm256_madd_epi16(pairs[p][h], ones));
    }
    const int64_t column = g * op.padded_n + tile * kTileCols;
    const __m256 magic = _mm256_castsi256_ps(_mm256_set1_epi32(kMagic));
    const float* sums = ix.sums + (m * op.groups + g) * (1 + Planes);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 zero = _mm256_sub_ps(_mm256_loadu_ps(op.zeros + column + 8 * h), magic);
      __m256 dot = _mm256_setzero_ps();
      float weight = 1.0f;
      for (int p = 0; p < Planes; ++p, weight /= kIntegerPlaneRatio) {
        // sum of (q - zero) * plane over the group
        const __m256 centred = _mm256_fnmadd_ps(zero, _mm256_set1_ps(sums[1 + p]), _mm256_cvtepi32_ps(acc[p][h]));
        dot = _mm256_fmadd_ps(centred, _mm256_set1_ps(weight), dot);
      }
      const __m256 scale = _mm256_loadu_ps(op.scales + column + 8 * h);
      _mm256_storeu_ps(out[0] + 8 * h, _mm256_fmadd_ps(_mm256_mul_ps(dot, _mm256_set1_ps(sums[0])), scale,
                                                       _mm256_loadu_ps(out[0] + 8 * h)));
    }
  }
  store_tile_rows8<1>(op, out, tile, m);
}

// y = x @ W by the integer path (4-bit values, at most integer_rows_max_avx2 rows): op.x is x staged
// as float32 [M, K_p].
template <int Planes>
void integer_product8(const Operands& op, int64_t m) {
  auto* planes = reinterpret_cast<int8_t*>(decode_scratch(kPlanesSlot, m * Planes * op.kp / 4));
  float* sums = decode_scratch(kSumsSlot, m * op.groups * (1 + Planes));
  const float* x = static_cast<const float*>(op.x);
  for (int64_t row = 0; row < m; ++row)
    for (int64_t g = 0; g < op.groups; ++g)
      quantise_group8<Planes>(x + row * op.kp, op.group_start[g], op.group_start[g + 1], op.kp,
                              planes + row * Planes * op.kp, sums + (row * op.groups + g) * (1 + Planes));
  const IntegerX8 ix{reinterpret_cast<const int32_t*>(planes), sums};
  tokenmill::parallel_for(0, op.padded_n / kTileCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t row = 0; row < m; ++row) tile_row_int8<Planes>(op, ix, tile, row);
  });
}

// The float32 result into out's bfloat16 / float16, rounded to nearest even (c10's conversions, as
// Tensor.copy_ rounds; a NaN stays a NaN).
void round_into(const float* y, torch::Tensor& out) {
  const int64_t count = out.numel();
  if (out.scalar_type() == torch::kBFloat16) {
    auto* o = out.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < count; ++i) o[i] = static_cast<c10::BFloat16>(y[i]);
  } else {
    auto* o = out.data_ptr<c10::Half>();
    for (int64_t i = 0; i < count; ++i) o[i] = static_cast<c10::Half>(y[i]);
  }
}
#endif  // TOKENMILL_PACKED_INT_AVX2

void check_operands(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                    const torch::Tensor& zeros, const torch::Tensor& x_index, const torch::Tensor& group_start,
                    int64_t bits, int64_t n, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "packed_int_linear: x must be a contiguous CPU [M, K]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
              "packed_int_linear: x must be float32, bfloat16 or float16, not ", dtype);
  TORCH_CHECK(bits == 4 || bits == 8, "packed_int_linear: bits must be 4 or 8, not ", bits);
  TORCH_CHECK(x_index.dim() == 1 && x_index.scalar_type() == torch::kInt32 && x_index.is_contiguous(),
              "packed_int_linear: x_index must be a contiguous int32 [K_p]");
  const int64_t kp = x_index.size(0), tiles = (n + kTileCols - 1) / kTileCols;
  TORCH_CHECK(kp % kPositionAlign == 0, "packed_int_linear: K_p = ", kp, " is not a multiple of ", kPositionAlign);
  TORCH_CHECK(group_start.dim() == 1 && group_start.scalar_type() == torch::kInt32 && group_start.is_contiguous() &&
                  group_start.size(0) >= 2, "packed_int_linear: group_start must be a contiguous int32 [G + 1]");
  const int64_t groups = group_start.size(0) - 1;
  TORCH_CHECK(packed.scalar_type() == torch::kInt32 && packed.is_contiguous() &&
                  packed.numel() == tiles * kp * bits * kTileCols / 32,
              "packed_int_linear: packed must be a contiguous int32 of ", tiles * kp * bits * kTileCols / 32, " words");
  for (const auto* t : {&scales, &zeros}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == groups && t->size(1) == tiles * kTileCols && t->is_contiguous(),
                "packed_int_linear: scales and zeros must be contiguous [", groups, ", ", tiles * kTileCols, "]");
  }
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && zeros.scalar_type() == torch::kFloat32,
              "packed_int_linear: scales and zeros (2^23 + zero) must be float32");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous(),
                "packed_int_linear: bias must be a contiguous float32 [N]");
  }
}

torch::Tensor& packed_int_linear_out(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                                     const torch::Tensor& zeros, const torch::Tensor& x_index,
                                     const torch::Tensor& group_start, int64_t bits, int64_t out_features,
                                     const c10::optional<torch::Tensor>& bias, torch::Tensor& out) {
  check_operands(x, packed, scales, zeros, x_index, group_start, bits, out_features, bias);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == out_features &&
                  out.scalar_type() == x.scalar_type() && out.is_contiguous(),
              "packed_int_linear: out must be a contiguous [", x.size(0), ", ", out_features, "] of x's dtype");
#if defined(TOKENMILL_PACKED_INT_AVX512)
  const int64_t m = x.size(0), kp = x_index.size(0);
  if (m == 0 || out_features == 0) return out;
  const int32_t* index = x_index.data_ptr<int32_t>();
  const int64_t groups = group_start.size(0) - 1;
#if defined(TOKENMILL_PACKED_INT_VNNI)
  const bool half_x = x.scalar_type() != torch::kFloat32;  // 2 planes for 8 / 11 significant bits, else 3
  const bool integer = m <= integer_rows_max(half_x) && integer_sums_fit(bits, group_start.data_ptr<int32_t>(), groups);
#else
  const bool integer = false;
#endif
#if defined(TOKENMILL_PACKED_INT_BF16)
  const bool bf16 = x.scalar_type() == torch::kBFloat16 && !integer;  // the integer path stages float32 x
#else
  const bool bf16 = false;
#endif
  torch::Tensor staged_tensor, y_tensor;  // the float path's; the integer path's are decode_scratch
  void* staged = nullptr;
  if (integer) {
    staged = decode_scratch(kStagedSlot, m * kp);
  } else {
    staged_tensor = torch::empty({m, kp}, x.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
    staged = staged_tensor.data_ptr();
  }
  if (bf16) {
    stage_rows<c10::BFloat16, c10::BFloat16>(x, index, kp, static_cast<c10::BFloat16*>(staged));
  } else if (x.scalar_type() == torch::kFloat32) {
    stage_rows<float, float>(x, index, kp, static_cast<float*>(staged));
  } else if (x.scalar_type() == torch::kBFloat16) {
    stage_rows<c10::BFloat16, float>(x, index, kp, static_cast<float*>(staged));
  } else {
    stage_rows<c10::Half, float>(x, index, kp, static_cast<float*>(staged));
  }
  const bool in_place = out.scalar_type() == torch::kFloat32;
  float* y = in_place ? out.data_ptr<float>() : nullptr;
  if (!in_place && integer) {
    y = decode_scratch(kResultSlot, m * out_features);
  } else if (!in_place) {
    y_tensor = torch::empty({m, out_features}, x.options().dtype(torch::kFloat32));
    y = y_tensor.data_ptr<float>();
  }
  const Operands op{staged, packed.data_ptr<int32_t>(), scales.data_ptr<float>(),
                    zeros.data_ptr<float>(), group_start.data_ptr<int32_t>(),
                    bias.has_value() ? bias->data_ptr<float>() : nullptr, y,
                    groups, kp, out_features, scales.size(1)};
#if defined(TOKENMILL_PACKED_INT_VNNI)
  if (integer) {
    if (bits == 4) {
      half_x ? integer_product<4, 2>(op, m) : integer_product<4, 3>(op, m);
    } else {
      half_x ? integer_product<8, 2>(op, m) : integer_product<8, 3>(op, m);
    }
  }
#endif
  if (!integer) {
    if (bits == 4) {
      bf16 ? product<4, true>(op, m) : product<4, false>(op, m);
    } else {
      bf16 ? product<8, true>(op, m) : product<8, false>(op, m);
    }
  }
  if (!in_place) round_into(y, out);
#elif defined(TOKENMILL_PACKED_INT_AVX2)
  const int64_t m = x.size(0), kp = x_index.size(0);
  if (m == 0 || out_features == 0) return out;
  const int32_t* index = x_index.data_ptr<int32_t>();
  const bool half_x = x.scalar_type() != torch::kFloat32;  // 2 planes for 8 / 11 significant bits, else 3
  const bool integer = bits == 4 && m <= integer_rows_max_avx2(half_x) &&
                       integer_sums_fit_avx2(group_start.data_ptr<int32_t>(), group_start.size(0) - 1);
  torch::Tensor staged, y_tensor;  // the float path's; decode's integer path keeps thread-local buffers
  float* staged_ptr = nullptr;
  if (integer) {
    staged_ptr = decode_scratch(kStagedSlot, m * kp);
  } else {
    staged = torch::empty({m, kp}, x.options().dtype(torch::kFloat32));
    staged_ptr = staged.data_ptr<float>();
  }
  if (x.scalar_type() == torch::kFloat32) {
    stage_rows<float, float>(x, index, kp, staged_ptr);
  } else if (x.scalar_type() == torch::kBFloat16) {
    stage_rows<c10::BFloat16, float>(x, index, kp, staged_ptr);
  } else {
    stage_rows<c10::Half, float>(x, index, kp, staged_ptr);
  }
  const bool in_place = out.scalar_type() == torch::kFloat32;
  float* y = in_place ? out.data_ptr<float>() : nullptr;
  if (!in_place && integer) {
    y = decode_scratch(kResultSlot, m * out_features);
  } else if (!in_place) {
    y_tensor = torch::empty({m, out_features}, x.options().dtype(torch::kFloat32));
    y = y_tensor.data_ptr<float>();
  }
  const Operands op{staged_ptr, packed.data_ptr<int32_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(),
                    group_start.data_ptr<int32_t>(), bias.has_value() ? bias->data_ptr<float>() : nullptr, y,
                    group_start.size(0) - 1, kp, out_features, scales.size(1)};
  if (integer) {
    half_x ? integer_product8<2>(op, m) : integer_product8<3>(op, m);
  } else {
    bits == 4 ? product8<4>(op, m) : product8<8>(op, m);
  }
  if (!in_place) round_into(y, out);
#else
  TORCH_CHECK(false, "packed_int_linear: this build has no vector kernel: the CPU has neither AVX-512 F/BW/VL nor AVX2 "
                     "(isa() is 'none')");
#endif
  return out;
}

torch::Tensor packed_int_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                                const torch::Tensor& zeros, const torch::Tensor& x_index,
                                const torch::Tensor& group_start, int64_t bits, int64_t out_features,
                                const c10::optional<torch::Tensor>& bias) {
  auto out = torch::empty({x.size(0), out_features}, x.options());
  packed_int_linear_out(x, packed, scales, zeros, x_index, group_start, bits, out_features, bias, out);
  return out;
}

std::string isa() {
#if defined(TOKENMILL_PACKED_INT_BF16) && defined(TOKENMILL_PACKED_INT_VNNI)
  return "avx512_bf16+vnni";
#elif defined(TOKENMILL_PACKED_INT_VNNI)
  return "avx512+vnni";
#elif defined(TOKENMILL_PACKED_INT_BF16)
  return "avx512_bf16";
#elif defined(TOKENMILL_PACKED_INT_AVX512)
  return "avx512";
#elif defined(TOKENMILL_PACKED_INT_AVX2)
  return "avx2+int4";  // the 4-bit integer decode path by vpmaddubsw
#else
  return "none";
#endif
}

}  // namespace

// torch.ops.tokenmill_packed_int.packed_int_linear and its .out overload: the CPU platform's
// step-graph capture records a call of the functional op as one of .out into a pooled buffer.
TORCH_LIBRARY(tokenmill_packed_int, m) {
  m.def("packed_int_linear(Tensor x, Tensor packed, Tensor scales, Tensor zeros, Tensor x_index, "
        "Tensor group_start, int bits, int out_features, Tensor? bias) -> Tensor");
  m.def("packed_int_linear.out(Tensor x, Tensor packed, Tensor scales, Tensor zeros, Tensor x_index, "
        "Tensor group_start, int bits, int out_features, Tensor? bias, *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(tokenmill_packed_int, CPU, m) {
  m.impl("packed_int_linear", &packed_int_linear);
  m.impl("packed_int_linear.out", &packed_int_linear_out);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction set the kernel was built for ('none': neither AVX-512 F/BW/VL nor AVX2)");
}
