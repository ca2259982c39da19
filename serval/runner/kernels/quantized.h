// The packed 4-bit / 8-bit weight layout shared by quantized_linear.cpp (few rows of x: integer dot products)
// and quantized_tiles.cpp (many rows: weights dequantized a tile at a time, fp32 FMAs). The layout itself is
// described in quantized_linear.cpp and written by serval/runner/quantization.py.
#pragma once
#include "common.h"

namespace serval_kernels::quantized {

constexpr int64_t kBlock = 32;  // weights per block along K
constexpr int64_t kGroup = 16;  // output rows per packed group

constexpr int64_t block_bytes(bool four_bit) { return (four_bit ? 4 : 8) * 64; }

// One block of one group as q[k][row] (k the weight's index in the block, row in the group): 4-bit codes
// 0..15, 8-bit codes -128..127. Byte i of chunk c is (half h, row r, element e) = (i / 32, i % 32 / 2, i % 2);
// 4-bit: its low nibble is weight 2(4c + h) + e, its high nibble weight 2(4c + 2 + h) + e; 8-bit: it is
// weight 2(2c + h) + e.
template <bool kFourBit>
inline void unpack_block(const uint8_t* block, int16_t q[kBlock][kGroup]) {
  constexpr int kChunks = kFourBit ? 4 : 8;
  for (int c = 0; c < kChunks; ++c) {
    for (int h = 0; h < 2; ++h) {
      for (int e = 0; e < 2; ++e) {
        const uint8_t* bytes = block + c * 64 + h * 32 + e;
        for (int r = 0; r < kGroup; ++r) {
          const uint8_t byte = bytes[2 * r];
          if constexpr (kFourBit) {
            q[2 * (4 * c + h) + e][r] = byte & 0x0F;
            q[2 * (4 * c + 2 + h) + e][r] = byte >> 4;
          } else {
            q[2 * (2 * c + h) + e][r] = static_cast<int8_t>(byte);
          }
        }
      }
    }
  }
}

// out[m, 16 G + n] = sum_k x[m, k] w[16 G + n, k] for every group G and row m, with w dequantized in fp32
// (exactly the file's weights). out has out_stride floats a row.
void matmul_dequantized_tiles(const float* x, int64_t M, int64_t K, const uint8_t* codes, int64_t group_bytes,
                              const at::Half* scales, const at::Half* offsets, bool four_bit, int64_t num_groups,
                              float* out, int64_t out_stride);

}  // namespace serval_kernels::quantized
