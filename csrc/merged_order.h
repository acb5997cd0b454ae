// A sharded store's merged order (issue 26): every suffix of every shard in one sequence sorted
// by its first `depth` tokens, written once when the store is built. Entry g is the position, in
// the shards' concatenated tokens, of the suffix at rank g.
//
// For a query of L <= depth tokens the suffixes matching it are, in this order, one run starting
// at the sum of the shards' own lower bounds; the suffix at any rank of that run has the same
// first `depth` tokens as the suffix at that rank in one suffix array over the concatenated
// tokens (both sequences are sorted by them and hold the same suffixes), hence the same
// continuation whenever L + cont_len <= depth. Sampling REST's evenly strided continuations is
// then one read per continuation instead of a selection across the shards (sharded_store.h).
//
// Building it merges the shards' suffix arrays (each already sorted) in parts cut at pivots of
// the largest shard, so that parts merge independently; ties in the first `depth` tokens keep
// the shards' order, then each shard's own.
#pragma once

#include <algorithm>
#include <cstdint>
#include <queue>
#include <stdexcept>
#include <vector>

#include "sharded_store.h"

namespace vrs {

// A suffix's shard and its position there (-1: an entry outside the store, which continues
// with nothing).
struct ShardPosition {
  int shard;
  int64_t position;
};

// A merged order read from disk (uint32 or uint64 entries) and the shards' first positions in
// the concatenated tokens (bases[shards] = the total). Entries are not trusted: one outside the
// store locates at position -1.
struct MergedOrder {
  const void* entries;
  bool wide;
  int64_t size;
  const int64_t* bases;
  int shards;
  int depth;

  ShardPosition locate(int64_t rank) const {
    if (rank < 0 || rank >= size) return {0, -1};
    const uint64_t entry = wide ? static_cast<const uint64_t*>(entries)[rank]
                                : static_cast<const uint32_t*>(entries)[rank];
    if (entry >= static_cast<uint64_t>(bases[shards])) return {0, -1};
    const int shard = static_cast<int>(std::upper_bound(bases, bases + shards + 1, static_cast<int64_t>(entry)) -
                                       bases) - 1;
    return {shard, static_cast<int64_t>(entry) - bases[shard]};
  }
};

// <0, 0, >0: suffix a against suffix b over their first depth tokens (a suffix that ends first
// sorts first, as in every shard's suffix array).
template <typename Index>
int compare_suffixes(const Index& a, int64_t pa, const Index& b, int64_t pb, int depth) {
  for (int i = 0; i < depth; ++i) {
    const bool a_ended = pa + i >= a.size, b_ended = pb + i >= b.size;
    if (a_ended || b_ended) return a_ended == b_ended ? 0 : (a_ended ? -1 : 1);
    const uint32_t ta = static_cast<uint32_t>(a.tokens[pa + i]), tb = static_cast<uint32_t>(b.tokens[pb + i]);
    if (ta != tb) return ta < tb ? -1 : 1;
  }
  return 0;
}

// Merging the shards' suffix arrays into the merged order.
template <typename Index>
class ShardMerger {
 public:
  ShardMerger(const Index* shards, int count, int depth) : shards_(shards), count_(count), depth_(depth) {
    bases_.assign(count + 1, 0);
    for (int s = 0; s < count; ++s) bases_[s + 1] = bases_[s] + shards[s].size;
  }

  int64_t total() const { return bases_[count_]; }

  // Where part k of `parts` starts in every shard (cuts[k * count + s]; part 0 at 0, part
  // `parts` at each shard's end): the entries before the pivot at k / parts of the largest shard.
  std::vector<int64_t> cuts(int parts) const {
    int largest = 0;
    for (int s = 1; s < count_; ++s)
      if (shards_[s].size > shards_[largest].size) largest = s;
    std::vector<int64_t> cut(static_cast<size_t>(parts + 1) * count_, 0);
    for (int s = 0; s < count_; ++s) cut[static_cast<size_t>(parts) * count_ + s] = shards_[s].size;
    for (int k = 1; k < parts; ++k) {
      const int64_t pivot = k * shards_[largest].size / parts;
      const int64_t pivot_pos = checked_entry(largest, pivot);
      for (int s = 0; s < count_; ++s)
        cut[static_cast<size_t>(k) * count_ + s] =
            s == largest ? pivot : entries_before(s, shards_[largest], pivot_pos, /*inclusive=*/s < largest);
    }
    return cut;
  }

  // Merge the entries [lo[s], hi[s]) of every shard into out (sum of hi - lo entries), as
  // positions in the concatenated tokens.
  template <typename Out>
  void merge(const int64_t* lo, const int64_t* hi, Out* out) const {
    std::vector<int64_t> head(lo, lo + count_), position(count_);
    auto later = [&](int a, int b) {  // heap order: a comes after b
      const int c = compare_suffixes(shards_[a], position[a], shards_[b], position[b], depth_);
      return c != 0 ? c > 0 : a > b;
    };
    std::priority_queue<int, std::vector<int>, decltype(later)> heads(later);
    for (int s = 0; s < count_; ++s) {
      if (head[s] >= hi[s]) continue;
      position[s] = checked_entry(s, head[s]);
      heads.push(s);
    }
    while (!heads.empty()) {
      const int s = heads.top();
      heads.pop();
      *out++ = static_cast<Out>(bases_[s] + position[s]);
      if (++head[s] < hi[s]) {
        position[s] = checked_entry(s, head[s]);
        heads.push(s);
      }
    }
  }

 private:
  int64_t checked_entry(int s, int64_t index) const {
    const int64_t entry = static_cast<int64_t>(shards_[s].suffix_array[index]);
    if (!shards_[s].valid(entry))
      throw std::invalid_argument("shard " + std::to_string(s) + "'s suffix array holds " + std::to_string(entry) +
                                  " at " + std::to_string(index) + ", outside its tokens");
    return entry;
  }

  // How many of shard s's suffixes sort before the suffix at pivot_pos of `of` (inclusive:
  // those equal to it over depth tokens too).
  int64_t entries_before(int s, const Index& of, int64_t pivot_pos, bool inclusive) const {
    return first_not_before(0, shards_[s].size, [&](int64_t i) {
      const int c = compare_suffixes(shards_[s], checked_entry(s, i), of, pivot_pos, depth_);
      return inclusive ? c <= 0 : c < 0;
    });
  }

  const Index* shards_;
  int count_;
  int depth_;
  std::vector<int64_t> bases_;
};

}  // namespace vrs
