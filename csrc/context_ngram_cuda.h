// Host-side entry points of the CUDA backend (compiled only when nvcc is found).
#pragma once

#include <cstdint>

#include "context_ngram.h"

namespace vrs {

struct ContextNgramCudaArgs {
  const int32_t* tokens;
  int64_t row_stride;
  const int32_t* lengths;
  const int32_t* rows;
  int num_rows;
  ContextNgramParams params;
  int32_t* drafts;
  int32_t* draft_lengths;
  int32_t* counts;
  int32_t* match_len;
  std::uintptr_t stream;
};

void context_ngram_cuda(const ContextNgramCudaArgs& args);
int cuda_device_count();

}  // namespace vrs
