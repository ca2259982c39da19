// One fp32 vector type for the kernels, whichever instruction set this variant is compiled for.
//
// The same kernel sources are compiled once per variant (serval/runner/kernels/__init__.py): with AVX-512
// flags a Vec is a __m512 (16 lanes), with AVX2+FMA+F16C a __m256 (8 lanes), and in the portable variant
// an array of 8 floats whose loops the compiler vectorizes for whatever the baseline is (SSE2, NEON).
// Algorithms are written once against kWidth lanes; only these few operations differ per ISA.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Float8_e5m2.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace serval_kernels::simd {

// Whether x is a NaN, from its bits: the kernels build with -ffast-math, under which std::isnan and x != x may
// be folded to false.
inline bool is_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

#if defined(__AVX512F__)
constexpr int kWidth = 16;
struct Vec { __m512 v; };

inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec set1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec load(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit left shift of the bits
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline Vec load(const at::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
// fp8 e5m2 is the high byte of an fp16: widened to 16 bits by a shift, then converted exactly.
inline Vec load(const at::Float8_e5m2* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8))};
}
// 8-bit integers (kWidth of them) as floats: the sub-block scales of k-quant weights.
inline Vec load(const uint8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))}; }
inline Vec load(const int8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))}; }
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
inline Vec div(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
// Lanes [0, count) from a, the rest from b.
inline Vec first_lanes(int64_t count, Vec a, Vec b) {
  const __mmask16 mask = count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << std::max<int64_t>(count, 0)) - 1);
  return {_mm512_mask_mov_ps(b.v, mask, a.v)};
}
inline Vec round_nearest(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT)}; }
inline Vec times_pow2(Vec a, Vec n) { return {_mm512_scalef_ps(a.v, n.v)}; }
// Whether any lane of a is greater than b's (false for NaN lanes, as the scalar a > b).
inline bool any_greater(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ) != 0; }
inline bool any_nan(Vec a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q) != 0; }
// The lanes rounded to bf16 as c10's float -> BFloat16 rounds them (to nearest even; NaN: 0x7FC0), to p.
inline void store(at::BFloat16* p, Vec a) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
// fp32 -> fp8 e5m2 (an 8-bit KV cache) as c10's fp8e5m2_from_fp32_value rounds, so that the native cache writes
// equal torch's .to(torch.float8_e5m2): to nearest even; from 65536 on inf (0x7C), NaN 0x7F; below 2^-14 the
// float add of 128 aligns the subnormal's mantissa (and rounds it).
inline void store(at::Float8_e5m2* p, Vec a) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(INT32_MIN));
  const __m512i mag = _mm512_xor_si512(bits, sign);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, 21), _mm512_set1_epi32(1));
  const __m512i rebias = _mm512_set1_epi32(static_cast<int32_t>((uint32_t(15 - 127) << 23) + 0xFFFFF));
  const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(mag, rebias), odd), 21);
  const __m512i denorm = _mm512_set1_epi32(134 << 23);
  const __m512i subnormal = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(mag), _mm512_castsi512_ps(denorm))), denorm);
  __m512i r = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(113 << 23)), subnormal);
  const __m512i special = _mm512_mask_mov_epi32(_mm512_set1_epi32(0x7C),
                                                _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(255 << 23)),
                                                _mm512_set1_epi32(0x7F));
  r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epi32_mask(mag, _mm512_set1_epi32(143 << 23)), special);
  r = _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(r));
}
// Lanes holding whole numbers within Code's range (int8_t or int16_t) stored as Code; returns their sum.
template <typename Code>
inline int32_t store_whole(Vec a, Code* p) {
  const __m512i i = _mm512_cvtps_epi32(a.v);
  if constexpr (sizeof(Code) == 1) _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(i));
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(i));
  return _mm512_reduce_add_epi32(i);
}

// Lane i of the result is the sum of the lanes of v[i]: 16 horizontal sums in 45 shuffles and adds
// instead of 16 separate reductions.
inline Vec sum_each(const Vec* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit chunk: the chunk's sum of each of 4 vectors
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD))};
}

#elif defined(__AVX2__)
constexpr int kWidth = 8;
struct Vec { __m256 v; };

inline Vec zero() { return {_mm256_setzero_ps()}; }
inline Vec set1(float x) { return {_mm256_set1_ps(x)}; }
inline Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vec load(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
}
inline Vec load(const at::Half* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline Vec load(const at::Float8_e5m2* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8))};
}
inline Vec load(const uint8_t* p) { return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))}; }
inline Vec load(const int8_t* p) { return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))}; }
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline float reduce_add(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec first_lanes(int64_t count, Vec a, Vec b) {
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 take = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(count)), _CMP_LT_OQ);
  return {_mm256_blendv_ps(b.v, a.v, take)};
}
inline Vec round_nearest(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline bool any_greater(Vec a, Vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ)) != 0; }
inline bool any_nan(Vec a) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)) != 0; }
inline void store(at::BFloat16* p, Vec a) {
  const __m256i u = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);  // values <= 0xFFFF: exact
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store(at::Float8_e5m2* p, Vec a) {  // as the AVX-512 one (magnitudes < 2^31: signed compares)
  const __m256i bits = _mm256_castps_si256(a.v);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN));
  const __m256i mag = _mm256_xor_si256(bits, sign);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(mag, 21), _mm256_set1_epi32(1));
  const __m256i rebias = _mm256_set1_epi32(static_cast<int32_t>((uint32_t(15 - 127) << 23) + 0xFFFFF));
  const __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(mag, rebias), odd), 21);
  const __m256i denorm = _mm256_set1_epi32(134 << 23);
  const __m256i subnormal = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(mag), _mm256_castsi256_ps(denorm))), denorm);
  __m256i r = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(113 << 23), mag));
  const __m256i special = _mm256_blendv_epi8(_mm256_set1_epi32(0x7C), _mm256_set1_epi32(0x7F),
                                             _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(255 << 23)));
  r = _mm256_blendv_epi8(r, special, _mm256_cmpgt_epi32(mag, _mm256_set1_epi32((143 << 23) - 1)));
  r = _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
  const __m256i low_bytes = _mm256_shuffle_epi8(
      r, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const uint64_t packed = static_cast<uint32_t>(_mm256_extract_epi32(low_bytes, 0)) |
                          static_cast<uint64_t>(static_cast<uint32_t>(_mm256_extract_epi32(low_bytes, 4))) << 32;
  std::memcpy(p, &packed, sizeof(packed));
}
template <typename Code>
inline int32_t store_whole(Vec a, Code* p) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_cvtps_epi32(a.v));
  int32_t sum = 0;
  for (int i = 0; i < 8; ++i) sum += p[i] = static_cast<Code>(lanes[i]);
  return sum;
}
// a * 2^n for integral n in [-126, 127]: n goes straight into the exponent bits.
inline Vec times_pow2(Vec a, Vec n) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(a.v, _mm256_castsi256_ps(bits))};
}

// Lane i of the result is the sum of the lanes of v[i] (8 vectors): three rounds of pairwise adds.
inline Vec sum_each(const Vec* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0].v, v[1].v), t1 = _mm256_hadd_ps(v[2].v, v[3].v);
  const __m256 t2 = _mm256_hadd_ps(v[4].v, v[5].v), t3 = _mm256_hadd_ps(v[6].v, v[7].v);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: 4 partial sums
  return {_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))};
}

#else
// Portable: plain loops over 8 lanes, vectorized by the compiler for the target's baseline.
constexpr int kWidth = 8;
struct Vec { float v[8]; };

#define SERVAL_LANES(expr) \
  Vec r;                   \
  for (int i = 0; i < 8; ++i) r.v[i] = (expr); \
  return r
inline Vec zero() { SERVAL_LANES(0.0f); }
inline Vec set1(float x) { SERVAL_LANES(x); }
inline Vec load(const float* p) { SERVAL_LANES(p[i]); }
inline Vec load(const at::BFloat16* p) { SERVAL_LANES(static_cast<float>(p[i])); }
inline Vec load(const at::Half* p) { SERVAL_LANES(static_cast<float>(p[i])); }
inline Vec load(const at::Float8_e5m2* p) { SERVAL_LANES(static_cast<float>(p[i])); }
inline Vec load(const uint8_t* p) { SERVAL_LANES(static_cast<float>(p[i])); }
inline Vec load(const int8_t* p) { SERVAL_LANES(static_cast<float>(p[i])); }
inline Vec add(Vec a, Vec b) { SERVAL_LANES(a.v[i] + b.v[i]); }
inline Vec sub(Vec a, Vec b) { SERVAL_LANES(a.v[i] - b.v[i]); }
inline Vec mul(Vec a, Vec b) { SERVAL_LANES(a.v[i] * b.v[i]); }
inline Vec fmadd(Vec a, Vec b, Vec c) { SERVAL_LANES(a.v[i] * b.v[i] + c.v[i]); }
inline Vec max(Vec a, Vec b) { SERVAL_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline Vec min(Vec a, Vec b) { SERVAL_LANES(a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
inline Vec div(Vec a, Vec b) { SERVAL_LANES(a.v[i] / b.v[i]); }
inline Vec first_lanes(int64_t count, Vec a, Vec b) { SERVAL_LANES(i < count ? a.v[i] : b.v[i]); }
inline Vec round_nearest(Vec a) { SERVAL_LANES(std::nearbyint(a.v[i])); }
inline Vec times_pow2(Vec a, Vec n) { SERVAL_LANES(std::ldexp(a.v[i], static_cast<int>(n.v[i]))); }
inline Vec sum_each(const Vec* v) {
  Vec r;
  for (int i = 0; i < 8; ++i) {
    float s = 0.0f;
    for (int j = 0; j < 8; ++j) s += v[i].v[j];
    r.v[i] = s;
  }
  return r;
}
#undef SERVAL_LANES
inline void store(float* p, Vec a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline float reduce_add(Vec a) {
  float s = 0.0f;
  for (float x : a.v) s += x;
  return s;
}
inline float reduce_max(Vec a) {
  float m = a.v[0];
  for (float x : a.v) m = x > m ? x : m;
  return m;
}
inline void store(at::BFloat16* p, Vec a) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<at::BFloat16>(a.v[i]);
}
inline void store(at::Float8_e5m2* p, Vec a) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<at::Float8_e5m2>(a.v[i]);
}
inline bool any_nan(Vec a) {
  bool any = false;
  for (int i = 0; i < 8; ++i) any |= is_nan(a.v[i]);
  return any;
}
inline bool any_greater(Vec a, Vec b) {
  bool any = false;
  for (int i = 0; i < 8; ++i) any |= a.v[i] > b.v[i];
  return any;
}
template <typename Code>
inline int32_t store_whole(Vec a, Code* p) {
  int32_t sum = 0;
  for (int i = 0; i < 8; ++i) sum += p[i] = static_cast<Code>(a.v[i]);
  return sum;
}
#endif

// e^x for x <= 0 (softmax after subtracting the max): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, and a
// degree-6 polynomial (relative error ~2e-7, below fp32 rounding of the sums it feeds).
inline Vec exp_nonpositive(Vec x) {
  x = max(x, set1(-87.0f));  // e^-87 is already below the smallest normal float
  const Vec n = round_nearest(mul(x, set1(1.44269504089f)));
  Vec r = fmadd(n, set1(-0.693145751953125f), x);
  r = fmadd(n, set1(-1.428606765330187e-06f), r);
  Vec p = set1(1.0f / 720);
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return times_pow2(p, n);
}

// e^x for x <= 88 (larger x taken as 88: e^88 ~ 1.65e38 is still finite): exp_nonpositive's range reduction and
// polynomial hold up there too (2^n with n <= 127).
inline Vec exp_bounded(Vec x) { return exp_nonpositive(min(x, set1(88.0f))); }

// Asks for the cache line at p ahead of its use (a no-op where the target has no prefetch instruction).
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

#if defined(__AVX2__)
// acc += v (int32 lanes), written into acc's own register. For sums carried around a loop and read after it,
// GCC 12 added each step into a fresh register and copied the sum back: a register move per sum and step, 8
// beside the 8 VPMADDWDs of quantized_linear.cpp's int16 passes, decoder slots the multiplies needed.
[[gnu::always_inline]] inline void add_in_place_epi32(__m256i& acc, __m256i v) {
  asm("vpaddd %1, %0, %0" : "+x"(acc) : "x"(v));
}
#endif

}  // namespace serval_kernels::simd
