// CUDA backend of the context n-gram matcher: one thread per request, the same
// device-callable routine as the CPU backend (context_ngram.h).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "context_ngram.h"
#include "context_ngram_cuda.h"

namespace vrs {
namespace {

__global__ void context_ngram_kernel(const int32_t* tokens, int64_t row_stride,
                                     const int32_t* lengths, const int32_t* rows, int num_rows,
                                     ContextNgramParams prm, int32_t* drafts, int32_t* draft_lengths,
                                     int32_t* counts, int32_t* match_len) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= num_rows) return;
  int match_pos[kMaxContextMatches];
  int match_count[kMaxContextMatches];
  const int row = rows[r];
  match_len[r] = context_ngram_one(tokens + row * row_stride, lengths[row], prm, match_pos,
                                   match_count, drafts + static_cast<int64_t>(r) * prm.k * prm.w,
                                   draft_lengths + static_cast<int64_t>(r) * prm.k,
                                   counts + static_cast<int64_t>(r) * prm.k);
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

}  // namespace

void context_ngram_cuda(const ContextNgramCudaArgs& args) {
  if (args.num_rows == 0) return;
  constexpr int kThreads = 64;
  const int blocks = (args.num_rows + kThreads - 1) / kThreads;
  auto stream = reinterpret_cast<cudaStream_t>(args.stream);
  context_ngram_kernel<<<blocks, kThreads, 0, stream>>>(
      args.tokens, args.row_stride, args.lengths, args.rows, args.num_rows, args.params,
      args.drafts, args.draft_lengths, args.counts, args.match_len);
  check(cudaGetLastError(), "context_ngram kernel launch");
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: report zero, clear the sticky error
    return 0;
  }
  return count;
}

}  // namespace vrs
