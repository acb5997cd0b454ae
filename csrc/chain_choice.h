// The goodput budget's choice among chain drafts, in one pass per step, and what verification
// made of them.
//
// Every row's candidate nodes form one chain (node j's parent is node j - 1). Each node gets its
// calibration bucket (source flags, match-length bucket, depth bucket, raw-probability bucket)
// and its calibrated chance given its parent: past depth 0 the calibration's table, at depth 0
// its bucket's decaying counts smoothed towards the depth-0 counts of its match length over the
// node's own halved raw guess. A node's path chance is the product along its chain of these
// chances, each times its token's factor (goodput/token_factor.py, when given) within the
// chances' bound. The nodes within their rows' budgets are ranked by path chance per second of
// verification, and the best b are kept for the b of the highest expected rate (tokens over
// seconds, what drafting adds counted 1 + margin times), none unless that rate beats a step
// without drafts.
//
// The same arithmetic, in the same order, as the NumPy path it replaces for chains:
// goodput/calibration.py (buckets, estimate), goodput/paths.py (path_products) and
// goodput/chooser.py (choose_nodes), which tree mode still runs and tests compare against.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace vrs {

// The calibration's state as the chooser reads it (arrays of goodput/calibration.py).
struct ChainCalibration {
  const double* chances;         // [sources, lengths, depths, probs]: every bucket's chance (read past depth 0)
  const double* accepted;        // same shape: decaying accepted counts (read at depth 0)
  const double* observed;        // same shape: decaying observed counts
  const double* first_accepted;  // [pools, lengths]: depth-0 accepted counts per prior pool and match-length bucket
  const double* first_observed;  // [pools, lengths]
  const int32_t* pool;           // [sources]: each source code's prior pool (0 .. pools - 1)
  const int32_t* length_bucket;  // [num_length_keys]: a match length's bucket (longer: the last key's)
  int num_length_keys;
  const int32_t* depth_bucket;   // [num_depth_keys]: a depth's bucket
  int num_depth_keys;
  int sources, lengths, depths, probs;
  double strength;         // Laplace prior strength
  double raw_prior_scale;  // the drafter's raw guess is scaled by this in the depth-0 prior
  double min_chance, max_chance;
};

// The cost model's terms a chain step reads (goodput/cost_model.py, seconds): a step of more
// than kernel_rows tokens (0: no such bound) also pays past_kernel_rows once.
struct ChainStepCost {
  double base, per_request, per_token, per_sampled_token;
  int64_t kernel_rows;
  double past_kernel_rows;

  double past(double tokens) const {
    return kernel_rows > 0 && tokens > static_cast<double>(kernel_rows) ? past_kernel_rows : 0.0;
  }
};

// One step's chain candidates, [rows, width] row-major.
struct ChainCandidates {
  int rows, width;
  const float* prob;         // the drafter's raw guess given the parent
  const int8_t* source;      // SOURCE_* flags
  const int32_t* match_len;  // the match length that retrieved the node
  const int32_t* size;       // [rows]: valid nodes per row
  const int32_t* budgets;    // [rows]: at most this many nodes per row
  const bool* samples;       // [rows]: the row's request samples (nullptr: none does)
  const double* factor;      // [rows, width]: each node's token factor on its chance (nullptr: none)
  int num_reqs;              // requests in the step
};

class ChainChooser {
 public:
  // Fills bucket, chance (given the parent, before the token factor; 0 past a row's size) and
  // keep ([rows, width] each);
  // returns the number of nodes kept.
  int64_t choose(const ChainCandidates& in, const ChainCalibration& cal, const ChainStepCost& cost,
                 double draft_seconds, double margin, int64_t* bucket, double* chance, bool* keep) {
    candidates_.clear();
    for (int r = 0; r < in.rows; ++r) {
      const int64_t offset = static_cast<int64_t>(r) * in.width;
      const int valid = std::min(in.size[r], in.width);
      const int within = std::min(valid, in.budgets[r]);
      const double node_cost = cost.per_token + cost.per_sampled_token * (in.samples != nullptr && in.samples[r]);
      double path = 1.0;
      for (int j = 0; j < in.width; ++j) {
        const int64_t i = offset + j;
        keep[i] = false;
        if (j >= valid) {
          bucket[i] = 0;
          chance[i] = 0.0;
          continue;
        }
        const int length = cal.length_bucket[std::clamp(in.match_len[i], 0, cal.num_length_keys - 1)];
        const int code = source_code(cal, in.source[i]);
        bucket[i] = bucket_of(cal, code, length, j, in.prob[i]);
        const int64_t pooled = static_cast<int64_t>(cal.pool[code]) * cal.lengths + length;
        chance[i] = std::min(j > 0 ? cal.chances[bucket[i]] : first_chance(cal, bucket[i], pooled, in.prob[i]),
                             cal.max_chance);
        path *= in.factor != nullptr ? std::min(chance[i] * in.factor[i], cal.max_chance) : chance[i];
        if (j < within && path > 0.0) candidates_.push_back({-path / std::max(node_cost, 1e-12), i, path});
      }
    }
    std::stable_sort(candidates_.begin(), candidates_.end(),
                     [](const Candidate& a, const Candidate& b) { return a.key < b.key; });
    const double reqs = in.num_reqs;
    const double idle = cost.base + cost.per_request * reqs + cost.past(reqs);
    double gained = 0.0, best_objective = reqs / std::max(idle, 1e-9), best_gained = 0.0, best_added = 0.0;
    int64_t sampled = 0, best = 0;
    for (size_t k = 0; k < candidates_.size(); ++k) {
      const Candidate& c = candidates_[k];
      gained += c.path;
      sampled += in.samples != nullptr && in.samples[c.flat / in.width];
      const double count = static_cast<double>(k + 1);
      const double added = cost.base + cost.per_request * reqs + cost.per_token * count +
                           cost.per_sampled_token * static_cast<double>(sampled) + cost.past(reqs + count) - idle +
                           draft_seconds;
      const double objective = (reqs + gained) / std::max(idle + (1.0 + margin) * added, 1e-9);
      if (objective > best_objective) {
        best_objective = objective;
        best = static_cast<int64_t>(k + 1);
        best_gained = gained;
        best_added = added;
      }
    }
    const double rate = (reqs + best_gained) / std::max(idle + best_added + margin * best_added, 1e-9);
    if (best == 0 || rate <= reqs / std::max(idle, 1e-9)) return 0;
    for (int64_t k = 0; k < best; ++k) keep[candidates_[k].flat] = true;
    return best;
  }

 private:
  struct Candidate {
    double key;  // minus path chance per second of verification
    int64_t flat;
    double path;
  };

  // A node's source flags as a source code (as NumPy's modulo).
  static int source_code(const ChainCalibration& cal, int8_t source) {
    return ((static_cast<int>(source) % cal.sources) + cal.sources) % cal.sources;
  }

  // The flat bucket of a node of source code `code` at `depth` with match-length bucket `length`.
  static int64_t bucket_of(const ChainCalibration& cal, int code, int length, int depth, float prob) {
    const int deep = cal.depth_bucket[std::clamp(depth, 0, cal.num_depth_keys - 1)];
    const float scaled = prob * static_cast<float>(cal.probs);  // NaN and negatives: bucket 0, as NumPy's clip
    const int raw = scaled >= 1.0f ? std::min(static_cast<int>(std::min(scaled, 1e9f)), cal.probs - 1) : 0;
    return ((static_cast<int64_t>(code) * cal.lengths + length) * cal.depths + deep) * cal.probs + raw;
  }

  // A depth-0 node's chance: its bucket's counts smoothed towards the depth-0 counts of its prior
  // pool and match-length bucket (flat index `pooled`) over its halved raw guess, clipped to
  // [min_chance, max_chance].
  static double first_chance(const ChainCalibration& cal, int64_t bucket, int64_t pooled, float prob) {
    const double prior = (cal.first_accepted[pooled] + cal.strength * cal.raw_prior_scale * static_cast<double>(prob)) /
                         (cal.first_observed[pooled] + cal.strength);
    const double smoothed = (cal.accepted[bucket] + cal.strength * prior) / (cal.observed[bucket] + cal.strength);
    return std::clamp(smoothed, cal.min_chance, cal.max_chance);
  }

  std::vector<Candidate> candidates_;
};

// What verification made of one row's chain (its first `width` nodes, `keep` a prefix of them)
// given the `emitted` tokens the target sampled for the row: a node is accepted when every node
// up to it was kept and matched its sampled token before the last one (the last sampled token
// is the target's own); observed when it was kept, its parent accepted and the step sampled
// past its depth, except a node matching the last sampled token (cut by the scheduler:
// unknown). As goodput/budget.py's _outcomes for chains.
inline void chain_outcomes(const int32_t* tokens, const bool* keep, int width, const int32_t* sampled, int emitted,
                           bool* accepted, bool* observed) {
  emitted = std::min(emitted, width + 1);
  bool parent_accepted = true;
  for (int j = 0; j < width; ++j) {
    const bool matched = j < emitted && tokens[j] == sampled[j];
    observed[j] = keep[j] && parent_accepted && j < emitted && !(matched && j == emitted - 1);
    parent_accepted = parent_accepted && keep[j] && matched && j < emitted - 1;
    accepted[j] = parent_accepted;
  }
}


// The counts one step's outcomes feed, each flat and owned by the caller: the calibration's
// decaying and never-decayed counts per bucket (goodput/calibration.py; `cells` buckets), the
// per-token sums of the tokens' factors (goodput/token_factor.py; nullptr when off; `vocab`
// ids) and this step's nodes observed and accepted per source code (`codes` codes).
struct OutcomeCounts {
  double* accepted;
  double* observed;
  double* accepted_total;
  double* observed_total;
  double* predicted_total;
  int64_t cells;
  double* token_predicted;
  double* token_accepted;
  int64_t vocab;
  int64_t* observed_by_code;
  int64_t* accepted_by_code;
  int codes;
};

// What one step's read-back counted: verified nodes observed and accepted, and first nodes of
// rows that sent none learned from the sampled token, and of those the hits.
struct OutcomeTally {
  int64_t observed = 0, accepted = 0, unsent_observed = 0, unsent_accepted = 0;
};

// Last step's chain nodes ([rows, width] row-major, as the budget kept them) and what they read.
struct PendingChains {
  int rows, width;
  const int32_t* tokens;
  const bool* keep;
  const int64_t* bucket;   // the calibration bucket of every node
  const double* chance;    // its calibrated chance given its parent, before the token factor
  const int8_t* source;    // SOURCE_* flags
  const bool* unsent_first;  // [rows]: the row kept no node and its first is learned from (nullptr: none)
  const int64_t* step_row;   // [rows]: the row's index in this step's sampled lists, -1: not in this step
};

// One node's outcome into the calibration's counts and its token's sums.
inline void count_outcome(OutcomeCounts& counts, int64_t bucket, double chance, int32_t token, bool hit) {
  const double value = hit ? 1.0 : 0.0;
  counts.accepted[bucket] += value;
  counts.observed[bucket] += 1.0;
  counts.accepted_total[bucket] += value;
  counts.observed_total[bucket] += 1.0;
  counts.predicted_total[bucket] += chance;
  if (counts.token_predicted != nullptr && token >= 0) {
    counts.token_predicted[token] += chance;
    counts.token_accepted[token] += value;
  }
}

// Reads what verification made of last step's chains from the tokens each row just sampled
// (`sampled[step_row[r]]`, `emitted[step_row[r]]` of them) and counts it, in the NumPy path's
// order (goodput/budget.py's observe for trees): every verified node observed (chain_outcomes) in row order, then the first node of each greedy
// row that kept none, as if verified: the one token the target sampled for the row is what
// greedy verification would have accepted there (calibration otherwise learns only from nodes
// the budget sends, so a few early rejections could hold a match length's first nodes below
// what pays, unsent and unlearned, for the rest of a run). Buckets, tokens and source codes
// must index the counts (the caller checks).
inline OutcomeTally count_chain_outcomes(const PendingChains& in, const int32_t* const* sampled, const int* emitted,
                                         OutcomeCounts& counts) {
  OutcomeTally tally;
  std::unique_ptr<bool[]> outcomes(new bool[2 * static_cast<size_t>(std::max(in.width, 1))]);
  bool* accepted = outcomes.get();
  bool* observed = accepted + in.width;
  for (int r = 0; r < in.rows; ++r) {
    const int64_t step_row = in.step_row[r];
    if (step_row < 0) continue;
    const int64_t offset = static_cast<int64_t>(r) * in.width;
    chain_outcomes(in.tokens + offset, in.keep + offset, in.width, sampled[step_row], emitted[step_row], accepted,
                   observed);
    for (int j = 0; j < in.width; ++j) {
      if (!observed[j]) continue;
      const int64_t i = offset + j;
      count_outcome(counts, in.bucket[i], in.chance[i], in.tokens[i], accepted[j]);
      const int code = ((static_cast<int>(in.source[i]) % counts.codes) + counts.codes) % counts.codes;
      counts.observed_by_code[code] += 1;
      counts.accepted_by_code[code] += accepted[j];
      tally.observed += 1;
      tally.accepted += accepted[j];
    }
  }
  if (in.unsent_first == nullptr) return tally;
  for (int r = 0; r < in.rows; ++r) {
    const int64_t step_row = in.step_row[r];
    const int64_t i = static_cast<int64_t>(r) * in.width;
    if (step_row < 0 || !in.unsent_first[r] || in.width == 0 || emitted[step_row] < 1 || sampled[step_row][0] < 0 ||
        !(in.chance[i] > 0.0))
      continue;
    const bool hit = in.tokens[i] == sampled[step_row][0];
    count_outcome(counts, in.bucket[i], in.chance[i], in.tokens[i], hit);
    tally.unsent_observed += 1;
    tally.unsent_accepted += hit;
  }
  return tally;
}

// The calibration's decaying counts as its chance table reads them ([sources, lengths, depths,
// probs] row-major) and the prior's settings (goodput/calibration.py).
struct CalibrationCounts {
  const double* accepted;
  const double* observed;
  const int32_t* pool;  // [sources]: each source code's prior pool (0 .. pools - 1)
  int pools;
  int sources, lengths, depths, probs;
  double strength, raw_prior_scale, min_chance, max_chance;
};

// Every bucket's chance (into `chances`, and as float32 into `table`) with the raw-probability
// bucket's midpoint as the drafter's guess, each depth shrunk towards the one above it:
// c[d] = (accepted[d] + strength·c[d − 1]) / (observed[d] + strength), c[−1] the depth-0 prior
// (the depth-0 counts of the source's prior pool and the match length over the halved midpoint),
// unclipped along the way and clipped when written; a source never observed keeps its pool's
// prior at every depth. Fills the depth-0 counts per pool and match length (`first_accepted`,
// `first_observed`, [pools, lengths]) and returns the best first chance: the highest depth-0
// chance of any observed bucket over the halved guess of a sure node, at most max_chance
// (raw_prior_scale when nothing is observed).
inline double fill_chance_table(const CalibrationCounts& in, double* chances, float* table, double* first_accepted,
                                double* first_observed) {
  const int64_t L = in.lengths, D = in.depths, P = in.probs, pools = in.pools;
  double best = -1.0;
  std::fill(first_accepted, first_accepted + pools * L, 0.0);
  std::fill(first_observed, first_observed + pools * L, 0.0);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t s = 0; s < in.sources; ++s)
      for (int64_t p = 0; p < P; ++p) {
        const int64_t i = ((s * L + l) * D) * P + p;
        first_accepted[in.pool[s] * L + l] += in.accepted[i];
        first_observed[in.pool[s] * L + l] += in.observed[i];
        if (in.observed[i] > 0.0)
          best = std::max(best, (in.accepted[i] + in.strength * in.raw_prior_scale) / (in.observed[i] + in.strength));
      }
  std::vector<double> prior(pools * L * P), running(P);  // [pools, lengths, probs]
  for (int64_t k = 0; k < pools * L; ++k)
    for (int64_t p = 0; p < P; ++p)
      prior[k * P + p] = (first_accepted[k] + in.strength * in.raw_prior_scale * ((p + 0.5) / P)) /
                         (first_observed[k] + in.strength);
  const auto bounded = [&](double c) { return std::min(std::max(c, in.min_chance), in.max_chance); };
  const int64_t per_source = L * D * P;
  std::vector<double> unseen(pools * per_source);  // a source never observed: its pool's prior at every depth
  std::vector<float> unseen_table(pools * per_source);
  for (int64_t k = 0; k < pools; ++k)
    for (int64_t i = 0; i < per_source; ++i) {
      unseen[k * per_source + i] = bounded(prior[(k * L + i / (D * P)) * P + i % P]);
      unseen_table[k * per_source + i] = static_cast<float>(unseen[k * per_source + i]);
    }
  for (int64_t s = 0; s < in.sources; ++s) {
    const double* observed = in.observed + s * per_source;
    double* out = chances + s * per_source;
    float* out_table = table + s * per_source;
    const int64_t pool = in.pool[s];
    if (std::all_of(observed, observed + per_source, [](double o) { return o == 0.0; })) {
      std::copy(unseen.begin() + pool * per_source, unseen.begin() + (pool + 1) * per_source, out);
      std::copy(unseen_table.begin() + pool * per_source, unseen_table.begin() + (pool + 1) * per_source, out_table);
      continue;
    }
    const double* accepted = in.accepted + s * per_source;
    for (int64_t l = 0; l < L; ++l) {
      std::copy(prior.begin() + (pool * L + l) * P, prior.begin() + (pool * L + l + 1) * P, running.begin());
      for (int64_t d = 0; d < D; ++d)
        for (int64_t p = 0; p < P; ++p) {
          const int64_t i = (l * D + d) * P + p;
          running[p] = (accepted[i] + in.strength * running[p]) / (observed[i] + in.strength);
          out[i] = bounded(running[p]);
          out_table[i] = static_cast<float>(out[i]);
        }
    }
  }
  return best < 0.0 ? in.raw_prior_scale : std::min(best, in.max_chance);
}

}  // namespace vrs
