// A datastore of several shards, each a suffix array over its own documents, searched as one
// suffix array over the shards' concatenated tokens would be (issue 26): the same longest match,
// the same number of matches, and the same evenly strided continuations.
//
// The suffixes that match a query are, in the one big array, the union of every shard's match
// range in lexicographic order. The continuation REST gathers at rank r of that union depends only
// on the key of the suffix at r: its cont_len tokens after the match, up to a separator. Keys are
// sorted within each shard's range, and suffixes of equal keys give equal continuations, so the
// key at rank r is found exactly by selection over the shards' ranges (pivot in the longest range
// where the middle wanted rank would sit, count the keys below and equal to it in every shard by
// binary search, recurse on the side holding each wanted rank) without merging them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace vrs {

// A suffix-array range [lo, hi) of one shard.
struct ShardRange {
  int64_t lo = 0, hi = 0;
  int64_t size() const { return hi - lo; }
};

// A suffix-array entry of one shard.
struct ShardEntry {
  int shard;
  int64_t index;
};

template <typename Index>
class ShardSelector {
 public:
  // Keys start match_len tokens into each suffix and span key_len tokens.
  ShardSelector(const Index* shards, int match_len, int key_len)
      : shards_(shards), match_len_(match_len), key_len_(key_len) {}

  // The entries at the sorted union ranks targets[0..count) (ranks within ranges' union, in
  // lexicographic order), one per target, written to out in target order.
  void select(std::vector<ShardRange> ranges, const int64_t* targets, int count, int64_t base,
              ShardEntry* out, int depth = 0) const {
    for (; count > 0; ++depth) {
      int longest = 0, nonempty = 0;
      for (int s = 0; s < static_cast<int>(ranges.size()); ++s) {
        nonempty += ranges[s].size() > 0;
        if (ranges[s].size() > ranges[longest].size()) longest = s;
      }
      if (nonempty <= 1) {  // one shard left: its ranks are the union's
        for (int t = 0; t < count; ++t) out[t] = {longest, ranges[longest].lo + (targets[t] - base)};
        return;
      }
      // Alternately where the middle wanted rank would sit and the range's middle: the first
      // converges fast on evenly mixed shards, the second halves the longest range whatever
      // the shards hold (so selection takes O(shards × log matches) rounds at worst).
      const int64_t offset = depth % 2 == 0 ? proportional_offset(ranges, longest, targets[count / 2] - base)
                                            : ranges[longest].size() / 2;
      const ShardEntry pivot{longest, ranges[longest].lo + offset};
      std::vector<ShardRange> below(ranges.size()), above(ranges.size());
      int64_t num_below = 0, num_equal = 0;
      for (int s = 0; s < static_cast<int>(ranges.size()); ++s) {
        const int64_t first_equal = partition<false>(s, ranges[s], pivot);
        const int64_t first_above = partition<true>(s, {first_equal, ranges[s].hi}, pivot);
        below[s] = {ranges[s].lo, first_equal};
        above[s] = {first_above, ranges[s].hi};
        num_below += first_equal - ranges[s].lo;
        num_equal += first_above - first_equal;
      }
      const int in_below = static_cast<int>(std::lower_bound(targets, targets + count, base + num_below) - targets);
      const int in_equal =
          static_cast<int>(std::lower_bound(targets + in_below, targets + count, base + num_below + num_equal) -
                           (targets + in_below));
      select(std::move(below), targets, in_below, base, out, depth + 1);
      std::fill(out + in_below, out + in_below + in_equal, pivot);  // equal keys: equal continuations
      targets += in_below + in_equal;
      out += in_below + in_equal;
      count -= in_below + in_equal;
      base += num_below + num_equal;
      ranges = std::move(above);
    }
  }

 private:
  // Where in ranges[shard] the union's rank sits if the shards interleave evenly (as shards of
  // documents of one kind do): a pivot there splits the wanted ranks near their middle and
  // leaves few ranks between it and the wanted one.
  static int64_t proportional_offset(const std::vector<ShardRange>& ranges, int shard, int64_t rank) {
    int64_t total = 0;
    for (const ShardRange& range : ranges) total += range.size();
    const double fraction = (static_cast<double>(rank) + 0.5) / static_cast<double>(total);
    const int64_t size = ranges[shard].size();
    return std::clamp<int64_t>(static_cast<int64_t>(fraction * static_cast<double>(size)), 0, size - 1);
  }

  // The key token i of an entry (UINT64_MAX past the end: it sorts with the separators).
  uint64_t key_token(const ShardEntry& e, int i) const {
    const Index& shard = shards_[e.shard];
    const int64_t entry = static_cast<int64_t>(shard.suffix_array[e.index]);
    const int64_t pos = entry + match_len_ + i;
    if (!shard.valid(entry) || pos >= shard.size) return UINT64_MAX;
    const uint32_t t = static_cast<uint32_t>(shard.tokens[pos]);
    return t == shard.separator ? UINT64_MAX : t;
  }

  // <0, 0, >0: the key of a against b's, compared up to key_len tokens or a separator in both.
  int compare(const ShardEntry& a, const ShardEntry& b) const {
    for (int i = 0; i < key_len_; ++i) {
      const uint64_t ta = key_token(a, i), tb = key_token(b, i);
      if (ta != tb) return ta < tb ? -1 : 1;
      if (ta == UINT64_MAX) return 0;
    }
    return 0;
  }

  // First index of range in shard s whose key is not below pivot's (strict: above it).
  template <bool kStrict>
  int64_t partition(int s, ShardRange range, const ShardEntry& pivot) const {
    int64_t lo = range.lo, count = range.size();
    while (count > 0) {
      const int64_t half = count / 2;
      const int c = compare({s, lo + half}, pivot);
      if (kStrict ? c <= 0 : c < 0) {
        lo += half + 1;
        count -= half + 1;
      } else {
        count = half;
      }
    }
    return lo;
  }

  const Index* shards_;
  int match_len_;
  int key_len_;
};

}  // namespace vrs
