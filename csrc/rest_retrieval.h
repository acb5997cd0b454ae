// REST retrieval (algorithms.md §1) for one request: longest-suffix match in a suffix-array
// datastore and in the request's own context, continuations merged into one weighted trie,
// the top_k best nodes as a subtree (flattened parents-first) and the best chain. Nodes rank by
// trie weight, or, given a ChanceTable, by calibrated path chance (then weight).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "context_ngram.h"
#include "context_states.h"
#include "merged_order.h"
#include "sharded_store.h"

namespace vrs {

// Every field starts at zero, which check_rest_params rejects: callers set them all
// (kernels/rest.py copies its RestParams, which holds the defaults).
struct RestParams {
  int n_min = 0;                // shortest suffix that may match
  int n_max = 0;                // longest suffix tried
  int max_matches = 0;          // datastore continuations per request (evenly sampled)
  int cont_len = 0;             // tokens per continuation
  int top_k = 0;                // tree nodes kept (0: no tree)
  int chain_len = 0;            // longest chain
  double min_ratio = 0;         // chain stops when weight(child) / weight(parent) < min_ratio
  bool tree_holds_chain = false;  // the tree's main path is the chain, its other nodes the best of the rest
  bool use_datastore = false;
  bool use_context = false;
  double context_weight = 0;    // weight of one context continuation (a datastore one weighs 1)
  int context_max_matches = 0;  // most recent context occurrences used (<= kMaxContextMatches)
  bool context_loops = false;   // a context continuation reaching the context's end repeats (a loop)
  int context_state_votes = 0;  // times the occurrence nearest by hidden state counts (given states)
  double output_weight = 0;     // weight of one continuation from the output index
  int output_max_matches = 0;   // output-index continuations per request (evenly sampled)
  double dense_weight = 0;      // weight of one given dense continuation (DReSD's neighbours, the store's or
                                // the learned index's)
  double live_weight = 0;       // weight of one given continuation from requests in flight
};

// Continuations found elsewhere (DReSD's dense neighbours in the store and in the index learned
// from served traffic, the live index of requests in flight)
// for one request: k rows of up to len tokens, row i holding lengths[i] of them (0: none), found
// with a match of match_len tokens (0: unknown).
struct GivenContinuations {
  const int32_t* tokens;   // [k, len]
  const int32_t* lengths;  // [k]
  int k;
  int len;
  int match_len;
};

// Calibrated chance that a node is accepted given its parent is, per (source flags, match-length
// bucket, depth bucket, raw-probability bucket): goodput/calibration.py's table, read clamped to
// [0, 1].
struct ChanceTable {
  const float* chance;           // [sources, lengths, depths, probs], C order
  int sources, lengths, depths, probs;
  const int32_t* length_bucket;  // [num_length_keys]: a match length's bucket (longer: the last key's)
  int num_length_keys;
  const int32_t* depth_bucket;   // [num_depth_keys]: a depth's bucket (0 = a child of the root)
  int num_depth_keys;

  double conditional(int8_t source, int match_len, int depth, float prob) const {
    const int length = length_bucket[std::min(match_len, num_length_keys - 1)];
    const int deep = depth_bucket[std::min(depth, num_depth_keys - 1)];
    const int raw = static_cast<int>(std::clamp<int64_t>(static_cast<int64_t>(prob * static_cast<float>(probs)),
                                                         0, probs - 1));
    const int64_t flat = ((static_cast<int64_t>(source % sources) * lengths + length) * depths + deep) * probs + raw;
    const float value = chance[flat];
    return value >= 0.0f ? std::min(static_cast<double>(value), 1.0) : 0.0;  // NaN and negatives: 0
  }
};

// Per-request outputs (views into the caller's arrays).
struct RestOutput {
  int32_t* tree_tokens;   // [top_k] or nullptr when top_k == 0 (as are the next two)
  int32_t* tree_parents;  // [top_k], -1 = child of the root
  int32_t* tree_size;     // scalar
  float* tree_prob;       // [top_k]: weight(node) / weight(parent), the drafter's acceptance guess
  int8_t* tree_source;    // [top_k]: kFrom* flags
  int32_t* chain_tokens;  // [chain_len]
  int32_t* chain_size;    // scalar
  float* chain_prob;      // [chain_len], as tree_prob
  int8_t* chain_source;   // [chain_len], as tree_source
  int32_t* match_info;    // [kMatchInfo]: datastore match length, context match length, datastore
                          //  matches, output-index match length, output-index matches, live match length
  int64_t* timings_ns;    // [4] or nullptr: search, gather, trie, select
};

template <typename Tok, typename Idx>
struct SuffixIndex {
  const Tok* tokens;
  const Idx* suffix_array;
  int64_t size;
  uint32_t separator;
  // Optional: offsets[t] = suffixes starting with a token below t (t < num_offsets), so the
  // suffixes starting with t are [offsets[t], offsets[t + 1]); narrows every binary search.
  // Read from disk: every range is clamped into [0, size].
  const int64_t* offsets = nullptr;
  int64_t num_offsets = 0;

  // The suffix-array range that can hold suffixes starting with token t (empty: none can).
  void first_token_range(int32_t t, int64_t* lo, int64_t* hi) const {
    if (offsets == nullptr) {
      *lo = 0;
      *hi = size;
    } else if (t < 0 || static_cast<int64_t>(t) + 1 >= num_offsets) {
      *lo = *hi = 0;
    } else {
      *lo = std::clamp<int64_t>(offsets[t], 0, size);
      *hi = std::clamp<int64_t>(offsets[t + 1], *lo, size);
    }
  }

  // Whether a suffix-array entry (read from disk) is a position of the store.
  bool valid(int64_t pos) const { return pos >= 0 && pos < size; }

  // <0, 0, >0: the suffix at pos against query q[0..len) (0: q is a prefix of the suffix);
  // an invalid pos sorts first.
  int compare(int64_t pos, const int32_t* q, int len) const {
    if (!valid(pos)) return -1;
    for (int i = 0; i < len; ++i) {
      if (pos + i >= size) return -1;
      const uint32_t t = static_cast<uint32_t>(tokens[pos + i]);
      const uint32_t want = static_cast<uint32_t>(q[i]);
      if (t != want) return t < want ? -1 : 1;
    }
    return 0;
  }

  // First entry of [lo, hi) whose suffix does not sort before q (strict: before or equal).
  // The two possible next midpoints are prefetched so that their cache misses overlap.
  template <bool kStrict>
  int64_t partition_point(const int32_t* q, int len, int64_t lo, int64_t hi) const {
    int64_t count = hi - lo;
    while (count > 0) {
      const int64_t half = count / 2;
      const int64_t mid = lo + half;
      __builtin_prefetch(suffix_array + lo + half / 2);
      __builtin_prefetch(suffix_array + mid + 1 + (count - half - 1) / 2);
      const int c = compare(suffix_array[mid], q, len);
      if (kStrict ? c <= 0 : c < 0) {
        lo = mid + 1;
        count -= half + 1;
      } else {
        count = half;
      }
    }
    return lo;
  }

  int64_t lower_bound(const int32_t* q, int len, int64_t lo, int64_t hi) const {
    return partition_point<false>(q, len, lo, hi);
  }

  int64_t upper_bound(const int32_t* q, int len, int64_t lo, int64_t hi) const {
    return partition_point<true>(q, len, lo, hi);
  }

  // How many suffixes sort before q (its lower bound in the whole array).
  int64_t rank_of(const int32_t* q, int len) const {
    int64_t lo = 0, hi = size;
    if (offsets == nullptr || (q[0] >= 0 && static_cast<int64_t>(q[0]) + 1 < num_offsets))
      first_token_range(q[0], &lo, &hi);
    return lower_bound(q, len, lo, hi);
  }

  // Whether q occurs: its first suffix-array entry and the end of its first-token bucket.
  bool occurs(const int32_t* q, int len, int64_t* first, int64_t* bucket_end) const {
    int64_t lo;
    first_token_range(q[0], &lo, bucket_end);
    *first = lower_bound(q, len, lo, *bucket_end);
    return *first < *bucket_end && compare(suffix_array[*first], q, len) == 0;
  }
};

// Which sources continued a node (bit flags of the *_source outputs).
constexpr int8_t kFromDatastore = 1;
constexpr int8_t kFromContext = 2;
constexpr int8_t kFromOutput = 8;  // 4 is the model's n-gram tables (N-Grammys, Python side)
constexpr int8_t kFromDense = 16;
constexpr int8_t kFromLive = 32;
constexpr int8_t kFromLearned = 64;
constexpr int kSourceCodes = 128;  // every combination of the flags: a chance table's first dimension
constexpr int kMatchInfo = 6;

// Each source's match length for one request (a node takes the longest of its sources').
struct MatchLengths {
  int datastore = 0, context = 0, output = 0, live = 0, dense = 0, learned = 0;

  int of(int8_t flags) const {
    int longest = 0;
    if (flags & kFromDatastore) longest = std::max(longest, datastore);
    if (flags & kFromContext) longest = std::max(longest, context);
    if (flags & kFromOutput) longest = std::max(longest, output);
    if (flags & kFromLive) longest = std::max(longest, live);
    if (flags & kFromDense) longest = std::max(longest, dense);
    if (flags & kFromLearned) longest = std::max(longest, learned);
    return longest;
  }
};

// Where a selected trie node goes: its token, parent position, weight ratio and sources.
struct NodeOutput {
  int32_t* tokens;
  int32_t* parents;  // nullptr for chains
  float* prob;
  int8_t* source;
};

// Trie of continuations with per-source counts; node 0 is the root.
class ContinuationTrie {
 public:
  struct Node {
    int32_t token;
    int32_t parent;
    int32_t first_child = -1;
    int32_t next_sibling = -1;
    int32_t last_child = -1;
    int32_t depth;
    int32_t datastore_count = 0;
    int32_t context_count = 0;
    int32_t output_count = 0;
    int32_t dense_count = 0;
    int32_t live_count = 0;
    int32_t learned_count = 0;
  };

  // An empty trie weighing each source by prm; nodes rank by calibrated path chance when
  // table is given, else by weight.
  void reset(const RestParams& prm, const ChanceTable* table) {
    context_weight_ = prm.context_weight;
    output_weight_ = prm.output_weight;
    dense_weight_ = prm.dense_weight;
    live_weight_ = prm.live_weight;
    table_ = table;
    nodes_.clear();
    nodes_.push_back(Node{-1, -1, -1, -1, -1, 0});
  }

  // Reusable per-thread buffers for gathered continuations.
  template <typename T>
  std::vector<T>& gather_buffer(size_t n) {
    std::vector<T>* buffer;
    if constexpr (std::is_same_v<T, uint16_t>) buffer = &buffer16_; else buffer = &buffer32_;
    if (buffer->size() < n) buffer->resize(n);
    return *buffer;
  }

  // Counts seq (len tokens from source) `times` times.
  template <typename T>
  void insert(const T* seq, int len, int8_t source, int32_t times = 1) {
    if (len <= 0) return;
    count(0, source, times);
    int32_t cur = 0;
    for (int i = 0; i < len; ++i) {
      cur = child(cur, static_cast<int32_t>(seq[i]));
      count(cur, source, times);
    }
  }

  double weight(int32_t node) const {
    const Node& n = nodes_[node];
    return n.datastore_count + context_weight_ * n.context_count + output_weight_ * n.output_count +
           dense_weight_ * (n.dense_count + n.learned_count) + live_weight_ * n.live_count;
  }

  // With a chance table: every node's calibrated path chance (the product of its and its
  // ancestors' conditional chances), given each source's match length. Call before selecting.
  void score(const MatchLengths& lengths) {
    if (table_ == nullptr) return;
    path_.resize(nodes_.size());
    conditional_.resize(nodes_.size());
    path_[0] = conditional_[0] = 1.0;
    for (size_t i = 1; i < nodes_.size(); ++i) {  // a parent is older than its children
      const Node& n = nodes_[i];
      const int8_t flags = source_flags(n);
      conditional_[i] = table_->conditional(flags, lengths.of(flags), n.depth - 1, ratio(static_cast<int32_t>(i)));
      path_[i] = path_[n.parent] * conditional_[i];
    }
  }

  // Strict total order: higher path chance first (with a chance table), then heavier, then
  // shallower, then smaller token, then older node.
  bool ranks_before(int32_t a, int32_t b) const {
    if (table_ != nullptr && path_[a] != path_[b]) return path_[a] > path_[b];
    const double wa = weight(a), wb = weight(b);
    if (wa != wb) return wa > wb;
    if (nodes_[a].depth != nodes_[b].depth) return nodes_[a].depth < nodes_[b].depth;
    if (nodes_[a].token != nodes_[b].token) return nodes_[a].token < nodes_[b].token;
    return a < b;
  }

  // The top_k best-ranked nodes, written depth-first (each node's children in rank order) with
  // parent positions; returns the count. With main_len > 0 the tree holds the chain first (its
  // first main_len nodes, as select_chain walks them) and its other top_k - main_len nodes are
  // the best-ranked of the rest: a goodput budget choosing among the tree's nodes then has the
  // whole chain to choose from as well as the branches. Every node ranks after its parent
  // (chances are at most 1), so the chosen nodes form a subtree and a best-first expansion from
  // the root (and the main path) finds them without sorting the trie. Depth-first puts the main
  // path (the best child of the best child ...) first: its nodes see exactly their ancestors
  // under a causal mask, so tree verification recomputes only the nodes after it.
  int select_tree(int top_k, int main_len, double min_ratio, NodeOutput out) {
    if (top_k <= 0) return 0;
    auto worse = [this](int32_t a, int32_t b) { return ranks_before(b, a); };
    std::vector<int32_t>& frontier = scratch_;
    std::vector<int32_t>& chosen = chosen_;
    frontier.clear();
    chosen.clear();
    for (int32_t cur = 0, best; static_cast<int>(chosen.size()) < std::min(top_k, main_len); cur = best) {
      best = best_child(cur);
      if (best < 0 || !chain_continues(best, cur, min_ratio)) break;
      chosen.push_back(best);
    }
    for (size_t i = 0; i <= chosen.size(); ++i) {  // the unchosen children of the root and the main path
      const int32_t parent = i == 0 ? 0 : chosen[i - 1];
      const int32_t next = i < chosen.size() ? chosen[i] : -1;
      for (int32_t c = nodes_[parent].first_child; c >= 0; c = nodes_[c].next_sibling)
        if (c != next) frontier.push_back(c);
    }
    std::make_heap(frontier.begin(), frontier.end(), worse);
    while (!frontier.empty() && static_cast<int>(chosen.size()) < top_k) {
      std::pop_heap(frontier.begin(), frontier.end(), worse);
      const int32_t best = frontier.back();
      frontier.pop_back();
      chosen.push_back(best);
      for (int32_t c = nodes_[best].first_child; c >= 0; c = nodes_[c].next_sibling) {
        frontier.push_back(c);
        std::push_heap(frontier.begin(), frontier.end(), worse);
      }
    }
    write_preorder(out);
    return static_cast<int>(chosen.size());
  }

  // From the root, follow the best-ranked child while its chance given its parent is at least
  // min_ratio: its calibrated chance with a table, else its weight over its parent's.
  int select_chain(int chain_len, double min_ratio, NodeOutput out) const {
    int len = 0;
    for (int32_t cur = 0, best; len < chain_len; cur = best) {
      best = best_child(cur);
      if (best < 0 || !chain_continues(best, cur, min_ratio)) break;
      write(out, len++, best);
    }
    return len;
  }

  size_t size() const { return nodes_.size(); }

 private:
  // The best-ranked child of a node (-1: none).
  int32_t best_child(int32_t node) const {
    int32_t best = -1;
    for (int32_t c = nodes_[node].first_child; c >= 0; c = nodes_[c].next_sibling)
      if (best < 0 || ranks_before(c, best)) best = c;
    return best;
  }

  // Whether a chain goes on from parent to child: the child's calibrated chance (with a table),
  // else its weight over the parent's, is at least min_ratio.
  bool chain_continues(int32_t child, int32_t parent, double min_ratio) const {
    return table_ != nullptr ? conditional_[child] >= min_ratio : weight(child) >= min_ratio * weight(parent);
  }

  // A node's weight over its parent's: the drafter's raw acceptance guess.
  float ratio(int32_t node) const { return static_cast<float>(weight(node) / weight(nodes_[node].parent)); }

  // Writes chosen_ (best-ranked first, a subtree) in preorder, children in rank order: each
  // chosen node is linked to its parent's list of chosen children (slot k: the root), then the
  // lists are walked with a stack of next siblings.
  void write_preorder(NodeOutput out) {
    const int k = static_cast<int>(chosen_.size());
    if (position_.size() < nodes_.size()) position_.resize(nodes_.size());
    first_kid_.assign(k + 1, -1);
    next_kid_.assign(k, -1);
    for (int i = 0; i < k; ++i) position_[chosen_[i]] = i;
    for (int i = k - 1; i >= 0; --i) {  // prepending in reverse rank order keeps rank order
      const int32_t parent = nodes_[chosen_[i]].parent;
      const int slot = parent == 0 ? k : position_[parent];
      next_kid_[i] = first_kid_[slot];
      first_kid_[slot] = i;
    }
    std::vector<int32_t>& pending = scratch_;  // next siblings still to visit
    pending.clear();
    int written = 0;
    for (int i = first_kid_[k]; i >= 0;) {
      const int32_t node = chosen_[i];
      const int32_t parent = nodes_[node].parent;
      out.parents[written] = parent == 0 ? -1 : position_[parent];
      write(out, written, node);
      position_[node] = written++;  // read by its children, written after it
      if (first_kid_[i] >= 0) {
        pending.push_back(next_kid_[i]);
        i = first_kid_[i];
        continue;
      }
      i = next_kid_[i];
      while (i < 0 && !pending.empty()) {
        i = pending.back();
        pending.pop_back();
      }
    }
  }

  static int8_t source_flags(const Node& n) {
    return static_cast<int8_t>((n.datastore_count > 0 ? kFromDatastore : 0) |
                               (n.context_count > 0 ? kFromContext : 0) |
                               (n.output_count > 0 ? kFromOutput : 0) | (n.dense_count > 0 ? kFromDense : 0) |
                               (n.live_count > 0 ? kFromLive : 0) | (n.learned_count > 0 ? kFromLearned : 0));
  }

  void write(NodeOutput out, int i, int32_t node) const {
    out.tokens[i] = nodes_[node].token;
    out.prob[i] = ratio(node);
    out.source[i] = source_flags(nodes_[node]);
  }

  void count(int32_t node, int8_t source, int32_t times) {
    Node& n = nodes_[node];
    if (source == kFromContext) n.context_count += times;
    else if (source == kFromOutput) n.output_count += times;
    else if (source == kFromDense) n.dense_count += times;
    else if (source == kFromLive) n.live_count += times;
    else if (source == kFromLearned) n.learned_count += times;
    else n.datastore_count += times;
  }

  int32_t child(int32_t parent, int32_t token) {
    // Sorted input (datastore ranges) hits the most recent child first.
    const int32_t last = nodes_[parent].last_child;
    if (last >= 0 && nodes_[last].token == token) return last;
    for (int32_t c = nodes_[parent].first_child; c >= 0; c = nodes_[c].next_sibling)
      if (nodes_[c].token == token) return c;
    const int32_t created = static_cast<int32_t>(nodes_.size());
    nodes_.push_back(Node{token, parent, -1, -1, -1, nodes_[parent].depth + 1});
    Node& p = nodes_[parent];
    if (p.last_child < 0) p.first_child = created; else nodes_[p.last_child].next_sibling = created;
    p.last_child = created;
    return created;
  }

  double context_weight_ = 1.0;
  double output_weight_ = 1.0;
  double dense_weight_ = 1.0;
  double live_weight_ = 1.0;
  const ChanceTable* table_ = nullptr;
  std::vector<Node> nodes_;
  std::vector<double> path_;         // calibrated path chance per node (with a table)
  std::vector<double> conditional_;  // calibrated chance given the parent per node (with a table)
  std::vector<uint16_t> buffer16_;
  std::vector<uint32_t> buffer32_;
  std::vector<int32_t> scratch_;
  std::vector<int32_t> chosen_;
  std::vector<int32_t> position_;  // trie node -> index in the selected tree
  std::vector<int32_t> first_kid_;  // per chosen node (and the root, last): its first chosen child
  std::vector<int32_t> next_kid_;   // per chosen node: its next chosen sibling
};

// Longest n in [n_min, min(n_max, n)] for which occurs(n) holds (0: none), by binary search over
// n: occurrence of a context's last n tokens is monotone in n.
template <typename Occurs>
int longest_occurring(const RestParams& prm, int n, Occurs&& occurs) {
  int low = std::max(prm.n_min, 1), high = std::min(prm.n_max, n), best = 0;
  while (low <= high) {
    const int mid = low + (high - low) / 2;
    if (occurs(mid)) {
      best = mid;
      low = mid + 1;
    } else {
      high = mid - 1;
    }
  }
  return best;
}

// Longest n in [n_min, n_max] whose last-n-token query occurs in the datastore (occurrence is
// monotone in n, so binary search over n). Returns n (0: none) and the SA range.
template <typename Tok, typename Idx>
int longest_datastore_match(const SuffixIndex<Tok, Idx>& index, const int32_t* ctx, int n,
                            const RestParams& prm, int64_t* lo, int64_t* hi) {
  int64_t best_first = 0, best_bucket_end = 0;
  const int best = longest_occurring(prm, n, [&](int len) {
    int64_t first, bucket_end;
    if (!index.occurs(ctx + n - len, len, &first, &bucket_end)) return false;
    best_first = first;  // the last success is the longest
    best_bucket_end = bucket_end;
    return true;
  });
  if (best > 0) {
    *lo = best_first;
    *hi = index.upper_bound(ctx + n - best, best, best_first, best_bucket_end);
  }
  return best;
}

// Insert the continuation (cont_len tokens, stopping at a separator) of the suffix at suffix-array
// entry `entry` (read from disk: one outside the store continues with nothing) matched with
// match_len tokens.
template <typename Tok, typename Idx>
void insert_continuation_at(const SuffixIndex<Tok, Idx>& index, int64_t entry, int match_len, int cont_len,
                            int8_t source, ContinuationTrie& trie) {
  std::vector<Tok>& buffer = trie.gather_buffer<Tok>(static_cast<size_t>(cont_len));
  const int64_t pos = entry + match_len;
  int len = 0;
  while (index.valid(entry) && len < cont_len && pos + len < index.size &&
         static_cast<uint32_t>(index.tokens[pos + len]) != index.separator) {
    buffer[len] = index.tokens[pos + len];
    ++len;
  }
  trie.insert(buffer.data(), len, source);
}

// Insert up to max_matches continuations of the suffix-array range [lo, hi) matched with
// match_len tokens, evenly strided over the range.
template <typename Tok, typename Idx>
void insert_continuations(const SuffixIndex<Tok, Idx>& index, int64_t lo, int64_t hi, int match_len,
                          int max_matches, int cont_len, int8_t source, ContinuationTrie& trie) {
  const int64_t found = hi - lo;
  const int take = static_cast<int>(std::min<int64_t>(found, max_matches));
  for (int j = 0; j < take; ++j)
    insert_continuation_at(index, static_cast<int64_t>(index.suffix_array[lo + (j * found) / take]), match_len,
                           cont_len, source, trie);
}

// A datastore REST searches: one or more shards (suffix arrays over their own documents) searched
// as one suffix array over their concatenated tokens (sharded_store.h).
template <typename Tok, typename Idx>
struct StoreShards {
  const SuffixIndex<Tok, Idx>* shards;
  int count;
  SelectionCache* cache = nullptr;  // selections of earlier steps (none: select every time)
  const MergedOrder* order = nullptr;  // the shards' merged order (none: select across them)

  // Whether a match and its continuations are sampled through the merged order (sorted deep
  // enough for them), not selected across the shards.
  bool samples_through_order(int match_len, int cont_len) const {
    return order != nullptr && match_len + cont_len <= order->depth;
  }
};

// The longest match in any shard (the same n as one array over all of them) and every shard's
// range for it (empty where it does not occur). The first shard searches every length; the
// others only lengths above the longest so far (one probe when they hold none longer).
template <typename Tok, typename Idx>
int longest_sharded_match(const StoreShards<Tok, Idx>& store, const int32_t* ctx, int n, const RestParams& prm,
                          std::vector<ShardRange>& ranges) {
  ranges.assign(store.count, ShardRange{});
  if (store.count == 1) return longest_datastore_match(store.shards[0], ctx, n, prm, &ranges[0].lo, &ranges[0].hi);
  int best = 0;
  for (int s = 0; s < store.count; ++s) {
    const SuffixIndex<Tok, Idx>& shard = store.shards[s];
    auto occurs = [&](int len) {
      int64_t first, bucket_end;
      return shard.occurs(ctx + n - len, len, &first, &bucket_end);
    };
    RestParams longer = prm;
    longer.n_min = std::max(prm.n_min, best + 1);
    if (longer.n_min > std::min(prm.n_max, n)) break;
    if (best > 0) {  // one probe tells whether this shard holds a longer match at all
      if (!occurs(longer.n_min)) continue;
      best = longer.n_min++;
    }
    best = std::max(best, longest_occurring(longer, n, occurs));
  }
  for (int s = 0; best > 0 && s < store.count; ++s) {
    const SuffixIndex<Tok, Idx>& shard = store.shards[s];
    int64_t first, bucket_end;
    if (shard.occurs(ctx + n - best, best, &first, &bucket_end))
      ranges[s] = {first, shard.upper_bound(ctx + n - best, best, first, bucket_end)};
    else if (store.samples_through_order(best, prm.cont_len))  // where it would sit: the run starts at the sum
      ranges[s].lo = ranges[s].hi = shard.rank_of(ctx + n - best, best);
  }
  return best;
}

// insert_continuations over the shards' ranges as one: the evenly strided ranks of their union
// in lexicographic order, read from the store's merged order when it is deep enough for the
// match and its continuations (merged_order.h), else each found by selection (ShardSelector).
// A selection is remembered by the matched tokens (store.cache): it depends on nothing else.
template <typename Tok, typename Idx>
void insert_sharded_continuations(const StoreShards<Tok, Idx>& store, const std::vector<ShardRange>& ranges,
                                  const int32_t* match, int match_len, int max_matches, int cont_len, int8_t source,
                                  ContinuationTrie& trie) {
  if (store.count == 1) {
    insert_continuations(store.shards[0], ranges[0].lo, ranges[0].hi, match_len, max_matches, cont_len, source, trie);
    return;
  }
  int64_t found = 0, first = 0;
  for (const ShardRange& range : ranges) {
    found += range.size();
    first += range.lo;
  }
  const int take = static_cast<int>(std::min<int64_t>(found, max_matches));
  if (store.samples_through_order(match_len, cont_len)) {
    for (int j = 0; j < take; ++j) {
      const ShardPosition at = store.order->locate(first + (j * found) / take);
      insert_continuation_at(store.shards[at.shard], at.position, match_len, cont_len, source, trie);
    }
    return;
  }
  thread_local std::vector<ShardEntry> entries;
  const SelectionKey key{match, match_len, cont_len, take};
  const bool cached = store.cache != nullptr && found > take;  // else every match is taken: nothing to select
  if (!cached || !store.cache->find(key, entries)) {
    std::vector<int64_t> targets(take);
    for (int j = 0; j < take; ++j) targets[j] = (j * found) / take;
    entries.resize(take);
    ShardSelector<SuffixIndex<Tok, Idx>>(store.shards, match_len, cont_len)
        .select(ranges, targets.data(), take, 0, entries.data());
    if (cached) store.cache->put(key, entries);
  }
  for (const ShardEntry& entry : entries) {
    const SuffixIndex<Tok, Idx>& shard = store.shards[entry.shard];
    insert_continuation_at(shard, static_cast<int64_t>(shard.suffix_array[entry.index]), match_len, cont_len,
                           source, trie);
  }
}

// The output index of finished requests: uint32 tokens, int32 suffix array.
using OutputIndex = SuffixIndex<uint32_t, int32_t>;

// Insert the given continuations (cut to cont_len) when their source weighs anything.
inline void insert_given(const GivenContinuations* given, double weight, int cont_len, int8_t source,
                         ContinuationTrie& trie) {
  if (given == nullptr || !(weight > 0)) return;
  for (int i = 0; i < given->k; ++i)
    trie.insert(given->tokens + static_cast<int64_t>(i) * given->len, std::min(given->lengths[i], cont_len), source);
}

// Continuations a request's caller found elsewhere, and the chance table to rank nodes by
// (each may be null).
struct RestExtras {
  const GivenContinuations* dense;
  const GivenContinuations* learned;
  const GivenContinuations* live;
  const ChanceTable* table;
  const ContextStates* states;  // the requests' hidden states by position, or nullptr
  int32_t state_slot;           // this request's slot in states (-1: none)
};

template <typename Tok, typename Idx>
void rest_retrieve_one(const StoreShards<Tok, Idx>* store, const OutputIndex* output, RestExtras extras,
                       const int32_t* ctx, int n, const RestParams& prm, ContinuationTrie& trie,
                       RestOutput out) {
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  thread_local std::vector<ShardRange> ranges;
  ranges.clear();
  int64_t found = 0, out_lo = 0, out_hi = 0;
  int ds_len = 0, out_len = 0;
  if (prm.use_datastore && store != nullptr && store->count > 0) {
    ds_len = longest_sharded_match(*store, ctx, n, prm, ranges);
    for (const ShardRange& range : ranges) found += range.size();
  }
  if (output != nullptr && output->size > 0 && prm.output_max_matches > 0 && prm.output_weight > 0)
    out_len = longest_datastore_match(*output, ctx, n, prm, &out_lo, &out_hi);
  auto t1 = clock::now();

  trie.reset(prm, extras.table);
  if (ds_len > 0)
    insert_sharded_continuations(*store, ranges, ctx + n - ds_len, ds_len, prm.max_matches, prm.cont_len,
                                 kFromDatastore, trie);
  if (out_len > 0)
    insert_continuations(*output, out_lo, out_hi, out_len, prm.output_max_matches, prm.cont_len, kFromOutput, trie);
  insert_given(extras.dense, prm.dense_weight, prm.cont_len, kFromDense, trie);
  insert_given(extras.learned, prm.dense_weight, prm.cont_len, kFromLearned, trie);
  insert_given(extras.live, prm.live_weight, prm.cont_len, kFromLive, trie);
  auto t2 = clock::now();

  // The request's own context, searched the same way.
  int ctx_len = 0;
  if (prm.use_context && prm.context_weight > 0) {
    int match_pos[kMaxContextMatches];
    int m = 0;
    ctx_len = longest_recent_match(ctx, n, prm.n_min, prm.n_max, prm.context_max_matches, match_pos, &m);
    thread_local std::vector<int32_t> continuation;
    continuation.resize(static_cast<size_t>(prm.cont_len));
    // The occurrence whose producing state is nearest the current one counts context_state_votes
    // times: where the occurrences' continuations part, the trie leans to the model's own state.
    const int nearest = extras.states == nullptr || prm.context_state_votes <= 1 ? -1
                        : extras.states->nearest_occurrence(extras.state_slot, match_pos, m, ctx_len, n);
    for (int i = 0; i < m; ++i) {
      const int len = context_continuation(ctx, n, match_pos[i], ctx_len, prm.cont_len, prm.context_loops,
                                           continuation.data());
      trie.insert(continuation.data(), len, kFromContext, i == nearest ? prm.context_state_votes : 1);
    }
  }
  auto t3 = clock::now();
  const int live_len = extras.live != nullptr && prm.live_weight > 0 ? extras.live->match_len : 0;
  const auto given_len = [&](const GivenContinuations* given) {
    return given != nullptr && prm.dense_weight > 0 ? given->match_len : 0;
  };
  trie.score(MatchLengths{ds_len, ctx_len, out_len, live_len, given_len(extras.dense), given_len(extras.learned)});
  if (out.tree_size != nullptr)
    *out.tree_size = trie.select_tree(prm.top_k, prm.tree_holds_chain ? prm.chain_len : 0, prm.min_ratio,
                                      {out.tree_tokens, out.tree_parents, out.tree_prob, out.tree_source});
  *out.chain_size = trie.select_chain(prm.chain_len, prm.min_ratio,
                                      {out.chain_tokens, nullptr, out.chain_prob, out.chain_source});
  auto t4 = clock::now();

  const auto clamp32 = [](int64_t v) { return static_cast<int32_t>(std::min<int64_t>(v, INT32_MAX)); };
  out.match_info[0] = ds_len;
  out.match_info[1] = ctx_len;
  out.match_info[2] = clamp32(found);
  out.match_info[3] = out_len;
  out.match_info[4] = clamp32(out_hi - out_lo);
  out.match_info[5] = live_len;
  if (out.timings_ns != nullptr) {
    auto ns = [](auto d) { return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(); };
    out.timings_ns[0] = ns(t1 - t0);
    out.timings_ns[1] = ns(t2 - t1);
    out.timings_ns[2] = ns(t3 - t2);
    out.timings_ns[3] = ns(t4 - t3);
  }
}

}  // namespace vrs
