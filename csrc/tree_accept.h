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
// A node without children (or at depth out_width - 1) emits a sample of its row (argmax for
// greedy). One uniform per candidate test and one per final sample, in that order.
//
// Canonical sums (what "sum" and "cumsum" mean above, identical on every backend): a row of V
// values is cut into kSegments contiguous segments of L = 32 * ceil(V / 1024) values (zero
// padded), each segment into tiles of 32. A tile's sum is the pairwise tree of its values
// ((v0 + v1) + (v2 + v3)) + ...; a segment's sum T[s] adds its tiles left to right starting
// from 0; segment s starts at E[s], the exclusive Hillis-Steele scan of T (E[0] = 0), and the
// total is E[31] + T[31]. cdf[i] = E[s] + (R + H[l]) where R is the segment's running sum of
// the earlier tiles and H the Hillis-Steele inclusive scan of i's tile. Sampling with u returns
// the smallest i < V with cdf[i] > u * total, else the last i with value > 0, else -1.
#pragma once

#include <cmath>
#include <cstdint>

#include "rng.h"

namespace vrs {

constexpr int kTileWidth = 32;
constexpr int kSegments = 32;
static_assert(kSegments == kTileWidth, "segment starts reuse the tile scan");

enum AcceptRule : int32_t { kGreedy = 0, kCandidates = 1, kMcss = 2, kMcssNoReplacement = 3 };

VRS_HD inline int64_t segment_length(int64_t vocab) {
  const int64_t span = static_cast<int64_t>(kTileWidth) * kSegments;
  return kTileWidth * ((vocab + span - 1) / span);
}

// Row values: float32 scores or a float64 workspace.
struct Dist {
  const float* f32;
  const double* f64;
  VRS_HD double operator()(int64_t i) const { return f64 ? f64[i] : static_cast<double>(f32[i]); }
};

// A distribution divided by its total (all zero when the total is 0).
struct Normalized {
  Dist dist;
  double total;
  VRS_HD double operator()(int64_t i) const { return total > 0 ? dist(i) / total : 0.0; }
};

// max(p - q, 0) of two normalised distributions: the MCSS residual.
struct Residual {
  Normalized p;
  Normalized q;
  VRS_HD double operator()(int64_t i) const {
    const double r = p(i) - q(i);
    return r > 0 ? r : 0.0;
  }
};

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
  // Whether an earlier sibling of child c carries the same token.
  VRS_HD bool repeats_sibling(int32_t node, int32_t c) const {
    for (int32_t j = node + 1; j < c; ++j)
      if (parents[j] == node && tokens[j] == tokens[c]) return true;
    return false;
  }
};

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

// Rules 2 and 3 at `node`; q is the draft distribution the children were drawn from.
template <class Ops>
VRS_HD int32_t walk_mcss(Ops& ops, const LocalTree& tree, int32_t node, Dist p, Dist q,
                         bool without_replacement, double* p_work, float* q_work,
                         UniformStream& rng, int32_t* emitted) {
  Normalized pn{p, ops.total(p)};
  Normalized qn{q, ops.total(q)};
  for (int32_t c = tree.next_child(node, node); c >= 0; c = tree.next_child(node, c)) {
    if (accept_ratio(rng.next(), tree.at_token(pn, c), tree.at_token(qn, c))) return c;
    const Residual residual{pn, qn};
    const double residual_total = ops.total(residual);
    if (residual_total > 0) {
      ops.store(p_work, residual);
      pn = Normalized{Dist{nullptr, p_work}, residual_total};
    }
    if (without_replacement) {
      if (qn.dist.f32 != q_work) ops.store(q_work, qn.dist);
      if (tree.token_in_vocab(c)) ops.write(q_work + tree.tokens[c], 0.0f);
      ops.barrier();
      const Dist masked{q_work, nullptr};
      qn = Normalized{masked, ops.total(masked)};
    }
  }
  *emitted = ops.sample(pn.dist, rng.next());
  return -1;
}

// Verifies request b; `p_work` (and `q_work` for rule 3) are the request's V-sized workspaces.
template <class Ops>
VRS_HD void accept_request(const TreeBatch& batch, int b, Ops& ops, double* p_work,
                           float* q_work) {
  const int32_t begin = batch.offsets[b];
  const LocalTree tree{batch.parents + begin, batch.tokens + begin,
                       batch.offsets[b + 1] - begin, batch.vocab};
  const int32_t rule = batch.rules[b];
  const bool usable = rule == kGreedy || (p_work != nullptr && (rule == kCandidates ||
                      (batch.draft_probs != nullptr && (rule == kMcss ||
                       (rule == kMcssNoReplacement && q_work != nullptr)))));
  UniformStream rng{batch.seeds[b], 0};
  int32_t node = -1, depth = 0, emitted = -1;
  while (usable) {
    const int64_t row = static_cast<int64_t>(begin) + b + node + 1;
    const Dist p{batch.scores + row * batch.vocab, nullptr};
    const bool leaf = depth >= batch.out_width - 1 || tree.next_child(node, node) < 0;
    int32_t next = -1;
    if (rule == kGreedy) {
      emitted = ops.argmax(p.f32);
      for (int32_t c = leaf ? -1 : tree.next_child(node, node); c >= 0 && next < 0;
           c = tree.next_child(node, c))
        if (tree.tokens[c] == emitted) next = c;
    } else if (leaf) {
      emitted = ops.sample(p, rng.next());
    } else if (rule == kCandidates) {
      next = walk_candidates(ops, tree, node, p, p_work, rng, &emitted);
    } else {
      const Dist q{batch.draft_probs + row * batch.vocab, nullptr};
      next = walk_mcss(ops, tree, node, p, q, rule == kMcssNoReplacement, p_work, q_work, rng,
                       &emitted);
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

// Pairwise tree sum of a tile, level by level ((t0 + t1) + (t2 + t3)) + ...
inline double tile_tree_sum(const double* t) {
  double level[kTileWidth / 2];
  for (int l = 0; l < kTileWidth / 2; ++l) level[l] = t[2 * l] + t[2 * l + 1];
  for (int width = kTileWidth / 4; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) level[l] = level[2 * l] + level[2 * l + 1];
  return level[0];
}

inline void hillis_steele_scan(double* x) {
  for (int d = 1; d < kTileWidth; d *= 2)
    for (int l = kTileWidth - 1; l >= d; --l) x[l] = x[l] + x[l - d];
}

struct CpuOps {
  int64_t vocab;

  static void barrier() {}
  template <class T>
  static void write(T* ptr, T value) {
    *ptr = value;
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

  // Segment starts E (exclusive scan) and the total of f.
  template <class F>
  double segment_starts(const F& f, double* starts) const {
    const int64_t length = segment_length(vocab);
    double sums[kSegments];
    for (int s = 0; s < kSegments; ++s) {
      double run = 0.0, t[kTileWidth];
      for (int64_t k = 0; k < length; k += kTileWidth) {
        load_tile(f, s * length + k, t);
        run = run + tile_tree_sum(t);
      }
      sums[s] = starts[s] = run;
    }
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
    for (int64_t i = vocab - 1; i >= 0; --i)
      if (f(i) > 0) return static_cast<int32_t>(i);
    return -1;
  }
  int32_t sample(const Dist& d, double u) const {
    return d.f64 ? sample([p = d.f64](int64_t i) { return p[i]; }, u)
                 : sample([p = d.f32](int64_t i) { return static_cast<double>(p[i]); }, u);
  }
};

}  // namespace vrs
