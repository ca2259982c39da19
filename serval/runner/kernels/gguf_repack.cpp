// A GGUF block-quantized matrix's bytes straight into the packed layout of quantized.h, in one parallel pass:
// what serval/runner/quantization.py's pack_block_codes(loader/dequant.py's block_codes(...)) builds with
// tensor ops (which stay the reference, and serve where these kernels are not built), at memory speed instead
// of ~10 full-size temporaries per matrix. No value is converted: codes, fp16 scales and the k-quants' 6-bit
// scales are copied bit for bit, so the packed weights are the file's.
//
// ggml's block layouts (ggml-common.h), per row of K weights:
//   Q4_0 (18 bytes / 32): d | 16 bytes, weight j in the low nibble of byte j, weight j + 16 in its high one
//   Q4_1 (20 / 32):       d | m | the same nibbles
//   Q8_0 (34 / 32):       d | 32 int8
//   Q5_0 (22 / 32):       d | qh (32 bits: the fifth bit of weight j is bit j) | nibbles as Q4_0; q - 16
//   Q5_1 (24 / 32):       d | m | qh | nibbles
//   Q4_K (144 / 256):     D | Dmin | 12 bytes of 6-bit scales and mins | 128 bytes: sub-block 2c in the low
//                         nibbles of bytes 32c..32c+31, sub-block 2c + 1 in their high nibbles
//   Q5_K (176 / 256):     D | Dmin | scales | qh (32 bytes: the fifth bit of weight l of sub-block j is bit
//                         j of byte l) | 128 bytes as Q4_K
//   Q6_K (210 / 256):     ql (128) | qh (64) | 16 int8 scales (one per 16 weights) | D; q - 32
//   MXFP4 (17 / 32):      e (E8M0 exponent byte) | 16 bytes of E2M1 nibbles laid out as Q4_0's
#include "quantized.h"

using namespace serval_kernels;
using namespace serval_kernels::quantized;

namespace {

// GGML's type ids (ggml.h), the ones this file reads.
enum GgmlType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kMXFP4 = 39
};

struct Format {
  int64_t block_weights, block_bytes;
  int bits;               // of the packed codes: 4, 5, 6 or 8
  int64_t scale_weights;  // weights per scale d: 32, or 16 (Q6_K)
  bool offsets, super;
  bool e8m0 = false;  // scales: one exponent byte per 32 weights (MXFP4), copied as it is
};

constexpr Format format_of(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18, 4, 32, false, false};
    case kQ4_1: return {32, 20, 4, 32, true, false};
    case kQ8_0: return {32, 34, 8, 32, false, false};
    case kQ5_0: return {32, 22, 5, 32, false, false};
    case kQ5_1: return {32, 24, 5, 32, true, false};
    case kQ4_K: return {256, 144, 4, 32, true, true};
    case kQ5_K: return {256, 176, 5, 32, true, true};
    case kMXFP4: return {32, 17, 4, 32, false, false, true};
    default: return {256, 210, 6, 16, false, true};  // kQ6_K
  }
}

constexpr uint64_t kNibbleBytes = 0x0F0F0F0F0F0F0F0FULL, kLowBitBytes = 0x0101010101010101ULL;

// Bit i of an 8-bit value in bit 0 of byte i.
inline uint64_t spread_bits(uint32_t bits) {
  uint64_t spread = 0;
  for (int i = 0; i < 8; ++i) spread |= static_cast<uint64_t>((bits >> i) & 1) << (8 * i);
  return spread;
}

inline uint16_t read_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t read_u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// The codes of one GGUF block (block_weights of them) as the file stores them (4-, 5-, 6-bit: 0..2^bits - 1,
// Q5_0's and Q6_K's bias not subtracted; 8-bit: the int8 value's byte), and its scales: d[] (fp16 bits, or the k-quants' sub-block scales), m[] (fp16 bits,
// or 6-bit mins), super_d / super_m (fp16 bits of D and -Dmin).
struct DecodedBlock {
  uint8_t q[256];
  uint16_t d[16], m[8];
  uint16_t super_d = 0, super_m = 0;
};

// Every type but Q4_0 / Q4_1 / MXFP4, which pack_q4_group_block packs without decoding.
template <int64_t type>
inline void decode_block(const uint8_t* b, DecodedBlock& out) {
  static_assert(type != kQ4_0 && type != kQ4_1 && type != kMXFP4);
  switch (type) {
    case kQ8_0:
      std::memcpy(out.q, b + 2, 32);
      out.d[0] = read_u16(b);
      return;
    case kQ5_0:
    case kQ5_1: {
      // Eight weights a step: weight j's nibble (the low ones for j < 16, then the high ones) joined with
      // bit j of qh, each of 8 bits of qh spread to bit 4 of its byte.
      const int at = type == kQ5_0 ? 2 : 4;
      const uint32_t qh = read_u32(b + at);
      const uint8_t* qs = b + at + 4;
      for (int j = 0; j < 16; j += 8) {
        uint64_t nibbles;
        std::memcpy(&nibbles, qs + j, 8);
        const uint64_t low = (nibbles & kNibbleBytes) | (spread_bits((qh >> j) & 0xFF) << 4);
        const uint64_t high = ((nibbles >> 4) & kNibbleBytes) | (spread_bits((qh >> (j + 16)) & 0xFF) << 4);
        std::memcpy(out.q + j, &low, 8);
        std::memcpy(out.q + j + 16, &high, 8);
      }
      out.d[0] = read_u16(b);
      if (type == kQ5_1) out.m[0] = read_u16(b + 2);
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      out.super_d = read_u16(b);
      out.super_m = read_u16(b + 2) ^ 0x8000;  // -Dmin: the sign bit, exact
      const uint8_t* s = b + 4;
      for (int j = 0; j < 4; ++j) {
        out.d[j] = s[j] & 0x3F, out.m[j] = s[j + 4] & 0x3F;
        out.d[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        out.m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
      }
      // Sub-block j's weight l: a nibble of qs[32 (j / 2) + l] (low for even j), for Q5_K joined with bit j of
      // qh[l]; eight weights a step.
      const bool five_bit = type == kQ5_K;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five_bit ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        for (int l = 0; l < 32; l += 8) {
          uint64_t nibbles, top = 0;
          std::memcpy(&nibbles, qs + 32 * (j / 2) + l, 8);
          if (five_bit) std::memcpy(&top, qh + l, 8);
          const uint64_t q = ((j % 2 ? nibbles >> 4 : nibbles) & kNibbleBytes) | (((top >> j) & kLowBitBytes) << 4);
          std::memcpy(out.q + 32 * j + l, &q, 8);
        }
      }
      return;
    }
    case kQ6_K: {
      // Weight 128h + 32k + l (l 0-31) takes its low 4 bits from ql[64h + 32(k % 2) + l] (the low nibble for
      // k < 2, the high one else) and its top 2 bits from bits 2k, 2k + 1 of qh[32h + l]: eight at a time.
      constexpr uint64_t kTwoBits = 0x0303030303030303ULL;
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; l += 8) {
          uint64_t first_run, second_run, top;
          std::memcpy(&first_run, b + 64 * h + l, 8);
          std::memcpy(&second_run, b + 64 * h + 32 + l, 8);
          std::memcpy(&top, b + 128 + 32 * h + l, 8);
          const uint64_t q[4] = {(first_run & kNibbleBytes) | ((top & kTwoBits) << 4),
                                 (second_run & kNibbleBytes) | (((top >> 2) & kTwoBits) << 4),
                                 ((first_run >> 4) & kNibbleBytes) | (((top >> 4) & kTwoBits) << 4),
                                 ((second_run >> 4) & kNibbleBytes) | (((top >> 6) & kTwoBits) << 4)};
          for (int k = 0; k < 4; ++k) std::memcpy(out.q + 128 * h + 32 * k + l, &q[k], 8);
        }
      for (int g = 0; g < 16; ++g) out.d[g] = static_cast<uint8_t>(b[192 + g]);  // int8 bits
      out.super_d = read_u16(b + 208);
      return;
    }
  }
}


// The packed tensors being written, as raw pointers (quantized.h's layout; sizes in the caller).
struct Packed {
  uint8_t* codes;
  uint8_t* scales;   // fp16 d, or 8-bit sub-block scales
  uint8_t* offsets;  // fp16 m, or 6-bit mins; null: none
  uint16_t* super;   // D, -Dmin; null: none
};

// Four packed bytes from 8 consecutive codes in a 64-bit word w (byte j: code j): byte j (j 0-3) pairs the
// low nibbles of codes j and j + 4, as a chunk's byte (h, r, e) with j = 2h + e pairs weights 8c + j and
// 8c + 4 + j (quantized.h).
inline uint32_t nibble_pairs(uint64_t w) {
  return static_cast<uint32_t>((w & 0x0F0F0F0F) | (((w >> 32) & 0x0F0F0F0F) << 4));
}

// The bits above the nibble of codes j and j + 4 (bits wide each), in bits 0.. and bits.. of byte j.
template <int bits>
inline uint32_t high_bits(uint64_t w) {
  constexpr uint64_t kMask = 0x01010101ULL * ((1u << bits) - 1);
  return static_cast<uint32_t>(((w >> 4) & kMask) | (((w >> 36) & kMask) << bits));
}

// A row's four bytes of a chunk: bytes (h, r, 0) and (h, r, 1) of each half h.
inline void store_pairs(uint8_t* chunk, int64_t r, uint32_t bytes) {
  for (int h = 0; h < 2; ++h) {
    const auto pair = static_cast<uint16_t>(bytes >> (16 * h));
    std::memcpy(chunk + h * 32 + 2 * r, &pair, 2);
  }
}

// Q4_0 / Q4_1 / MXFP4, group G's rows of block i, without decoding a byte per weight: the packed chunks are the
// file's nibbles regrouped. Chunk c's byte (h, r, e) pairs weights 8c + 2h + e and 8c + 4 + 2h + e of row r
// (quantized.h); the file holds weights 0-15 in the low nibbles of its 16 bytes and 16-31 in the high ones,
// so chunks 0 and 1 pair the low nibbles of bytes j and j + 4 of each 8-byte half (j 0-3), chunks 2 and 3
// their high nibbles. Decoding a byte per weight first (the generic path below) ran at 1.2 GB/s of file
// bytes, ~0.5 s of a 1B Q4_0 model's start; this runs at ~5.
template <int64_t type>
void pack_q4_group_block(const uint8_t* src, int64_t row_bytes, int64_t num_rows, int64_t K, int64_t G, int64_t i,
                         const Packed& out) {
  constexpr int64_t kNibblesAt = type == kMXFP4 ? 1 : (type == kQ4_0 ? 2 : 4);  // after d or e (and m)
  const int64_t block = G * (K / kBlock) + i;
  uint8_t* chunks = out.codes + block * 4 * kChunkBytes;
  for (int64_t r = 0; r < kGroup; ++r) {
    uint64_t half0 = 0, half1 = 0;  // padding rows: zero codes and scales
    uint16_t d = 0, m = 0;  // MXFP4: d is the exponent byte
    if (r < num_rows) {
      const uint8_t* b = src + r * row_bytes + i * format_of(type).block_bytes;
      std::memcpy(&half0, b + kNibblesAt, 8);
      std::memcpy(&half1, b + kNibblesAt + 8, 8);
      d = type == kMXFP4 ? b[0] : read_u16(b);
      if constexpr (type == kQ4_1) m = read_u16(b + 2);
    }
    store_pairs(chunks, r, nibble_pairs(half0));
    store_pairs(chunks + kChunkBytes, r, nibble_pairs(half1));
    store_pairs(chunks + 2 * kChunkBytes, r, nibble_pairs(half0 >> 4));  // the high nibbles
    store_pairs(chunks + 3 * kChunkBytes, r, nibble_pairs(half1 >> 4));
    if constexpr (type == kMXFP4) out.scales[block * kGroup + r] = static_cast<uint8_t>(d);
    else std::memcpy(out.scales + (block * kGroup + r) * 2, &d, 2);
    if constexpr (type == kQ4_1) std::memcpy(out.offsets + (block * kGroup + r) * 2, &m, 2);
  }
}

// Group G's 16 rows (fewer in a last, padded group) of block i (block_weights along K) of every row.
template <int64_t type>
void pack_group_block(const uint8_t* src, int64_t row_bytes, int64_t num_rows, int64_t K, int64_t G, int64_t i,
                      const Packed& out) {
  constexpr Format f = format_of(type);
  constexpr int64_t kChunks = chunks_per_block(f.bits), kScales = f.block_weights / f.scale_weights;
  constexpr int64_t kBlocks32 = f.block_weights / kBlock, kScaleSize = f.super ? 1 : 2;
  DecodedBlock rows[kGroup];
  for (int64_t r = 0; r < kGroup; ++r) {
    if (r < num_rows) decode_block<type>(src + r * row_bytes + i * f.block_bytes, rows[r]);
    else rows[r] = DecodedBlock{};  // padding rows: zero codes and scales
  }
  // Each 32-weight block's chunks (quantized.h), byte (half h, row r, element e): per scale block, its nibble
  // chunks, then for 5 and 6 bits its chunk of high bits; or the int8 chunks.
  const int64_t blocks32 = K / kBlock;
  constexpr int kHighBits = f.bits == 8 ? 0 : f.bits - 4;
  constexpr int64_t kNibbleChunks = f.scale_weights / 8;
  for (int64_t b = 0; b < kBlocks32; ++b) {
    uint8_t* chunk = out.codes + (G * blocks32 + i * kBlocks32 + b) * kChunks * kChunkBytes;
    for (int64_t first = b * kBlock; first < (b + 1) * kBlock; first += f.scale_weights) {  // each scale block
      if constexpr (f.bits == 8) {
        for (int64_t c = 0; c < kChunks; ++c)
          for (int64_t h = 0; h < 2; ++h)
            for (int64_t r = 0; r < kGroup; ++r)
              for (int64_t e = 0; e < 2; ++e) *chunk++ = rows[r].q[first + 2 * (2 * c + h) + e];
      } else {
        // A row at a time, four bytes of each chunk from a word of 8 codes: the nibble chunks, then the
        // chunk of the bits above them (5- and 6-bit codes), byte j holding those of weights 8c + 4n + j at
        // bit kHighBits * (2c + n).
        for (int64_t r = 0; r < kGroup; ++r) {
          uint32_t high = 0;
          for (int64_t c = 0; c < kNibbleChunks; ++c) {
            uint64_t codes;
            std::memcpy(&codes, rows[r].q + first + 8 * c, 8);
            store_pairs(chunk + c * kChunkBytes, r, nibble_pairs(codes));
            if constexpr (kHighBits > 0) high |= high_bits<kHighBits>(codes) << (kHighBits * 2 * c);
          }
          if constexpr (kHighBits > 0) store_pairs(chunk + kNibbleChunks * kChunkBytes, r, high);
        }
        chunk += (kNibbleChunks + (kHighBits > 0 ? 1 : 0)) * kChunkBytes;
      }
    }
  }
  for (int64_t s = 0; s < kScales; ++s) {
    const int64_t at = (G * (K / f.scale_weights) + i * kScales + s) * kGroup;
    for (int64_t r = 0; r < kGroup; ++r) {
      if constexpr (kScaleSize == 2) std::memcpy(out.scales + (at + r) * 2, &rows[r].d[s], 2);
      else out.scales[at + r] = static_cast<uint8_t>(rows[r].d[s]);
    }
  }
  if constexpr (f.offsets) {
    for (int64_t s = 0; s < kBlocks32; ++s) {
      const int64_t at = (G * blocks32 + i * kBlocks32 + s) * kGroup;
      for (int64_t r = 0; r < kGroup; ++r) {
        if constexpr (kScaleSize == 2) std::memcpy(out.offsets + (at + r) * 2, &rows[r].m[s], 2);
        else out.offsets[at + r] = static_cast<uint8_t>(rows[r].m[s]);
      }
    }
  }
  if constexpr (f.super) {
    uint16_t* at = out.super + (G * (K / kSuperWeights) + i) * 2 * kGroup;
    for (int64_t r = 0; r < kGroup; ++r) at[r] = rows[r].super_d, at[kGroup + r] = rows[r].super_m;
  }
}

template <int64_t type>
void pack_all(const uint8_t* src, int64_t rows, int64_t K, const Packed& out) {
  constexpr Format f = format_of(type);
  const int64_t row_bytes = K / f.block_weights * f.block_bytes, groups = (rows + kGroup - 1) / kGroup;
  parallel_chunks(groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t G = begin; G < end; ++G) {
      const uint8_t* group = src + G * kGroup * row_bytes;
      const int64_t num_rows = std::min(kGroup, rows - G * kGroup);
      for (int64_t i = 0; i < K / f.block_weights; ++i) {
        if constexpr (type == kQ4_0 || type == kQ4_1 || type == kMXFP4)
          pack_q4_group_block<type>(group, row_bytes, num_rows, K, G, i, out);
        else
          pack_group_block<type>(group, row_bytes, num_rows, K, G, i, out);
      }
    }
  });
}

}  // namespace

// The four buffers (codes, scales, offsets, super_scales) of `rows` rows of a `type` matrix K wide, allocated
// and unfilled, rows padded to whole groups of 16; an absent one is empty.
std::vector<at::Tensor> gguf_packed_buffers(int64_t type, int64_t rows, int64_t K) {
  TORCH_CHECK(type == kQ4_0 || type == kQ4_1 || type == kQ8_0 || type == kQ5_0 || type == kQ5_1 || type == kQ4_K ||
              type == kQ5_K || type == kQ6_K || type == kMXFP4, "GGML type ", type, " has no packed form");
  const Format f = format_of(type);
  TORCH_CHECK(K % f.block_weights == 0, "K: whole blocks of ", f.block_weights);
  const int64_t groups = (rows + kGroup - 1) / kGroup, blocks32 = K / kBlock;
  const auto options = at::TensorOptions();
  auto codes = at::empty({groups, blocks32, chunks_per_block(f.bits), kChunkBytes},
                            options.dtype(f.bits == 8 ? at::kChar : at::kByte));
  const auto scale_type = f.e8m0 ? at::kByte : (!f.super ? at::kHalf : (type == kQ6_K ? at::kChar : at::kByte));
  auto scales = at::empty({groups, K / f.scale_weights, kGroup}, options.dtype(scale_type));
  auto offsets = f.offsets ? at::empty({groups, blocks32, kGroup}, options.dtype(f.super ? at::kByte : at::kHalf))
                           : at::empty({0});
  auto super = f.super ? at::empty({groups, K / kSuperWeights, 2, kGroup}, options.dtype(at::kHalf))
                       : at::empty({0});
  return {codes, scales, offsets, super};
}

// raw: (rows, K / block weights * block bytes) uint8, the matrix's bytes, packed into `out` (buffers of
// gguf_packed_buffers for this type and K, of at least first_group + ceil(rows / 16) groups) from group
// first_group on: the shards of a fused matrix go straight into its one set of buffers.
void pack_gguf_blocks_into(at::Tensor raw, int64_t type, int64_t rows, int64_t K, std::vector<at::Tensor> out,
                           int64_t first_group) {
  const auto like = gguf_packed_buffers(type, kGroup, K);  // one group: the shapes past the first dimension
  TORCH_CHECK(out.size() == 4 && first_group >= 0, "out: codes, scales, offsets, super_scales");
  const int64_t groups = (rows + kGroup - 1) / kGroup;
  for (size_t i = 0; i < 4; ++i) {
    if (like[i].numel() == 0) {
      TORCH_CHECK(out[i].numel() == 0, "out[", i, "]: this type has none");
      continue;
    }
    TORCH_CHECK(out[i].scalar_type() == like[i].scalar_type() && out[i].is_contiguous() &&
                    out[i].dim() == like[i].dim() && out[i].sizes().slice(1) == like[i].sizes().slice(1) &&
                    out[i].size(0) >= first_group + groups,
                "out[", i, "]: not this type's buffer for K = ", K, " and ", first_group + groups, " groups");
  }
  const Format f = format_of(type);
  const int64_t row_bytes = K / f.block_weights * f.block_bytes;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() == rows * row_bytes,
              "raw: the matrix's bytes, (rows, row bytes) uint8");
  auto at = [&](size_t i) {
    return static_cast<uint8_t*>(out[i].data_ptr()) + first_group * out[i].stride(0) * out[i].element_size();
  };
  const Packed packed{at(0), at(1), f.offsets ? at(2) : nullptr,
                      f.super ? reinterpret_cast<uint16_t*>(at(3)) : nullptr};
  const uint8_t* src = raw.data_ptr<uint8_t>();
  switch (type) {
    case kQ4_0: pack_all<kQ4_0>(src, rows, K, packed); break;
    case kQ4_1: pack_all<kQ4_1>(src, rows, K, packed); break;
    case kQ8_0: pack_all<kQ8_0>(src, rows, K, packed); break;
    case kQ5_0: pack_all<kQ5_0>(src, rows, K, packed); break;
    case kQ5_1: pack_all<kQ5_1>(src, rows, K, packed); break;
    case kQ4_K: pack_all<kQ4_K>(src, rows, K, packed); break;
    case kQ5_K: pack_all<kQ5_K>(src, rows, K, packed); break;
    case kMXFP4: pack_all<kMXFP4>(src, rows, K, packed); break;
    default: pack_all<kQ6_K>(src, rows, K, packed); break;
  }
}

// raw: (rows, K / block weights * block bytes) uint8, the matrix's bytes. Returns [codes, scales, offsets,
// super_scales] as PackedWeight holds them (an absent one empty), rows padded to whole groups of 16.
std::vector<at::Tensor> pack_gguf_blocks(at::Tensor raw, int64_t type, int64_t rows, int64_t K) {
  auto out = gguf_packed_buffers(type, rows, K);
  pack_gguf_blocks_into(raw, type, rows, K, out, 0);
  return out;
}
