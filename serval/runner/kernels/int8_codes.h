// What quantized_int8.cpp's products (both ISAs) take from a packed block beside its nibbles: MXFP4's
// codes as an int8 table, which codes go in signed (MXFP4's on AVX2, Q6_K's), which 5-bit ones unsigned, and
// each block's d and m.
//
// MXFP4's codes are signed table values v (-12..12, quantized.h), which the unsigned operand of VPMADDUBSW and
// VPDPBUSD cannot take as they are. With VPDPBUSD's int32 sums (AVX-512) the table is shifted to unsigned
// v + 12 and the offset m = -12 d takes the shift back, as Q4_0's m = -8 d does; VPMADDUBSW's int16 sums
// (AVX2) would overflow with codes up to 24 (16 x 24 x 127 > 32767), so there a code gives VPMADDUBSW its
// magnitude and x its sign (VPSIGNB), as ggml does, and m is 0. Either way the products are exactly v x.
#pragma once
#include "quantized.h"

#if defined(__AVX2__)
namespace serval_kernels::quantized {

// The table MXFP4's nibbles are looked up in, as the products here take them (above): v + 12 with
// VPDPBUSD's int32 sums, signed v with VPMADDUBSW's int16 ones.
#if defined(__AVX512VNNI__)
inline constexpr bool kTableShifted = true;
alignas(16) inline constexpr int8_t kInt8Table[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
#else
inline constexpr bool kTableShifted = false;
alignas(16) inline constexpr int8_t kInt8Table[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#endif

// Whether the products give a code's magnitude to VPMADDUBSW's unsigned operand and its sign to x (VPSIGNB):
// MXFP4's signed table values where the table is not shifted, and Q6_K's codes less their bias (-32 .. 31:
// with int16 sums a scale block of 16 weights makes 8 products a lane, 8 x 32 x 127 < 32767).
template <Layout L>
inline constexpr bool kSignedOperand = (Traits<L>::kCodeTable && !kTableShifted) || L == Layout::kQ6K;

// Where the products take the 5-bit codes unsigned, 0..31 as the file holds them: Q5_0's too, its bias 16 then
// being an offset m = -16 d (exact: a power of two), as Q4_0's 8 is. Signed with magnitudes (kSignedOperand)
// they would cost a VPSIGNB per operand and row; unsigned, VPMADDUBSW's int16 sums hold 8 products a lane
// (8 x 31 x 127 < 32767), so they widen twice an x block (ScaleBlocks' spans) where 4-bit codes widen once.
template <Layout L>
inline constexpr bool kUnbiased5Bit = L == Layout::kQ5Sym || L == Layout::kQ5 || L == Layout::kQ5K;

// Whether the products' y takes the offset term m sum(x_b): the layouts with offsets, Q5_0's unbiased codes
// (above) and MXFP4's shifted table.
template <Layout L>
inline constexpr bool kInt8Offsets =
    Traits<L>::kOffsets || L == Layout::kQ5Sym || (Traits<L>::kCodeTable && kTableShifted);

// block_scales, with the m its codes here need: MXFP4's -12 d for the shifted table, else 0 (block_scales
// gives MXFP4 none; -12 d is exact: 3 times a power of two), and Q5_0's -16 d (kUnbiased5Bit).
template <Layout L>
[[gnu::always_inline]] inline void int8_block_scales(const PackedMatrix& w, int64_t G, int64_t s, float* d, float* m) {
  block_scales<L>(w, G, s, d, m);
  if constexpr (Traits<L>::kCodeTable)
    for (int r = 0; r < kGroup; ++r) m[r] = kTableShifted ? -12.0f * d[r] : 0.0f;
  if constexpr (L == Layout::kQ5Sym)
    for (int r = 0; r < kGroup; ++r) m[r] = -16.0f * d[r];
}

#if defined(__AVX512VNNI__)
// Word order that makes dword r of a nibble chunk row r's 4 consecutive weights: the chunk's 32-byte half h
// holds row r's weights 2h, 2h + 1 (of its 4) in word r, so dword r takes word r of half 0, then of half 1.
alignas(64) inline constexpr int16_t kRowQuads[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// A 4-bit chunk c (64 bytes) as the unsigned operands of VPDPBUSD and AMX's TDPBSUD: `low` holds each row's
// weights 8c .. 8c + 3 (dword r: row r), `high` its weights 8c + 4 .. 8c + 7; MXFP4's nibbles looked up in
// kInt8Table.
template <Layout L>
[[gnu::always_inline]] inline void nibble_row_quads(const uint8_t* chunk, __m512i& low, __m512i& high) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), order = _mm512_load_si512(kRowQuads);
  const __m512i packed = _mm512_loadu_si512(chunk);
  low = _mm512_and_si512(packed, nibble);
  high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  if constexpr (Traits<L>::kCodeTable) {  // unsigned v + 12 (kInt8Table)
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kInt8Table)));
    low = _mm512_shuffle_epi8(table, low);
    high = _mm512_shuffle_epi8(table, high);
  }
  low = _mm512_permutexvar_epi16(order, low);
  high = _mm512_permutexvar_epi16(order, high);
}

// A Q8_0 chunk c (64 bytes) as the signed operand: dword r holds row r's weights 4c .. 4c + 3.
[[gnu::always_inline]] inline __m512i int8_row_quads(const uint8_t* chunk) {
  return _mm512_permutexvar_epi16(_mm512_load_si512(kRowQuads), _mm512_loadu_si512(chunk));
}
#endif

// Masked nibbles (0..15 in each byte) as the products take them: the codes, or MXFP4's kInt8Table values.
template <Layout L>
inline __m256i int8_codes(__m256i nibbles) {
  if constexpr (!Traits<L>::kCodeTable) return nibbles;
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kInt8Table));
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles);
}

}  // namespace serval_kernels::quantized
#endif
