// Host-side entry points of the CUDA tree kernels (compiled only when nvcc is found).
#pragma once

#include <cstdint>

#include "tree_accept.h"

namespace vrs {

struct PackTreeCudaArgs {
  const int32_t* parents;  // [num_nodes]
  const int32_t* offsets;  // [num_trees + 1]
  int num_nodes;
  int num_trees;
  int32_t* depth;  // [num_nodes]
  uint64_t* mask;  // [num_nodes, words] or null
  int words;
  std::uintptr_t stream;
};

// One thread per node.
void pack_tree_masks_cuda(const PackTreeCudaArgs& args);

// One block per request; p_work [B, V] float64 (needed by rules 1-3) and q_work [B, V] float32
// (rule 3) are scratch rows, null when no request needs them.
void accept_trees_cuda(const TreeBatch& batch, int num_requests, double* p_work, float* q_work,
                       std::uintptr_t stream);

}  // namespace vrs
