// CPU backend of tree attention (tree_attention.h): torch's OpenMP team over (tile of up to
// kTileNodes nodes of one request, kv head). A task scores each context block of the cache for
// all of its query rows at once (the block stays in L1; up to 6 rows × 2 chunks of keys, or of
// value dimensions, share each load), folds it into a per-row online softmax, then adds each
// node's ancestors; a row masks the keys before its sliding window (blocks before every
// row's window are skipped), soft-caps its scores and starts its softmax from its sink.
// A tile whose nodes form a chain (node j's ancestors are nodes 0..j: a causal step) folds the
// step's own keys as part of the blocks they lie in, whole chunks of keys at a time, masking
// the keys after each row: a row's result then depends on its position and the cache alone,
// bit for bit, not on how many tokens its step brought. The hot
// function is compiled for AVX-512, AVX2+FMA and baseline x86-64 (picked at load time); where
// the CPU has AVX-512 a build of its own scores keys and sums values 16 lanes at a time (each
// score and each output dimension is still one lane's multiply-adds in order: the same sums, bit
// for bit). This file alone may contract multiply-adds (CMakeLists.txt).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "isa_clones.h"
#include "parallel.h"
#include "tree_attention.h"

namespace vrs {
namespace {

constexpr int kTileNodes = 8;
constexpr int kChunk = 8;  // keys folded together (one AVX2 register of floats): the chain fold's unit
constexpr int kWideLanes = 16;  // keys scored, or value dimensions summed, together on AVX-512
// Multiply-adds worth one more thread of torch's OpenMP team (its threads spin between torch's
// operators, so waking one costs a few µs).
constexpr int64_t kAttentionGrain = int64_t{1} << 18;

struct BFloat16 {
  uint16_t bits;
};

VRS_INLINE float to_float(float x) { return x; }

VRS_INLINE float to_float(BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

VRS_INLINE void store(float* dst, float value) { *dst = value; }

VRS_INLINE void store(BFloat16* dst, float value) {  // round to nearest even, NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  dst->bits = std::isnan(value) ? static_cast<uint16_t>((bits >> 16) | 0x40)
                                : static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// W floats as one GCC vector (kChunk: one AVX2 register, two SSE ones; kWideLanes: one AVX-512
// register).
template <int W>
struct Lanes {
  typedef float Float __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t Int __attribute__((vector_size(W * sizeof(int32_t))));
  typedef uint16_t Bits16 __attribute__((vector_size(W * sizeof(uint16_t))));
};
typedef Lanes<kChunk>::Float VFloat;
typedef Lanes<kChunk>::Int VInt;

template <int W>
VRS_INLINE typename Lanes<W>::Float load_lanes(const float* p) {
  typename Lanes<W>::Float v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int W>
VRS_INLINE typename Lanes<W>::Float load_lanes(const BFloat16* p) {
  typename Lanes<W>::Bits16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  const typename Lanes<W>::Int widened = __builtin_convertvector(bits, typename Lanes<W>::Int) << 16;
  typename Lanes<W>::Float v;
  std::memcpy(&v, &widened, sizeof(v));
  return v;
}

template <int W>
VRS_INLINE void store_lanes(float* p, typename Lanes<W>::Float v) { std::memcpy(p, &v, sizeof(v)); }

template <typename T>
VRS_INLINE VFloat load_chunk(const T* p) { return load_lanes<kChunk>(p); }

VRS_INLINE void store_chunk(float* p, VFloat v) { store_lanes<kChunk>(p, v); }

VRS_INLINE VFloat splat(float x) { return VFloat{} + x; }

// exp(x) for x <= 0 on a chunk: Cephes' single-precision polynomial (within 2 ulp), rounded
// to nearest by the 1.5 * 2^23 trick; 0 below -87 (exp(-inf) of a masked key included).
VRS_INLINE VFloat exp_nonpositive(VFloat x) {
  const auto underflow = x < -87.0f;
  x = underflow ? splat(-87.0f) : x;
  const VFloat k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const VFloat r = x - k * 0.693359375f + k * 2.12194440e-4f;
  VFloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const VFloat y = p * r * r + r + 1.0f;
  const VInt exponent = (__builtin_convertvector(k, VInt) + 127) << 23;
  VFloat scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return underflow ? splat(0.0f) : y * scale;
}

VRS_INLINE float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

// Where a layer's keys and values are: key (t, d) at key[t * key_t + d * key_d], value (t, d)
// at value[t * value_t + d], t counted from the start of a block.
struct Strides {
  int64_t key_t, key_d, value_offset, value_t;

  static Strides of(const TreeAttentionArgs& a) {
    const int64_t d = a.head_size, bs = a.block_size;
    if (a.layout == KVLayoutCode::kCpuVec) return {1, bs, bs * d, d};
    return {2 * d, 1, d, 2 * d};
  }
};

// One task's query rows (node-major, then the kv head's query heads) and softmax state.
struct Workspace {
  std::vector<float> q, acc, max, sum, scores;  // scores: [rows, stride]
  std::vector<int64_t> node_keys, node_values;   // a node's ancestors' offsets in the cache
  std::vector<int> first;  // per row: the first key its window keeps (tree_attention.h)
  std::vector<int> skip;   // per row: keys of the current block before its window
  std::vector<int> stop;   // per row: keys of the current block up to itself (a chain's rows)
  int stride = 0;

  void reset(int rows, int head_size, int block_size, int max_tree_nodes) {
    stride = (std::max(block_size, max_tree_nodes) + kChunk - 1) / kChunk * kChunk;
    q.assign(static_cast<size_t>(rows) * head_size, 0.0f);
    acc.assign(static_cast<size_t>(rows) * head_size, 0.0f);
    max.assign(rows, -std::numeric_limits<float>::infinity());
    sum.assign(rows, 0.0f);
    scores.resize(static_cast<size_t>(rows) * stride);
    first.assign(rows, 0);
    skip.assign(rows, 0);
    stop.assign(rows, 0);
  }
};

// The node's depth: its ancestors-or-self, bits 0..node_index of its ancestor row.
inline int depth_of(const TreeAttentionArgs& a, int64_t node) {
  const int index = a.node_index[node];
  const uint64_t* bits = a.ancestors + node * a.words;
  int depth = 0;
  for (int w = 0; w <= index / 64; ++w) {
    const int last = std::min(63, index - w * 64);
    const uint64_t mask = last == 63 ? ~uint64_t{0} : (uint64_t{2} << last) - 1;
    depth += __builtin_popcountll(bits[w] & mask);
  }
  return depth;
}

// The first of a node's context + depth keys its window keeps (0 without a window).
inline int first_key(const TreeAttentionArgs& a, int context, int depth) {
  return a.window > 0 ? std::max(0, context + depth - a.window) : 0;
}

// scores[0..n) = softcap * tanh(scores / softcap).
inline void cap_scores(float* scores, int n, float softcap) {
  for (int t = 0; t < n; ++t) scores[t] = softcap * std::tanh(scores[t] / softcap);
}

struct Tile {
  int64_t begin, end;  // nodes [begin, end) of one request
};

struct TaskView {
  const TreeAttentionArgs& a;
  Strides st;
  const int32_t* table;  // the request's block table row
  int context;

  // Element offset of the block holding cache position `pos`, kv head `g` (checked beforehand
  // by check_positions: nothing here may throw, exceptions do not cross target_clones).
  VRS_INLINE int64_t block_base(int pos, int g) const {
    const int64_t block = table[pos / a.block_size];
    return ((block * a.kv_heads + g) * a.block_size) * 2 * a.head_size;
  }
};

// Rows handled together by the inner loops: up to kRowBlock accumulators share every key or
// value load and hide the multiply-add latency (a GQA group of 3 rows runs as one block of 3).
constexpr int kRowBlock = 6;

template <int R>
using Rows = std::integral_constant<int, R>;

// fn(Rows<R>{}, r) for blocks of R <= kRowBlock rows from r on, covering [begin, end).
template <typename Fn>
VRS_INLINE void for_row_blocks(int begin, int end, Fn&& fn) {
  int r = begin;
  for (; r + kRowBlock <= end; r += kRowBlock) fn(Rows<kRowBlock>{}, r);
  switch (end - r) {
    case 5: fn(Rows<5>{}, r); break;
    case 4: fn(Rows<4>{}, r); break;
    case 3: fn(Rows<3>{}, r); break;
    case 2: fn(Rows<2>{}, r); break;
    case 1: fn(Rows<1>{}, r); break;
    default: break;
  }
}

// acc[r][d] += sum_t p[r][t] * value(t)[d] for rows [r0, r0 + R) and dimensions
// [d0, d0 + C * W) (C vectors of W dimensions: R * C accumulators share each load).
template <int W, int R, int C, typename T, typename ValueAt>
VRS_INLINE void accumulate_chunks(Workspace& ws, int r0, int d0, int n, int head_size, const T* cache,
                                  ValueAt value_at) {
  const float* p[R];
  float* acc[R];
  typename Lanes<W>::Float sums[R][C];
  for (int i = 0; i < R; ++i) {
    p[i] = ws.scores.data() + static_cast<int64_t>(r0 + i) * ws.stride;
    acc[i] = ws.acc.data() + static_cast<int64_t>(r0 + i) * head_size + d0;
    for (int c = 0; c < C; ++c) sums[i][c] = load_lanes<W>(acc[i] + c * W);
  }
  for (int t = 0; t < n; ++t) {
    const T* v = cache + value_at(t) + d0;
    typename Lanes<W>::Float values[C];
    for (int c = 0; c < C; ++c) values[c] = load_lanes<W>(v + c * W);
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) sums[i][c] += p[i][t] * values[c];
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) store_lanes<W>(acc[i] + c * W, sums[i][c]);
}

// acc[r][d] += sum_t p[r][t] * value(t)[d] for rows [r0, r0 + R), W dimensions a vector (the
// last ones in chunks of kChunk, then one at a time).
template <int W, int R, typename T, typename ValueAt>
VRS_INLINE void accumulate_rows(Workspace& ws, int r0, int n, int head_size, const T* cache,
                                ValueAt value_at) {
  int d0 = 0;
  for (; d0 + 2 * W <= head_size; d0 += 2 * W) accumulate_chunks<W, R, 2>(ws, r0, d0, n, head_size, cache, value_at);
  for (; d0 + W <= head_size; d0 += W) accumulate_chunks<W, R, 1>(ws, r0, d0, n, head_size, cache, value_at);
  for (; d0 + kChunk <= head_size; d0 += kChunk)
    accumulate_chunks<kChunk, R, 1>(ws, r0, d0, n, head_size, cache, value_at);
  for (int t = 0; t < n && d0 < head_size; ++t) {
    const T* v = cache + value_at(t);
    for (int i = 0; i < R; ++i) {
      const float weight = ws.scores[static_cast<int64_t>(r0 + i) * ws.stride + t];
      float* acc = ws.acc.data() + static_cast<int64_t>(r0 + i) * head_size;
      for (int d = d0; d < head_size; ++d) acc[d] += weight * to_float(v[d]);
    }
  }
}

// Folds `n` scored keys into rows [row_begin, row_end): row r sees keys [skip[r], stop[r]) of
// them (skip null: from 0, stop null: to n), soft-capped (softcap > 0), the others weigh
// nothing; scores[r * stride + t] becomes exp(score - new max). Values of the first `n_values`
// keys are read (keys past them are unseen by every row), key t's at cache + value_at(t), W
// dimensions a vector.
template <int W, typename T, typename ValueAt>
VRS_INLINE void fold_keys(Workspace& ws, int row_begin, int row_end, int n, int n_values, int head_size,
                          const T* cache, ValueAt value_at, const int* skip, const int* stop, float softcap) {
  for (int r = row_begin; r < row_end; ++r) {
    float* s = ws.scores.data() + static_cast<int64_t>(r) * ws.stride;
    const int begin = skip ? std::min(skip[r], n) : 0;
    const int end = stop ? std::max(begin, std::min(stop[r], n)) : n;
    if (begin == end) {  // weights 0: the row's state stays as it is
      std::fill(s, s + n, 0.0f);
      continue;
    }
    std::fill(s, s + begin, -std::numeric_limits<float>::infinity());
    std::fill(s + end, s + n, -std::numeric_limits<float>::infinity());
    if (softcap > 0.0f) cap_scores(s + begin, end - begin, softcap);
    const int full = n - n % kChunk;
    VFloat tops = splat(ws.max[r]);
    for (int t = 0; t < full; t += kChunk) {
      const VFloat chunk = load_chunk(s + t);
      tops = chunk > tops ? chunk : tops;
    }
    float top = ws.max[r];
    for (int i = 0; i < kChunk; ++i) top = std::max(top, tops[i]);
    for (int t = full; t < n; ++t) top = std::max(top, s[t]);
    const float correction = exp_nonpositive(ws.max[r] - top);
    VFloat totals = {};
    for (int t = 0; t < full; t += kChunk) {
      const VFloat e = exp_nonpositive(load_chunk(s + t) - top);
      store_chunk(s + t, e);
      totals += e;
    }
    float total = 0.0f;
    for (int i = 0; i < kChunk; ++i) total += totals[i];
    for (int t = full; t < n; ++t) {
      s[t] = exp_nonpositive(s[t] - top);
      total += s[t];
    }
    ws.max[r] = top;
    ws.sum[r] = ws.sum[r] * correction + total;
    float* acc = ws.acc.data() + static_cast<int64_t>(r) * head_size;
    for (int d = 0; d < head_size; ++d) acc[d] *= correction;
  }
  for_row_blocks(row_begin, row_end, [&](auto block, int r) VRS_LAMBDA_INLINE {
    accumulate_rows<W, decltype(block)::value>(ws, r, n_values, head_size, cache, value_at);
  });
}

// The next context block's keys and values asked into the L2 cache a few lines at a time, spread
// over the current block's scoring loop (its first rows), so that they arrive while it computes:
// the hardware prefetchers stop at every 4 KiB page, and a (block, kv head) spans 16 of them.
// Issuing a whole block's lines at once stalls on the full miss buffers instead.
struct Prefetch {
  const char* next = nullptr;  // this stretch of the next block, or null: nothing to ask for
  int64_t bytes_per_step = 0;  // a multiple of the cache line

  VRS_INLINE void step(int d) const {
    if (next == nullptr) return;
    for (int64_t offset = 0; offset < bytes_per_step; offset += 64)
      __builtin_prefetch(next + d * bytes_per_step + offset, 0, 2);
  }
};

// Scores of rows [r0, r0 + R) for keys t0..t0 + C * W - 1 of a block, key t0 + j's dimension d
// at keys[d * key_d + j] (C vectors of W keys: R * C accumulators share each load).
template <int W, int R, int C, typename T>
VRS_INLINE void score_chunks(Workspace& ws, int r0, int t0, int head_size, const T* keys,
                             int64_t key_d, const Prefetch& ahead) {
  typename Lanes<W>::Float sums[R][C] = {};
  const float* q[R];
  for (int i = 0; i < R; ++i) q[i] = ws.q.data() + static_cast<int64_t>(r0 + i) * head_size;
  for (int d = 0; d < head_size; ++d) {
    ahead.step(d);
    typename Lanes<W>::Float k[C];
    for (int c = 0; c < C; ++c) k[c] = load_lanes<W>(keys + d * key_d + c * W);
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) sums[i][c] += q[i][d] * k[c];
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c)
      store_lanes<W>(ws.scores.data() + static_cast<int64_t>(r0 + i) * ws.stride + t0 + c * W, sums[i][c]);
}

// Scores of every row of the task for keys [t0, t0 + C * W) of a block while t0 + C * W <= end
// (t0 advanced past them), the first row block asking `next` (a stretch of the next block per
// key range, `per_step` bytes a dimension) into the cache as it goes.
template <int W, int C, typename T>
VRS_INLINE void score_ranges(Workspace& ws, int rows, int& t0, int end, int head_size, const T* keys,
                             int64_t key_d, const char* next, int64_t per_step) {
  const Prefetch none;
  for (; t0 + C * W <= end; t0 += C * W) {
    const Prefetch ahead{next ? next + t0 / (C * W) * head_size * per_step : nullptr, per_step};
    for_row_blocks(0, rows, [&](auto block, int r) VRS_LAMBDA_INLINE {
      score_chunks<W, decltype(block)::value, C>(ws, r, t0, head_size, keys + t0, key_d, r == 0 ? ahead : none);
    });
  }
}

// Scores of the first n keys of one context block (key (t, d) at keys[t * key_t + d * key_d])
// for every row of the task, W keys a vector (the last in chunks of kChunk), prefetching the
// next block's keys and values from `next` on (null: no next block).
template <int W, typename T>
VRS_INLINE void score_block(Workspace& ws, int rows, int n, int head_size, int block_size,
                            const T* keys, const Strides& st, const T* next) {
  const int64_t stride = ws.stride;
  float* scores = ws.scores.data();
  const float* q = ws.q.data();
  int t0 = 0;
  if (st.key_t == 1) {  // keys transposed: vectorize over keys, whole chunks within the block
    const int full = std::min(n, block_size - block_size % kChunk);
    const int64_t steps = static_cast<int64_t>(full / (2 * W)) * head_size;
    const int64_t next_bytes = int64_t{2} * block_size * head_size * static_cast<int64_t>(sizeof(T));
    const int64_t per_step = steps > 0 ? (next_bytes / steps + 63) / 64 * 64 : 0;
    score_ranges<W, 2>(ws, rows, t0, full, head_size, keys, st.key_d, reinterpret_cast<const char*>(next), per_step);
    score_ranges<W, 1>(ws, rows, t0, full, head_size, keys, st.key_d, nullptr, 0);
    // The last chunk whole (its keys past n lie in the block, their scores unread).
    score_ranges<kChunk, 1>(ws, rows, t0, (full + kChunk - 1) / kChunk * kChunk, head_size, keys, st.key_d,
                            nullptr, 0);
  }
  for (int t = t0; t < n; ++t) {  // the rest, and keys stored as rows
    const T* k = keys + t * st.key_t;
    for (int r = 0; r < rows; ++r) {
      const float* qr = q + static_cast<int64_t>(r) * head_size;
      float dot = 0.0f;
      for (int d = 0; d < head_size; ++d) dot += qr[d] * to_float(k[d * st.key_d]);
      scores[r * stride + t] = dot;
    }
  }
}

// Whether the tile's nodes form a chain: each one's ancestors-or-self are nodes 0..its index,
// so that its keys are the cache positions 0..context + index (a causal step).
inline bool is_chain(const TreeAttentionArgs& a, const Tile& tile) {
  for (int64_t node = tile.begin; node < tile.end; ++node) {
    const int index = a.node_index[node];
    const uint64_t* bits = a.ancestors + node * a.words;
    for (int w = 0; w < a.words; ++w) {
      const int last = index - w * 64;  // the last ancestor bit of this word
      const uint64_t expected = last < 0 ? 0 : last >= 63 ? ~uint64_t{0} : (uint64_t{2} << last) - 1;
      if (bits[w] != expected) return false;
    }
  }
  return true;
}

template <int W, typename T>
VRS_INLINE void attend_tile(const TreeAttentionArgs& a, const Tile& tile, int g, Workspace& ws) {
  const int group = a.heads / a.kv_heads, hs = a.head_size, bs = a.block_size;
  const int rows = static_cast<int>(tile.end - tile.begin) * group;
  const T* query = static_cast<const T*>(a.query);
  const T* cache = static_cast<const T*>(a.cache);
  ws.reset(rows, hs, bs, a.words * 64);
  const int64_t request = a.node_request[tile.begin];
  const TaskView view{a, Strides::of(a), a.block_table + request * a.table_width,
                      a.node_context[tile.begin]};
  // A chain folds its step's keys with the blocks (whole chunks: see the file's comment).
  const bool chain = bs % kChunk == 0 && is_chain(a, tile);
  int window_start = view.context;  // the first context key any row of the tile keeps
  int keys_end = view.context;      // the keys the blocks hold for the tile's rows
  for (int r = 0; r < rows; ++r) {
    const int64_t node = tile.begin + r / group, head = g * group + r % group;
    const T* src = query + a.node_row[node] * a.query_stride + head * hs;
    for (int d = 0; d < hs; ++d) ws.q[static_cast<size_t>(r) * hs + d] = to_float(src[d]) * a.scale;
    ws.first[r] = first_key(a, view.context, depth_of(a, node));
    window_start = std::min(window_start, ws.first[r]);
    if (chain) keys_end = std::max(keys_end, view.context + a.node_index[node] + 1);
    if (a.sinks) {  // the sink: a key of score sinks[head] and no value
      ws.max[r] = a.sinks[head];
      ws.sum[r] = 1.0f;
    }
  }
  const Strides& st = view.st;
  for (int start = window_start - window_start % bs; start < keys_end; start += bs) {
    const int64_t base = view.block_base(start, g);
    const int n_values = std::min(bs, keys_end - start);
    const int n = chain ? std::min(bs, (n_values + kChunk - 1) / kChunk * kChunk) : n_values;
    for (int r = 0; r < rows; ++r) {
      ws.skip[r] = std::max(0, ws.first[r] - start);
      if (chain) ws.stop[r] = view.context + a.node_index[tile.begin + r / group] + 1 - start;
    }
    const T* next = start + bs < keys_end ? cache + view.block_base(start + bs, g) : nullptr;
    score_block<W>(ws, rows, n, hs, bs, cache + base, st, next);
    fold_keys<W>(ws, 0, rows, n, n_values, hs, cache,
                 [&](int t) VRS_LAMBDA_INLINE { return base + st.value_offset + t * st.value_t; },
                 a.window > 0 ? ws.skip.data() : nullptr, chain ? ws.stop.data() : nullptr, a.softcap);
  }
  for (int64_t node = tile.begin; node < tile.end && !chain; ++node) {  // ancestors and the node itself
    const int index = a.node_index[node];
    const uint64_t* bits = a.ancestors + node * a.words;
    const int first = static_cast<int>(node - tile.begin) * group;
    int key = view.context;  // the ancestor's key number (tree_attention.h)
    ws.node_keys.clear();
    ws.node_values.clear();
    for (int j = 0; j <= index; ++j) {
      if (!((bits[j / 64] >> (j % 64)) & 1)) continue;
      if (key++ < ws.first[first]) continue;  // before the node's window
      const int pos = view.context + j;
      const int64_t base = view.block_base(pos, g), in_block = pos % bs;
      ws.node_keys.push_back(base + in_block * st.key_t);
      ws.node_values.push_back(base + st.value_offset + in_block * st.value_t);
    }
    const int n = static_cast<int>(ws.node_keys.size());
    for (int r = first; r < first + group; ++r) {
      const float* qr = ws.q.data() + static_cast<int64_t>(r) * hs;
      for (int t = 0; t < n; ++t) {
        const T* k = cache + ws.node_keys[t];
        float dot = 0.0f;
        for (int d = 0; d < hs; ++d) dot += qr[d] * to_float(k[d * st.key_d]);
        ws.scores[static_cast<int64_t>(r) * ws.stride + t] = dot;
      }
    }
    fold_keys<W>(ws, first, first + group, n, n, hs, cache,
                 [&](int t) VRS_LAMBDA_INLINE { return ws.node_values[t]; }, nullptr, nullptr, a.softcap);
  }
  T* out = static_cast<T*>(a.out);
  for (int r = 0; r < rows; ++r) {
    const int64_t node = tile.begin + r / group, head = g * group + r % group;
    const float inverse = 1.0f / ws.sum[r];
    const float* acc = ws.acc.data() + static_cast<int64_t>(r) * hs;
    T* row = out + a.node_row[node] * a.out_stride + head * hs;
    for (int d = 0; d < hs; ++d) store(row + d, acc[d] * inverse);
  }
}

VRS_ISA_CLONES void attend_tile_float32(const TreeAttentionArgs& a, const Tile& tile, int g,
                                        Workspace& ws) {
  attend_tile<kChunk, float>(a, tile, g, ws);
}

VRS_ISA_CLONES void attend_tile_bfloat16(const TreeAttentionArgs& a, const Tile& tile, int g,
                                         Workspace& ws) {
  attend_tile<kChunk, BFloat16>(a, tile, g, ws);
}

#if VRS_HAS_WIDE
VRS_WIDE void attend_tile_wide(const TreeAttentionArgs& a, const Tile& tile, int g, Workspace& ws) {
  if (a.dtype == AttentionDtype::kFloat32) attend_tile<kWideLanes, float>(a, tile, g, ws);
  else attend_tile<kWideLanes, BFloat16>(a, tile, g, ws);
}
#else
void attend_tile_wide(const TreeAttentionArgs&, const Tile&, int, Workspace&) {}
#endif

// One tile's kv head on the widest vectors the CPU has.
void attend_tile_any(const TreeAttentionArgs& a, const Tile& tile, int g, Workspace& ws) {
  if (has_wide_lanes()) attend_tile_wide(a, tile, g, ws);
  else if (a.dtype == AttentionDtype::kFloat32) attend_tile_float32(a, tile, g, ws);
  else attend_tile_bfloat16(a, tile, g, ws);
}

// Runs of up to kTileNodes consecutive nodes of the same request.
std::vector<Tile> tiles_of(const TreeAttentionArgs& a) {
  std::vector<Tile> tiles;
  for (int64_t begin = 0; begin < a.num_nodes;) {
    int64_t end = begin + 1;
    while (end < a.num_nodes && end - begin < kTileNodes &&
           a.node_request[end] == a.node_request[begin] &&
           a.node_context[end] == a.node_context[begin])
      ++end;
    tiles.push_back({begin, end});
    begin = end;
  }
  return tiles;
}

// Every position a tile's nodes read lies in its block table row, on a block of the cache.
void check_positions(const TreeAttentionArgs& a, const std::vector<Tile>& tiles) {
  for (const Tile& tile : tiles) {
    int64_t last = 0;
    for (int64_t m = tile.begin; m < tile.end; ++m)
      last = std::max<int64_t>(last, static_cast<int64_t>(a.node_context[m]) + a.node_index[m]);
    if (last / a.block_size >= a.table_width)
      throw std::out_of_range("tree attention: position " + std::to_string(last) +
                              " is past the block table's " + std::to_string(a.table_width) +
                              " blocks");
    const int32_t* table = a.block_table + static_cast<int64_t>(a.node_request[tile.begin]) * a.table_width;
    for (int64_t index = 0; index <= last / a.block_size; ++index)
      if (table[index] < 0 || table[index] >= a.num_blocks)
        throw std::out_of_range("tree attention: block table holds block " +
                                std::to_string(table[index]) + ", outside the cache's " +
                                std::to_string(a.num_blocks) + " blocks");
  }
}

template <typename T>
void write_kv(const TreeAttentionArgs& a, const KVWriteArgs& w) {
  const int hs = a.head_size, bs = a.block_size;
  const T* keys = static_cast<const T*>(w.keys);
  const T* values = static_cast<const T*>(w.values);
  T* cache = static_cast<T*>(const_cast<void*>(a.cache));
  for (int64_t t = 0; t < w.tokens; ++t) {
    if (w.slots[t] < 0) continue;
    const int64_t block = w.slots[t] / bs, offset = w.slots[t] % bs;
    for (int h = 0; h < a.kv_heads; ++h) {
      T* base = cache + (block * a.kv_heads + h) * bs * 2 * hs;
      const T* key = keys + t * w.key_stride + h * hs;
      const T* value = values + t * w.value_stride + h * hs;
      for (int d = 0; d < hs; ++d) base[d * bs + offset] = key[d];  // keys transposed
      std::memcpy(base + static_cast<int64_t>(hs) * bs + offset * hs, value, sizeof(T) * hs);
    }
  }
}

}  // namespace

void write_kv_cpu(const TreeAttentionArgs& a, const KVWriteArgs& w) {
  if (a.layout != KVLayoutCode::kCpuVec)
    throw std::invalid_argument(
        "tree attention stores keys and values in the CPU_VEC layout only");
  for (int64_t t = 0; t < w.tokens; ++t)
    if (w.slots[t] >= a.num_blocks * a.block_size)
      throw std::out_of_range("tree attention: slot " + std::to_string(w.slots[t]) +
                              " is past the cache's " +
                              std::to_string(a.num_blocks * a.block_size) + " slots");
  if (a.dtype == AttentionDtype::kFloat32) write_kv<float>(a, w);
  else if (a.dtype == AttentionDtype::kBFloat16) write_kv<BFloat16>(a, w);
  else throw std::invalid_argument("tree attention on the CPU takes float32 or bfloat16");
}

void tree_attention_cpu(const TreeAttentionArgs& a, int max_threads) {
  if (a.dtype == AttentionDtype::kFloat16)
    throw std::invalid_argument("tree attention on the CPU takes float32 or bfloat16, not float16");
  const std::vector<Tile> tiles = tiles_of(a);
  check_positions(a, tiles);
  int64_t work = 0;
  for (int64_t m = 0; m < a.num_nodes; ++m) work += a.node_context[m] + a.node_index[m] + 1;
  work *= static_cast<int64_t>(a.heads) * a.head_size * 2;
  const ThreadPlan plan{max_threads, work, kAttentionGrain};
  const int64_t tasks = static_cast<int64_t>(tiles.size()) * a.kv_heads;
  team_parallel_for(tasks, plan, [&](int64_t task) {
    thread_local Workspace ws;
    attend_tile_any(a, tiles[task / a.kv_heads], static_cast<int>(task % a.kv_heads), ws);
  });
}

}  // namespace vrs
