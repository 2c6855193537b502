// The attention entry points of a team (attention.h declares them and holds the arithmetic):
// a translation unit of their own, so that the block arithmetic's instantiations (query counts x
// head sizes x KV store layouts) compile in parallel with the rest of the kernels (build.py).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention.h"

namespace hl {

// Per-thread state of an item that merges its blocks as it goes (a prefill item's rows, a decode
// item's whole (row, KV head)): each row's merged result (max, sum per query, then the outputs),
// a block's results, a prefill item's gathered queries, and a merge's maxima and factors (per
// query).
struct ItemScratch {
  std::vector<float> state, block, queries, tops, factors;
  void reserve(int64_t rows, int group, int64_t d) {
    const int64_t per_row = group * (d + 2);
    grow(state, rows * per_row);
    grow(block, rows * per_row);
    grow(queries, rows * group * d);
    grow(tops, rows * group);
    grow(factors, 2 * rows * group);
  }

 private:
  static void grow(std::vector<float>& buffer, int64_t n) {
    if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  }
};

// Merge the block results of n rows (m (n G), l (n G), o (n G, d)) into the rows' states (row i's
// at states + i * G (d + 2): m (G), l (G), o (G, d)); first[i]: row i's state holds nothing yet (it
// takes the block's result as it is). merge_into per query, its two exponentials computed for
// every query at once (exp_each: the same bits).
void merge_block_results(float* states, int64_t n, int group, int64_t d, const Partial& results, const bool* first,
                         ItemScratch& work) {
  const int64_t per_row = group * (d + 2), queries = n * group;
  const float* m = results.m;
  const float* l = results.l;
  const float* o = results.o;
  float* tops = work.tops.data();
  float* factors = work.factors.data();  // (2, queries): e^(m - top), then e^(m_b - top)
  for (int64_t i = 0; i < n; ++i) {
    const float* st = states + i * per_row;
    for (int g = 0; g < group; ++g) {
      const int64_t k = i * group + g;
      tops[k] = first[i] ? m[k] : std::max(st[g], m[k]);
      factors[k] = first[i] ? 0.0f : st[g] - tops[k];
      factors[queries + k] = m[k] - tops[k];
    }
  }
  exp_each(factors, 2 * queries);
  for (int64_t i = 0; i < n; ++i) {
    float* st = states + i * per_row;
    for (int g = 0; g < group; ++g) {
      const int64_t k = i * group + g;
      if (first[i])
        merge_into(st[g], st[group + g], st + 2 * group + g * d, m[k], l[k], o + k * d, d, true);
      else
        merge_scaled(st[g], st[group + g], st + 2 * group + g * d, tops[k], factors[k], factors[queries + k], l[k],
                     o + k * d, d);
    }
  }
}

// `count` queries' merged max m, sum l and output o (count, d) -> their outputs o / l at out
// (count, d; may be o itself), and where lse is not null m + log l at lse (count).
void finish_queries(const float* m, const float* l, const float* o, int64_t count, int64_t d, float* out, float* lse) {
  for (int64_t g = 0; g < count; ++g) {
    const float inverse = 1.0f / l[g];
    for (int64_t j = 0; j < d; ++j) out[g * d + j] = o[g * d + j] * inverse;
    if (lse != nullptr) lse[g] = m[g] + std::log(l[g]);
  }
}

// A row's merged state (m (G), l (G), o (G, d)) -> its G outputs at out (G, d), and lse (G) where
// not null.
void finish_row(const float* state, int group, int64_t d, float* out, float* lse) {
  finish_queries(state, state + group, state + 2 * group, group, d, out, lse);
}

// ---- decode rows ----------------------------------------------------------------------------
void attention_team(const Team& team, const float* q, int64_t q_stride, const HLLayerCache* caches,
                    int64_t rows, int n_heads, int n_kv_heads, int64_t d, const ScoreOptions& options,
                    float* out, AttentionParts& parts, BlockScratch& scratch, float* lse) {
  const int group = n_heads / n_kv_heads;
  if (team.thread == 0) {
    int64_t all_blocks = 0, longest = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t count = RowBlocks(caches[r], caches[r].start).count();
      all_blocks += count * n_kv_heads;
      longest = std::max(longest, count);
    }
    const int64_t per_item = parts.blocks_per_item =
        decode_blocks_per_item(all_blocks, rows * n_kv_heads, longest, team.size);
    int64_t blocks = 0, items = 0;
    parts.reserve(0, 0, rows);
    for (int64_t r = 0; r < rows; ++r) {
      parts.row_blocks[r] = blocks;
      parts.item_offsets[r] = items;
      const RowBlocks rb(caches[r], caches[r].start);
      if (rb.count() > per_item) blocks += rb.count() * n_kv_heads;  // block results kept: a split row's
      items += (rb.count() + per_item - 1) / per_item * n_kv_heads;
    }
    parts.reserve(blocks, static_cast<int64_t>(group) * (d + 2), rows);
    parts.row_blocks[rows] = blocks;
    parts.item_offsets[rows] = items;
  }
  team.barrier();
  thread_local ItemScratch work;
  work.reserve(1, group, d);
  const int64_t all_items = parts.item_offsets[rows], per_item = parts.blocks_per_item;
  const int64_t stride = static_cast<int64_t>(group);  // one block's max/sum entries
  for (int64_t item = team.claim(); item < all_items; item = team.claim()) {
    const int64_t r = std::upper_bound(parts.item_offsets.begin(), parts.item_offsets.begin() + rows, item) -
                      parts.item_offsets.begin() - 1;
    const HLLayerCache& cache = caches[r];
    const RowBlocks rb(cache, cache.start);
    const int64_t items_per_head = (rb.count() + per_item - 1) / per_item;
    const int64_t local = item - parts.item_offsets[r];
    const int64_t head = local / items_per_head, chunk = local % items_per_head;
    const float* queries = q + r * q_stride + head * group * d;  // (G, d)
    // Block b's keys and values (every store's part, in place). The readers ask for the rows
    // ahead of the ones they read, the next block's first rows included; an item's first rows are
    // left to the hardware (asking for every block's first 4 KiB as well measured no faster).
    const auto block_of = [&](int64_t b) {
      return block_kv(cache, head, rb.block_lo(b), RowBlocks::block_hi(b, cache.start));
    };
    scratch.reserve(group, d);
    if (items_per_head == 1) {  // the whole (row, KV head): its blocks merged as they come, in order
      const Partial block{work.block.data() + group * d, work.block.data() + group * (d + 1), work.block.data()};
      for (int64_t i = 0; i < rb.count(); ++i) {
        attend_queries(group, queries, block_of(rb.first + i), d, options, block, scratch);
        const bool first = i == 0;
        merge_block_results(work.state.data(), 1, group, d, block, &first, work);
      }
      const int64_t h0 = r * n_heads + head * group;  // the pair's first query head among all rows'
      finish_row(work.state.data(), group, d, out + h0 * d, lse == nullptr ? nullptr : lse + h0);
      continue;
    }
    for (int64_t i = chunk * per_item; i < std::min(rb.count(), (chunk + 1) * per_item); ++i) {
      const int64_t slot = parts.row_blocks[r] + head * rb.count() + i;  // (row, head, block)
      const Partial result{parts.max.data() + slot * stride, parts.sum.data() + slot * stride,
                           parts.out.data() + slot * stride * d};
      attend_queries(group, queries, block_of(rb.first + i), d, options, result, scratch);
    }
  }
  team.barrier();
  // the split rows' (row, query head)s (finer than their (row, KV head)s, so that a few KV heads
  // still share out): each merges its kept block results in order
  const Share heads(rows * n_heads, team);
  for (int64_t i = heads.first; i < heads.last; ++i) {
    const int64_t r = i / n_heads, h = i % n_heads, head = h / group, g = h % group;
    const RowBlocks rb(caches[r], caches[r].start);
    if (rb.count() <= per_item) continue;  // merged by its item
    float m = 0.0f, l = 0.0f;
    float* o = out + i * d;
    for (int64_t blk = 0; blk < rb.count(); ++blk) {
      const int64_t slot = parts.row_blocks[r] + head * rb.count() + blk;
      merge_into(m, l, o, parts.max[slot * stride + g], parts.sum[slot * stride + g],
                 parts.out.data() + (slot * stride + g) * d, d, blk == 0);
    }
    finish_queries(&m, &l, o, 1, d, o, lse == nullptr ? nullptr : lse + i);
  }
  team.barrier();
}

// ---- prefill chunks ---------------------------------------------------------------------------
void prefill_attention_team(const Team& team, const float* q, int64_t q_stride, const HLLayerCache* caches,
                            const int64_t* offsets, int64_t segments, int n_heads, int n_kv_heads, int64_t d,
                            const ScoreOptions& options, float* out, BlockScratch& scratch) {
  const int group = n_heads / n_kv_heads;
  const int64_t per_row = group * (d + 2);
  thread_local ItemScratch work;
  work.reserve(QUERY_ROWS, group, d);
  auto chunks_of = [&](int64_t s) { return (offsets[s + 1] - offsets[s] + QUERY_ROWS - 1) / QUERY_ROWS; };
  int64_t items = 0;
  for (int64_t s = 0; s < segments; ++s) items += chunks_of(s) * n_kv_heads;
  for (int64_t item = team.claim(); item < items; item = team.claim()) {
    int64_t s = 0, local = item;
    for (; local >= chunks_of(s) * n_kv_heads; ++s) local -= chunks_of(s) * n_kv_heads;
    // A segment's items head by head (one KV head's rows stay in the cache from item to item), each
    // head's last positions first (they see the most blocks: the long items are claimed early)
    const HLLayerCache& cache = caches[s];
    const int64_t chunks = chunks_of(s);
    const int64_t head = local / chunks, r0 = offsets[s] + (chunks - 1 - local % chunks) * QUERY_ROWS;
    const int64_t r1 = std::min(offsets[s + 1], r0 + QUERY_ROWS);
    auto position = [&](int64_t r) { return cache.start + (r - offsets[s]); };
    auto query = [&](int64_t r) { return q + r * q_stride + head * group * d; };
    // merge the block results of rows [ra, ra + n) (laid out m (n G), l (n G), o (n G, d)) into their states
    auto merge_rows = [&](int64_t ra, int64_t n, const Partial& results, int64_t b) {
      bool first[QUERY_ROWS];  // the row's state holds nothing yet
      for (int64_t i = 0; i < n; ++i) first[i] = b == RowBlocks(cache, position(ra + i)).first;
      merge_block_results(work.state.data() + (ra - r0) * per_row, n, group, d, results, first, work);
    };
    scratch.reserve(BATCH_QUERIES, d);
    int64_t gathered_first = r1, gathered_last = r1;  // the rows whose queries work.queries holds
    const int64_t first_block = RowBlocks(cache, position(r0)).first, last_block = position(r1 - 1) / KEY_BLOCK;
    for (int64_t b = first_block; b <= last_block; ++b) {
      const int64_t b_lo = b * KEY_BLOCK, b_hi = b_lo + KEY_BLOCK;
      // the block's keys and values the item's rows see, as float32 rows once for them all
      const int64_t kv_lo = std::max(b_lo, cache.first_visible(position(r0)));
      const int64_t kv_hi = std::min(b_hi, position(r1 - 1) + 1);
      const KVRun kv = gathered_kv(cache, head, kv_lo, kv_hi, d, scratch);
      auto rows_from = [&](int64_t lo, int64_t hi) {  // keys [lo, hi) of the gathered rows
        BlockKV part{};
        part.runs[0] = KVRun{nullptr, kv.keys + (lo - kv_lo) * d, kv.values + (lo - kv_lo) * d, head, 0, hi - lo};
        part.count = 1;
        return part;
      };
      int64_t whole_first = r1, whole_last = r0;  // the rows that see the block whole: one run
      for (int64_t r = r0; r < r1; ++r) {
        const RowBlocks rb(cache, position(r));
        if (b < rb.first || b > rb.last) continue;  // the block is outside this row's keys
        const int64_t lo = rb.block_lo(b), hi = RowBlocks::block_hi(b, position(r));
        if (lo == b_lo && hi == b_hi) {
          whole_first = std::min(whole_first, r), whole_last = r + 1;
          continue;
        }
        const Partial result{work.block.data(), work.block.data() + group, work.block.data() + 2 * group};
        attend_queries(group, query(r), rows_from(lo, hi), d, options, result, scratch);
        merge_rows(r, 1, result, b);
      }
      if (whole_first < whole_last) {
        const int64_t n = whole_last - whole_first;
        if (whole_first != gathered_first || whole_last != gathered_last) {  // gathered once for a run of blocks
          for (int64_t i = 0; i < n; ++i)
            std::memcpy(work.queries.data() + i * group * d, query(whole_first + i), group * d * sizeof(float));
          gathered_first = whole_first, gathered_last = whole_last;
        }
        const Partial result{work.block.data(), work.block.data() + n * group, work.block.data() + 2 * n * group};
        attend_queries(static_cast<int>(n * group), work.queries.data(), rows_from(b_lo, b_hi), d, options,
                       result, scratch);
        merge_rows(whole_first, n, result, b);
      }
    }
    for (int64_t r = r0; r < r1; ++r)
      finish_row(work.state.data() + (r - r0) * per_row, group, d, out + (r * n_heads + head * group) * d, nullptr);
  }
  team.barrier();
}

}  // namespace hl
