// Quick checks of a datastore's suffix array at open (datastores/reader.py): nothing in the
// files is trusted, every index is checked before it is read.
//
// 1. One sequential pass over the suffix array: every entry in [0, n), and the entries' sum and
//    sum of squares (mod 2^64) those of a permutation of [0, n). One altered, lost or duplicated
//    entry always changes the sum; two can keep both sums only by swapping places.
// 2. First-token buckets: with the tokens' counts (offsets[t] = tokens below t), the first and
//    last suffix of every bucket start with its token, and the separators' bucket comes last.
// 3. Suffix order: adjacent entries (i, i + 1) compared over at most `compare_tokens` tokens
//    (a suffix that ends first sorts first): every pair when n - 1 <= samples, else `samples`
//    pairs drawn at random.
//
// count_tokens gives the first-token buckets (datastores/reader.py: first_token_offsets).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "rest_retrieval.h"
#include "rng.h"

namespace vrs {

struct StoreProblem {
  bool found = false;
  bool suffix_array_only = false;  // the suffix array alone is at fault (else it or the tokens)
  std::string message;
};

inline StoreProblem problem(bool suffix_array_only, std::string message) {
  return {true, suffix_array_only, std::move(message)};
}

// Sum and sum of squares of 0 .. n - 1, mod 2^64 (each division done before the products).
inline void permutation_sums(uint64_t n, uint64_t* sum, uint64_t* squares) {
  if (n == 0) {
    *sum = *squares = 0;
    return;
  }
  const uint64_t a = n - 1, b = n;
  *sum = (a % 2 == 0) ? (a / 2) * b : a * (b / 2);
  uint64_t f[3] = {a, b, 2 * n - 1};  // (n - 1) n (2n - 1) / 6
  (f[0] % 2 == 0 ? f[0] : f[1]) /= 2;
  for (uint64_t& x : f) {
    if (x % 3 == 0) {
      x /= 3;
      break;
    }
  }
  *squares = f[0] * f[1] * f[2];
}

template <typename Tok, typename Idx>
StoreProblem check_entries(const SuffixIndex<Tok, Idx>& index) {
  const int64_t n = index.size;
  int64_t low = 0, high = 0;
  uint64_t sum = 0, squares = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(index.suffix_array[i]);
    low = std::min(low, v);
    high = std::max(high, v);
    sum += static_cast<uint64_t>(v);
    squares += static_cast<uint64_t>(v) * static_cast<uint64_t>(v);
  }
  if (low < 0 || high >= n) {
    for (int64_t i = 0; i < n; ++i)
      if (!index.valid(index.suffix_array[i]))
        return problem(true, "entry " + std::to_string(i) + " is " +
                                 std::to_string(static_cast<int64_t>(index.suffix_array[i])) +
                                 ", outside [0, " + std::to_string(n) + ")");
  }
  uint64_t want_sum, want_squares;
  permutation_sums(static_cast<uint64_t>(n), &want_sum, &want_squares);
  if (sum != want_sum || squares != want_squares)
    return problem(true, "its entries are not a permutation of [0, " + std::to_string(n) +
                             ") (their sum or sum of squares differs: an entry is altered, "
                             "duplicated or lost)");
  return {};
}

// Whether entries [lo, hi) (clamped) can hold the bucket of token t: both ends start with t.
template <typename Tok, typename Idx>
StoreProblem check_bucket(const SuffixIndex<Tok, Idx>& index, int64_t lo, int64_t hi, uint32_t t) {
  lo = std::clamp<int64_t>(lo, 0, index.size);
  hi = std::clamp<int64_t>(hi, lo, index.size);
  if (lo == hi) return {};
  for (const int64_t entry : {lo, hi - 1}) {
    const int64_t pos = static_cast<int64_t>(index.suffix_array[entry]);
    if (!index.valid(pos))
      return problem(true, "entry " + std::to_string(entry) + " is outside [0, " + std::to_string(index.size) + ")");
    const uint32_t got = static_cast<uint32_t>(index.tokens[pos]);
    if (got != t)
      return problem(false, "entry " + std::to_string(entry) + " (the suffix at " + std::to_string(pos) +
                                ") starts with token " + std::to_string(got) +
                                ", but the token counts put it among the suffixes starting with " +
                                std::to_string(t));
  }
  return {};
}

template <typename Tok, typename Idx>
StoreProblem check_buckets(const SuffixIndex<Tok, Idx>& index) {
  if (index.offsets == nullptr || index.num_offsets < 1) return {};
  for (int64_t t = 0; t + 1 < index.num_offsets; ++t) {
    StoreProblem p = check_bucket(index, index.offsets[t], index.offsets[t + 1], static_cast<uint32_t>(t));
    if (p.found) return p;
  }
  return check_bucket(index, index.offsets[index.num_offsets - 1], index.size, index.separator);
}

// <0, 0 (equal over `len` tokens), >0: the suffixes at a and b (valid positions).
template <typename Tok, typename Idx>
int compare_suffixes(const SuffixIndex<Tok, Idx>& index, int64_t a, int64_t b, int len) {
  for (int i = 0; i < len; ++i) {
    const bool a_ends = a + i >= index.size, b_ends = b + i >= index.size;
    if (a_ends || b_ends) return a_ends == b_ends ? 0 : (a_ends ? -1 : 1);
    const uint32_t x = static_cast<uint32_t>(index.tokens[a + i]);
    const uint32_t y = static_cast<uint32_t>(index.tokens[b + i]);
    if (x != y) return x < y ? -1 : 1;
  }
  return 0;
}

template <typename Tok, typename Idx>
StoreProblem check_pair(const SuffixIndex<Tok, Idx>& index, int64_t i, int compare_tokens) {
  const int64_t a = static_cast<int64_t>(index.suffix_array[i]);
  const int64_t b = static_cast<int64_t>(index.suffix_array[i + 1]);
  if (!index.valid(a) || !index.valid(b))
    return problem(true, "entry " + std::to_string(index.valid(a) ? i + 1 : i) + " is outside [0, " +
                             std::to_string(index.size) + ")");
  if (a == b)
    return problem(true, "entries " + std::to_string(i) + " and " + std::to_string(i + 1) +
                             " are both " + std::to_string(a));
  if (compare_suffixes(index, a, b, compare_tokens) > 0)
    return problem(false, "suffixes " + std::to_string(i) + " and " + std::to_string(i + 1) +
                              " (at " + std::to_string(a) + " and " + std::to_string(b) +
                              ") are out of order");
  return {};
}

template <typename Tok, typename Idx>
StoreProblem check_order(const SuffixIndex<Tok, Idx>& index, int64_t samples, int compare_tokens,
                         uint64_t seed) {
  const int64_t pairs = index.size - 1;
  if (pairs <= 0 || compare_tokens < 1) return {};
  const bool every = pairs <= samples;
  const int64_t count = every ? pairs : samples;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t i = every ? s : static_cast<int64_t>(splitmix64(seed + static_cast<uint64_t>(s)) %
                                                       static_cast<uint64_t>(pairs));
    StoreProblem p = check_pair(index, i, compare_tokens);
    if (p.found) return p;
  }
  return {};
}

// counts[t] += occurrences of token t < vocab in tokens[0, n), separators skipped; returns the
// index of the first token that is neither (-1: none), counting stopped there.
template <typename Tok>
int64_t count_tokens(const Tok* tokens, int64_t n, uint32_t separator, int64_t* counts, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t t = static_cast<uint32_t>(tokens[i]);
    if (static_cast<int64_t>(t) < vocab) {
      ++counts[t];
    } else if (t != separator) {
      return i;
    }
  }
  return -1;
}

// The first problem the three checks find (found == false: none).
template <typename Tok, typename Idx>
StoreProblem check_suffix_index(const SuffixIndex<Tok, Idx>& index, int64_t samples,
                                int compare_tokens, uint64_t seed) {
  StoreProblem p = check_entries(index);
  if (!p.found) p = check_buckets(index);
  if (!p.found) p = check_order(index, samples, compare_tokens, seed);
  return p;
}

}  // namespace vrs
