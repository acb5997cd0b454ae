// A datastore of several shards, each a suffix array over its own documents, searched as one
// suffix array over the shards' concatenated tokens would be (issue 26): the same longest match,
// the same number of matches, and the same evenly strided continuations.
//
// The suffixes that match a query are, in the one big array, the union of every shard's match
// range in lexicographic order. The continuation REST gathers at rank r of that union depends only
// on the key of the suffix at r: its cont_len tokens after the match, up to a separator. Keys are
// sorted within each shard's range, and suffixes of equal keys give equal continuations, so the
// key at rank r is found exactly by selection over the shards' ranges (pivot on an entry of one,
// count the keys below and equal to it in every shard by binary search, keep the side holding
// each wanted rank) without merging them.
//
// Selecting is the costly part (thousands of matches of a short query: a hundred selections, each
// a few binary searches per shard), and its result depends only on the matched tokens and the
// sampling parameters: a SelectionCache keeps the selections of frequent queries per store. A
// store with a merged order (merged_order.h) reads each sampled rank instead, and selects only
// where a match and its continuation run deeper than the order is sorted.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace vrs {

// The first index of [lo, hi) that is not before(i), for a before() true on a prefix of the
// range (binary search).
template <typename Before>
int64_t first_not_before(int64_t lo, int64_t hi, Before&& before) {
  for (int64_t count = hi - lo; count > 0;) {
    const int64_t half = count / 2;
    if (before(lo + half)) {
      lo += half + 1;
      count -= half + 1;
    } else {
      count = half;
    }
  }
  return lo;
}

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

// The shards' ranges around a pivot: those below it, how many keys equal it, those above.
struct ShardSplit {
  std::vector<ShardRange> below, above;
  int64_t num_below = 0, num_equal = 0;
};

// What a selection depends on: the matched tokens and how many continuations of how many tokens.
struct SelectionKey {
  const int32_t* match;
  int match_len, cont_len, take;

  uint64_t hash() const {
    uint64_t h = 1469598103934665603ull ^ (static_cast<uint64_t>(cont_len) << 32 | static_cast<uint32_t>(take));
    for (int i = 0; i < match_len; ++i) h = (h ^ static_cast<uint32_t>(match[i])) * 1099511628211ull;
    return h;
  }
};

// Selections by key in a fixed number of slots (a newer key takes its slot from an older one),
// each behind its own lock: rows drafted in parallel read and fill it at once. Belongs to one
// store (its entries index that store's shards).
class SelectionCache {
 public:
  explicit SelectionCache(int slots) : count_(std::max(slots, 1)), slots_(new Slot[count_]) {}

  bool find(const SelectionKey& key, std::vector<ShardEntry>& out) const {
    Slot& slot = slot_of(key);
    std::lock_guard<std::mutex> lock(slot.mutex);
    if (!slot.holds(key)) return false;
    out = slot.entries;
    return true;
  }

  void put(const SelectionKey& key, const std::vector<ShardEntry>& entries) {
    Slot& slot = slot_of(key);
    std::lock_guard<std::mutex> lock(slot.mutex);
    slot.match.assign(key.match, key.match + key.match_len);
    slot.cont_len = key.cont_len;
    slot.take = key.take;
    slot.entries = entries;
  }

 private:
  struct Slot {
    std::mutex mutex;
    std::vector<int32_t> match;
    int cont_len = 0, take = 0;
    std::vector<ShardEntry> entries;

    bool holds(const SelectionKey& key) const {
      return cont_len == key.cont_len && take == key.take && static_cast<int>(match.size()) == key.match_len &&
             std::equal(match.begin(), match.end(), key.match);
    }
  };

  Slot& slot_of(const SelectionKey& key) const { return slots_[key.hash() % static_cast<uint64_t>(count_)]; }

  int count_;
  std::unique_ptr<Slot[]> slots_;
};

template <typename Index>
class ShardSelector {
 public:
  // Keys start match_len tokens into each suffix and span key_len tokens.
  ShardSelector(const Index* shards, int match_len, int key_len)
      : shards_(shards), match_len_(match_len), key_len_(key_len) {}

  // The entries at the sorted union ranks targets[0..count) (ranks within ranges' union, in
  // lexicographic order, less base), one per target, written to out in target order. Several
  // ranks are split around a pivot where their middle one would sit (or, every other round, the
  // longest range's middle); a rank alone is bracketed (select_one).
  void select(std::vector<ShardRange> ranges, const int64_t* targets, int count, int64_t base,
              ShardEntry* out, int depth = 0) const {
    for (; count > 0; ++depth) {
      const Shape shape = shape_of(ranges);
      if (shape.nonempty <= 1) {  // one shard left: its ranks are the union's
        for (int t = 0; t < count; ++t) out[t] = {shape.longest, ranges[shape.longest].lo + (targets[t] - base)};
        return;
      }
      if (count == 1) {
        out[0] = select_one(std::move(ranges), targets[0] - base);
        return;
      }
      const ShardEntry pivot = depth % 2 == 0 ? proportional_pivot(ranges, shape, targets[count / 2] - base)
                                              : middle_pivot(ranges, shape);
      ShardSplit split = split_at(ranges, pivot);
      const int in_below =
          static_cast<int>(std::lower_bound(targets, targets + count, base + split.num_below) - targets);
      const int in_equal = static_cast<int>(
          std::lower_bound(targets + in_below, targets + count, base + split.num_below + split.num_equal) -
          (targets + in_below));
      select(std::move(split.below), targets, in_below, base, out, depth + 1);
      std::fill(out + in_below, out + in_below + in_equal, pivot);  // equal keys: equal continuations
      targets += in_below + in_equal;
      out += in_below + in_equal;
      count -= in_below + in_equal;
      base += split.num_below + split.num_equal;
      ranges = std::move(split.above);
    }
  }

 private:
  struct Shape {
    int64_t total = 0;
    int longest = 0;
    int nonempty = 0;
  };

  static Shape shape_of(const std::vector<ShardRange>& ranges) {
    Shape shape;
    for (int s = 0; s < static_cast<int>(ranges.size()); ++s) {
      shape.total += ranges[s].size();
      shape.nonempty += ranges[s].size() > 0;
      if (ranges[s].size() > ranges[shape.longest].size()) shape.longest = s;
    }
    return shape;
  }

  // The entry at rank within the union (Floyd-Rivest style): pivots where rank - d and rank + d
  // would sit if the shards interleave evenly (d = sqrt of the union: the spread of such ranks),
  // which on evenly mixed shards bracket the rank in a range of ~2d; a round that does not halve
  // the union is followed by one at the longest range's middle, so that no shard contents make
  // it take more than O(shards × log union) rounds.
  ShardEntry select_one(std::vector<ShardRange> ranges, int64_t rank) const {
    ShardEntry found{};
    for (bool halve = false;;) {
      Shape shape = shape_of(ranges);
      if (shape.nonempty <= 1) return {shape.longest, ranges[shape.longest].lo + rank};
      const int64_t before = shape.total;
      if (halve) {
        if (narrow(ranges, rank, middle_pivot(ranges, shape), &found)) return found;
        halve = false;
        continue;
      }
      const int64_t spread = std::max<int64_t>(1, static_cast<int64_t>(std::sqrt(static_cast<double>(shape.total))));
      if (narrow(ranges, rank, proportional_pivot(ranges, shape, std::max<int64_t>(rank - spread, 0)), &found))
        return found;
      shape = shape_of(ranges);
      if (shape.nonempty <= 1) return {shape.longest, ranges[shape.longest].lo + rank};
      if (narrow(ranges, rank, proportional_pivot(ranges, shape, std::min(rank + spread, shape.total - 1)), &found))
        return found;
      halve = shape_of(ranges).total > before / 2;
    }
  }

  // Keep the side of pivot that holds rank (rank becomes its rank there); true, with *found
  // set, when the key at rank equals the pivot's.
  bool narrow(std::vector<ShardRange>& ranges, int64_t& rank, const ShardEntry& pivot, ShardEntry* found) const {
    ShardSplit split = split_at(ranges, pivot);
    if (rank < split.num_below) {
      ranges = std::move(split.below);
      return false;
    }
    if (rank < split.num_below + split.num_equal) {
      *found = pivot;
      return true;
    }
    rank -= split.num_below + split.num_equal;
    ranges = std::move(split.above);
    return false;
  }

  // Each shard's keys below, equal to and above the pivot's. The searches start where the
  // answer likely is and gallop from there: the pivot's own index in its shard, the
  // proportional place in the others, and the first equal key for the first one above (equal
  // keys are few: continuations of cont_len tokens).
  ShardSplit split_at(const std::vector<ShardRange>& ranges, const ShardEntry& pivot) const {
    ShardSplit split{std::vector<ShardRange>(ranges.size()), std::vector<ShardRange>(ranges.size())};
    const ShardRange& own = ranges[pivot.shard];
    const double fraction = static_cast<double>(pivot.index - own.lo) / static_cast<double>(own.size());
    for (int s = 0; s < static_cast<int>(ranges.size()); ++s) {
      const ShardRange& range = ranges[s];
      const int64_t guess = s == pivot.shard ? pivot.index
                                             : range.lo + static_cast<int64_t>(fraction * static_cast<double>(range.size()));
      const int64_t first_equal = partition<false>(s, range, pivot, guess);
      const int64_t first_above = partition<true>(s, {first_equal, range.hi}, pivot, first_equal);
      split.below[s] = {ranges[s].lo, first_equal};
      split.above[s] = {first_above, ranges[s].hi};
      split.num_below += first_equal - ranges[s].lo;
      split.num_equal += first_above - first_equal;
    }
    return split;
  }

  static ShardEntry middle_pivot(const std::vector<ShardRange>& ranges, const Shape& shape) {
    return {shape.longest, ranges[shape.longest].lo + ranges[shape.longest].size() / 2};
  }

  // The entry of the longest range where the union's rank would sit if the shards interleave
  // evenly (as shards of documents of one kind do).
  static ShardEntry proportional_pivot(const std::vector<ShardRange>& ranges, const Shape& shape, int64_t rank) {
    const double fraction = (static_cast<double>(rank) + 0.5) / static_cast<double>(shape.total);
    const ShardRange& range = ranges[shape.longest];
    const int64_t offset = static_cast<int64_t>(fraction * static_cast<double>(range.size()));
    return {shape.longest, range.lo + std::clamp<int64_t>(offset, 0, range.size() - 1)};
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

  // First index of range in shard s whose key is not below pivot's (strict: above it): galloping
  // from hint (any index; clamped into the range) to bracket it, then binary search.
  template <bool kStrict>
  int64_t partition(int s, ShardRange range, const ShardEntry& pivot, int64_t hint) const {
    auto before = [&](int64_t i) {  // i lies before the partition point
      const int c = compare({s, i}, pivot);
      return kStrict ? c <= 0 : c < 0;
    };
    if (range.size() <= 0) return range.lo;
    const int64_t start = std::clamp(hint, range.lo, range.hi - 1);
    int64_t lo = range.lo, hi = range.hi;  // the point lies in [lo, hi]; hi is not before (or the end)
    if (before(start)) {
      for (int64_t previous = start, step = 1;; previous = lo, step *= 2) {
        lo = start + step;
        if (lo >= range.hi || !before(lo)) {
          hi = std::min(lo, range.hi);
          lo = previous + 1;
          break;
        }
      }
    } else {
      for (int64_t previous = start, step = 1;; previous = hi, step *= 2) {
        hi = start - step;
        if (hi < range.lo || before(hi)) {
          lo = std::max(hi + 1, range.lo);
          hi = previous;
          break;
        }
      }
    }
    return first_not_before(lo, hi, before);
  }

  const Index* shards_;
  int match_len_;
  int key_len_;
};

}  // namespace vrs
