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

// Scratch rows of every request (RequestWork's, one row per request), null when none needs them.
struct TreeWorkspaces {
  double* p;          // [B, V]: rules 1-3
  float* q;           // [B, V]: rule 3 with dense draft rows
  double* row;        // [B, V]: lazy target rows, or rules 2-3 with sparse draft rows
  int32_t* q_tokens;  // [B, M]: sparse draft rows
  float* q_values;    // [B, M]
};

// One block per request.
void accept_trees_cuda(const TreeBatch& batch, int num_requests, const TreeWorkspaces& work,
                       std::uintptr_t stream);

// The lazy target rows of tree_accept.h for whole logits rows (one block per row).
struct TargetRowsArgs {
  const float* logits;       // [rows, V]
  const float* temperature;  // [rows]
  const int32_t* top_k;      // [rows]
  const float* top_p;        // [rows]
  double* out;               // [rows, V]
  int64_t rows;
  int64_t vocab;
};
void target_rows_cuda(const TargetRowsArgs& args, std::uintptr_t stream);

}  // namespace vrs
