// CUDA backend of tree attention (tree_attention.h): one thread block per (node, kv head), the
// keys in tiles of kThreads (one per thread), an online softmax per query head in shared
// memory, the output accumulated by (head, dim) pairs spread over the threads. Reads the paged
// cache in place; a position outside the block table or the cache contributes nothing. Keys
// before the node's sliding window are never read, scores are soft-capped and each head's
// softmax starts from its sink, as in the CPU kernel (tree_attention.cpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "tree_attention.h"

namespace vrs {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxGroup = 8;         // query heads per kv head
constexpr int kMaxPairs = 16;        // (head, dim) outputs per thread: group * head_size <= 2048
constexpr int kMaxTreeNodes = 256;   // ancestor rows of at most 4 words
constexpr int kMaxHeadSize = 256;

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

struct SharedState {
  float q[kMaxGroup][kMaxHeadSize];
  float scores[kMaxGroup][kThreads];
  float max[kMaxGroup];
  float sum[kMaxGroup];
  float correction[kMaxGroup];
  long long value_at[kThreads];
  int ancestors[kMaxTreeNodes];
  int num_ancestors;
};

template <typename T>
__global__ void tree_attention_kernel(TreeAttentionArgs a) {
  __shared__ SharedState sh;
  const int node = blockIdx.x, g = blockIdx.y, tid = threadIdx.x;
  const int64_t row = a.node_row[node];
  if (row < 0 || row >= a.query_rows || row >= a.out_rows) return;
  const int group = a.heads / a.kv_heads, hs = a.head_size, bs = a.block_size;
  const T* query = static_cast<const T*>(a.query);
  const T* cache = static_cast<const T*>(a.cache);
  const bool vec = a.layout == KVLayoutCode::kCpuVec;
  const long long key_t = vec ? 1 : 2LL * hs, key_d = vec ? bs : 1;
  const long long value_offset = vec ? static_cast<long long>(bs) * hs : hs;
  const long long value_t = vec ? hs : 2LL * hs;
  for (int i = tid; i < group * hs; i += kThreads) {
    const int h = i / hs, d = i % hs;
    sh.q[h][d] = to_float(query[row * a.query_stride + (g * group + h) * hs + d]) * a.scale;
  }
  if (tid < group) {  // a sink is a key of score sinks[head] and no value
    sh.max[tid] = a.sinks ? a.sinks[g * group + tid] : -INFINITY;
    sh.sum[tid] = a.sinks ? 1.0f : 0.0f;
  }
  if (tid == 0) {
    const int index = a.node_index[node];
    int count = 0;
    for (int j = 0; j <= index && j < kMaxTreeNodes; ++j)
      if ((a.ancestors[static_cast<long long>(node) * a.words + j / 64] >> (j % 64)) & 1ULL)
        sh.ancestors[count++] = j;
    sh.num_ancestors = count;
  }
  __syncthreads();
  const int request = a.node_request[node];
  const bool known_request = request >= 0 && request < a.table_rows;
  const int context = a.node_context[node];
  const int num_keys = known_request ? context + sh.num_ancestors : 0;
  const int first_key = a.window > 0 ? max(0, num_keys - a.window) : 0;  // the node's window
  const int* table = a.block_table + static_cast<long long>(known_request ? request : 0) * a.table_width;
  float acc[kMaxPairs];
  for (int p = 0; p < kMaxPairs; ++p) acc[p] = 0.0f;
  for (int tile = first_key; tile < num_keys; tile += kThreads) {
    const int key = tile + tid;
    bool valid = key < num_keys;
    long long base = 0;
    int in_block = 0;
    if (valid) {
      const int pos = key < context ? key : context + sh.ancestors[key - context];
      const int index = pos / bs;
      const long long block = index < a.table_width ? table[index] : -1;
      valid = block >= 0 && block < a.num_blocks;
      base = ((block * a.kv_heads + g) * bs) * 2LL * hs;
      in_block = pos % bs;
    }
    for (int h = 0; h < group; ++h) {
      float dot = -INFINITY;
      if (valid) {
        const T* k = cache + base + in_block * key_t;
        dot = 0.0f;
        for (int d = 0; d < hs; ++d) dot += sh.q[h][d] * to_float(k[d * key_d]);
        if (a.softcap > 0.0f) dot = a.softcap * tanhf(dot / a.softcap);
      }
      sh.scores[h][tid] = dot;
    }
    sh.value_at[tid] = valid ? base + value_offset + in_block * value_t : -1;
    __syncthreads();
    if (tid < group) {
      float top = sh.max[tid];
      for (int t = 0; t < kThreads; ++t) top = fmaxf(top, sh.scores[tid][t]);
      sh.correction[tid] = top == -INFINITY ? 1.0f : __expf(sh.max[tid] - top);
      sh.max[tid] = top;
    }
    __syncthreads();
    for (int h = 0; h < group; ++h)
      sh.scores[h][tid] = sh.value_at[tid] < 0 ? 0.0f : __expf(sh.scores[h][tid] - sh.max[h]);
    __syncthreads();
    if (tid < group) {
      float total = 0.0f;
      for (int t = 0; t < kThreads; ++t) total += sh.scores[tid][t];
      sh.sum[tid] = sh.sum[tid] * sh.correction[tid] + total;
    }
    for (int p = 0, i = tid; i < group * hs; ++p, i += kThreads) {
      const int h = i / hs, d = i % hs;
      float value = acc[p] * sh.correction[h];
      for (int t = 0; t < kThreads; ++t)
        if (sh.value_at[t] >= 0) value += sh.scores[h][t] * to_float(cache[sh.value_at[t] + d]);
      acc[p] = value;
    }
    __syncthreads();
  }
  T* out = static_cast<T*>(a.out);
  for (int p = 0, i = tid; i < group * hs; ++p, i += kThreads) {
    const int h = i / hs, d = i % hs;
    out[row * a.out_stride + (g * group + h) * hs + d] =
        from_float<T>(sh.sum[h] > 0.0f ? acc[p] / sh.sum[h] : 0.0f);
  }
}

}  // namespace

void tree_attention_cuda(const TreeAttentionArgs& a, std::uintptr_t stream) {
  const int group = a.heads / a.kv_heads;
  if (group > kMaxGroup || a.head_size > kMaxHeadSize || group * a.head_size > kThreads * kMaxPairs ||
      a.words * 64 > kMaxTreeNodes)
    throw std::invalid_argument("tree attention on CUDA supports up to " + std::to_string(kMaxGroup) +
                                " query heads per kv head, head size " + std::to_string(kMaxHeadSize) +
                                " and trees of " + std::to_string(kMaxTreeNodes) + " nodes");
  if (a.num_nodes == 0) return;
  const dim3 grid(static_cast<unsigned>(a.num_nodes), static_cast<unsigned>(a.kv_heads));
  auto* cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case AttentionDtype::kFloat32:
      tree_attention_kernel<float><<<grid, kThreads, 0, cuda_stream>>>(a);
      break;
    case AttentionDtype::kFloat16:
      tree_attention_kernel<__half><<<grid, kThreads, 0, cuda_stream>>>(a);
      break;
    case AttentionDtype::kBFloat16:
      tree_attention_kernel<__nv_bfloat16><<<grid, kThreads, 0, cuda_stream>>>(a);
      break;
  }
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("tree_attention_kernel: ") + cudaGetErrorString(status));
}

}  // namespace vrs
