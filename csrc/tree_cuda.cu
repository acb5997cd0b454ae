// CUDA backend of the tree kernels: packing with one thread per node, verification with one
// block per request running the shared walk (tree_accept.h) on block-wide collectives that
// compute the same canonical sums as the CPU, bit for bit.
#include <cuda_runtime.h>

#include <climits>
#include <stdexcept>
#include <string>

#include "tree_accept.h"
#include "tree_cuda.h"
#include "tree_pack.h"

namespace vrs {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // tiles loaded per warp before they are summed
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kWarps == kSegments, "one canonical segment per warp");
static_assert(kTileWidth == 32, "one canonical tile per warp access");

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

__global__ void pack_tree_kernel(const int32_t* parents, const int32_t* offsets, int num_nodes,
                                 int num_trees, int32_t* depth, uint64_t* mask, int words) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= num_nodes) return;
  int tree = 0, end = num_trees;  // the last tree starting at or before i
  while (end - tree > 1) {
    const int mid = (tree + end) / 2;
    if (offsets[mid] <= i) tree = mid; else end = mid;
  }
  const int begin = offsets[tree];
  uint64_t* row = mask != nullptr ? mask + static_cast<int64_t>(i) * words : nullptr;
  depth[i] = pack_node(parents + begin, i - begin, row, words);
}

// The pairwise tree sum of the warp's 32 values, in every lane (xor pairs add the same operands).
__device__ double warp_tree_sum(double v) {
  for (int d = 1; d < 32; d *= 2) v = v + __shfl_xor_sync(kFullMask, v, d);
  return v;
}

__device__ double warp_inclusive_scan(double v, int lane) {
  for (int d = 1; d < 32; d *= 2) {
    const double other = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v = v + other;
  }
  return v;
}

__device__ bool better(float value, int index, float best, int best_index) {
  return value > best || (value == best && index < best_index);
}

struct Shared {
  double segment_sum[kSegments];
  double segment_start[kSegments];
  double total;
  float best_value[kWarps];
  int best_index[kWarps];
  int index;
};

// Block-wide collectives for accept_request; every thread of the block calls each of them.
struct BlockOps {
  int64_t vocab;
  Shared* sh;

  __device__ static int lane() { return threadIdx.x & 31; }
  __device__ static int warp() { return threadIdx.x >> 5; }
  __device__ static void barrier() { __syncthreads(); }
  template <class T>
  __device__ static void write(T* ptr, T value) {
    if (threadIdx.x == 0) *ptr = value;
  }

  __device__ int32_t argmax(const float* row) const {
    float best = -INFINITY;
    int index = INT_MAX;
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads)
      if (better(row[i], static_cast<int>(i), best, index)) {
        best = row[i];
        index = static_cast<int>(i);
      }
    reduce_best(best, index);
    if (lane() == 0) sh->best_value[warp()] = best, sh->best_index[warp()] = index;
    __syncthreads();
    if (warp() == 0) {
      best = sh->best_value[lane()];
      index = sh->best_index[lane()];
      reduce_best(best, index);
      if (lane() == 0) sh->index = index == INT_MAX ? -1 : index;
    }
    __syncthreads();
    return sh->index;
  }

  __device__ static void reduce_best(float& best, int& index) {
    for (int d = 16; d > 0; d /= 2) {
      const float other = __shfl_down_sync(kFullMask, best, d);
      const int other_index = __shfl_down_sync(kFullMask, index, d);
      if (better(other, other_index, best, index)) best = other, index = other_index;
    }
  }

  template <class T, class F>
  __device__ void store(T* dst, const F& f) const {
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) dst[i] = static_cast<T>(f(i));
    __syncthreads();
  }

  // Canonical total of f; leaves the segment starts in shared memory and resets sh->index.
  template <class F>
  __device__ double total(const F& f) const {
    const int64_t length = segment_length(vocab);
    const int64_t base = warp() * length;
    double run = 0.0;
    for (int64_t k = 0; k < length; k += kUnroll * 32) {
      double v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = base + k + 32 * j + lane();
        v[j] = k + 32 * j < length && i < vocab ? f(i) : 0.0;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j)
        if (k + 32 * j < length) run = run + warp_tree_sum(v[j]);
    }
    if (lane() == 0) sh->segment_sum[warp()] = run;
    __syncthreads();
    if (warp() == 0) {
      const double sum = sh->segment_sum[lane()];
      double start = __shfl_up_sync(kFullMask, warp_inclusive_scan(sum, lane()), 1);
      if (lane() == 0) start = 0.0, sh->index = INT_MAX;
      sh->segment_start[lane()] = start;
      if (lane() == 31) sh->total = start + sum;
    }
    __syncthreads();
    return sh->total;
  }

  template <class F>
  __device__ int32_t sample(const F& f, double u) const {
    const double target = u * total(f);
    const int64_t length = segment_length(vocab);
    const int64_t base = warp() * length;
    const double start = sh->segment_start[warp()];
    double run = 0.0;
    for (int64_t k = 0; k < length; k += 32) {
      const int64_t i = base + k + lane();
      const double scan = warp_inclusive_scan(i < vocab ? f(i) : 0.0, lane());
      const unsigned hits = __ballot_sync(kFullMask, i < vocab && start + (run + scan) > target);
      if (hits != 0) {
        if (lane() == 0) atomicMin(&sh->index, static_cast<int>(base + k + __ffs(hits) - 1));
        break;
      }
      run = run + __shfl_sync(kFullMask, scan, 31);
    }
    __syncthreads();
    const int index = sh->index;
    return index == INT_MAX ? last_positive(f) : index;
  }

  template <class F>
  __device__ int32_t last_positive(const F& f) const {
    int index = -1;
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads)
      if (f(i) > 0) index = static_cast<int>(i);
    for (int d = 16; d > 0; d /= 2) index = max(index, __shfl_down_sync(kFullMask, index, d));
    if (lane() == 0) sh->best_index[warp()] = index;
    __syncthreads();
    if (warp() == 0) {
      index = sh->best_index[lane()];
      for (int d = 16; d > 0; d /= 2) index = max(index, __shfl_down_sync(kFullMask, index, d));
      if (lane() == 0) sh->index = index;
    }
    __syncthreads();
    return sh->index;
  }
};

__global__ void __launch_bounds__(kThreads)
    accept_trees_kernel(TreeBatch batch, double* p_work, float* q_work) {
  __shared__ Shared sh;
  BlockOps ops{batch.vocab, &sh};
  const int b = blockIdx.x;
  const int64_t row = static_cast<int64_t>(b) * batch.vocab;
  accept_request(batch, b, ops, p_work != nullptr ? p_work + row : nullptr,
                 q_work != nullptr ? q_work + row : nullptr);
}

}  // namespace

void pack_tree_masks_cuda(const PackTreeCudaArgs& args) {
  if (args.num_nodes == 0) return;
  constexpr int kPackThreads = 256;
  const int blocks = (args.num_nodes + kPackThreads - 1) / kPackThreads;
  pack_tree_kernel<<<blocks, kPackThreads, 0, reinterpret_cast<cudaStream_t>(args.stream)>>>(
      args.parents, args.offsets, args.num_nodes, args.num_trees, args.depth, args.mask,
      args.words);
  check(cudaGetLastError(), "pack_tree_masks kernel launch");
}

void accept_trees_cuda(const TreeBatch& batch, int num_requests, double* p_work, float* q_work,
                       std::uintptr_t stream) {
  if (num_requests == 0) return;
  accept_trees_kernel<<<num_requests, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      batch, p_work, q_work);
  check(cudaGetLastError(), "accept_trees kernel launch");
}

}  // namespace vrs
