// AMX's int8 tile products (Sapphire Rapids and later Xeons) for quantized_int8.cpp's matmuls of 16 rows of x
// or more, in the `avx512` build: chosen at run time where the CPU has AMX-INT8 and Linux grants the process
// its tile state, since the build also serves AVX-512 CPUs without it (Zen 4 and 5, Ice Lake).
//
// One TDPBSUD multiplies 16 rows of x by a scale block's 32 weights of a group's 16 rows: 8,192 products, which
// take the AVX-512 passes 128 VPDPBUSDs. The block's sums are exact integers either way, and each is scaled into
// fp32 exactly as those passes scale it (y = fma(dot, d dx, y), then y = fma(m, sum(x_b), y), block after block),
// so a row's numbers are the same bits whichever path computed them, and whatever rows share its call (batch
// invariance). What is left per block is that scaling, about 5 vector operations a row of x; llama.cpp's AMX
// kernels (ggml-cpu/amx) likewise scale each block's tile in AVX-512 registers.
//
// A group is taken a span of scale blocks at a time: its codes unpacked into B tiles (8 rows of 64 bytes: row
// k holds each output row's weights 4k .. 4k + 3, the order the AVX-512 passes' permute gives them) with their
// d and m, on the stack; every tile of 16 rows of x then goes over the span with its 16 rows' sums in registers.
#pragma once
#include "int8_codes.h"

#if defined(__AVX512VNNI__) && defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#define SERVAL_HAS_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <vector>

namespace serval_kernels::quantized::amx {

constexpr int64_t kTileRows = 16;  // rows of x a tile product takes
constexpr int64_t kSpan = 8;       // scale blocks unpacked at a time: 4 KB of B tiles

// Whether this process may use AMX-INT8: the CPU has it (CPUID 7: EDX bits 24 and 25), Linux (5.16 on) grants
// the process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), and SERVAL_DISABLE_AMX is
// not 1 (to compare the two paths). Asked once, on the calling thread, before any thread touches a tile.
inline bool usable() {
  static const bool granted = [] {
    const char* off = std::getenv("SERVAL_DISABLE_AMX");
    if (off != nullptr && std::strcmp(off, "1") == 0) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0 || ((d >> 24) & 3) != 3) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

// The tiles: 0 and 1 sums (16 x 16 int32), 2 and 3 x (16 rows x 32 codes), 4 and 5 weights (8 x 64 bytes),
// two of each so that one block's product runs while the other's sums are scaled.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 32, 32, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 8, 8};
};

// Holds the tile configuration on this thread for a run of groups (every thread loads its own; the tiles are
// released after, so nothing else running on the thread finds them configured).
class TileScope {
 public:
  [[gnu::target("amx-tile")]] TileScope() {
    static constexpr TileConfig kConfig{};
    _tile_loadconfig(&kConfig);
  }
  [[gnu::target("amx-tile")]] ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// A span of a group's scale blocks as the tile products take them: the codes (unsigned nibbles, or Q8_0's signed
// bytes), each block's d and m, and for Q8_0 128 times each output row's code sum (x comes as x + 128: below).
struct alignas(64) Stage {
  uint8_t codes[kSpan][8][64];
  float d[kSpan][kGroup], m[kSpan][kGroup];
  int32_t shift[kSpan][kGroup];
};

template <Layout L>
inline void stage_span(const PackedMatrix& w, int64_t G, int64_t s0, int64_t n, Stage& stage) {
  constexpr int kChunks = Traits<L>::kChunks;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t s = s0 + b;
    const uint8_t* block = w.codes + G * w.group_bytes + s * kChunks * kChunkBytes;
    if constexpr (L == Layout::kQ8) {
      const __m512i one_twenty_eight = _mm512_set1_epi8(static_cast<char>(0x80));
      __m512i shift = _mm512_setzero_si512();
      for (int c = 0; c < kChunks; ++c) {
        const __m512i codes = int8_row_quads(block + c * kChunkBytes);
        shift = _mm512_dpbusd_epi32(shift, one_twenty_eight, codes);
        _mm512_store_si512(stage.codes[b][c], codes);
      }
      _mm512_store_si512(stage.shift[b], shift);
      block_scales<L>(w, G, s, stage.d[b], stage.m[b]);
    } else {
      for (int c = 0; c < kChunks; ++c) {  // B rows 2c and 2c + 1: weights 8c .. 8c + 3 and 8c + 4 .. 8c + 7
        __m512i low, high;
        nibble_row_quads<L>(block + c * kChunkBytes, low, high);
        _mm512_store_si512(stage.codes[b][2 * c], low);
        _mm512_store_si512(stage.codes[b][2 * c + 1], high);
      }
      int8_block_scales<L>(w, G, s, stage.d[b], stage.m[b]);
    }
  }
}

// x's block scales and sums as the tiles take them: for each tile of 16 rows and each scale block, the 16 rows'
// values side by side (so that scaling a block's sums reads them at fixed offsets from one pointer).
struct TileScales {
  std::vector<float> scales, sums;  // (rows / 16, K / 32, 16)
};

inline TileScales tile_scales(const QuantizedRows<int8_t>& xq, int64_t rows, int64_t num_blocks) {
  TileScales by_tile{std::vector<float>(rows * num_blocks), std::vector<float>(rows * num_blocks)};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t s = 0; s < num_blocks; ++s) {
      const int64_t at = (r / kTileRows * num_blocks + s) * kTileRows + r % kTileRows;
      by_tile.scales[at] = xq.scales[r * num_blocks + s];
      by_tile.sums[at] = xq.sums[r * num_blocks + s];
    }
  return by_tile;
}

// y[r] += a block's sums for a tile's 16 rows (dots: 16 x 16 int32, row r of x in row r), scaled as the
// AVX-512 passes scale them; dx, sums: the 16 rows' scales and sums for this block.
template <Layout L>
[[gnu::always_inline]] inline void scale_block(const int32_t* dots, const Stage& stage, int64_t b, const float* dx,
                                               const float* sums, __m512 (&y)[kTileRows]) {
  const __m512 dv = _mm512_load_ps(stage.d[b]), mv = _mm512_load_ps(stage.m[b]);
  for (int r = 0; r < kTileRows; ++r) {
    __m512i dot = _mm512_load_si512(dots + r * kGroup);
    if constexpr (L == Layout::kQ8) dot = _mm512_sub_epi32(dot, _mm512_load_si512(stage.shift[b]));
    y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(dx[r])), y[r]);
    if constexpr (L != Layout::kQ8) y[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sums[r]), y[r]);
  }
}

// A tile of 16 rows of x (x: row 0's first code of the span, rows K apart) times the span's n staged blocks:
// block b's 16 x 16 integer sums into sums[b]. Two blocks at a time, in tiles 0 to 5 (TileConfig).
template <Layout L>
[[gnu::target("amx-tile,amx-int8")]] inline void tile_products(const Stage& stage, const int8_t* x, int64_t K,
                                                               int64_t n, int32_t (*sums)[kTileRows * kGroup]) {
  for (int64_t b = 0; b < n; b += 2) {
    _tile_zero(0);
    _tile_loadd(2, x + b * kBlock, K);
    _tile_loadd(4, stage.codes[b], 64);
    if constexpr (L == Layout::kQ8) _tile_dpbusd(0, 2, 4);
    else _tile_dpbsud(0, 2, 4);
    if (b + 1 < n) {
      _tile_zero(1);
      _tile_loadd(3, x + (b + 1) * kBlock, K);
      _tile_loadd(5, stage.codes[b + 1], 64);
      if constexpr (L == Layout::kQ8) _tile_dpbusd(1, 3, 5);
      else _tile_dpbsud(1, 3, 5);
    }
    _tile_stored(0, sums[b], kGroup * 4);
    if (b + 1 < n) _tile_stored(1, sums[b + 1], kGroup * 4);
  }
}

// out[r][0:16] = group G's products with rows 0 .. rows of x (a multiple of 16), over all of K; the thread holds
// a TileScope. Q8_0's signed codes take x + 128 (split_for_int8<true>, as the AVX-512 pass does) through
// TDPBUSD, less 128 times the codes' sum; the 4-bit layouts' unsigned codes take x as it is through TDPBSUD.
// The tile products of the next 16 rows are issued before this tile's sums are scaled, into the other half of
// `dots`: scaling reads sums that were stored a tile earlier, not ones a tile store has still to write.
template <Layout L>
[[gnu::target("amx-tile,amx-int8")]] void group_tiles(const PackedMatrix& w, int64_t G,
                                                      const QuantizedRows<int8_t>& xq, const TileScales& by_tile,
                                                      int64_t rows, float* out, int64_t out_stride) {
  const int64_t K = w.K, num_blocks = K / kBlock;
  Stage stage;
  alignas(64) int32_t dots[2][kSpan][kTileRows * kGroup];
  for (int64_t s0 = 0; s0 < num_blocks; s0 += kSpan) {
    const int64_t n = std::min(kSpan, num_blocks - s0);
    stage_span<L>(w, G, s0, n, stage);
    tile_products<L>(stage, xq.codes.data() + s0 * kBlock, K, n, dots[0]);
    for (int64_t t = 0; t < rows; t += kTileRows) {
      const int half = static_cast<int>(t / kTileRows % 2);
      if (t + kTileRows < rows)
        tile_products<L>(stage, xq.codes.data() + (t + kTileRows) * K + s0 * kBlock, K, n, dots[1 - half]);
      __m512 y[kTileRows];
      for (int r = 0; r < kTileRows; ++r)
        y[r] = s0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (t + r) * out_stride);
      const int64_t at = (t / kTileRows * num_blocks + s0) * kTileRows;
      for (int64_t b = 0; b < n; ++b)
        scale_block<L>(dots[half][b], stage, b, by_tile.scales.data() + at + b * kTileRows,
                       by_tile.sums.data() + at + b * kTileRows, y);
      for (int r = 0; r < kTileRows; ++r) _mm512_storeu_ps(out + (t + r) * out_stride, y[r]);
    }
  }
}

}  // namespace serval_kernels::quantized::amx
#endif
