// Context n-gram matcher (algorithms.md §3, N-Grammys appendix B.2).
//
// For one request with context ctx[0..n): take the longest q in [q_min, q_max] whose
// last-q-token query occurs earlier in the context; over the most recent `max_matches`
// earlier occurrences, count the distinct continuations ctx[p+q : min(p+q+w, n)]
// (truncated at the end of the context; a truncated one is its own w-gram) and return the
// k most frequent, ties to the most recent occurrence.
//
// The same function runs on the CPU (one request per task) and on CUDA (one request per
// thread), so both backends return identical results.
#pragma once

#include <cstdint>

#include "hd.h"

namespace vrs {

constexpr int kMaxContextMatches = 256;

struct ContextNgramParams {
  int q_min;
  int q_max;
  int w;            // draft length
  int k;            // drafts per request
  int max_matches;  // most recent occurrences considered, <= kMaxContextMatches
};

VRS_HD inline bool same_tokens(const int32_t* a, const int32_t* b, int len) {
  for (int i = 0; i < len; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// Fills match_pos with the most recent occurrences of the last q tokens (newest first).
VRS_HD inline int find_recent_matches(const int32_t* ctx, int n, int q, int max_matches,
                                      int* match_pos) {
  if (q <= 0 || n < q + 1) return 0;
  const int32_t* query = ctx + n - q;
  int m = 0;
  for (int p = n - q - 1; p >= 0 && m < max_matches; --p)
    if (ctx[p + q - 1] == query[q - 1] && same_tokens(ctx + p, query, q)) match_pos[m++] = p;
  return m;
}

// The continuation of the earlier occurrence at p of the context's last q tokens, up to len
// tokens, into out; returns its length. It is ctx[p + q ..] up to the end of the context, whose
// distance d = n - p - q is then its period: when the match spans a whole period (q >= d, so the
// context's last q + d tokens repeat every d tokens: a loop) it goes on repeating, as the
// context would if it continued as it did after p; else it stops at the end of the context.
VRS_HD inline int context_continuation(const int32_t* ctx, int n, int p, int q, int len, bool loops,
                                       int32_t* out) {
  const int start = p + q, period = n - start;
  const int count = loops && q >= period ? len : (period < len ? period : len);
  for (int i = 0; i < count; ++i) out[i] = ctx[start + i % period];
  return count;
}

// Longest q in [q_min, q_max] whose last-q-token query occurred earlier (an occurrence of
// length q implies one of length q - 1, so binary search over q); fills match_pos with its
// most recent occurrences. Returns q (0: none) and sets *num_matches.
VRS_HD inline int longest_recent_match(const int32_t* ctx, int n, int q_min, int q_max,
                                       int max_matches, int* match_pos, int* num_matches) {
  int low = q_min > 1 ? q_min : 1, high = q_max < n - 1 ? q_max : n - 1, best = 0;
  while (low <= high) {
    const int mid = low + (high - low) / 2;
    if (find_recent_matches(ctx, n, mid, 1, match_pos) > 0) {
      best = mid;
      low = mid + 1;
    } else {
      high = mid - 1;
    }
  }
  *num_matches = best > 0 ? find_recent_matches(ctx, n, best, max_matches, match_pos) : 0;
  return best;
}

// Returns the q that matched (0: none). Outputs: drafts [k*w] (-1 padded), lengths [k],
// counts [k]; rows past the number of distinct continuations stay empty.
VRS_HD inline int context_ngram_one(const int32_t* ctx, int n, const ContextNgramParams& prm,
                                    int* match_pos, int* match_count, int32_t* out_drafts,
                                    int32_t* out_lengths, int32_t* out_counts) {
  for (int i = 0; i < prm.k * prm.w; ++i) out_drafts[i] = -1;
  for (int i = 0; i < prm.k; ++i) out_lengths[i] = out_counts[i] = 0;

  int m = 0;
  const int q = longest_recent_match(ctx, n, prm.q_min, prm.q_max, prm.max_matches, match_pos, &m);
  if (m == 0) return 0;

  // Count each distinct continuation at its most recent occurrence; -1 marks duplicates.
  for (int i = 0; i < m; ++i) {
    const int start_i = match_pos[i] + q;
    const int len_i = (n - start_i) < prm.w ? (n - start_i) : prm.w;
    match_count[i] = 1;
    for (int j = 0; j < i; ++j) {
      if (match_count[j] < 0) continue;
      const int start_j = match_pos[j] + q;
      const int len_j = (n - start_j) < prm.w ? (n - start_j) : prm.w;
      if (len_i == len_j && same_tokens(ctx + start_i, ctx + start_j, len_i)) {
        ++match_count[j];
        match_count[i] = -1;
        break;
      }
    }
  }
  // Select the k heaviest, ties to the most recent (lowest index).
  for (int slot = 0; slot < prm.k; ++slot) {
    int best = -1;
    for (int i = 0; i < m; ++i)
      if (match_count[i] > 0 && (best < 0 || match_count[i] > match_count[best])) best = i;
    if (best < 0) break;
    const int start = match_pos[best] + q;
    const int len = (n - start) < prm.w ? (n - start) : prm.w;
    for (int t = 0; t < len; ++t) out_drafts[slot * prm.w + t] = ctx[start + t];
    out_lengths[slot] = len;
    out_counts[slot] = match_count[best];
    match_count[best] = 0;
  }
  return q;
}

}  // namespace vrs
