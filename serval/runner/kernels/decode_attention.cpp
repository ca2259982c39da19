// Decode attention over the paged KV cache, read in place (no gather into padded tensors).
//
// One query token per sequence, which sees the last `window` tokens of its context (0: all of them; gpt-oss's
// sliding layers). A head's learned sink logit (gpt-oss), when given, joins the softmax's denominator only:
// it takes a share of the attention and gives back no value. Work is split over (sequence, kv head) pairs; each
// pair walks its context once for all G query heads that share the kv head (GQA): every K and V row is read
// and widened to fp32 once per pair, not once per head. Two passes (scores, then softmax-weighted V): exact
// softmax, not an online one.
//
// For head sizes of 32, 64 and 128 the head's query, its tiles of partial q.k sums (one token per vector lane:
// 16 on AVX-512, 8 on AVX2 and the portable variant) and its output accumulators live in vector registers;
// other sizes take the plain loop. Scores are formed by common.h's tile_scores over tiles at whole multiples
// of the tile width from position 0, as prefill_attention.cpp forms them, and the softmax and the weighted
// sum of V go in the same order: a query's output is bitwise the one a prefill chunk gives it (batch
// invariance).
//
// The cache holds q's dtype or, with `--kv-cache-dtype fp8_e5m2` or `int8`, one byte a value (K below: the cache's
// element type; an int8 cache's row scales follow its codes, common.h's Int8Row): rows are widened to fp32 as they
// are loaded (fp8 exactly, int8 as code * scale, the same products in both kernels), so an 8-bit cache's output
// is bitwise what its widened values give, and half the bytes are read (a 64-sequence step at 160 tokens, 30 layers, AMD
// family 26: 8.8 -> 5.8-6.0 ms, `bench/kv_cache_dtype.py --kernel`).
//
// Multi-head latent attention (DeepSeek's MLA, absorbed): value_dim < head_dim, k_cache and v_cache the same
// tensor of one "kv head" whose row is [latent, roped key part]; a token's value is the first value_dim values
// of its key row. The same tiles and orders as above: the latent size 512 + 64 (every DeepSeek-V2/V3 and Kimi
// checkpoint) has its own register path, its V pass in column chunks that keep each output's sum unchanged.
#include "common.h"

using namespace serval_kernels;

namespace {

struct Context {
  const int64_t* rows;  // per token from the visible keys' tile on: its K/V row's element offset in the cache
  int64_t len;
  int64_t skip;  // leading tokens of rows the query does not see (before a window's first key, same tile)
  float scale;
  const int64_t* next_rows = nullptr;  // the K rows of the task this thread takes next, to ask for early
  int64_t next_len = 0;
  const float* k_scales = nullptr;  // an int8 cache's row scales (common.h), else null
  const float* v_scales = nullptr;
};

// The plain path: any head size, any ISA.
template <typename T>
void attend_head_plain(const float* q, const T* k_cache, const T* v_cache, const Context& c, float sink,
                       int64_t head_dim, int64_t value_dim, float* scores, float* row, float* out) {
  for (int64_t t = 0; t < c.len; ++t) {
    load_cache_row(k_cache + c.rows[t], row, head_dim, row_scale(c.k_scales, c.rows[t], head_dim));
    scores[t] = dot(q, row, head_dim) * c.scale;
  }
  float m = sink;
  for (int64_t t = 0; t < c.len; ++t) m = std::max(m, scores[t]);
  float sum = std::exp(sink - m);
  for (int64_t t = 0; t < c.len; ++t) { scores[t] = std::exp(scores[t] - m); sum += scores[t]; }
  std::fill(out, out + value_dim, 0.0f);
  for (int64_t t = 0; t < c.len; ++t) {
    load_cache_row(v_cache + c.rows[t], row, value_dim, row_scale(c.v_scales, c.rows[t], head_dim));
    axpy(scores[t] / sum, row, out, value_dim);
  }
}

// Asks for the cache lines of K/V rows ahead of their use. A step's KV cache is far larger than the L3 (a
// 64-sequence step reads ~300 MB), and its rows are scattered over blocks, so the hardware prefetchers stall
// at every block boundary. 64 sequences of 200 tokens, 30 layers, 2 threads (AVX-512): 20.9 -> 16.1 ms (the
// same data hot in the L3: 7.2 ms).
template <typename T, int D>
inline void prefetch_rows(const T* cache, const int64_t* rows, int64_t begin, int64_t end,
                          const float* scales = nullptr, int64_t head_dim = D) {
  constexpr int64_t kRowBytes = D * sizeof(T);
  for (int64_t t = begin; t < end; ++t) {
    const char* p = reinterpret_cast<const char*>(cache + rows[t]);
    for (int64_t b = 0; b < kRowBytes; b += 64) simd::prefetch(p + b);
    // An int8 cache's row scales lie apart from its codes, a block's in a few lines (2-3 tokens to a line).
    if (scales != nullptr) simd::prefetch(scales + rows[t] / head_dim);
  }
}

// Tasks a thread takes at a time (at most), so that it knows the next one and asks for its keys during this one: its
// first kNextAsked rows as the softmax ends, the rest one a V row, so that the reads go on through both
// passes (the V rows are asked for in the first). Before, each task began on a stall for its first keys: 64
// sequences of 192 tokens, 30 layers, 2 threads (AMD family 26, K/V from memory, alternating builds):
// 13.2-13.9 -> 12.0-12.7 ms with the first 16 asked for, 12.3-13.5 -> 11.3-11.7 with all of them (the next
// task's rows found once, then swapped in); runs of 12 or 16 were no better than 4.
constexpr int64_t kTaskRun = 4, kNextAsked = 16;

// The lanes of the tile at t0 that the query sees (from c.skip to c.len), `outside` elsewhere.
inline simd::Vec visible(const Context& c, int64_t t0, simd::Vec a, simd::Vec outside) {
  return visible_lanes(c.skip, c.len - 1, t0 / simd::kWidth, a, outside);
}

// The V pass takes common.h's value_chunk output vectors at a time and kValueAccumulators / that many heads a
// sweep over the V rows (NH). On AVX2 (chunks of 4, 12 accumulators) a sweep takes 3 heads (the default model's
// group) and each V row is read once for them, not once a head: a row of 64 fp32 values (4 cache lines) did not
// stay in L1 from one head's sweep to the next, and the three sweeps' reads from L2 bound the pass.

// One sweep of the V pass over NH heads of a group and one chunk of CB output vectors: each V row is read and
// widened once for all NH heads. out_h = sum_t p_h,t v_t * inv_h, the tokens in order, as one head alone sums.
// On the first sweep (`ask_ahead`), each V row read asks for one of the next task's K rows of D values (past
// those asked for already), so that the memory reads go on evenly through both passes.
template <typename T, int CB, int NH, int D>
void weigh_values(const T* v_cache, const Context& c, const float* const* weights, const float* inv, int c0,
                  float* const* outs, const T* k_cache, bool ask_ahead) {
  using simd::Vec;
  constexpr int W = simd::kWidth;
  Vec acc[NH][CB];
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < CB; ++i) acc[h][i] = simd::zero();
  const int64_t ask_from = kNextAsked - c.skip, ask_end = ask_ahead ? c.next_len : 0;
  for (int64_t t = c.skip; t < c.len; ++t) {
    if (t + ask_from < ask_end) prefetch_rows<T, D>(k_cache, c.next_rows, t + ask_from, t + ask_from + 1, c.k_scales);
    const CacheRow<T> v(v_cache + c.rows[t], row_scale(c.v_scales, c.rows[t], D));
    // The weights first, then a row vector at a time: NH + 1 registers beside the accumulators (AVX2's 12
    // and the row's 4 vectors held at once left one accumulator in memory, a store and a load a token).
    Vec p[NH];
    for (int h = 0; h < NH; ++h) p[h] = simd::set1(weights[h][t]);
    for (int i = 0; i < CB; ++i) {
      const Vec row = v.load(W * (c0 + i));
      for (int h = 0; h < NH; ++h) acc[h][i] = simd::fmadd(p[h], row, acc[h][i]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    const Vec scale = simd::set1(inv[h]);
    for (int i = 0; i < CB; ++i) simd::store(outs[h] + W * (c0 + i), simd::mul(acc[h][i], scale));
  }
  // A next task longer than this one: the rest of its rows.
  if (ask_ahead) prefetch_rows<T, D>(k_cache, c.next_rows, std::max(c.len + ask_from, kNextAsked), c.next_len, c.k_scales);
}

// The G query heads that share one kv head (GQA; MLA's absorbed heads all share its one latent "head"), over one
// context. Each K row is widened to fp32 once per tile into `keys` (W rows of D, in L1) and each V row once per
// sweep of up to kValueAccumulators / CB heads, instead of once per head. 64 sequences, 9 heads over 3 kv heads
// (the default model), 30 layers, 2 threads, AVX-512 (AMD family 26): with the K/V in the L3, 6.5-6.7 -> 5.8-6.1
// ms at 192 tokens and 20.9-21.5 -> 16.9-20.5 ms at 512; from memory no change (12.3-13.7 ms at 192: the
// reads, ~22 GB/s, bound it). Each head's arithmetic is what one head alone did, in the same order: the same
// bits as before, and as a prefill chunk gives (batch invariance).
template <typename T, int D, int DV = D>  // head_dim, a multiple of 2 * kWidth; value_dim, of kValueChunk vectors
void attend_group(const float* q, int64_t group, const T* k_cache, const T* v_cache, const Context& c,
                  const float* sinks, float* scores, int64_t stride, float* keys, float* inv, float* out) {
  using simd::Vec;
  constexpr int W = simd::kWidth, C = D / W;
  // Pass 1: scores[h][t] = q_h . k_t * scale, W tokens a tile, their horizontal sums done together.
  const Vec scale = simd::set1(c.scale);
  constexpr int64_t kAhead = 16;  // tokens (AVX-512: measured against 32, 64, 96: the shortest was best)
  prefetch_rows<T, D>(k_cache, c.rows, 0, std::min(c.len, kAhead), c.k_scales);
  for (int64_t t0 = 0; t0 < c.len; t0 += W) {
    const int64_t tile = std::min<int64_t>(W, c.len - t0);
    // The K rows a tile on, and this tile's V rows for pass 2.
    prefetch_rows<T, D>(k_cache, c.rows, std::min(c.len, t0 + kAhead), std::min(c.len, t0 + kAhead + W), c.k_scales);
    prefetch_rows<T, DV>(v_cache, c.rows, t0, t0 + tile, c.v_scales, D);
    for (int64_t i = 0; i < tile; ++i) {
      const int64_t row = c.rows[t0 + i];
      load_cache_row(k_cache + row, keys + i * D, D, row_scale(c.k_scales, row, D));
    }
    for (int64_t h = 0; h < group; ++h) {
      Vec qv[C];
      for (int i = 0; i < C; ++i) qv[i] = simd::load(q + h * D + W * i);
      // scores has room for whole tiles: the lanes past the context are written but never read.
      simd::store(scores + h * stride + t0, tile_scores<C>(qv, tile, [&](int64_t i) { return keys + i * D; }, scale));
    }
  }
  // Softmax numerators (zero outside the visible keys); the division by their sum is folded into the output.
  const Vec minus_infinity = simd::set1(-INFINITY);
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores + h * stride;
    Vec vmax = minus_infinity;
    for (int64_t t = 0; t < c.len; t += W) vmax = simd::max(vmax, visible(c, t, simd::load(s + t), minus_infinity));
    const float m_scalar = std::max(simd::reduce_max(vmax), sinks[h]);
    const Vec m = simd::set1(m_scalar);
    Vec vsum = simd::zero();
    for (int64_t t = 0; t < c.len; t += W) {
      const Vec e = visible(c, t, simd::exp_nonpositive(simd::sub(simd::load(s + t), m)), simd::zero());
      simd::store(s + t, e);
      vsum = simd::add(vsum, e);
    }
    inv[h] = 1.0f / (simd::reduce_add(vsum) + std::exp(sinks[h] - m_scalar));
  }
  // The next task's first keys, asked for now (its V pass still to run here), so that it does not start on
  // a stall; the V pass asks for the rest.
  prefetch_rows<T, D>(k_cache, c.next_rows, 0, std::min(c.next_len, kNextAsked), c.k_scales);
  // Pass 2: out_h = sum_t p_h,t v_t / sum_t p_h,t, up to NH heads a sweep over the V rows.
  constexpr int CV = DV / W, CB = value_chunk(CV), NH = std::max(1, kValueAccumulators / CB);
  static_assert(DV % W == 0 && CV % CB == 0, "whole chunks of whole vectors");
  for (int64_t h0 = 0; h0 < group; h0 += NH) {
    const float* weights[NH];
    float* outs[NH];
    const int64_t heads = std::min<int64_t>(NH, group - h0);
    for (int64_t h = 0; h < heads; ++h) {
      weights[h] = scores + (h0 + h) * stride;
      outs[h] = out + (h0 + h) * DV;
    }
    for (int c0 = 0; c0 < CV; c0 += CB) {
      with_row_count<NH>(heads, [&](auto n) {
        weigh_values<T, CB, decltype(n)::value, D>(v_cache, c, weights, inv + h0, c0, outs, k_cache, h0 == 0 && c0 == 0);
      });
    }
  }
}

// A thread's buffers for its (sequence, kv head) tasks: the group's queries and outputs in fp32, its scores
// (whole tiles a head), a tile of widened keys, the plain path's row, the sinks, the softmax's 1 / sums, the
// visible tokens' row offsets, and those of the task it takes next (found during this one, then swapped in).
// Sized on a thread's first task; later tasks reuse them.
struct Scratch {
  std::vector<float> qf, acc, keys, row, scores, group_sinks, inv;
  std::vector<int64_t> rows, next_rows;
  int64_t next_task = -1;  // whose rows next_rows holds
  void size_for(int64_t group, int64_t head_dim, int64_t value_dim) {
    qf.resize(group * head_dim), acc.resize(group * value_dim), keys.resize(simd::kWidth * head_dim);
    row.resize(head_dim), group_sinks.resize(group), inv.resize(group);
  }
};

template <typename T, typename K>  // query and output, cache
void decode_attention_impl(
    const at::Tensor& q,             // (num_seqs, num_heads, head_dim)
    const at::Tensor& k_cache,       // (num_blocks, block_size, num_kv_heads, head_dim)
    const at::Tensor& v_cache,       // same
    const at::Tensor& block_tables,  // (num_seqs, max_blocks) int64
    const at::Tensor& context_lens,  // (num_seqs,) int64
    double scale,
    int64_t window,                  // the last tokens a query sees; 0: its whole context
    const float* sinks,              // (num_heads,) sink logits, or null
    at::Tensor& out) {               // (num_seqs, num_heads, value_dim)
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2), value_dim = out.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const int64_t q_row_stride = q.stride(0);  // a fused qkv row's q part: its heads contiguous, rows apart
  const K* k_ptr = reinterpret_cast<const K*>(k_cache.data_ptr());
  const K* v_ptr = reinterpret_cast<const K*>(v_cache.data_ptr());
  T* out_ptr = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t slot_stride = num_kv_heads * head_dim;  // elements between consecutive tokens
  const float* k_scales = int8_row_scales(k_cache);  // an int8 cache's, else null
  const float* v_scales = int8_row_scales(v_cache);
  const int64_t block_stride = block_size * slot_stride;

  // The visible rows of a (sequence, kv head) from token `first` up to `end`: each token's row offset, found
  // once per task (a division per token costs more than its math).
  const auto fill_rows = [&](int64_t seq, int64_t kv_head, int64_t first, int64_t end, int64_t* out) {
    for (int64_t b = first / block_size, t0 = b * block_size; t0 < end; ++b, t0 += block_size) {
      const int64_t offset = tables[seq * max_blocks + b] * block_stride + kv_head * head_dim;
      for (int64_t i = std::max<int64_t>(0, first - t0); i < block_size && t0 + i < end; ++i)
        out[t0 + i - first] = offset + i * slot_stride;
    }
  };
  // The first token a sequence's query sees (a window's first key; 0: all of them).
  const auto visible_from = [&](int64_t seq) { return window > 0 ? std::max<int64_t>(0, lens[seq] - window) : 0; };
  // Rows from the visible keys' tile on, tiles at whole multiples of the width from position 0 (as
  // prefill_attention.cpp's): the same lanes, so the same sums.
  const auto first_row = [&](int64_t seq) { return visible_from(seq) / simd::kWidth * simd::kWidth; };
  parallel_task_runs<Scratch>(num_seqs * num_kv_heads, kTaskRun, [&](int64_t task, int64_t next, Scratch& scratch) {
    scratch.size_for(group, head_dim, value_dim);
    std::vector<float> &qf = scratch.qf, &acc = scratch.acc, &keys = scratch.keys, &row = scratch.row;
    std::vector<float> &scores = scratch.scores, &group_sinks = scratch.group_sinks, &inv = scratch.inv;
    std::vector<int64_t>& rows = scratch.rows;
    const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
    const int64_t context_len = lens[seq], first = first_row(seq);
    const int64_t len = context_len - first;
    const int64_t stride = len + simd::kWidth;  // whole tiles
    scores.resize(group * stride);
    if (scratch.next_task == task) {
      rows.swap(scratch.next_rows);  // found during the task before
    } else {
      rows.resize(len);
      fill_rows(seq, kv_head, first, context_len, rows.data());
    }
    int64_t next_len = 0;
    scratch.next_task = next;
    if (next >= 0) {
      const int64_t next_seq = next / num_kv_heads, next_first = first_row(next_seq);
      next_len = lens[next_seq] - next_first;
      scratch.next_rows.resize(next_len);
      fill_rows(next_seq, next % num_kv_heads, next_first, lens[next_seq], scratch.next_rows.data());
    }
    const int64_t first_head = seq * num_heads + kv_head * group;  // the group's first head, over all sequences
    for (int64_t g = 0; g < group; ++g) {
      load_row(q_ptr + seq * q_row_stride + (kv_head * group + g) * head_dim, qf.data() + g * head_dim, head_dim);
      group_sinks[g] = sinks != nullptr ? sinks[kv_head * group + g] : -INFINITY;
    }
    const Context context{rows.data(), len, visible_from(seq) - first, static_cast<float>(scale), scratch.next_rows.data(),
                          next_len, k_scales, v_scales};
    const bool same = head_dim == value_dim;
    const auto attend = [&](auto kernel) {
      kernel(qf.data(), group, k_ptr, v_ptr, context, group_sinks.data(), scores.data(), stride, keys.data(),
             inv.data(), acc.data());
    };
    if (same && head_dim == 32) attend(attend_group<K, 32>);
    else if (same && head_dim == 64) attend(attend_group<K, 64>);
    else if (same && head_dim == 128) attend(attend_group<K, 128>);
    else if (head_dim == 576 && value_dim == 512) attend(attend_group<K, 576, 512>);
    else {
      for (int64_t g = 0; g < group; ++g)
        attend_head_plain<K>(qf.data() + g * head_dim, k_ptr, v_ptr, {rows.data() + context.skip, len - context.skip, 0,
                             context.scale, nullptr, 0, k_scales, v_scales}, group_sinks[g], head_dim, value_dim, scores.data(), row.data(),
                             acc.data() + g * value_dim);
    }
    T* o = out_ptr + first_head * value_dim;
    for (int64_t d = 0; d < group * value_dim; ++d) o[d] = static_cast<T>(acc[d]);
  });
}

}  // namespace

at::Tensor paged_decode_attention(
    at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
    at::Tensor context_lens, double scale, int64_t window, at::Tensor sinks, int64_t value_dim) {
  TORCH_CHECK(q.dim() == 3 && (q.is_contiguous() || (q.stride(2) == 1 && q.stride(1) == q.size(2))),
              "q: (sequences, heads, head_dim), each row's heads contiguous (its rows may be apart: a qkv view)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim)");
  if (value_dim == 0) value_dim = q.size(2);
  TORCH_CHECK(value_dim > 0 && value_dim <= q.size(2), "value_dim: at most head_dim (0: head_dim)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(window >= 0, "window: a token count, 0 for none");
  const float* sink_ptr = sink_logits(sinks, q.size(1));
  auto out = at::empty({q.size(0), q.size(1), value_dim}, q.options());
  auto bt = block_tables.contiguous();
  auto cl = context_lens.contiguous();
  with_attention_types(q, k_cache, v_cache, [&](auto query, auto cache) {
    decode_attention_impl<decltype(query), decltype(cache)>(q, k_cache, v_cache, bt, cl, scale, window, sink_ptr, out);
  });
  return out;
}
