// Counter-based uniforms shared by the CPU and CUDA kernels and mirrored bit for bit by the
// Python reference (vllm_retrieval_spec/kernels/tree_reference.py: uniform):
//
//   u(seed, counter) = (splitmix64(seed ^ (counter * 0x9E3779B97F4A7C15 + 1)) >> 11) * 2^-53
//
// all arithmetic modulo 2^64, splitmix64 as in Steele, Lea & Flood (2014). u is a multiple of
// 2^-53 in [0, 1), exact in double. A request's counter starts at 0 and advances once per draw.
//
// Seeded sampling (the keyed rule of tree_accept.h) draws the token at absolute position t of a
// request with seed s with one uniform that depends on (s, t) only:
//
//   keyed_uniform(s, t) = u(splitmix64(s), t)
//
// The key splitmix64(s) spreads nearby seeds (0, 1, 2, ...) apart; under one key distinct
// positions have distinct counters, hence distinct 64-bit words (splitmix64 is a bijection).
#pragma once

#include <cstdint>

#include "hd.h"

namespace vrs {

VRS_HD inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

VRS_HD inline double counter_uniform(uint64_t seed, uint64_t counter) {
  const uint64_t bits = splitmix64(seed ^ (counter * 0x9E3779B97F4A7C15ULL + 1ULL)) >> 11;
  return static_cast<double>(bits) * 0x1.0p-53;
}

VRS_HD inline double keyed_uniform(uint64_t seed, uint64_t position) {
  return counter_uniform(splitmix64(seed), position);
}

// The uniforms of one request, in draw order.
struct UniformStream {
  uint64_t seed;
  uint64_t counter;
  VRS_HD double next() { return counter_uniform(seed, counter++); }
};

}  // namespace vrs
