// Tree speculative verification: walk each request's draft tree with the target's scores,
// accept a path and emit one more token. Shared by the CPU (one request per task, CpuOps below)
// and CUDA (one request per block, BlockOps in tree_cuda.cu): the walk, its draw order and every
// floating-point operation are the same, so both backends and the NumPy reference
// (vllm_retrieval_spec/kernels/tree_reference.py) agree exactly.
//
// Layout: request b owns draft nodes [offsets[b], offsets[b+1]) (tokens, parents as in
// tree_pack.h) and score rows from row_offsets[b] = offsets[b] + b: row 0 is the target after
// the context, row j + 1 the target after local node j. draft_probs rows line up with scores:
// the candidates below a node were drawn from the node's own row. Rules:
//   0 greedy: scores are logits; t = argmax (ties to the lowest id); descend to the first child
//     carrying t, else emit t.
//   1 deterministic candidates: scores are probabilities; child c_i (flat order) is accepted
//     with probability p_i(c_i) / sum(p_i), p_1 = p, p_{i+1} = p_i with c_i zeroed (the sum by
//     subtraction); if all fail, emit a sample of p_{m+1} (of p when rounding left it empty).
//   2 MCSS with replacement: accept x_i iff u < p(x_i) / q(x_i) (normalised; q = 0 accepts iff
//     p > 0), else p <- max(p - q, 0) normalised (kept as is when that residual is all zero);
//     if all fail, emit a sample of p.
//   3 MCSS without replacement: as 2, and after a rejection q[x_i] <- 0, q renormalised.
//   4 keyed (seeded sampling that repeats exactly): scores as rule 1; at a node of depth d,
//     t = sample(p, keyed_uniform(seeds[b], positions[b] + d)) (rng.h), the token the request
//     samples at that absolute position whatever was drafted; descend to the first child
//     carrying t, else emit t. A child is accepted with probability p(child), a node's children
//     with the sum of theirs, as rule 1 does; the emitted tokens are those without drafts.
// A node without children (or at depth out_width - 1) emits a sample of its row (argmax for
// greedy). Rules 1-3 draw one uniform per candidate test and one per final sample, in that
// order, from the stream uniform(seeds[b], 0), uniform(seeds[b], 1), ...; rule 4 one keyed
// uniform per visited node.
//
// Canonical sums (what "sum" and "cumsum" mean above, identical on every backend): a row of V
// values is cut into kSegments contiguous segments of L = 32 * ceil(V / 1024) values (zero
// padded), each segment into tiles of 32. A tile's sum is the pairwise tree of its values
// ((v0 + v1) + (v2 + v3)) + ...; a segment's sum T[s] adds its tiles left to right starting
// from 0; segment s starts at E[s], the exclusive Hillis-Steele scan of T (E[0] = 0), and the
// total is E[31] + T[31]. cdf[i] = E[s] + (R + H[l]) where R is the segment's running sum of
// the earlier tiles and H the Hillis-Steele inclusive scan of i's tile. Sampling with u returns
// the smallest i < V with cdf[i] > u * total, else the last i with value > 0, else -1.
//
// Lazy target rows (optional per-request temperature T > 0, top_k k, top_p p; rules 1-3, greedy
// ignores them): scores are then raw logits, and each row the walk visits becomes, before the
// rule uses it, the target distribution e (unnormalised, float64): vLLM's
// softmax(apply_top_k_top_p(logits / T, k, p)), computed in float64 instead of float32:
//   l_i: the logit, NaN read as -inf and -0 as +0; key_i = order_key(l_i), the uint32 whose order
//     is the order of the values (equal values, equal keys); x_i = double(l_i) / double(T).
//   top-k (0 < k < V, else off): K = {i : key_i >= tau}, tau the k-th largest key (ties at the
//     threshold kept); m = max_i x_i.
//   e_i = 0 for i outside K or x_i = -inf; 1 where x_i = m; else exp_neg(x_i - m), where
//     exp_neg(y) = 0 for y < -700, else ldexp(P(r), n) with n = rint(y * kInvLn2),
//     r = (y - n * kLn2Hi) - n * kLn2Lo and P(r) = sum_{j <= 12} r^j / j! by Horner from
//     degree 12 (the constants in exp_neg; round to nearest, no fused multiply-adds).
//   top-p (p < 1, else off; only when S = sum(e) > 0): the vocabulary ascends by
//     pos_i = key_i * V + i (by value, ties by token id); M(t) = sum of e_j over pos_j <= t;
//     c = the first i in that order with M(pos_i) > (1 - double(p)) * S (double), else the last
//     i (the largest pos); then e_j <- 0 for pos_j < pos_c. vLLM keeps i iff its float32
//     ascending cumsum exceeds 1 - p: the cuts differ only where float32 rounding decides.
//   Every sum (S, M) is a canonical sum, so every backend finds the same cut. The vocabulary is
//   never sorted: the backend's guess_position (CpuOps: a histogram of the top 11 key bits, the
//   boundary bucket sorted; BlockOps: three radix levels) proposes c, M just below and at it
//   (two canonical sums) certify it, and only where they refute it a bisection over positions,
//   a canonical sum per step, finds it. tau likewise: CpuOps selects it exactly (a heap of the k
//   largest keys, nth_element for k > 1024), BlockOps by radix counts that two counts certify,
//   else a bisection.
//
// Sparse draft rows (optional, rules 2-3, instead of draft_probs): row r's q is
// (draft_tokens[r, j], draft_values[r, j]) for j < M, entries whose token is outside [0, V)
// being padding, tokens distinct; q is zero elsewhere and used exactly as the dense row with
// those values would be. Sums of q are canonical sums over only its entries (zeros add
// exactly); residuals are p's row patched at q's tokens. Work per row: O(M^2), none of it in V.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "rng.h"

namespace vrs {

constexpr int kTileWidth = 32;
constexpr int kSegments = 32;
static_assert(kSegments == kTileWidth, "segment starts reuse the tile scan");
constexpr int kHistogramBuckets = 2048;  // radix guesses: 11 key bits per level at most
constexpr uint64_t kNoPosition = ~uint64_t{0};

enum AcceptRule : int32_t {
  kGreedy = 0,
  kCandidates = 1,
  kMcss = 2,
  kMcssNoReplacement = 3,
  kKeyed = 4
};

VRS_HD inline int64_t segment_length(int64_t vocab) {
  const int64_t span = static_cast<int64_t>(kTileWidth) * kSegments;
  return kTileWidth * ((vocab + span - 1) / span);
}

// Pairwise tree sum of a tile, level by level ((t0 + t1) + (t2 + t3)) + ...
VRS_HD inline double tile_tree_sum(const double* t) {
  double level[kTileWidth / 2];
  for (int l = 0; l < kTileWidth / 2; ++l) level[l] = t[2 * l] + t[2 * l + 1];
  for (int width = kTileWidth / 4; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) level[l] = level[2 * l] + level[2 * l + 1];
  return level[0];
}

VRS_HD inline void hillis_steele_scan(double* x) {
  for (int d = 1; d < kTileWidth; d *= 2)
    for (int l = kTileWidth - 1; l >= d; --l) x[l] = x[l] + x[l - d];
}

// The canonical total from the segment sums T: E[31] + T[31] (E the exclusive scan).
VRS_HD inline double total_of_segments(const double* sums) {
  double scan[kSegments];
  for (int s = 0; s < kSegments; ++s) scan[s] = sums[s];
  hillis_steele_scan(scan);
  return scan[kSegments - 2] + sums[kSegments - 1];
}

// Row values: float32 scores or a float64 workspace.
struct Dist {
  const float* f32;
  const double* f64;
  VRS_HD double operator()(int64_t i) const { return f64 ? f64[i] : static_cast<double>(f32[i]); }
};

// A distribution divided by its total (all zero when the total is 0).
template <class F>
struct NormalizedOf {
  F dist;
  double total;
  VRS_HD double operator()(int64_t i) const { return total > 0 ? dist(i) / total : 0.0; }
};
using Normalized = NormalizedOf<Dist>;

// max(p - q, 0) of two normalised distributions: the MCSS residual.
template <class Q>
struct ResidualOf {
  Normalized p;
  NormalizedOf<Q> q;
  VRS_HD double operator()(int64_t i) const {
    const double r = p(i) - q(i);
    return r > 0 ? r : 0.0;
  }
};
using Residual = ResidualOf<Dist>;

// Accept with probability num / den (num >= den accepts; num = 0 never does).
VRS_HD inline bool accept_ratio(double u, double num, double den) {
  return num > 0 && (num >= den || u < num / den);
}

struct TreeBatch {
  const float* scores;       // [N + B, V]
  const float* draft_probs;  // [N + B, V] or null
  int64_t vocab;
  const int32_t* tokens;   // [N]
  const int32_t* parents;  // [N]
  const int32_t* offsets;  // [B + 1]
  const int32_t* rules;    // [B]
  const uint64_t* seeds;   // [B]
  int out_width;
  int32_t* out_tokens;    // [B, out_width]
  int32_t* path_nodes;    // [B, out_width - 1]
  int32_t* num_accepted;  // [B]
  // Lazy target rows: all three [B], or all null (scores of rules 1-3 are then probabilities).
  const float* temperature = nullptr;
  const int32_t* top_k = nullptr;
  const float* top_p = nullptr;
  // Sparse draft rows [N + B, draft_width], or null.
  const int32_t* draft_tokens = nullptr;
  const float* draft_values = nullptr;
  int32_t draft_width = 0;
  // Rule 4: the absolute position of each request's root token (the one row 0 samples) [B],
  // or null (no keyed request).
  const int64_t* positions = nullptr;
};

// One request's scratch rows (null where its rule and inputs need none).
struct RequestWork {
  double* p = nullptr;         // [V]: residuals (rules 1-3)
  float* q = nullptr;          // [V]: masked dense q (rule 3)
  double* row = nullptr;       // [V]: the lazy target row; the second residual row (sparse q)
  int32_t* q_tokens = nullptr;  // [M]: a sparse q row sorted by token (rules 2-3)
  float* q_values = nullptr;    // [M]
};

// One request's tree: its nodes, their parents and tokens, as local indices.
struct LocalTree {
  const int32_t* parents;
  const int32_t* tokens;
  int32_t size;
  int64_t vocab;

  // First child of `node` after local index `after` (-1: none).
  VRS_HD int32_t next_child(int32_t node, int32_t after) const {
    for (int32_t j = after + 1; j < size; ++j)
      if (parents[j] == node) return j;
    return -1;
  }
  VRS_HD bool token_in_vocab(int32_t j) const { return tokens[j] >= 0 && tokens[j] < vocab; }
  // f at node j's token (0 for a token outside the vocabulary).
  template <class F>
  VRS_HD double at_token(const F& f, int32_t j) const {
    return token_in_vocab(j) ? f(tokens[j]) : 0.0;
  }
  // The first child of `node` carrying `token` (-1: none).
  VRS_HD int32_t child_carrying(int32_t node, int32_t token) const {
    for (int32_t c = next_child(node, node); c >= 0; c = next_child(node, c))
      if (tokens[c] == token) return c;
    return -1;
  }
  // Whether an earlier sibling of child c carries the same token.
  VRS_HD bool repeats_sibling(int32_t node, int32_t c) const {
    for (int32_t j = node + 1; j < c; ++j)
      if (parents[j] == node && tokens[j] == tokens[c]) return true;
    return false;
  }
};

// ---------------------------------------------------------------------------------------------
// Lazy target rows (see the top of this file).

VRS_HD inline float canonical_logit(float v) {
  if (v != v) return -INFINITY;
  return v == 0.0f ? 0.0f : v;
}

VRS_HD inline uint32_t order_key(float v) {
  const float c = canonical_logit(v);
  uint32_t bits;
  memcpy(&bits, &c, sizeof bits);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Where a row's order keys come from: computed from the logits (CUDA), or cached (CpuOps).
struct LogitKeys {
  const float* logits;
  VRS_HD uint32_t operator()(int64_t i) const { return order_key(logits[i]); }
};
struct CachedKeys {
  const uint32_t* keys;
  VRS_HD uint32_t operator()(int64_t i) const { return keys[i]; }
};

VRS_HD inline double scaled_logit(float v, double temperature) {
  return static_cast<double>(canonical_logit(v)) / temperature;
}

// exp(y) for y <= 0 from +, -, * only, so every backend rounds alike. rint(v) for v in
// [-1010, 0] is (v + 1.5 * 2^52) - 1.5 * 2^52 (ties to even), and ldexp(P, n) = P * 2^n exactly
// (P in [0.7, 1.5], a normal result), 2^n built from its bits.
constexpr double kInvLn2 = 0x1.71547652b82fep+0, kLn2Hi = 0x1.62e42feep-1,
                 kLn2Lo = 0x1.a39ef35793c76p-33, kRoundToInteger = 0x1.8p52, kExpFloor = -700.0;
constexpr int64_t kRoundToIntegerBits = 0x4338000000000000;  // 1.5 * 2^52

// exp_neg for y in [kExpFloor, 0], on a double (Bits int64_t) or a vector of doubles (Bits the
// matching vector of int64_t: tree_cpu.cpp, which needs it inlined into its ISA clones).
#if defined(__CUDACC__)
#define VRS_HD_ALWAYS_INLINE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define VRS_HD_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define VRS_HD_ALWAYS_INLINE inline
#endif
template <class T, class Bits>
VRS_HD_ALWAYS_INLINE T exp_neg_inside(T y) {
  const T t = y * kInvLn2 + kRoundToInteger;  // 1.5 * 2^52 + n: n in its low bits
  const T n = t - kRoundToInteger;
  const T r = (y - n * kLn2Hi) - n * kLn2Lo;
  T p = r * 0x1.1eed8eff8d898p-29 + 0x1.ae64567f544e4p-26;  // 1 / 12!, 1 / 11!
  p = p * r + 0x1.27e4fb7789f5cp-22;
  p = p * r + 0x1.71de3a556c734p-19;
  p = p * r + 0x1.a01a01a01a01ap-16;
  p = p * r + 0x1.a01a01a01a01ap-13;
  p = p * r + 0x1.6c16c16c16c17p-10;
  p = p * r + 0x1.1111111111111p-7;
  p = p * r + 0x1.5555555555555p-5;
  p = p * r + 0x1.5555555555555p-3;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  Bits bits;
  memcpy(&bits, &t, sizeof bits);
  bits = (bits - kRoundToIntegerBits + 1023) << 52;
  T scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

VRS_HD inline double exp_neg(double y) {
  return y >= kExpFloor ? exp_neg_inside<double, int64_t>(y) : 0.0;
}

// e_i of the top of this file, before top-p.
template <class Keys>
struct TargetWeight {
  const float* logits;
  Keys keys;
  uint32_t min_key;  // top-k threshold (0: off)
  double temperature;
  double max_x;
  VRS_HD double operator()(int64_t i) const {
    if (min_key > 0 && keys(i) < min_key) return 0.0;
    const double x = scaled_logit(logits[i], temperature);
    if (x == -INFINITY) return 0.0;
    return x == max_x ? 1.0 : exp_neg(x - max_x);
  }
};

struct Ones {
  VRS_HD double operator()(int64_t) const { return 1.0; }
};

// f with f(index) replaced by value.
template <class F>
struct Replaced {
  F f;
  int64_t index;
  double value;
  VRS_HD double operator()(int64_t i) const { return i == index ? value : f(i); }
};

// 1 where the key is at least `key` (a uint64 so that 2^32 counts nothing).
template <class Keys>
struct KeyAtLeast {
  Keys keys;
  uint64_t key;
  VRS_HD double operator()(int64_t i) const { return keys(i) >= key ? 1.0 : 0.0; }
};

// w where the key equals `key`, else 0.
template <class Keys, class W>
struct KeyGroup {
  Keys keys;
  uint32_t key;
  W w;
  VRS_HD double operator()(int64_t i) const { return keys(i) == key ? w(i) : 0.0; }
};

// e at positions (key_i * V + i) up to position key * V + index (M of the top of this file),
// or from it on.
template <class Keys>
struct PositionMask {
  Keys keys;
  const double* e;
  uint64_t key;
  uint64_t index;
  bool from;
  VRS_HD double operator()(int64_t i) const {
    const uint64_t k = keys(i), j = static_cast<uint64_t>(i);
    const bool before = k < key || (k == key && j < index);
    const bool at = k == key && j == index;
    return (from ? !before : before || at) ? e[i] : 0.0;
  }
};

template <class Ops, class Keys>
VRS_HD PositionMask<Keys> position_mask(const Ops& ops, const Keys& keys, const double* e,
                                        uint64_t position, bool from) {
  const uint64_t vocab = static_cast<uint64_t>(ops.vocab);
  return PositionMask<Keys>{keys, e, position / vocab, position % vocab, from};
}

// #{i : key_i >= key}, exact (integers).
template <class Ops, class Keys>
VRS_HD double count_at_least(Ops& ops, const Keys& keys, uint64_t key) {
  return ops.total(KeyAtLeast<Keys>{keys, key});
}

// tau: the largest key with #{key_i >= tau} >= k (0 < k < V): the backend's guess, certified by
// two counts (unless the backend's guess is exact by construction), else bisected.
template <class Ops, class Keys>
VRS_HD uint32_t top_k_key(Ops& ops, const Keys& keys, int32_t k) {
  const uint64_t guess = ops.guess_top_k_key(keys, k);
  if (Ops::kExactTopKGuess) return static_cast<uint32_t>(guess);
  if (guess != kNoPosition && count_at_least(ops, keys, guess) >= k &&
      count_at_least(ops, keys, guess + 1) < k)
    return static_cast<uint32_t>(guess);
  uint64_t lo = 0, hi = uint64_t{1} << 32;  // #{>= lo} = V >= k, #{>= hi} = 0 < k
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (count_at_least(ops, keys, mid) >= k) lo = mid; else hi = mid;
  }
  return static_cast<uint32_t>(lo);
}

// Whether the top-p cut is at or below position t: M(t) > threshold, or t reaches the last one.
template <class Ops, class Keys>
VRS_HD bool cut_at_or_below(Ops& ops, const Keys& keys, const double* e, double threshold,
                            uint64_t last, uint64_t t) {
  return t >= last || ops.total(position_mask(ops, keys, e, t, false)) > threshold;
}

// The top-p cut c's position: the first position t with cut_at_or_below (an element's).
template <class Ops, class Keys>
VRS_HD uint64_t top_p_cut(Ops& ops, const Keys& keys, const double* e, double threshold,
                          uint64_t last) {
  const uint64_t vocab = static_cast<uint64_t>(ops.vocab);
  uint64_t guess = ops.guess_position(keys, Dist{nullptr, e}, threshold);
  if (guess > last || keys(static_cast<int64_t>(guess % vocab)) != guess / vocab) guess = last;
  // M(guess - 1), and M(guess): the same sum with the guessed element's e added.
  const int64_t index = static_cast<int64_t>(guess % vocab);
  double before = 0.0, through = 0.0;
  ops.total_pair(position_mask(ops, keys, e, guess - 1, false), index, e[index], &before,
                 &through);
  uint64_t lo = 0, hi = last;  // invariant: not at lo (M(0) = 0, no element sits at 0), at hi
  if (guess == last || through > threshold) {
    if (!(before > threshold)) return guess;
    hi = guess - 1;
  } else {
    lo = guess;
  }
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (cut_at_or_below(ops, keys, e, threshold, last, mid)) hi = mid; else lo = mid;
  }
  return hi;
}

// Writes the target row e of `logits` (top of this file) to out [V].
template <class Ops>
VRS_HD void target_row(Ops& ops, const float* logits, float temperature, int32_t top_k,
                       float top_p, double* out) {
  const int64_t vocab = ops.vocab;
  const bool top_k_on = top_k > 0 && top_k < vocab;
  using Keys = decltype(ops.row_keys(logits, true));
  const Keys keys = ops.row_keys(logits, top_k_on || top_p < 1.0f);
  const uint32_t min_key = top_k_on ? top_k_key(ops, keys, top_k) : 0u;
  const int32_t best = ops.argmax(logits);
  const double t = temperature;
  const double max_x = best < 0 ? -INFINITY : scaled_logit(logits[best], t);
  ops.store(out, TargetWeight<Keys>{logits, keys, min_key, t, max_x});
  if (!(top_p < 1.0f) || best < 0) return;
  const double total = ops.total(Dist{nullptr, out});
  if (!(total > 0)) return;
  const double threshold = (1.0 - static_cast<double>(top_p)) * total;
  const uint32_t max_key = order_key(logits[best]);
  const int32_t last_index =
      ops.last_positive(KeyGroup<Keys, Ones>{keys, max_key, Ones{}});
  const uint64_t last = static_cast<uint64_t>(max_key) * static_cast<uint64_t>(vocab) +
                        static_cast<uint64_t>(last_index);
  const uint64_t cut = top_p_cut(ops, keys, out, threshold, last);
  ops.store(out, position_mask(ops, keys, out, cut, true));
}

// ---------------------------------------------------------------------------------------------
// Draft rows of the MCSS rules: dense (a [V] row) or sparse (sorted entries).

// q of a sparse row: entries sorted by token, distinct.
struct SparseQ {
  const int32_t* tokens;
  const float* values;
  int32_t size;
  VRS_HD int32_t find(int64_t token) const {
    int32_t lo = 0, hi = size;
    while (lo < hi) {
      const int32_t mid = lo + (hi - lo) / 2;
      if (tokens[mid] < token) lo = mid + 1; else hi = mid;
    }
    return lo < size && tokens[lo] == token ? lo : -1;
  }
  VRS_HD double operator()(int64_t i) const {
    const int32_t j = find(i);
    return j >= 0 ? static_cast<double>(values[j]) : 0.0;
  }
};

// The canonical sum of the dense row holding a sparse q (one thread's work).
struct SparseTotal {
  SparseQ q;
  int64_t vocab;
  VRS_HD double operator()() const {
    const int64_t length = segment_length(vocab);
    double sums[kSegments];
    for (int s = 0; s < kSegments; ++s) sums[s] = 0.0;
    for (int32_t j = 0; j < q.size;) {
      const int64_t start = q.tokens[j] / kTileWidth * kTileWidth;
      double t[kTileWidth];
      for (int l = 0; l < kTileWidth; ++l) t[l] = 0.0;
      for (; j < q.size && q.tokens[j] < start + kTileWidth; ++j)
        t[q.tokens[j] - start] = static_cast<double>(q.values[j]);
      const int s = static_cast<int>(start / length);
      sums[s] = sums[s] + tile_tree_sum(t);
    }
    return total_of_segments(sums);
  }
};

// Entry j of a sparse row goes to its rank among the row's valid entries (by token, then j).
struct SparseRank {
  const int32_t* tokens;
  const float* values;
  int32_t width;
  int64_t vocab;
  int32_t* out_tokens;
  float* out_values;
  VRS_HD bool valid(int32_t j) const { return tokens[j] >= 0 && tokens[j] < vocab; }
  VRS_HD void operator()(int64_t j64) const {
    const int32_t j = static_cast<int32_t>(j64);
    if (!valid(j)) return;
    int32_t rank = 0;
    for (int32_t k = 0; k < width; ++k)
      if (valid(k) && (tokens[k] < tokens[j] || (tokens[k] == tokens[j] && k < j))) ++rank;
    out_tokens[rank] = tokens[j];
    out_values[rank] = values[j];
  }
  VRS_HD int32_t size() const {
    int32_t n = 0;
    for (int32_t k = 0; k < width; ++k) n += valid(k) ? 1 : 0;
    return n;
  }
};

// p(i) with negative zeros and negatives read as 0 (the residual where q is 0).
struct PositivePart {
  Normalized p;
  VRS_HD double operator()(int64_t i) const {
    const double v = p(i);
    return v > 0 ? v : 0.0;
  }
};

// Writes the residual max(p - q, 0) at q's tokens over a row holding p.
struct ResidualPatch {
  double* dst;
  ResidualOf<SparseQ> residual;
  VRS_HD void operator()(int64_t j) const {
    const int32_t token = residual.q.dist.tokens[j];
    dst[token] = residual(token);
  }
};

struct DenseDraft {
  Dist q;
  float* q_work;
  double* p_work;

  template <class Ops>
  VRS_HD double total(Ops& ops) const { return ops.total(q); }
  VRS_HD Normalized normalized(double total) const { return Normalized{q, total}; }
  // p <- max(p - q, 0) normalised, unless that is all zero.
  template <class Ops>
  VRS_HD void residual(Ops& ops, Normalized& pn, double q_total) const {
    const Residual residual{pn, normalized(q_total)};
    const double residual_total = ops.total(residual);
    if (residual_total > 0) {
      ops.store(p_work, residual);
      pn = Normalized{Dist{nullptr, p_work}, residual_total};
    }
  }
  // q[token of c] <- 0; returns the new total.
  template <class Ops>
  VRS_HD double remove(Ops& ops, const LocalTree& tree, int32_t c) {
    if (q.f32 != q_work) ops.store(q_work, q);
    if (tree.token_in_vocab(c)) ops.write(q_work + tree.tokens[c], 0.0f);
    ops.barrier();
    q = Dist{q_work, nullptr};
    return ops.total(q);
  }
};

struct SparseDraft {
  SparseQ q;
  float* values;  // q.values, writable
  int64_t vocab;
  double* p_work;
  double* alt_work;  // the second residual row (the first may hold p)

  template <class Ops>
  VRS_HD double total(Ops& ops) const { return ops.single(SparseTotal{q, vocab}); }
  VRS_HD NormalizedOf<SparseQ> normalized(double total) const { return {q, total}; }
  template <class Ops>
  VRS_HD void residual(Ops& ops, Normalized& pn, double q_total) const {
    double* dst = pn.dist.f64 == p_work ? alt_work : p_work;
    ops.store(dst, PositivePart{pn});
    ops.parallel_for(q.size, ResidualPatch{dst, {pn, normalized(q_total)}});
    const double residual_total = ops.total(Dist{nullptr, dst});
    if (residual_total > 0) pn = Normalized{Dist{nullptr, dst}, residual_total};
  }
  template <class Ops>
  VRS_HD double remove(Ops& ops, const LocalTree& tree, int32_t c) {
    const int32_t j = tree.token_in_vocab(c) ? q.find(tree.tokens[c]) : -1;
    if (j >= 0) ops.write(values + j, 0.0f);
    ops.barrier();
    return total(ops);
  }
};

// ---------------------------------------------------------------------------------------------
// The walk.

// Rule 1 at `node`; returns the accepted child or -1 with *emitted set.
template <class Ops>
VRS_HD int32_t walk_candidates(Ops& ops, const LocalTree& tree, int32_t node, Dist p,
                               double* work, UniformStream& rng, int32_t* emitted) {
  double rest = ops.total(p);
  for (int32_t c = tree.next_child(node, node); c >= 0; c = tree.next_child(node, c)) {
    const double mass = tree.repeats_sibling(node, c) ? 0.0 : tree.at_token(p, c);
    if (accept_ratio(rng.next(), mass, rest)) return c;
    rest -= mass;
  }
  ops.store(work, p);
  for (int32_t c = tree.next_child(node, node); c >= 0; c = tree.next_child(node, c))
    if (tree.token_in_vocab(c)) ops.write(work + tree.tokens[c], 0.0);
  ops.barrier();
  const Dist residual{nullptr, work};
  const double u = rng.next();
  *emitted = ops.total(residual) > 0 ? ops.sample(residual, u) : ops.sample(p, u);
  return -1;
}

// Rules 2 and 3 at `node`; q (DenseDraft or SparseDraft) is the draft distribution the children
// were drawn from.
template <class Ops, class Draft>
VRS_HD int32_t walk_mcss(Ops& ops, const LocalTree& tree, int32_t node, Dist p, Draft& q,
                         bool without_replacement, UniformStream& rng, int32_t* emitted) {
  Normalized pn{p, ops.total(p)};
  double q_total = q.total(ops);
  for (int32_t c = tree.next_child(node, node); c >= 0; c = tree.next_child(node, c)) {
    if (accept_ratio(rng.next(), tree.at_token(pn, c), tree.at_token(q.normalized(q_total), c)))
      return c;
    q.residual(ops, pn, q_total);
    if (without_replacement) q_total = q.remove(ops, tree, c);
  }
  *emitted = ops.sample(pn.dist, rng.next());
  return -1;
}

// Verifies request b with its scratch rows `work`.
template <class Ops>
VRS_HD void accept_request(const TreeBatch& batch, int b, Ops& ops, const RequestWork& work) {
  const int32_t begin = batch.offsets[b];
  const LocalTree tree{batch.parents + begin, batch.tokens + begin,
                       batch.offsets[b + 1] - begin, batch.vocab};
  const int32_t rule = batch.rules[b];
  const bool lazy = batch.temperature != nullptr;
  const bool sparse = batch.draft_tokens != nullptr;
  const bool has_q = sparse || batch.draft_probs != nullptr;
  const bool mcss = rule == kMcss || rule == kMcssNoReplacement;
  const bool usable =
      rule == kGreedy ||
      (rule == kKeyed && batch.positions != nullptr && (!lazy || work.row != nullptr)) ||
      (work.p != nullptr && (!lazy || work.row != nullptr) &&
       (rule == kCandidates ||
        (mcss && has_q &&
         (sparse ? work.row != nullptr && work.q_tokens != nullptr && work.q_values != nullptr
                 : rule == kMcss || work.q != nullptr))));
  UniformStream rng{batch.seeds[b], 0};
  int32_t node = -1, depth = 0, emitted = -1;
  while (usable) {
    const int64_t row = static_cast<int64_t>(begin) + b + node + 1;
    const float* scores = batch.scores + row * batch.vocab;
    Dist p{scores, nullptr};
    const bool leaf = depth >= batch.out_width - 1 || tree.next_child(node, node) < 0;
    int32_t next = -1;
    if (rule != kGreedy && lazy) {
      target_row(ops, scores, batch.temperature[b], batch.top_k[b], batch.top_p[b], work.row);
      p = Dist{nullptr, work.row};
    }
    if (rule == kGreedy || rule == kKeyed) {
      emitted = rule == kGreedy
                    ? ops.argmax(p.f32)
                    : ops.sample(p, keyed_uniform(batch.seeds[b],
                                                  static_cast<uint64_t>(batch.positions[b]) + depth));
      if (!leaf) next = tree.child_carrying(node, emitted);
    } else {
      if (leaf) {
        emitted = ops.sample(p, rng.next());
      } else if (rule == kCandidates) {
        next = walk_candidates(ops, tree, node, p, work.p, rng, &emitted);
      } else if (sparse) {
        const int64_t width = batch.draft_width;
        const SparseRank rank{batch.draft_tokens + row * width, batch.draft_values + row * width,
                              batch.draft_width, batch.vocab, work.q_tokens, work.q_values};
        ops.barrier();  // the previous node's last test may still read the sorted row
        ops.parallel_for(width, rank);
        SparseDraft q{SparseQ{work.q_tokens, work.q_values, rank.size()}, work.q_values,
                      batch.vocab, work.p, work.row};
        next = walk_mcss(ops, tree, node, p, q, rule == kMcssNoReplacement, rng, &emitted);
      } else {
        DenseDraft q{Dist{batch.draft_probs + row * batch.vocab, nullptr}, work.q, work.p};
        next = walk_mcss(ops, tree, node, p, q, rule == kMcssNoReplacement, rng, &emitted);
      }
    }
    if (next < 0) break;
    ops.write(batch.path_nodes + static_cast<int64_t>(b) * (batch.out_width - 1) + depth, next);
    ops.write(batch.out_tokens + static_cast<int64_t>(b) * batch.out_width + depth,
              tree.tokens[next]);
    node = next;
    ++depth;
  }
  int32_t* out = batch.out_tokens + static_cast<int64_t>(b) * batch.out_width;
  for (int i = depth; i < batch.out_width; ++i) ops.write(out + i, i == depth ? emitted : -1);
  int32_t* path = batch.path_nodes + static_cast<int64_t>(b) * (batch.out_width - 1);
  for (int i = depth; i < batch.out_width - 1; ++i) ops.write(path + i, -1);
  ops.write(batch.num_accepted + b, depth);
}

// ---------------------------------------------------------------------------------------------
// CPU collectives: the canonical sums above, computed by one thread.

// dst[i] = TargetWeight{logits, keys, min_key, temperature, max_x}(i) for i < n, bit for bit,
// vectorised (tree_cpu.cpp).
void store_target_weights(const float* logits, const uint32_t* keys, int64_t n, uint32_t min_key,
                          double temperature, double max_x, double* dst);

struct CpuOps {
  int64_t vocab;
  static constexpr bool kExactTopKGuess = true;  // guess_top_k_key selects exactly

  static void barrier() {}
  template <class T>
  static void write(T* ptr, T value) {
    *ptr = value;
  }
  template <class F>
  static double single(const F& f) {
    return f();
  }
  template <class F>
  static void parallel_for(int64_t n, const F& f) {
    for (int64_t j = 0; j < n; ++j) f(j);
  }

  // Largest value (NaN never wins) by 16 independent lanes, then its first index.
  int32_t argmax(const float* row) const {
    constexpr int kLanes = 16;
    float lanes[kLanes];
    for (int l = 0; l < kLanes; ++l) lanes[l] = -INFINITY;
    int64_t i = 0;
    for (; i + kLanes <= vocab; i += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] = row[i + l] > lanes[l] ? row[i + l] : lanes[l];
    float best = -INFINITY;
    for (; i < vocab; ++i) best = row[i] > best ? row[i] : best;
    for (int l = 0; l < kLanes; ++l) best = lanes[l] > best ? lanes[l] : best;
    for (i = 0; i < vocab; ++i)
      if (row[i] == best) return static_cast<int32_t>(i);
    return -1;
  }

  template <class T, class F>
  void store(T* dst, const F& f) const {
    for (int64_t i = 0; i < vocab; ++i) dst[i] = static_cast<T>(f(i));
  }

  template <class F>
  void load_tile(const F& f, int64_t start, double* t) const {
    if (start + kTileWidth <= vocab) {
      for (int l = 0; l < kTileWidth; ++l) t[l] = f(start + l);
    } else {
      for (int l = 0; l < kTileWidth; ++l) t[l] = start + l < vocab ? f(start + l) : 0.0;
    }
  }

  // Segment s's sum T[s].
  template <class F>
  double segment_sum(const F& f, int s) const {
    const int64_t length = segment_length(vocab);
    double run = 0.0, t[kTileWidth];
    for (int64_t k = 0; k < length; k += kTileWidth) {
      load_tile(f, s * length + k, t);
      run = run + tile_tree_sum(t);
    }
    return run;
  }

  // Segment starts E (exclusive scan) and the total of f.
  template <class F>
  double segment_starts(const F& f, double* starts) const {
    double sums[kSegments];
    for (int s = 0; s < kSegments; ++s) sums[s] = starts[s] = segment_sum(f, s);
    hillis_steele_scan(starts);
    for (int s = kSegments - 1; s > 0; --s) starts[s] = starts[s - 1];
    starts[0] = 0.0;
    return starts[kSegments - 1] + sums[kSegments - 1];
  }

  template <class F>
  double total(const F& f) const {
    double starts[kSegments];
    return segment_starts(f, starts);
  }
  double total(const Dist& d) const {
    return d.f64 ? total([p = d.f64](int64_t i) { return p[i]; })
                 : total([p = d.f32](int64_t i) { return static_cast<double>(p[i]); });
  }

  // The totals of f and of f with f(index) replaced by value: one pass and 1/32 of one.
  template <class F>
  void total_pair(const F& f, int64_t index, double value, double* plain, double* replaced) const {
    double sums[kSegments];
    for (int s = 0; s < kSegments; ++s) sums[s] = segment_sum(f, s);
    *plain = total_of_segments(sums);
    const int s = static_cast<int>(index / segment_length(vocab));
    sums[s] = segment_sum(Replaced<F>{f, index, value}, s);
    *replaced = total_of_segments(sums);
  }

  template <class F>
  int32_t last_positive(const F& f) const {
    for (int64_t i = vocab - 1; i >= 0; --i)
      if (f(i) > 0) return static_cast<int32_t>(i);
    return -1;
  }

  template <class F>
  int32_t sample(const F& f, double u) const {
    double starts[kSegments];
    const double target = u * segment_starts(f, starts);
    const int64_t length = segment_length(vocab);
    for (int s = 0; s < kSegments; ++s) {
      double run = 0.0, t[kTileWidth];
      for (int64_t k = 0; k < length; k += kTileWidth) {
        const int64_t start = s * length + k;
        load_tile(f, start, t);
        hillis_steele_scan(t);
        for (int l = 0; l < kTileWidth && start + l < vocab; ++l)
          if (starts[s] + (run + t[l]) > target) return static_cast<int32_t>(start + l);
        run = run + t[kTileWidth - 1];
      }
    }
    return last_positive(f);
  }
  int32_t sample(const Dist& d, double u) const {
    return d.f64 ? sample([p = d.f64](int64_t i) { return p[i]; }, u)
                 : sample([p = d.f32](int64_t i) { return static_cast<double>(p[i]); }, u);
  }

  // The row's order keys, cached for the row's passes (when needed: else none).
  CachedKeys row_keys(const float* logits, bool needed) const {
    if (!needed) return CachedKeys{nullptr};
    thread_local std::vector<uint32_t> keys;
    keys.resize(vocab);
    for (int64_t i = 0; i < vocab; ++i) keys[i] = order_key(logits[i]);
    return CachedKeys{keys.data()};
  }

  // The k-th largest key (0 < k < V), exactly: a min-heap of the k largest, or a selection.
  uint64_t guess_top_k_key(const CachedKeys& keys, int32_t k) const {
    thread_local std::vector<uint32_t> heap;
    if (k > 1024) {
      heap.assign(keys.keys, keys.keys + vocab);
      std::nth_element(heap.begin(), heap.begin() + (vocab - k), heap.end());
      return heap[vocab - k];
    }
    heap.assign(keys.keys, keys.keys + k);
    std::make_heap(heap.begin(), heap.end(), std::greater<uint32_t>());
    for (int64_t i = k; i < vocab; ++i) {
      if (keys.keys[i] <= heap.front()) continue;
      std::pop_heap(heap.begin(), heap.end(), std::greater<uint32_t>());
      heap.back() = keys.keys[i];
      std::push_heap(heap.begin(), heap.end(), std::greater<uint32_t>());
    }
    return heap.front();
  }

  // A guess at the position (key * V + index) of the first element, ascending by position,
  // where a running sum of w (>= 0) exceeds target; kNoPosition if none. One histogram of w over
  // the top 11 key bits, then the boundary bucket sorted and walked. Sums are plain (any order):
  // callers certify the guess.
  template <class W>
  uint64_t guess_position(const CachedKeys& keys, const W& w, double target) const {
    constexpr int kShift = 32 - 11;
    thread_local std::vector<double> histogram;
    thread_local std::vector<uint64_t> members;
    histogram.assign(2 * kHistogramBuckets, 0.0);  // two interleaved copies
    int64_t i = 0;
    for (; i + 2 <= vocab; i += 2) {
      const double w0 = w(i), w1 = w(i + 1);
      if (w0 > 0) histogram[2 * (keys(i) >> kShift)] += w0;
      if (w1 > 0) histogram[2 * (keys(i + 1) >> kShift) + 1] += w1;
    }
    if (i < vocab && w(i) > 0) histogram[2 * (keys(i) >> kShift)] += w(i);
    double below = 0.0;
    uint32_t bucket = 0;
    for (; bucket < kHistogramBuckets; ++bucket) {
      const double mass = histogram[2 * bucket] + histogram[2 * bucket + 1];
      if (below + mass > target) break;
      below = below + mass;
    }
    if (bucket == kHistogramBuckets) return kNoPosition;
    members.clear();
    const uint64_t v = static_cast<uint64_t>(vocab);
    for (i = 0; i < vocab; ++i)
      if ((keys(i) >> kShift) == bucket && w(i) > 0)
        members.push_back(static_cast<uint64_t>(keys(i)) * v + static_cast<uint64_t>(i));
    std::sort(members.begin(), members.end());
    for (const uint64_t pos : members) {
      below = below + w(static_cast<int64_t>(pos % v));
      if (below > target) return pos;
    }
    return kNoPosition;
  }

  // The e row of the lazy target rows, eight lanes at a time (store_target_weights).
  void store(double* dst, const TargetWeight<CachedKeys>& f) const {
    store_target_weights(f.logits, f.keys.keys, vocab, f.min_key, f.temperature, f.max_x, dst);
  }
};

}  // namespace vrs
