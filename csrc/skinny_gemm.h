// Skinny fp32 GEMM for verification steps on CPUs: y[M,N] = x[M,K] · w[N,K]ᵀ (+ bias) for the
// few rows a decode or verification step computes (M up to a few dozen). The weights are packed
// once (when the model loads) into panels of kSkinnyGemmPanel output columns, each panel's K rows
// of 16 floats contiguous: a register-blocked kernel (up to 6 rows of x × 16 columns, 12 vector
// accumulators of 8 lanes; with AVX-512, up to 12 rows × 2 panels, 24 accumulators of 16 lanes)
// reads a panel from memory once per call and from cache for every further block of rows,
// broadcasting x, with no horizontal sums. Each output is summed over k in order, whatever
// M is and however the rows are blocked, so a row's result does not depend on the rows beside it.
// Threads: the OpenMP team torch runs on (found in the process at first use), so no second pool
// competes with torch's for the cores; without one, the calling thread alone.
#pragma once

#include <cstdint>

namespace vrs {

// Output columns of a packed panel; out_features is padded to a whole number of panels.
constexpr int64_t kSkinnyGemmPanel = 16;

struct SkinnyGemmArgs {
  const float* x;     // [rows, in_features], rows contiguous
  const float* w;     // packed: [ceil(out_features / 16), in_features, 16], padding columns zero
  const float* bias;  // [out_features] or nullptr
  float* y;           // [rows, out_features]
  int64_t rows;
  int64_t in_features;
  int64_t out_features;
};

void skinny_gemm_cpu(const SkinnyGemmArgs& args);

// A language-model head's step for an argmax: the weights' bfloat16 copy (packed as skinny_gemm's,
// each weight rounded to nearest) gives every output within a bound of its exact value
// (2^-8 + rounding of the sums, times |x|·|w_n|, Cauchy-Schwarz), so that only the panels whose
// bound reaches the largest lower bound among the first valid_features outputs can hold the
// row's largest output; those panels are computed as skinny_gemm_cpu computes them (the same
// code, bit for bit), every other output is -inf. Half the weight bytes of a full pass, for the
// same argmax (first index on ties).
struct ScreenedHeadArgs {
  const float* x;            // [rows, in_features], rows contiguous
  const uint16_t* w_bf16;    // packed as w in bfloat16 or, with pairs, in k-pairs: [panels, ceil(K / 2), 16, 2]
  const float* w;            // packed float32 weights (skinny_gemm's layout)
  const float* norms;        // [out_features]: each output's weight row's Euclidean norm, rounded up
  const float* panel_norms;  // [panels]: the largest of its panel's norms
  float* y;                  // [rows, out_features]
  float* panel_max;          // scratch [rows, panels] (the call allocates it)
  int64_t rows;
  int64_t in_features;
  int64_t out_features;
  int64_t valid_features;  // the outputs an argmax reads (the rest: padding), 1..out_features
  bool pairs;              // w_bf16 in k-pairs, for the bfloat16 dot product (screened_head_pairs())
  const uint32_t* x_pairs;  // scratch: x in bfloat16 k-pairs (the call fills it)
};

// Fills y as above; false (y then holds no result) when x or an output computed is not finite, or
// for more rows than screened_head_max_rows(), past which the full head is the faster.
bool screened_head_cpu(const ScreenedHeadArgs& args);
int64_t screened_head_max_rows(bool pairs);

// Whether screened_head_cpu takes its weights in k-pairs: this CPU runs the bfloat16 dot product
// (AVX512_BF16), which multiplies x rounded to bfloat16 too (a bound of 2^-7 instead of 2^-8),
// two k a lane, at twice the multiply-adds of a float32 lane.
bool screened_head_pairs();

// Threads skinny_gemm_cpu runs on: torch's OpenMP team size, or 1 without one.
int skinny_gemm_threads();

}  // namespace vrs
