// Prefill attention over the paged KV cache: every query row of every prefilling sequence in one call.
//
// A sequence's new tokens are the last query_len positions of its context: row i sits at position
// context_len - query_len + i and sees keys 0..that position (causal, after whatever prefix was cached), or
// only the last `window` of them (gpt-oss's sliding layers). A head's learned sink logit (gpt-oss), when
// given, joins each row's softmax denominator and gives back no value. K and
// V are read from the cache, where the step's own rows were written first, so a prefix-cache hit or a later
// prefill chunk needs no gather and no mask tensor.
//
// Work is split into tasks of (sequence, kv head, block of 16 query rows), the heaviest (last rows) first. A
// task's G query heads sharing the kv head take its keys a chunk at a time (16 KB of fp32 rows, widened once and
// kept in L1): scores for all of the task's rows, then an exact softmax (max, exp, sum) a row, then the
// softmax-weighted sum of V, again a chunk of values at a time for all rows. Scores are formed a tile of
// kWidth keys (16 on AVX-512, 8 on AVX2) at a time by common.h's tile_scores, tiles at whole multiples of the
// width from position 0, exactly as decode_attention.cpp forms them, and the softmax and the sum of V go in
// the same order: a row's output does not depend on the chunk it is computed in, nor on whether it is decoded
// (batch invariance; chunked prefill, a prefix-cache hit and a one-token chunk included). Rows go several at a
// time through V (value_rows) so that enough independent FMA chains are in flight.
// (Until 2026-12-06 K went transposed into the tiles, a row's scores lane-wise FMAs of the broadcast query
// with no horizontal sums: cheaper, but summed in another order than a decode's.)
//
// Multi-head latent attention (value_dim < head_dim, k_cache and v_cache one tensor): a token's value is the
// first value_dim values of its key row (decode_attention.cpp says more); 576 / 512 has its own register path.
//
// NOTE: PyTorch's SDPA on the CPU took ~0.6-1 ms per layer for one 137-token prompt of SmolLM2 (its math path
// with GQA materialises the masks and repeats K/V); this is the prefill's largest cost after the matmuls.
#include "common.h"

using namespace serval_kernels;

namespace {

constexpr int64_t kQueryBlock = 16;
constexpr int64_t kTile = simd::kWidth;  // keys per tile: one per vector lane

struct Task {
  int64_t seq, kv_head, row_begin, row_end;  // rows: indices into the sequence's new tokens
};

struct Layout {
  int64_t num_heads, num_kv_heads, group, head_dim, value_dim;
  int64_t q_token_stride, q_head_stride, out_token_stride, out_head_stride;
  int64_t block_size, max_blocks, slot_stride, block_stride;
  const float* k_scales;  // an int8 cache's row scales (common.h), else null
  const float* v_scales;
  float scale;
  int64_t window;      // 0: a row sees its whole context
  const float* sinks;  // per query head, or null

  float sink(int64_t head) const { return sinks != nullptr ? sinks[head] : -INFINITY; }
};

struct Sequence {
  int64_t query_start, query_len, context_len;
  const int64_t* block_table;
  int64_t position(int64_t row) const { return context_len - query_len + row; }
  // The first key that row sees.
  int64_t first_key(int64_t row, int64_t window) const {
    return window > 0 ? std::max<int64_t>(0, position(row) - window + 1) : 0;
  }
};

// Per-thread scratch, grown as needed and kept: a prefill's tasks are many and alike.
struct Scratch {
  std::vector<float> keys, values, queries, scores, sums, maxima, inverse_sums, zeros;
};

// The K/V cache row of context token t of one kv head, as an element offset.
inline int64_t cache_row(const Sequence& s, const Layout& l, int64_t kv_head, int64_t t) {
  return s.block_table[t / l.block_size] * l.block_stride + (t % l.block_size) * l.slot_stride + kv_head * l.head_dim;
}

template <typename T>
void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Any head size, any ISA: one row at a time.
template <typename T, typename K>
void attend_task_plain(const T* q, const K* k_cache, const K* v_cache, T* out, const Sequence& s, const Layout& l,
                       const Task& task, Scratch& scratch) {
  // Keys [base, base + num_keys): what the task's rows see.
  const int64_t D = l.head_dim, DV = l.value_dim, base = s.first_key(task.row_begin, l.window);
  const int64_t num_keys = s.position(task.row_end - 1) + 1 - base;
  scratch.keys.resize(num_keys * D);
  scratch.values.resize(num_keys * DV);
  scratch.queries.resize(D);
  scratch.scores.resize(num_keys + DV);  // scores, then one output row
  for (int64_t t = 0; t < num_keys; ++t) {
    const int64_t row = cache_row(s, l, task.kv_head, base + t);
    load_cache_row(k_cache + row, scratch.keys.data() + t * D, D, row_scale(l.k_scales, row, D));
    load_cache_row(v_cache + row, scratch.values.data() + t * DV, DV, row_scale(l.v_scales, row, D));
  }
  float* scores = scratch.scores.data();
  float* acc = scores + num_keys;
  for (int64_t g = 0; g < l.group; ++g) {
    const int64_t head = task.kv_head * l.group + g;
    for (int64_t r = task.row_begin; r < task.row_end; ++r) {
      const int64_t token = s.query_start + r;
      const int64_t begin = s.first_key(r, l.window) - base, end = s.position(r) + 1 - base;
      load_row(q + token * l.q_token_stride + head * l.q_head_stride, scratch.queries.data(), D);
      float m = l.sink(head);
      for (int64_t t = begin; t < end; ++t) {
        scores[t] = dot(scratch.queries.data(), scratch.keys.data() + t * D, D) * l.scale;
        m = std::max(m, scores[t]);
      }
      float sum = std::exp(l.sink(head) - m);
      for (int64_t t = begin; t < end; ++t) { scores[t] = std::exp(scores[t] - m); sum += scores[t]; }
      std::fill(acc, acc + DV, 0.0f);
      for (int64_t t = begin; t < end; ++t) axpy(scores[t] / sum, scratch.values.data() + t * DV, acc, DV);
      store_row(acc, out + token * l.out_token_stride + head * l.out_head_stride, DV);
    }
  }
}

// The V pass's rows at a time (R), each with common.h's value_chunk output vectors: R * CB accumulators of
// kValueAccumulators, beside the rows' R weights and one V vector, at most 4 rows. AVX2: 3 rows of 4-vector
// chunks (12 accumulators); with 16 (2 rows of a whole 8-vector head) two of them lived on the stack, a store and
// a reload on each key's chain, and with 8 (2 rows) the FMAs' latency bound each key's step.
constexpr int value_rows(int chunk) { return std::clamp(kValueAccumulators / chunk, 1, 4); }

// The keys a pass takes at a time: every query row of the task (its G heads' 16 rows) goes over one chunk of K
// (then of V), widened into `keys` (`values`) and kept in L1, before the next. A row at a time over all of the
// task's keys read them from L2 once a row: a 448-token prompt's 16-row task holds 115 KB of fp32 keys, streamed
// 48 times (the default model's 3 heads a kv head). With the chunks and the AVX2 rows above, that prompt's 30
// layers took ~0.75x the time on AVX2 (AMD family 25, one thread and two; docs/benchmarks/2026-12-07.md).
constexpr int64_t kChunkBytes = 16 * 1024;  // a chunk's fp32 rows: half of a 32 KB L1
template <int D>
constexpr int64_t chunk_tiles() { return std::max<int64_t>(1, kChunkBytes / (kTile * D * 4)); }

// A task's rows, R at a time: the tiles of keys the group's rows go over ([first_tile, tiles), the union of its
// rows' keys: keys outside a row's are masked), and each row's first and last key (relative to the task's base).
struct RowGroups {
  int64_t first[kQueryBlock], position[kQueryBlock], first_tile[kQueryBlock], tiles[kQueryBlock];
  int64_t count;
};

template <int R>
RowGroups row_groups(const Sequence& s, const Layout& l, const Task& task, int64_t base) {
  RowGroups g;
  const int64_t rows = task.row_end - task.row_begin;
  for (int64_t i = 0; i < rows; ++i) {
    g.position[i] = s.position(task.row_begin + i) - base;
    g.first[i] = s.first_key(task.row_begin + i, l.window) - base;
  }
  g.count = (rows + R - 1) / R;
  for (int64_t j = 0; j < g.count; ++j) {
    g.first_tile[j] = g.first[j * R] / kTile;
    g.tiles[j] = g.position[std::min<int64_t>(j * R + R - 1, rows - 1)] / kTile + 1;
  }
  return g;
}

// Rows [begin, end) of keys (or values), relative to base, widened to fp32 into dst; whole tiles past the
// context's last key are zeros (weighted by zero, never read as keys).
template <typename K>
void widen_rows(const K* cache, const float* scales, const Sequence& s, const Layout& l, int64_t kv_head,
                int64_t base, int64_t begin, int64_t end, int64_t num_keys, int64_t width, float* dst) {
  for (int64_t t = begin; t < std::min(end, num_keys); ++t) {
    const int64_t row = cache_row(s, l, kv_head, base + t);
    load_cache_row(cache + row, dst + (t - begin) * width, width, row_scale(scales, row, l.head_dim));
  }
  if (end > num_keys) std::fill(dst + (std::max(begin, num_keys) - begin) * width, dst + (end - begin) * width, 0.0f);
}

template <typename T, typename K, int D, int DV = D>  // q and out, cache; head_dim, a multiple of 2 * kWidth; value_dim
void attend_task(const T* q, const K* k_cache, const K* v_cache, T* out, const Sequence& s, const Layout& l,
                 const Task& task, Scratch& scratch) {
  using simd::Vec;
  constexpr int W = simd::kWidth, C = D / W, CV = DV / W, CB = value_chunk(CV), R = value_rows(CB);
  static_assert(DV % W == 0 && CV % CB == 0, "whole chunks of whole vectors");
  constexpr int64_t kChunkTiles = chunk_tiles<D>(), kChunk = kChunkTiles * kTile;
  // Keys [base, base + num_keys): what the task's rows see, from the start of its first key's tile; below, key
  // indices are relative to base, which is a whole number of tiles.
  const int64_t base = s.first_key(task.row_begin, l.window) / kTile * kTile;
  const int64_t num_keys = s.position(task.row_end - 1) + 1 - base;
  const int64_t num_tiles = (num_keys + kTile - 1) / kTile, padded = num_tiles * kTile;
  const int64_t rows = task.row_end - task.row_begin, slots = l.group * kQueryBlock;  // slots: (head, row)
  const RowGroups groups = row_groups<R>(s, l, task, base);
  scratch.keys.resize(kChunk * D);
  scratch.values.resize(kChunk * DV);
  scratch.queries.resize(slots * D);
  scratch.scores.resize(slots * padded);
  scratch.sums.resize(slots * DV);
  scratch.maxima.resize(slots * W);
  scratch.inverse_sums.resize(slots);
  scratch.zeros.assign(padded, 0.0f);
  float* keys = scratch.keys.data();
  float* values = scratch.values.data();
  for (int64_t g = 0; g < l.group; ++g) {
    const int64_t head = task.kv_head * l.group + g;
    for (int64_t i = 0; i < rows; ++i) {
      const T* src = q + (s.query_start + task.row_begin + i) * l.q_token_stride + head * l.q_head_stride;
      load_row(src, scratch.queries.data() + (g * kQueryBlock + i) * D, D);
    }
  }
  const auto scores_of = [&](int64_t g, int64_t i) { return scratch.scores.data() + (g * kQueryBlock + i) * padded; };
  const Vec scale = simd::set1(l.scale);
  const Vec minus_infinity = simd::set1(-INFINITY);

  // Scores, masked outside each row's keys, and each row's max, a chunk of keys at a time.
  for (int64_t c0 = 0; c0 < num_tiles; c0 += kChunkTiles) {
    const int64_t c1 = std::min(num_tiles, c0 + kChunkTiles), key0 = c0 * kTile;
    widen_rows(k_cache, l.k_scales, s, l, task.kv_head, base, key0, c1 * kTile, num_keys, D, keys);
    for (int64_t g = 0; g < l.group; ++g) {
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t j = i / R, slot = g * kQueryBlock + i;
        const int64_t from = std::max(c0, groups.first_tile[j]), to = std::min(c1, groups.tiles[j]);
        if (from >= to) continue;
        Vec qv[C];
        for (int c = 0; c < C; ++c) qv[c] = simd::load(scratch.queries.data() + slot * D + W * c);
        float* row = scores_of(g, i);
        Vec vmax = from == groups.first_tile[j] ? minus_infinity : simd::load(scratch.maxima.data() + slot * W);
        for (int64_t tile = from; tile < to; ++tile) {
          const int64_t t0 = tile * kTile, in_tile = std::min<int64_t>(kTile, num_keys - t0);
          const Vec sc = tile_scores<C>(qv, in_tile, [&](int64_t k) { return keys + (t0 - key0 + k) * D; }, scale);
          vmax = simd::max(vmax, visible_lanes(groups.first[i], groups.position[i], tile, sc, minus_infinity));
          simd::store(row + t0, sc);
        }
        simd::store(scratch.maxima.data() + slot * W, vmax);
      }
    }
  }
  // Softmax numerators, zero outside each row's keys; 1 / their sum (and the sink's) is applied to the output.
  float* inverse_sums = scratch.inverse_sums.data();
  for (int64_t g = 0; g < l.group; ++g) {
    const float sink = l.sink(task.kv_head * l.group + g);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t j = i / R, slot = g * kQueryBlock + i;
      float* row = scores_of(g, i);
      const float m_scalar = std::max(simd::reduce_max(simd::load(scratch.maxima.data() + slot * W)), sink);
      const Vec m = simd::set1(m_scalar);
      Vec vsum = simd::zero();
      for (int64_t tile = groups.first_tile[j]; tile < groups.tiles[j]; ++tile) {
        const Vec e = visible_lanes(groups.first[i], groups.position[i], tile,
                                    simd::exp_nonpositive(simd::sub(simd::load(row + tile * kTile), m)), simd::zero());
        simd::store(row + tile * kTile, e);
        vsum = simd::add(vsum, e);
      }
      inverse_sums[slot] = 1.0f / (simd::reduce_add(vsum) + std::exp(sink - m_scalar));
    }
  }
  // sums = sum_t p_t v_t, R rows and CB output vectors at a time, a chunk of values at a time: each sum goes on
  // from where the chunk before left it (fp32 in the scratch), so its terms are added in the same order.
  for (int64_t c0 = 0; c0 < num_tiles; c0 += kChunkTiles) {
    const int64_t c1 = std::min(num_tiles, c0 + kChunkTiles), key0 = c0 * kTile;
    widen_rows(v_cache, l.v_scales, s, l, task.kv_head, base, key0, c1 * kTile, num_keys, DV, values);
    for (int64_t g = 0; g < l.group; ++g) {
      for (int64_t j = 0; j < groups.count; ++j) {
        const int64_t from = std::max(c0, groups.first_tile[j]), to = std::min(c1, groups.tiles[j]);
        if (from >= to) continue;
        const bool first = from == groups.first_tile[j];
        // Rows past the task's last (R does not divide its rows) read a row of zeros, and the last row's sums,
        // which they do not write back: no work, no value.
        const float* probs[R];
        float* sums[R];
        for (int i = 0; i < R; ++i) {
          const int64_t row = j * R + i;
          probs[i] = row < rows ? scores_of(g, row) : scratch.zeros.data();
          sums[i] = scratch.sums.data() + (g * kQueryBlock + std::min(row, rows - 1)) * DV;
        }
        for (int c0v = 0; c0v < CV; c0v += CB) {
          Vec acc[R][CB];
          for (int i = 0; i < R; ++i)
            for (int c = 0; c < CB; ++c) acc[i][c] = first ? simd::zero() : simd::load(sums[i] + W * (c0v + c));
          for (int64_t t = from * kTile; t < to * kTile; ++t) {
            const float* v = values + (t - key0) * DV + W * c0v;
            Vec p[R];
            for (int i = 0; i < R; ++i) p[i] = simd::set1(probs[i][t]);
            for (int c = 0; c < CB; ++c) {
              const Vec vc = simd::load(v + W * c);
              for (int i = 0; i < R; ++i) acc[i][c] = simd::fmadd(p[i], vc, acc[i][c]);
            }
          }
          for (int i = 0; i < R && j * R + i < rows; ++i)
            for (int c = 0; c < CB; ++c) simd::store(sums[i] + W * (c0v + c), acc[i][c]);
        }
      }
    }
  }
  // out = sums / sum_t p_t
  for (int64_t g = 0; g < l.group; ++g) {
    const int64_t head = task.kv_head * l.group + g;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t slot = g * kQueryBlock + i;
      float* sum = scratch.sums.data() + slot * DV;
      const Vec inverse = simd::set1(inverse_sums[slot]);
      for (int c = 0; c < CV; ++c) simd::store(sum + W * c, simd::mul(simd::load(sum + W * c), inverse));
      store_row(sum, out + (s.query_start + task.row_begin + i) * l.out_token_stride + head * l.out_head_stride, DV);
    }
  }
}

template <typename T, typename K>  // q and out, cache
void prefill_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& query_starts,
                            const at::Tensor& query_lens, const at::Tensor& context_lens, double scale,
                            int64_t window, const float* sinks, at::Tensor& out) {
  const Layout l{
      q.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), q.size(2), out.size(2),
      q.stride(0), q.stride(1), out.stride(0), out.stride(1),
      k_cache.size(1), block_tables.size(1), k_cache.size(2) * q.size(2), k_cache.size(1) * k_cache.size(2) * q.size(2),
      int8_row_scales(k_cache), int8_row_scales(v_cache), static_cast<float>(scale), window, sinks};
  const int64_t num_seqs = query_lens.size(0);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  std::vector<Sequence> seqs(num_seqs);
  std::vector<Task> tasks;
  for (int64_t i = 0; i < num_seqs; ++i) {
    seqs[i] = {query_starts.data_ptr<int64_t>()[i], query_lens.data_ptr<int64_t>()[i],
               context_lens.data_ptr<int64_t>()[i], tables + i * l.max_blocks};
    TORCH_CHECK(seqs[i].query_len <= seqs[i].context_len, "query_len must not exceed context_len");
    TORCH_CHECK(seqs[i].context_len <= l.max_blocks * l.block_size, "context_len exceeds the block table");
    for (int64_t r = 0; r < seqs[i].query_len; r += kQueryBlock) {
      for (int64_t h = 0; h < l.num_kv_heads; ++h) tasks.push_back({i, h, r, std::min(seqs[i].query_len, r + kQueryBlock)});
    }
  }
  // Heaviest first (the rows that see the most keys), so that the last tasks handed out are short ones.
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return seqs[a.seq].position(a.row_end - 1) > seqs[b.seq].position(b.row_end - 1);
  });
  const T* q_ptr = q.data_ptr<T>();
  const K* k_ptr = static_cast<const K*>(k_cache.data_ptr());
  const K* v_ptr = static_cast<const K*>(v_cache.data_ptr());
  T* out_ptr = out.data_ptr<T>();
  parallel_chunks(static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const Sequence& s = seqs[task.seq];
      const bool same = l.head_dim == l.value_dim;
      if (same && l.head_dim == 32) { attend_task<T, K, 32>(q_ptr, k_ptr, v_ptr, out_ptr, s, l, task, scratch); continue; }
      if (same && l.head_dim == 64) { attend_task<T, K, 64>(q_ptr, k_ptr, v_ptr, out_ptr, s, l, task, scratch); continue; }
      if (same && l.head_dim == 128) { attend_task<T, K, 128>(q_ptr, k_ptr, v_ptr, out_ptr, s, l, task, scratch); continue; }
      if (l.head_dim == 576 && l.value_dim == 512) {
        attend_task<T, K, 576, 512>(q_ptr, k_ptr, v_ptr, out_ptr, s, l, task, scratch);
        continue;
      }
      attend_task_plain<T, K>(q_ptr, k_ptr, v_ptr, out_ptr, s, l, task, scratch);
    }
  }, Schedule::kDynamic);
}

}  // namespace

void paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                             at::Tensor block_tables, at::Tensor query_starts, at::Tensor query_lens,
                             at::Tensor context_lens, double scale, at::Tensor out, int64_t window,
                             at::Tensor sinks) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.size(0) == out.size(0) && q.size(1) == out.size(1) &&
              out.size(2) <= q.size(2), "q: (tokens, heads, head_dim), out: (tokens, heads, value_dim <= head_dim)");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out rows must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "k_cache, v_cache: contiguous (num_blocks, block_size, num_kv_heads, head_dim)");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out in q's dtype");
  for (const auto* t : {&block_tables, &query_starts, &query_lens, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "tables and lengths: contiguous int64");
  }
  TORCH_CHECK(block_tables.size(0) == query_lens.size(0) && query_starts.size(0) == query_lens.size(0) &&
              context_lens.size(0) == query_lens.size(0), "one block table, start and length per sequence");
  TORCH_CHECK(window >= 0, "window: a token count, 0 for none");
  const float* sink_ptr = sink_logits(sinks, q.size(1));
  with_attention_types(q, k_cache, v_cache, [&](auto query, auto cache) {
    prefill_attention_impl<decltype(query), decltype(cache)>(q, k_cache, v_cache, block_tables, query_starts, query_lens,
                                                             context_lens, scale, window, sink_ptr, out);
  });
}
