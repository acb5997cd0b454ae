// CUDA backend of tree attention (tree_attention.h), flash-decoding style. A thread block serves
// pieces of runs for one kv head (tree_tiles.h). Consecutive nodes of one request (a run) share
// their context, and their tree keys are the cache positions right after it, so the block reads
// the run's keys once — cache positions from the first any node's window keeps to its last tree
// node — coalesced into shared memory as float32, and scores each key for all of the run's query
// rows (nodes × query heads of the group) at once; a row masks the keys outside its path (its
// window, the other branches). Per tile of kKeys keys: scores (a thread per key and row group), a
// block-wide online softmax per row, then P·V (a thread per 4 rows × 4 dims). When tiles × kv
// heads would not fill the GPU, each run's keys are split over gridDim.z blocks whose partial
// (max, sum, acc) a second kernel merges. Positions outside the block table or the cache
// contribute nothing; soft-cap and sinks as in the CPU kernel (tree_attention.cpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "tree_attention.h"
#include "tree_tiles.h"

namespace vrs {
namespace {

constexpr int kThreads = 128;                                  // 4 warps
constexpr int kWarps = kThreads / 32;
// 32 keys a tile: 43 KB of shared memory and 128 registers a thread at head size 128 let four
// blocks share an SM (64 keys: two, and 1.45x slower at 64 trees x 4,000 keys on an H200).
constexpr int kKeys = 32;                                      // keys per tile
constexpr int kRows = 16;                                      // query rows per block
constexpr int kKeyWarps = kKeys / 32;                          // warps scoring one row group
constexpr int kScoreRows = kRows / (kThreads / kKeys);         // rows scored per thread: 4
constexpr int kValueRows = kRows / kWarps;                     // rows per warp in P·V: 4
constexpr int kPassDims = 32 * 4;                              // dims of one P·V pass (float4 per lane)
constexpr int kMaxHeadSize = 256;
constexpr int kMaxPasses = kMaxHeadSize / kPassDims;
constexpr int kMaxWords = 4;                                   // ancestor rows of at most 256 nodes
constexpr int kMaxSplits = 32;
constexpr int kLoadBatch = 8;  // independent 16-byte loads in flight per thread
static_assert(kKeys % 32 == 0, "whole warps of keys");
static_assert(kValueRows == 4 && kScoreRows * (kThreads / kKeys) == kRows, "float4 rows of P");

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// Launch shape and shared-memory layout, the same for every block.
struct Geometry {
  int group;         // query heads per kv head
  int tile_nodes;    // nodes per block (kRows / group)
  int splits;        // blocks sharing each run's keys (gridDim.z)
  int dims;          // head size rounded up to 4 (zero padded)
  int key_stride;    // floats per key row in shared memory: dims / 4 odd (no bank conflicts)
  bool vector_rows;  // split layout, rows of 16-byte vectors: coalesced vector loads
  int64_t key_t, key_d, value_offset, value_t;  // key (t, d) at key_t * t + key_d * d in a block
};

// One node of the block's current run: which of the run's keys its row sees.
struct RunNode {
  int first;           // first context position its window keeps (the context length: none)
  int first_ancestor;  // smallest tree index its window keeps
  int last;            // its own tree index, -1: no tree keys
  uint64_t bits[kMaxWords];  // its ancestors-or-self among tree indices 0..last
};

// Consecutive nodes of one request and context, and the cache positions this block reads.
struct Run {
  int64_t begin, end;
  int rows;            // (end - begin) * group
  int context;
  int first_key, end_key;
  const int32_t* table;  // the request's block table row, nullptr: unknown request
};

struct BlockShared {
  RunNode nodes[kRows];
  float tile_max[kKeyWarps][kRows];
  float tile_sum[kKeyWarps][kRows];
  int64_t key_block[kKeys];  // element offset of each tile key's (block, kv head), -1: nothing
  int key_slot[kKeys];        // its position in the block
};

// The shared float arrays: scaled queries [kRows, dims], keys [kKeys, key_stride], values
// [kKeys, dims], probabilities [kKeys, kRows].
struct Tiles {
  float *q, *k, *v, *p;

  __device__ static Tiles of(float* base, const Geometry& geo) {
    Tiles t;
    t.q = base;
    t.k = t.q + kRows * geo.dims;
    t.v = t.k + kKeys * geo.key_stride;
    t.p = t.v + kKeys * geo.dims;
    return t;
  }
};

size_t tiles_bytes(const Geometry& geo) {
  return sizeof(float) * (static_cast<size_t>(kRows) * geo.dims + kKeys * geo.key_stride +
                          static_cast<size_t>(kKeys) * geo.dims + kKeys * kRows);
}

__device__ __forceinline__ bool row_in_range(const TreeAttentionArgs& a, int64_t row) {
  return row >= 0 && row < a.query_rows && row < a.out_rows;
}

// Element offset of (block, kv head g) holding cache position pos, -1 outside the table or cache.
__device__ __forceinline__ int64_t block_base(const TreeAttentionArgs& a, const Run& run, int g,
                                              int pos) {
  if (run.table == nullptr || pos < 0) return -1;
  const int index = pos / a.block_size;
  if (index >= a.table_width) return -1;
  const int64_t block = run.table[index];
  if (block < 0 || block >= a.num_blocks) return -1;
  return (block * a.kv_heads + g) * a.block_size * 2LL * a.head_size;
}

// Tree index of the n-th (0-based) set bit.
__device__ int nth_ancestor(const uint64_t (&bits)[kMaxWords], int n) {
  for (int w = 0; w < kMaxWords; ++w) {
    const int count = __popcll(bits[w]);
    if (n < count) {
      uint64_t b = bits[w];
      for (int i = 0; i < n; ++i) b &= b - 1;
      return w * 64 + __ffsll(static_cast<long long>(b)) - 1;
    }
    n -= count;
  }
  return kMaxWords * 64;
}

// The node's ancestor bits 0..node_index, depth and window (tree_attention.h).
__device__ RunNode describe_node(const TreeAttentionArgs& a, int64_t node, int context) {
  RunNode n;
  n.last = min(a.node_index[node], a.words * 64 - 1);
  int depth = 0;
  for (int w = 0; w < kMaxWords; ++w) {
    const int top = n.last - w * 64;  // highest bit kept in this word
    uint64_t bits = w < a.words && top >= 0 ? a.ancestors[node * a.words + w] : 0;
    if (top < 63) bits &= top >= 0 ? (2ULL << top) - 1 : 0;
    n.bits[w] = bits;
    depth += __popcll(bits);
  }
  const int first = a.window > 0 ? max(0, context + depth - a.window) : 0;
  n.first = min(first, context);
  n.first_ancestor = first > context ? nth_ancestor(n.bits, first - context) : 0;
  n.last = max(n.last, -1);
  return n;
}

// Whether a row of node n attends to cache position pos of its request.
__device__ __forceinline__ bool sees(const RunNode& n, int context, int pos) {
  if (pos < context) return pos >= n.first;
  const int a = pos - context;
  return a >= n.first_ancestor && a <= n.last && ((n.bits[a >> 6] >> (a & 63)) & 1ULL);
}

// Every thread: the run's keys from the first any window keeps to its last tree node, the
// block's split of them in whole tiles (after sh.nodes is filled).
__device__ void split_keys(const Geometry& geo, const BlockShared& sh, Run& run) {
  int first = INT_MAX, end = run.context;
  for (int n = 0; n < run.end - run.begin; ++n) {
    const RunNode& node = sh.nodes[n];
    first = min(first, node.first < run.context ? node.first : run.context + node.first_ancestor);
    end = max(end, run.context + node.last + 1);
  }
  const int keys = run.table == nullptr ? 0 : max(0, end - first);
  const int per_split = (keys + geo.splits - 1) / geo.splits;
  const int chunk = (per_split + kKeys - 1) / kKeys * kKeys;
  run.first_key = first + min(keys, static_cast<int>(blockIdx.z) * chunk);
  run.end_key = first + min(keys, static_cast<int>(blockIdx.z + 1) * chunk);
}

// Fill sh.nodes and the scaled queries of the run's rows (zeros beyond them).
template <typename T>
__device__ void load_run(const TreeAttentionArgs& a, const Geometry& geo, const Run& run,
                         BlockShared& sh, const Tiles& tiles) {
  const int tid = threadIdx.x, g = blockIdx.y;
  if (tid < run.end - run.begin) sh.nodes[tid] = describe_node(a, run.begin + tid, run.context);
  const T* query = static_cast<const T*>(a.query);
  for (int i = tid; i < kRows * geo.dims; i += kThreads) {
    const int r = i / geo.dims, d = i % geo.dims;
    float q = 0.0f;
    if (r < run.rows && d < a.head_size) {
      const int64_t row = a.node_row[run.begin + r / geo.group];
      const int head = g * geo.group + r % geo.group;
      if (row_in_range(a, row)) q = to_float(query[row * a.query_stride + head * a.head_size + d]) * a.scale;
    }
    tiles.q[i] = q;
  }
}

// Where positions pos0 .. pos0 + kKeys are (-1 outside the split, the table or the cache).
__device__ void locate_tile(const TreeAttentionArgs& a, const Run& run, int pos0, BlockShared& sh) {
  const int key = threadIdx.x, pos = pos0 + key;
  if (key >= kKeys) return;
  sh.key_block[key] = pos < run.end_key ? block_base(a, run, blockIdx.y, pos) : -1;
  sh.key_slot[key] = pos % a.block_size;
}

// A key row then its value row (2 * head_size contiguous elements of the split layout) of each
// tile key into shared memory as float32, kLoadBatch 16-byte loads in flight per thread.
template <typename T>
__device__ void load_vector_rows(const TreeAttentionArgs& a, const Geometry& geo, const BlockShared& sh,
                                 const Tiles& tiles) {
  constexpr int kPerVector = 16 / sizeof(T);
  union Vector {
    uint4 raw;
    T x[kPerVector];
  };
  const T* cache = static_cast<const T*>(a.cache);
  const int vectors = 2 * a.head_size / kPerVector, total = kKeys * vectors;
  for (int first = threadIdx.x; first < total; first += kThreads * kLoadBatch) {
    Vector batch[kLoadBatch];
#pragma unroll
    for (int b = 0; b < kLoadBatch; ++b) {
      const int i = first + b * kThreads;
      const int key = i < total ? i / vectors : 0;
      const int64_t block = i < total ? sh.key_block[key] : -1;
      const T* row = cache + block + sh.key_slot[key] * geo.key_t;
      batch[b].raw = block < 0 ? make_uint4(0, 0, 0, 0)
                               : *reinterpret_cast<const uint4*>(row + i % vectors * kPerVector);
    }
#pragma unroll
    for (int b = 0; b < kLoadBatch; ++b) {
      const int i = first + b * kThreads;
      if (i >= total) break;
      const int key = i / vectors, e = i % vectors * kPerVector;
      float* dst = e >= a.head_size ? tiles.v + key * geo.dims + e - a.head_size : tiles.k + key * geo.key_stride + e;
#pragma unroll
      for (int j = 0; j < kPerVector; j += 4)  // 16-byte aligned: strides and e are multiples of 4
        *reinterpret_cast<float4*>(dst + j) = make_float4(to_float(batch[b].x[j]), to_float(batch[b].x[j + 1]),
                                                          to_float(batch[b].x[j + 2]), to_float(batch[b].x[j + 3]));
    }
  }
}

// Keys and values of the tile into shared memory as float32 (zeros for keys that contribute
// nothing, zero padding up to geo.dims).
template <typename T>
__device__ void load_tile(const TreeAttentionArgs& a, const Geometry& geo, const BlockShared& sh,
                          const Tiles& tiles) {
  if (geo.vector_rows) {
    load_vector_rows<T>(a, geo, sh, tiles);
    return;
  }
  const T* cache = static_cast<const T*>(a.cache);
  for (int i = threadIdx.x; i < kKeys * geo.dims; i += kThreads) {
    const int key = i / geo.dims, d = i % geo.dims;
    const int64_t block = d < a.head_size ? sh.key_block[key] : -1;
    const int t = sh.key_slot[key];
    tiles.k[key * geo.key_stride + d] = block < 0 ? 0.0f : to_float(cache[block + t * geo.key_t + d * geo.key_d]);
    tiles.v[key * geo.dims + d] =
        block < 0 ? 0.0f : to_float(cache[block + geo.value_offset + t * geo.value_t + d]);
  }
}

__device__ __forceinline__ float warp_max(float x) {
  for (int lane = 16; lane > 0; lane /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, lane));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int lane = 16; lane > 0; lane /= 2) x += __shfl_xor_sync(0xffffffffu, x, lane);
  return x;
}

__device__ __forceinline__ float fma4(float4 a, float4 b, float c) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, c))));
}

// s[i] = (query row i) · key for kScoreRows query rows dims apart, over the padded dims.
__device__ __forceinline__ void dot_rows(const float* q, const float* key, int dims,
                                         float (&s)[kScoreRows]) {
#pragma unroll
  for (int i = 0; i < kScoreRows; ++i) s[i] = 0.0f;
#pragma unroll 4
  for (int d = 0; d < dims; d += 4) {
    const float4 k4 = *reinterpret_cast<const float4*>(key + d);
#pragma unroll
    for (int i = 0; i < kScoreRows; ++i) s[i] = fma4(*reinterpret_cast<const float4*>(q + i * dims + d), k4, s[i]);
  }
}

// The running max of a row after this tile (identical in every thread that tracks the row).
__device__ __forceinline__ float updated_max(const BlockShared& sh, int row, float max) {
#pragma unroll
  for (int h = 0; h < kKeyWarps; ++h) max = fmaxf(max, sh.tile_max[h][row]);
  return max;
}

// exp(x - max), 0 for a masked score (x = -inf).
__device__ __forceinline__ float weight(float x, float max) {
  return x == -INFINITY ? 0.0f : __expf(x - max);
}

// Scores of the tile's key (this thread's) for its row group, masked, soft-capped; their
// per-warp maxima into sh.tile_max. Then (after a barrier) their probabilities into tiles.p,
// their per-warp sums into sh.tile_sum, the rows' running max in max.
struct Scorer {
  int key, row_group;  // key of the tile, rows row_group * kScoreRows ..
  float max[kScoreRows];
  float s[kScoreRows];

  __device__ void score(const TreeAttentionArgs& a, const Geometry& geo, const Run& run, int pos0,
                        const BlockShared& sh, const Tiles& tiles) {
    const int pos = pos0 + key;
    const bool key_ok = sh.key_block[key] >= 0;
    dot_rows(tiles.q + row_group * kScoreRows * geo.dims, tiles.k + key * geo.key_stride, geo.dims, s);
#pragma unroll
    for (int i = 0; i < kScoreRows; ++i) {
      const int r = row_group * kScoreRows + i;
      const bool ok = key_ok && r < run.rows && sees(sh.nodes[r / geo.group], run.context, pos);
      if (ok && a.softcap > 0.0f) s[i] = a.softcap * tanhf(s[i] / a.softcap);
      s[i] = ok ? s[i] : -INFINITY;
    }
  }

  __device__ void reduce_max(BlockShared& sh) const {
    const int key_warp = key / 32;
#pragma unroll
    for (int i = 0; i < kScoreRows; ++i) {
      const float m = warp_max(s[i]);
      if (key % 32 == 0) sh.tile_max[key_warp][row_group * kScoreRows + i] = m;
    }
  }

  __device__ void weigh(BlockShared& sh, const Tiles& tiles) {
    const int key_warp = key / 32;
#pragma unroll
    for (int i = 0; i < kScoreRows; ++i) {
      const int r = row_group * kScoreRows + i;
      max[i] = updated_max(sh, r, max[i]);
      const float p = weight(s[i], max[i]);
      tiles.p[key * kRows + r] = p;
      const float total = warp_sum(p);
      if (key % 32 == 0) sh.tile_sum[key_warp][r] = total;
    }
  }
};

// This warp's kValueRows rows: running max, sum and acc over dims lane * 4 + kPassDims * pass.
struct Accumulator {
  int first_row, lane;
  float max[kValueRows], sum[kValueRows];
  float4 acc[kValueRows][kMaxPasses];

  __device__ void add_tile(const Geometry& geo, int keys, const BlockShared& sh, const Tiles& tiles) {
#pragma unroll
    for (int j = 0; j < kValueRows; ++j) {
      const int r = first_row + j;
      const float top = updated_max(sh, r, max[j]);
      const float correction = top == max[j] ? 1.0f : __expf(max[j] - top);
      max[j] = top;
      float tile_sum = 0.0f;
#pragma unroll
      for (int h = 0; h < kKeyWarps; ++h) tile_sum += sh.tile_sum[h][r];
      sum[j] = fmaf(sum[j], correction, tile_sum);
#pragma unroll
      for (int pass = 0; pass < kMaxPasses; ++pass) {
        acc[j][pass].x *= correction, acc[j][pass].y *= correction;
        acc[j][pass].z *= correction, acc[j][pass].w *= correction;
      }
    }
    for (int key = 0; key < keys; ++key) {
      const float4 p = *reinterpret_cast<const float4*>(tiles.p + key * kRows + first_row);
      const float pj[kValueRows] = {p.x, p.y, p.z, p.w};
#pragma unroll
      for (int pass = 0; pass < kMaxPasses; ++pass) {
        const int d = lane * 4 + pass * kPassDims;
        if (d >= geo.dims) break;
        const float4 v = *reinterpret_cast<const float4*>(tiles.v + key * geo.dims + d);
#pragma unroll
        for (int j = 0; j < kValueRows; ++j) {
          float4& o = acc[j][pass];
          o.x = fmaf(pj[j], v.x, o.x), o.y = fmaf(pj[j], v.y, o.y);
          o.z = fmaf(pj[j], v.z, o.z), o.w = fmaf(pj[j], v.w, o.w);
        }
      }
    }
  }
};

// Initial softmax state of a row: its head's sink (split 0 only: merged once), else empty.
__device__ __forceinline__ void start_row(const TreeAttentionArgs& a, const Geometry& geo, int r,
                                          float& max, float& sum) {
  const bool sink = a.sinks != nullptr && blockIdx.z == 0;
  max = sink ? a.sinks[blockIdx.y * geo.group + r % geo.group] : -INFINITY;
  sum = sink ? 1.0f : 0.0f;
}

// The rows' results: normalised into out (one split), else partial (max, sum, acc) per split.
template <typename T>
__device__ void store_rows(const TreeAttentionArgs& a, const Geometry& geo, const Run& run,
                           const Accumulator& acc, float* partial) {
  const int64_t partials = a.num_nodes * a.heads * geo.splits;
  for (int j = 0; j < kValueRows; ++j) {
    const int r = acc.first_row + j;
    if (r >= run.rows) break;
    const int64_t node = run.begin + r / geo.group;
    const int head = blockIdx.y * geo.group + r % geo.group;
    const int64_t row = a.node_row[node];
    const int64_t slot = (node * a.heads + head) * geo.splits + blockIdx.z;
    if (geo.splits > 1 && acc.lane == 0) {
      partial[partials * a.head_size + 2 * slot] = acc.max[j];
      partial[partials * a.head_size + 2 * slot + 1] = acc.sum[j];
    }
    if (geo.splits == 1 && !row_in_range(a, row)) continue;
    T* out = geo.splits == 1 ? static_cast<T*>(a.out) + row * a.out_stride + head * a.head_size : nullptr;
    for (int pass = 0; pass < kMaxPasses; ++pass) {
      const float4 o = acc.acc[j][pass];
      const float values[4] = {o.x, o.y, o.z, o.w};
      for (int c = 0; c < 4; ++c) {
        const int d = acc.lane * 4 + pass * kPassDims + c;
        if (d >= a.head_size) break;
        if (geo.splits > 1)
          partial[slot * a.head_size + d] = values[c];
        else
          out[d] = from_float<T>(acc.sum[j] > 0.0f ? values[c] / acc.sum[j] : 0.0f);
      }
    }
  }
}

// One run of the block's tile: its split of the keys, tile by tile.
template <typename T>
__device__ void attend_run(const TreeAttentionArgs& a, const Geometry& geo, Run& run, BlockShared& sh,
                           const Tiles& tiles, float* partial) {
  __syncthreads();  // the previous run is done with the shared state
  load_run<T>(a, geo, run, sh, tiles);
  __syncthreads();
  split_keys(geo, sh, run);
  const int tid = threadIdx.x;
  Scorer scorer;
  scorer.key = tid % kKeys, scorer.row_group = tid / kKeys;
  Accumulator acc;
  acc.first_row = tid / 32 * kValueRows, acc.lane = tid % 32;
  for (int i = 0; i < kScoreRows; ++i) {
    float unused;
    start_row(a, geo, scorer.row_group * kScoreRows + i, scorer.max[i], unused);
  }
  for (int j = 0; j < kValueRows; ++j) {
    start_row(a, geo, acc.first_row + j, acc.max[j], acc.sum[j]);
    for (int pass = 0; pass < kMaxPasses; ++pass) acc.acc[j][pass] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  for (int pos0 = run.first_key; pos0 < run.end_key; pos0 += kKeys) {
    locate_tile(a, run, pos0, sh);
    __syncthreads();
    load_tile<T>(a, geo, sh, tiles);
    __syncthreads();
    scorer.score(a, geo, run, pos0, sh, tiles);
    scorer.reduce_max(sh);
    __syncthreads();
    scorer.weigh(sh, tiles);
    __syncthreads();
    acc.add_tile(geo, min(kKeys, run.end_key - pos0), sh, tiles);
    __syncthreads();  // before the next tile overwrites its locations, keys, values, maxima, weights
  }
  store_rows<T>(a, geo, run, acc, partial);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) tree_attention_kernel(TreeAttentionArgs a, Geometry geo,
                                                                  float* partial) {
  extern __shared__ float4 dynamic_shared[];
  __shared__ BlockShared sh;
  const Tiles tiles = Tiles::of(reinterpret_cast<float*>(dynamic_shared), geo);
  const NodeRuns runs{a.node_request, a.node_context, a.node_index, a.num_nodes, geo.tile_nodes};
  for (int64_t begin = first_piece(runs, blockIdx.x); begin >= 0;) {
    Run run;
    run.begin = begin, run.end = piece_end(runs, begin);
    run.rows = static_cast<int>(run.end - run.begin) * geo.group;
    run.context = a.node_context[begin];
    const int request = a.node_request[begin];
    run.table = request >= 0 && request < a.table_rows
                    ? a.block_table + static_cast<int64_t>(request) * a.table_width
                    : nullptr;
    attend_run<T>(a, geo, run, sh, tiles, partial);
    begin = next_piece(runs, blockIdx.x, run.end);
  }
}

// out row of each node = the merge of its splits' partial (max, sum, acc) per head.
template <typename T>
__global__ void merge_splits_kernel(TreeAttentionArgs a, int splits, const float* partial) {
  const int64_t node = blockIdx.x, row = a.node_row[node];
  if (!row_in_range(a, row)) return;
  const float* stats = partial + a.num_nodes * a.heads * splits * a.head_size;
  T* out = static_cast<T*>(a.out) + row * a.out_stride;
  for (int i = threadIdx.x; i < a.heads * a.head_size; i += blockDim.x) {
    const int head = i / a.head_size, d = i % a.head_size;
    const int64_t first = (node * a.heads + head) * splits;
    float top = -INFINITY;
    for (int s = 0; s < splits; ++s) top = fmaxf(top, stats[2 * (first + s)]);
    float sum = 0.0f, value = 0.0f;
    for (int s = 0; s < splits && top != -INFINITY; ++s) {
      const float w = weight(stats[2 * (first + s)], top);
      sum = fmaf(stats[2 * (first + s) + 1], w, sum);
      value = fmaf(partial[(first + s) * a.head_size + d], w, value);
    }
    out[i] = from_float<T>(sum > 0.0f ? value / sum : 0.0f);
  }
}

int element_size(AttentionDtype dtype) { return dtype == AttentionDtype::kFloat32 ? 4 : 2; }

// Splits of each run's keys so that about one wave of blocks fills the GPU.
int choose_splits(int64_t blocks, int blocks_per_sm) {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 1;
  const int64_t wave = static_cast<int64_t>(sms) * blocks_per_sm;
  if (blocks >= wave) return 1;
  return static_cast<int>(std::min<int64_t>(kMaxSplits, (wave + blocks - 1) / blocks));
}

Geometry geometry_of(const TreeAttentionArgs& a) {
  Geometry geo{};
  geo.group = a.heads / a.kv_heads;
  geo.tile_nodes = kRows / geo.group;
  geo.dims = (a.head_size + 3) / 4 * 4;
  geo.key_stride = geo.dims % 8 == 0 ? geo.dims + 4 : geo.dims;
  const int64_t d = a.head_size, bs = a.block_size;
  const bool split = a.layout == KVLayoutCode::kSplitLastDim;
  geo.key_t = split ? 2 * d : 1;
  geo.key_d = split ? 1 : bs;
  geo.value_offset = split ? d : bs * d;
  geo.value_t = split ? 2 * d : d;
  geo.vector_rows = split && (a.head_size * element_size(a.dtype)) % 16 == 0 &&
                    reinterpret_cast<std::uintptr_t>(a.cache) % 16 == 0;
  return geo;
}

void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// Stream-ordered scratch for the splits' partial results, freed after the merge is queued.
struct Scratch {
  float* data = nullptr;
  cudaStream_t stream;

  Scratch(size_t bytes, cudaStream_t s) : stream(s) {
    if (cudaMallocAsync(reinterpret_cast<void**>(&data), bytes, stream) != cudaSuccess)
      check_launch("tree attention scratch");
  }
  ~Scratch() { cudaFreeAsync(data, stream); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

template <typename T>
void launch(const TreeAttentionArgs& a, Geometry geo, cudaStream_t stream) {
  const size_t shared = tiles_bytes(geo);
  auto* kernel = tree_attention_kernel<T>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)) !=
      cudaSuccess)
    check_launch("tree_attention_kernel shared memory");
  int per_sm = 1;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared);
  const int64_t tiles = (a.num_nodes + geo.tile_nodes - 1) / geo.tile_nodes;
  geo.splits = choose_splits(tiles * a.kv_heads, std::max(per_sm, 1));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(a.kv_heads), static_cast<unsigned>(geo.splits));
  if (geo.splits == 1) {
    kernel<<<grid, kThreads, shared, stream>>>(a, geo, nullptr);
    check_launch("tree_attention_kernel");
    return;
  }
  const Scratch partial(sizeof(float) * a.num_nodes * a.heads * geo.splits * (a.head_size + 2), stream);
  kernel<<<grid, kThreads, shared, stream>>>(a, geo, partial.data);
  check_launch("tree_attention_kernel");
  merge_splits_kernel<T><<<static_cast<unsigned>(a.num_nodes), kThreads, 0, stream>>>(a, geo.splits, partial.data);
  check_launch("merge_splits_kernel");
}

}  // namespace

void tree_attention_cuda(const TreeAttentionArgs& a, std::uintptr_t stream) {
  if (a.heads / a.kv_heads > kRows || a.head_size > kMaxHeadSize || a.words > kMaxWords)
    throw std::invalid_argument("tree attention on CUDA supports up to " + std::to_string(kRows) +
                                " query heads per kv head, head size " + std::to_string(kMaxHeadSize) +
                                " and trees of " + std::to_string(kMaxWords * 64) + " nodes");
  if (a.num_nodes == 0) return;
  const Geometry geo = geometry_of(a);
  auto* cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case AttentionDtype::kFloat32:
      launch<float>(a, geo, cuda_stream);
      break;
    case AttentionDtype::kFloat16:
      launch<__half>(a, geo, cuda_stream);
      break;
    case AttentionDtype::kBFloat16:
      launch<__nv_bfloat16>(a, geo, cuda_stream);
      break;
  }
}

}  // namespace vrs
