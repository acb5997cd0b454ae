// How the CUDA tree attention kernel shares a step's nodes out between its thread blocks (host
// and device code: the CPU build exposes it so that tests check the partition).
//
// A block computes at most tile_nodes nodes of one run (consecutive nodes of one request and
// context) at once and reads the run's context once for them. The nodes are cut into chunks,
// each starting at a run's first node or at a node whose index in its tree is a multiple of
// tile_nodes; block x serves the chunks that start in its range [x * tile_nodes, (x + 1) *
// tile_nodes), each to its end, in pieces of at most tile_nodes nodes. A run of at most
// tile_nodes nodes that crosses no multiple of tile_nodes (a tree of up to tile_nodes nodes, its
// leading chain left out) is one piece, so its context is read once; fixed tiles of tile_nodes
// consecutive nodes straddled two requests whenever runs were shorter, reading both contexts.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define VRS_HOST_DEVICE __host__ __device__
#else
#define VRS_HOST_DEVICE
#endif

namespace vrs {

struct NodeRuns {
  const int32_t* request;  // [num_nodes] each node's row of the block table
  const int32_t* context;  // [num_nodes] each node's context length
  const int32_t* index;    // [num_nodes] each node's index in its tree
  int64_t num_nodes;
  int tile_nodes;  // nodes a block computes at once
};

// Whether node m starts a chunk (the first node of a run, or at a multiple of tile_nodes).
VRS_HOST_DEVICE inline bool starts_chunk(const NodeRuns& n, int64_t m) {
  return m == 0 || n.request[m] != n.request[m - 1] || n.context[m] != n.context[m - 1] ||
         n.index[m] % n.tile_nodes == 0;
}

// The first piece block `block` serves, or -1 when no chunk starts in its range.
VRS_HOST_DEVICE inline int64_t first_piece(const NodeRuns& n, int64_t block) {
  const int64_t begin = block * n.tile_nodes;
  const int64_t end = begin + n.tile_nodes < n.num_nodes ? begin + n.tile_nodes : n.num_nodes;
  for (int64_t m = begin; m < end; ++m)
    if (starts_chunk(n, m)) return m;
  return -1;
}

// The end of the piece starting at node begin: before the next chunk start, at most tile_nodes on.
VRS_HOST_DEVICE inline int64_t piece_end(const NodeRuns& n, int64_t begin) {
  const int64_t limit = begin + n.tile_nodes < n.num_nodes ? begin + n.tile_nodes : n.num_nodes;
  int64_t end = begin + 1;
  while (end < limit && !starts_chunk(n, end)) ++end;
  return end;
}

// The piece block `block` serves after one ending at node end, or -1 when it is done: the rest
// of its chunk, or the next chunk starting in its range.
VRS_HOST_DEVICE inline int64_t next_piece(const NodeRuns& n, int64_t block, int64_t end) {
  if (end >= n.num_nodes) return -1;
  return end < (block + 1) * n.tile_nodes || !starts_chunk(n, end) ? end : -1;
}

}  // namespace vrs
