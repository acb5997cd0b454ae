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
  // Lazy target rows and sparse drafts.
  double scalar;
  double histogram[kHistogramBuckets];
  double part[32];
  double below;
  int bucket;
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
    return scan_above(f, 0.0, target);
  }

  // The smallest i with base + cdf[i] > target (canonical cdf), else the last i with f(i) > 0,
  // else -1.
  template <class F>
  __device__ int32_t first_above(const F& f, double base, double target) const {
    total(f);
    return scan_above(f, base, target);
  }

  // first_above once total(f) has left the segment starts in shared memory.
  template <class F>
  __device__ int32_t scan_above(const F& f, double offset, double target) const {
    const int64_t length = segment_length(vocab);
    const int64_t base = warp() * length;
    const double start = sh->segment_start[warp()];
    double run = 0.0;
    for (int64_t k = 0; k < length; k += 32) {
      const int64_t i = base + k + lane();
      const double scan = warp_inclusive_scan(i < vocab ? f(i) : 0.0, lane());
      const unsigned hits =
          __ballot_sync(kFullMask, i < vocab && offset + (start + (run + scan)) > target);
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

  // f() on one thread, its value returned to all.
  template <class F>
  __device__ double single(const F& f) const {
    if (threadIdx.x == 0) sh->scalar = f();
    __syncthreads();
    const double value = sh->scalar;
    __syncthreads();
    return value;
  }

  template <class F>
  __device__ void parallel_for(int64_t n, const F& f) const {
    for (int64_t j = threadIdx.x; j < n; j += kThreads) f(j);
    __syncthreads();
  }

  static constexpr bool kExactTopKGuess = false;  // certified: radix_select is untested on CPUs
  __device__ static LogitKeys row_keys(const float* logits, bool) { return LogitKeys{logits}; }

  // The totals of f and of f with f(index) replaced by value.
  template <class F>
  __device__ void total_pair(const F& f, int64_t index, double value, double* plain,
                             double* replaced) const {
    *plain = total(f);
    *replaced = total(Replaced<F>{f, index, value});
  }

  // The k-th largest key (0 < k < V): ascending, the first element whose running count exceeds
  // V - k (exact: integer counts).
  __device__ uint64_t guess_top_k_key(const LogitKeys& keys, int32_t k) const {
    const uint64_t position = radix_select(keys, Ones{}, static_cast<double>(vocab - k), false);
    return position == kNoPosition ? kNoPosition : position / static_cast<uint64_t>(vocab);
  }

  // CpuOps::guess_position's contract.
  template <class W>
  __device__ uint64_t guess_position(const LogitKeys& keys, const W& w, double target) const {
    return radix_select(keys, w, target, true);
  }

  // Three radix levels (11, 11 and 10 key bits) of shared-memory histograms of w, then the
  // boundary key's elements in index order (with_index; else index 0).
  template <class W>
  __device__ uint64_t radix_select(const LogitKeys& keys, const W& w, double target,
                                   bool with_index) const {
    uint32_t prefix = 0;
    int done = 0;
    double below = 0.0;
    for (int level = 0; level < 3; ++level) {
      const int bits = level < 2 ? 11 : 10;
      const int buckets = 1 << bits;
      for (int j = threadIdx.x; j < buckets; j += kThreads) sh->histogram[j] = 0.0;
      __syncthreads();
      for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
        const uint32_t key = keys(i);
        if (done > 0 && (key >> (32 - done)) != prefix) continue;
        const double weight = w(i);
        if (weight > 0) atomicAdd(&sh->histogram[(key >> (32 - done - bits)) & (buckets - 1)], weight);
      }
      __syncthreads();
      const int bucket = crossing(buckets, &below, target);
      if (bucket < 0) return kNoPosition;
      prefix = (prefix << bits) | static_cast<uint32_t>(bucket);
      done += bits;
    }
    const uint64_t start = static_cast<uint64_t>(prefix) * static_cast<uint64_t>(vocab);
    if (!with_index) return start;
    const int32_t index = first_above(KeyGroup<LogitKeys, W>{keys, prefix, w}, below, target);
    return index < 0 ? kNoPosition : start + static_cast<uint64_t>(index);
  }

  // The first histogram bucket where *below plus the running bucket sum exceeds target (-1:
  // none); *below becomes the sum before it. Lanes of warp 0 sum 1/32 of the buckets each, then
  // lane 0 walks those sums and the buckets from the crossing lane on.
  __device__ int crossing(int buckets, double* below, double target) const {
    const int per_lane = buckets / 32;
    if (warp() == 0) {
      double part = 0.0;
      for (int j = 0; j < per_lane; ++j) part = part + sh->histogram[lane() * per_lane + j];
      sh->part[lane()] = part;
      __syncwarp();
      if (lane() == 0) {
        double acc = *below;
        int l = 0;
        for (; l < 32 && !(acc + sh->part[l] > target); ++l) acc = acc + sh->part[l];
        int found = -1;
        for (int j = l * per_lane; j < buckets && found < 0; ++j) {
          if (acc + sh->histogram[j] > target) found = j; else acc = acc + sh->histogram[j];
        }
        sh->bucket = found;
        sh->below = acc;
      }
    }
    __syncthreads();
    const int bucket = sh->bucket;
    *below = sh->below;
    __syncthreads();
    return bucket;
  }
};

template <class T>
__device__ T* row_of(T* base, int64_t row, int64_t width) {
  return base != nullptr ? base + row * width : nullptr;
}

__global__ void __launch_bounds__(kThreads)
    accept_trees_kernel(TreeBatch batch, TreeWorkspaces work) {
  __shared__ Shared sh;
  BlockOps ops{batch.vocab, &sh};
  const int b = blockIdx.x;
  const int64_t vocab = batch.vocab, width = batch.draft_width;
  const RequestWork request{row_of(work.p, b, vocab), row_of(work.q, b, vocab),
                            row_of(work.row, b, vocab), row_of(work.q_tokens, b, width),
                            row_of(work.q_values, b, width)};
  accept_request(batch, b, ops, request);
}

__global__ void __launch_bounds__(kThreads) target_rows_kernel(TargetRowsArgs args) {
  __shared__ Shared sh;
  BlockOps ops{args.vocab, &sh};
  const int64_t r = blockIdx.x;
  target_row(ops, args.logits + r * args.vocab, args.temperature[r], args.top_k[r],
             args.top_p[r], args.out + r * args.vocab);
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

void accept_trees_cuda(const TreeBatch& batch, int num_requests, const TreeWorkspaces& work,
                       std::uintptr_t stream) {
  if (num_requests == 0) return;
  accept_trees_kernel<<<num_requests, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      batch, work);
  check(cudaGetLastError(), "accept_trees kernel launch");
}

void target_rows_cuda(const TargetRowsArgs& args, std::uintptr_t stream) {
  if (args.rows == 0) return;
  target_rows_kernel<<<args.rows, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(args);
  check(cudaGetLastError(), "target_rows kernel launch");
}

}  // namespace vrs
