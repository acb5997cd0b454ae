// Skinny fp32 GEMM for verification steps on CPUs: y[M,N] = x[M,K] · w[N,K]ᵀ (+ bias) for the
// few rows a decode or verification step computes (M up to a few dozen), reading the weights in
// torch's [out_features, in_features] layout once per call. oneDNN's packed GEMM leaves its
// one-row path at M = 2 and costs ~1.6x a one-row step from M = 5 on a 2-core x86 VM; this one
// streams each block of 4 weight rows from memory once and reuses it from L1 for every 3 rows of
// x. Threads: the OpenMP team torch runs on (found in the process at first use), so no second
// pool competes with torch's for the cores; without one, the calling thread alone.
#pragma once

#include <cstdint>

namespace vrs {

struct SkinnyGemmArgs {
  const float* x;     // [rows, in_features], rows contiguous
  const float* w;     // [out_features, in_features]
  const float* bias;  // [out_features] or nullptr
  float* y;           // [rows, out_features]
  int64_t rows;
  int64_t in_features;
  int64_t out_features;
};

void skinny_gemm_cpu(const SkinnyGemmArgs& args);

// Threads skinny_gemm_cpu runs on: torch's OpenMP team size, or 1 without one.
int skinny_gemm_threads();

}  // namespace vrs
