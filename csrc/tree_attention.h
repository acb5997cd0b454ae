// Tree attention on a paged KV cache: the draft nodes of branching trees attend to their
// request's whole context and to their ancestors (and themselves), reading keys and values in
// place from vLLM's cache through the block table — no copy of the context.
//
// Node m reads its query from token row node_row[m] of query [tokens, heads * head_size] and
// writes that row of out (rows may be strided: vLLM's query is a view of the fused QKV). It is
// of request r = node_request[m] (a row of block_table) with local index
// j = node_index[m] and context length C = node_context[m] (root included; 0 for a chain that
// starts a prefill) attends to the cache
// positions 0..C-1 and to C + a for every ancestor-or-self a of j (bit a of its ancestor row).
// Those keys are, in order, the node's path from the first token: logical positions 0..C-1+d
// for a node at depth d (its number of ancestors-or-self), the node itself last. A sliding
// window of W keeps the last W of them (keys at logical positions > C-1+d-W, as vLLM's window
// counts from the query's own position); a soft-cap s maps each scaled score x to
// s * tanh(x / s); an attention sink adds exp(sink[h]) to query head h's softmax denominator
// (a key without a value).
// The CPU kernel (tree_attention.cpp) and the CUDA kernel (tree_attention_cuda.cu) compute the
// same online softmax in float32; vllm_retrieval_spec.kernels.attention_reference is the plain
// torch reference both are tested against.
#pragma once

#include <cstdint>

namespace vrs {

// Per (block, kv head) of a layer's cache [num_blocks, kv_heads, block_size, 2 * head_size]:
enum class KVLayoutCode : int {
  kCpuVec = 0,        // keys transposed [head_size, block_size], then values [block_size, head_size]
  kSplitLastDim = 1,  // keys and values side by side on the last dimension
};

enum class AttentionDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct TreeAttentionArgs {
  const void* query;            // [tokens, heads * head_size], rows query_stride apart
  const void* cache;            // [num_blocks, kv_heads, block_size, 2 * head_size]
  void* out;                    // [out_tokens, heads * head_size], rows out_stride apart
  const int64_t* node_row;      // [nodes] token row of each node in query and out
  const int32_t* block_table;   // [table_rows, table_width]
  const int32_t* node_request;  // [nodes] row of block_table
  const int32_t* node_context;  // [nodes] context tokens of the node's request (root included)
  const int32_t* node_index;    // [nodes] local index within its tree
  const uint64_t* ancestors;    // [nodes, words] bit a: local node a is an ancestor or itself
  const float* sinks;           // [heads] sink logit per query head, or nullptr (no sinks)
  int64_t num_nodes;
  int64_t query_rows;
  int64_t query_stride;
  int64_t out_rows;
  int64_t out_stride;
  int64_t num_blocks;
  int64_t table_rows;
  int table_width;
  int words;
  int heads;
  int kv_heads;
  int head_size;
  int block_size;
  KVLayoutCode layout;
  AttentionDtype dtype;
  float scale;
  int window;     // sliding window in keys (the query's own included), 0: none
  float softcap;  // logit soft-cap, 0: none
};

// A step's new keys and values, stored into the cache before its attention reads it.
struct KVWriteArgs {
  const void* keys;      // [tokens, kv_heads * head_size], rows key_stride apart, the cache's dtype
  const void* values;    // [tokens, kv_heads * head_size], rows value_stride apart
  const int64_t* slots;  // [tokens] cache slot (block * block_size + offset), < 0: not stored
  int64_t tokens;
  int64_t key_stride;
  int64_t value_stride;
};

// Stores token t's key and value at cache slot slots[t] in the kCpuVec layout, as vLLM's
// cpu_attn_reshape_and_cache does; throws std::out_of_range, before storing anything, on a slot
// past the cache.
void write_kv_cpu(const TreeAttentionArgs& args, const KVWriteArgs& write);

// Torch's OpenMP team (or the pool) over (tile of a request's nodes, kv head); throws
// std::out_of_range on a block id or position outside the cache or the block table.
void tree_attention_cpu(const TreeAttentionArgs& args, int max_threads);

#ifdef VRS_WITH_CUDA
// One thread block per (node, kv head); positions outside the table or the cache are skipped.
void tree_attention_cuda(const TreeAttentionArgs& args, std::uintptr_t stream);
#endif

}  // namespace vrs
