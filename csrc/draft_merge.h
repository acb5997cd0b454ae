// Merging a request's k drafts into one tree (N-Grammys' tree mode).
//
// Drafts are walked in slot order from the root; a (parent, token) step taken before reuses its
// node, any other appends a new node. Nodes are thus numbered in the order first met: parents
// before children, and a node budget that cuts the list keeps the first drafts whole. A node's
// weight is the sum of the weights of the drafts through it (the drafter's q: a child's weight
// over its parent's). Reference: vllm_retrieval_spec/kernels/draft_merge_reference.py.
#pragma once

#include <cstdint>
#include <vector>

namespace vrs {

class DraftMerger {
 public:
  // drafts [k, w], lengths [k] (each in [0, w]), weights [k]; writes tokens, parents (-1: the
  // root) and weights of up to k * w nodes and returns the node count.
  int merge(const int32_t* drafts, const int32_t* lengths, const float* weights, int k, int w,
            int32_t* tokens, int32_t* parents, float* node_weights) {
    const size_t links = static_cast<size_t>(k) * w + 1;  // slot 0: the root, i + 1: node i
    first_child_.assign(links, -1);
    next_sibling_.resize(links);
    int size = 0;
    for (int slot = 0; slot < k; ++slot) {
      int32_t node = -1;
      for (int t = 0; t < lengths[slot]; ++t) {
        node = child(node, drafts[slot * w + t], tokens, parents, node_weights, &size);
        node_weights[node] += weights[slot];
      }
    }
    return size;
  }

 private:
  int32_t child(int32_t parent, int32_t token, int32_t* tokens, int32_t* parents,
                float* node_weights, int* size) {
    int32_t& head = first_child_[parent + 1];
    for (int32_t c = head; c >= 0; c = next_sibling_[c + 1])
      if (tokens[c] == token) return c;
    const int32_t created = (*size)++;
    tokens[created] = token;
    parents[created] = parent;
    node_weights[created] = 0.0f;
    next_sibling_[created + 1] = head;
    head = created;
    return created;
  }

  std::vector<int32_t> first_child_;
  std::vector<int32_t> next_sibling_;
};

}  // namespace vrs
