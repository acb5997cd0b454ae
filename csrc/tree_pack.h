// Tree packing for tree attention: depth and ancestor bitmask of every draft node.
//
// A batch of ragged trees is flat: request b owns nodes [offsets[b], offsets[b+1]); parents[i]
// is the node's parent as a local index in its own tree (-1: child of the root, i.e. of the
// context's last token), parents before children. depth = 1 for children of the root, the
// parent's depth + 1 otherwise. Row i of the mask has bit j (word j / 64, bit j % 64) set iff
// local node j is node i or one of its ancestors. The CPU runs one tree per task, CUDA one node
// per thread, both through pack_node.
#pragma once

#include <cstdint>

#include "hd.h"

namespace vrs {

// Walks from local node `local` up to the root of its tree; returns its depth and, when `row`
// is given, fills its `words` mask words. Stops at a parent that does not precede its child,
// so malformed trees cannot loop or index out of bounds.
VRS_HD inline int32_t pack_node(const int32_t* parents, int32_t local, uint64_t* row, int words) {
  if (row != nullptr)
    for (int w = 0; w < words; ++w) row[w] = 0;
  int32_t depth = 0;
  for (int32_t j = local, child = local + 1; j >= 0 && j < child; child = j, j = parents[j]) {
    if (row != nullptr && (j >> 6) < words) row[j >> 6] |= 1ULL << (j & 63);
    ++depth;
  }
  return depth;
}

}  // namespace vrs
