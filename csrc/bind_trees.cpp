// Bindings of the tree kernels: packing (tree_pack.h) and verification (tree_accept.h), on CPU
// threads or CUDA.
#include <nanobind/stl/optional.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "parallel.h"
#include "tree_accept.h"
#include "tree_attention.h"
#include "tree_pack.h"
#include "tree_tiles.h"
#ifdef VRS_WITH_CUDA
#include "tree_cuda.h"
#endif

namespace vrs_bind {
namespace {

using Cpu = nb::device::cpu;
#ifdef VRS_WITH_CUDA
using Cuda = nb::device::cuda;
#endif

template <typename Device>
using FloatMatrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, Device>;
template <typename Device>
using FloatVector = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, Device>;
template <typename Device>
using DoubleMatrix = nb::ndarray<double, nb::ndim<2>, nb::c_contig, Device>;
template <typename Device>
using SeedVector = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, Device>;
template <typename Device>
using PositionVector = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, Device>;
template <typename Device>
using MaskMatrix = nb::ndarray<uint64_t, nb::ndim<2>, nb::c_contig, Device>;

// Values scanned worth one thread (about what waking one costs many times over).
constexpr int64_t kTreeGrain = int64_t{1} << 18;
// Passes over a row that a lazy target row costs (keys, selections, exp, sums; about).
constexpr int64_t kTargetRowPasses = 16;

// Number of trees; offsets must have B + 1 entries.
template <typename Device>
int check_offsets_shape(const ConstVector<Device>& offsets) {
  if (offsets.shape(0) < 1) throw std::invalid_argument("offsets must have B + 1 >= 1 entries");
  return static_cast<int>(offsets.shape(0) - 1);
}

// Host offsets must start at 0, never decrease and end at num_nodes (memory safety of the walk).
void check_offsets_values(const ConstVector<Cpu>& offsets, int64_t num_nodes) {
  const size_t trees = offsets.shape(0) - 1;
  bool ok = offsets(0) == 0 && offsets(trees) == num_nodes;
  for (size_t b = 0; ok && b < trees; ++b) ok = offsets(b) <= offsets(b + 1);
  if (!ok)
    throw std::invalid_argument("offsets must start at 0, never decrease and end at " +
                                std::to_string(num_nodes) + " (the number of nodes)");
}

template <typename Device>
int check_pack_args(const ConstVector<Device>& parents, const ConstVector<Device>& offsets,
                    const Output<Device, 1>& depth, const std::optional<MaskMatrix<Device>>& mask) {
  check_offsets_shape(offsets);
  if (depth.shape(0) != parents.shape(0))
    throw std::invalid_argument("depth must have one entry per node");
  if (mask && (mask->shape(0) != parents.shape(0) || mask->shape(1) < 1))
    throw std::invalid_argument("ancestor_mask must have shape [nodes, words >= 1]");
  return mask ? static_cast<int>(mask->shape(1)) : 0;
}

int pack_tree_masks_cpu(ConstVector<Cpu> parents, ConstVector<Cpu> offsets,
                        Output<Cpu, 1> depth,
                        std::optional<MaskMatrix<Cpu>> mask, int num_threads) {
  const int words = check_pack_args(parents, offsets, depth, mask);
  check_offsets_values(offsets, static_cast<int64_t>(parents.shape(0)));
  const int trees = check_offsets_shape(offsets);
  const int32_t* parent_data = parents.data();
  const int32_t* offset_data = offsets.data();
  int32_t* depth_data = depth.data();
  uint64_t* mask_data = mask ? mask->data() : nullptr;
  nb::gil_scoped_release release;
  const vrs::ThreadPlan plan{num_threads, static_cast<int64_t>(parents.shape(0)) * 64, kTreeGrain};
  vrs::parallel_for(trees, plan, [&](int64_t b) {
    const int32_t begin = offset_data[b];
    for (int32_t i = begin; i < offset_data[b + 1]; ++i) {
      uint64_t* row = mask_data != nullptr ? mask_data + static_cast<int64_t>(i) * words : nullptr;
      depth_data[i] = vrs::pack_node(parent_data + begin, i - begin, row, words);
    }
  });
  return trees;
}

// Per-row sampling parameters of the lazy target rows: all three or none.
template <typename Device>
struct SamplingArgs {
  std::optional<FloatVector<Device>> temperature;
  std::optional<ConstVector<Device>> top_k;
  std::optional<FloatVector<Device>> top_p;

  // Whether they are given, checking that each has `rows` entries.
  bool given(size_t rows) const {
    if (!temperature && !top_k && !top_p) return false;
    if (!temperature || !top_k || !top_p)
      throw std::invalid_argument("temperature, top_k and top_p must be given together");
    if (temperature->shape(0) != rows || top_k->shape(0) != rows || top_p->shape(0) != rows)
      throw std::invalid_argument("temperature, top_k and top_p must have " +
                                  std::to_string(rows) + " entries (one per request)");
    return true;
  }
};

// Sparse draft rows: tokens (-1 padded) and their probabilities, both [N + B, M].
template <typename Device>
struct SparseDraftArgs {
  std::optional<TokenMatrix<Device>> tokens;
  std::optional<FloatMatrix<Device>> probs;
};

template <typename Device>
struct TreeAcceptArgs {
  FloatMatrix<Device> scores;
  std::optional<FloatMatrix<Device>> draft_probs;
  ConstVector<Device> tokens, parents, offsets, rules;
  SeedVector<Device> seeds;
  Output<Device, 2> out_tokens, path_nodes;
  Output<Device, 1> num_accepted;
  SamplingArgs<Device> sampling;
  SparseDraftArgs<Device> draft;
  std::optional<PositionVector<Device>> positions;  // [B]: the keyed rule's root positions

  // Checks the shapes; returns the batch view the kernels read.
  vrs::TreeBatch batch() const {
    const size_t trees = check_offsets_shape(offsets);
    const size_t nodes = parents.shape(0);
    if (tokens.shape(0) != nodes) throw std::invalid_argument("tokens and parents must have N entries");
    if (scores.shape(0) != nodes + trees)
      throw std::invalid_argument("scores must have N + B = " + std::to_string(nodes + trees) +
                                  " rows, got " + std::to_string(scores.shape(0)));
    if (scores.shape(1) < 1) throw std::invalid_argument("scores must have a vocabulary axis >= 1");
    if (draft_probs && (draft_probs->shape(0) != scores.shape(0) ||
                        draft_probs->shape(1) != scores.shape(1)))
      throw std::invalid_argument("draft_probs must have the shape of scores");
    if (rules.shape(0) != trees || seeds.shape(0) != trees || num_accepted.shape(0) != trees)
      throw std::invalid_argument("rules, seeds and num_accepted must have B entries");
    if (out_tokens.shape(0) != trees || out_tokens.shape(1) < 1 ||
        path_nodes.shape(0) != trees || path_nodes.shape(1) != out_tokens.shape(1) - 1)
      throw std::invalid_argument("out_tokens must be [B, width >= 1] and path_nodes [B, width - 1]");
    vrs::TreeBatch batch{scores.data(),    draft_probs ? draft_probs->data() : nullptr,
                         static_cast<int64_t>(scores.shape(1)),
                         tokens.data(),    parents.data(),
                         offsets.data(),   rules.data(),
                         seeds.data(),     static_cast<int>(out_tokens.shape(1)),
                         out_tokens.data(), path_nodes.data(),
                         num_accepted.data()};
    if (sampling.given(trees)) {
      batch.temperature = sampling.temperature->data();
      batch.top_k = sampling.top_k->data();
      batch.top_p = sampling.top_p->data();
    }
    if (positions) {
      if (positions->shape(0) != trees)
        throw std::invalid_argument("positions must have B = " + std::to_string(trees) +
                                    " entries (one per request)");
      batch.positions = positions->data();
    }
    if (draft.tokens.has_value() != draft.probs.has_value())
      throw std::invalid_argument("draft_tokens and draft_values must be given together");
    if (draft.tokens) {
      if (draft_probs)
        throw std::invalid_argument("pass draft_probs (dense) or draft_tokens and draft_values "
                                    "(sparse), not both");
      if (draft.tokens->shape(0) != scores.shape(0) || draft.probs->shape(0) != scores.shape(0) ||
          draft.tokens->shape(1) != draft.probs->shape(1))
        throw std::invalid_argument("draft_tokens and draft_values must both be [N + B, M] = [" +
                                    std::to_string(scores.shape(0)) + ", M]");
      batch.draft_tokens = draft.tokens->data();
      batch.draft_values = draft.probs->data();
      batch.draft_width = static_cast<int32_t>(draft.tokens->shape(1));
    }
    return batch;
  }
};

int accept_trees_cpu(const TreeAcceptArgs<Cpu>& args, int num_threads) {
  const vrs::TreeBatch batch = args.batch();
  check_offsets_values(args.offsets, static_cast<int64_t>(args.parents.shape(0)));
  const int trees = check_offsets_shape(args.offsets);
  const bool needs_q = batch.draft_probs != nullptr;
  const bool sparse = batch.draft_tokens != nullptr;
  const bool needs_row = batch.temperature != nullptr || sparse;
  nb::gil_scoped_release release;
  const int64_t passes = batch.temperature != nullptr ? kTargetRowPasses : 1;
  const vrs::ThreadPlan plan{num_threads, trees * batch.vocab * passes, kTreeGrain};
  vrs::parallel_for(trees, plan, [&](int64_t b) {
    thread_local std::vector<double> p_work, row_work;
    thread_local std::vector<float> q_work, q_values;
    thread_local std::vector<int32_t> q_tokens;
    p_work.resize(batch.vocab);
    if (needs_q) q_work.resize(batch.vocab);
    if (needs_row) row_work.resize(batch.vocab);
    if (sparse) {
      q_tokens.resize(std::max<int32_t>(1, batch.draft_width));
      q_values.resize(q_tokens.size());
    }
    vrs::CpuOps ops{batch.vocab};
    const vrs::RequestWork work{p_work.data(), needs_q ? q_work.data() : nullptr,
                                needs_row ? row_work.data() : nullptr,
                                sparse ? q_tokens.data() : nullptr,
                                sparse ? q_values.data() : nullptr};
    vrs::accept_request(batch, static_cast<int>(b), ops, work);
  });
  return trees;
}

// Checks the lazy target rows' arguments; returns the number of rows.
template <typename Device>
size_t check_target_rows(const FloatMatrix<Device>& logits, const SamplingArgs<Device>& sampling,
                         const DoubleMatrix<Device>& out) {
  if (logits.shape(1) < 1) throw std::invalid_argument("logits must have a vocabulary axis >= 1");
  if (out.shape(0) != logits.shape(0) || out.shape(1) != logits.shape(1))
    throw std::invalid_argument("out must have the shape of logits");
  sampling.given(logits.shape(0));
  return logits.shape(0);
}

int target_rows_cpu(const FloatMatrix<Cpu>& logits, const SamplingArgs<Cpu>& sampling,
                    DoubleMatrix<Cpu> out, int num_threads) {
  const size_t rows = check_target_rows(logits, sampling, out);
  if (!sampling.temperature) throw std::invalid_argument("temperature, top_k and top_p are required");
  const int64_t vocab = static_cast<int64_t>(logits.shape(1));
  const float* logit_data = logits.data();
  const float* temperature = sampling.temperature->data();
  const int32_t* top_k = sampling.top_k->data();
  const float* top_p = sampling.top_p->data();
  double* out_data = out.data();
  nb::gil_scoped_release release;
  const vrs::ThreadPlan plan{num_threads, static_cast<int64_t>(rows) * vocab * kTargetRowPasses,
                             kTreeGrain};
  vrs::parallel_for(static_cast<int64_t>(rows), plan, [&](int64_t r) {
    vrs::CpuOps ops{vocab};
    vrs::target_row(ops, logit_data + r * vocab, temperature[r], top_k[r], top_p[r],
                    out_data + r * vocab);
  });
  return static_cast<int>(rows);
}


template <typename Device, size_t Dims>
using Floats = nb::ndarray<nb::ndim<Dims>, Device>;
template <typename Device>
using TableMatrix = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, Device>;
template <typename Device>
using ConstMaskMatrix = nb::ndarray<const uint64_t, nb::ndim<2>, nb::c_contig, Device>;
template <typename Device>
using RowVector = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, Device>;

vrs::AttentionDtype attention_dtype(nb::dlpack::dtype dtype) {
  if (dtype == nb::dtype<float>()) return vrs::AttentionDtype::kFloat32;
  if (dtype.bits == 16 && dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat))
    return vrs::AttentionDtype::kBFloat16;
  if (dtype.bits == 16 && dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float))
    return vrs::AttentionDtype::kFloat16;
  throw std::invalid_argument("tree attention takes float32, bfloat16 or float16 tensors");
}

// The inputs of tree attention, shapes checked (tree_attention.h says what each holds).
template <typename Device>
struct TreeAttentionInputs {
  Floats<Device, 2> query;
  Floats<Device, 4> kv_cache;
  Floats<Device, 2> out;
  RowVector<Device> node_row;
  TableMatrix<Device> block_table;
  ConstVector<Device> node_request, node_context, node_index;
  ConstMaskMatrix<Device> ancestors;
  int heads;
  int layout;
  float scale;
  int window;
  float softcap;
  std::optional<FloatVector<Device>> sinks;

  vrs::TreeAttentionArgs args() const {
    const size_t nodes = node_row.shape(0), kv_heads = kv_cache.shape(1);
    const size_t head_size = kv_cache.shape(3) / 2;
    if (heads < 1 || kv_heads == 0 || heads % kv_heads != 0 || kv_cache.shape(3) % 2 != 0)
      throw std::invalid_argument("kv_cache must be [blocks, kv_heads, block_size, 2 * head_size] "
                                  "with kv_heads dividing the query's heads");
    if (query.shape(1) != heads * head_size || out.shape(1) != query.shape(1) ||
        query.stride(1) != 1 || out.stride(1) != 1 || !kv_cache.is_valid() ||
        kv_cache.stride(3) != 1 || kv_cache.stride(2) != static_cast<int64_t>(2 * head_size) ||
        kv_cache.stride(1) != static_cast<int64_t>(kv_cache.shape(2) * 2 * head_size) ||
        kv_cache.stride(0) != static_cast<int64_t>(kv_heads * kv_cache.shape(2) * 2 * head_size))
      throw std::invalid_argument("query and out must be [tokens, heads * head_size] with "
                                  "contiguous rows, kv_cache contiguous");
    if (node_request.shape(0) != nodes || node_context.shape(0) != nodes ||
        node_index.shape(0) != nodes || ancestors.shape(0) != nodes || ancestors.shape(1) < 1)
      throw std::invalid_argument("node_row, node_request, node_context, node_index and "
                                  "ancestors must have one row per node");
    if (layout != 0 && layout != 1) throw std::invalid_argument("layout must be 0 or 1");
    const bool sinks_fit = !sinks || sinks->shape(0) == static_cast<size_t>(heads);
    if (window < 0 || !(softcap >= 0.0f) || !sinks_fit)
      throw std::invalid_argument("window must be >= 0 (0: none), softcap >= 0 (0: none) and "
                                  "sinks [heads] float32");
    const vrs::AttentionDtype dtype = attention_dtype(query.dtype());
    if (attention_dtype(kv_cache.dtype()) != dtype || attention_dtype(out.dtype()) != dtype)
      throw std::invalid_argument("query, kv_cache and out must have one dtype");
    return vrs::TreeAttentionArgs{
        query.data(), kv_cache.data(), out.data(), node_row.data(), block_table.data(),
        node_request.data(), node_context.data(), node_index.data(), ancestors.data(),
        sinks ? sinks->data() : nullptr, static_cast<int64_t>(nodes),
        static_cast<int64_t>(query.shape(0)), query.stride(0),
        static_cast<int64_t>(out.shape(0)), out.stride(0),
        static_cast<int64_t>(kv_cache.shape(0)), static_cast<int64_t>(block_table.shape(0)),
        static_cast<int>(block_table.shape(1)), static_cast<int>(ancestors.shape(1)), heads,
        static_cast<int>(kv_heads), static_cast<int>(head_size),
        static_cast<int>(kv_cache.shape(2)), static_cast<vrs::KVLayoutCode>(layout), dtype, scale,
        window, softcap};
  }
};

// Host node arrays must name query and out rows, table rows, contexts of 0 or more tokens (0: a
// chain starting a prefill) and nodes the ancestor rows hold.
void check_attention_nodes(const vrs::TreeAttentionArgs& a) {
  for (int64_t m = 0; m < a.num_nodes; ++m)
    if (a.node_row[m] < 0 || a.node_row[m] >= std::min(a.query_rows, a.out_rows) ||
        a.node_request[m] < 0 || a.node_request[m] >= a.table_rows || a.node_context[m] < 0 ||
        a.node_index[m] < 0 || a.node_index[m] >= a.words * 64)
      throw std::out_of_range("tree attention: node " + std::to_string(m) +
                              " names a token row, block table row, context or tree index out "
                              "of range");
}

// A step's keys and values to store before attending (write_kv_cpu), shapes checked.
struct NewKV {
  std::optional<Floats<Cpu, 2>> keys, values;
  std::optional<RowVector<Cpu>> slots;

  std::optional<vrs::KVWriteArgs> args(const vrs::TreeAttentionArgs& a) const {
    if (!keys && !values && !slots) return std::nullopt;
    if (!keys || !values || !slots)
      throw std::invalid_argument("new_keys, new_values and new_slots come together");
    const size_t tokens = slots->shape(0), width = static_cast<size_t>(a.kv_heads) * a.head_size;
    for (const Floats<Cpu, 2>* rows : {&*keys, &*values})
      if (rows->shape(0) < tokens || rows->shape(1) != width || rows->stride(1) != 1 ||
          attention_dtype(rows->dtype()) != a.dtype)
        throw std::invalid_argument("new_keys and new_values must be [tokens >= slots, kv_heads * "
                                    "head_size] with contiguous rows, in the cache's dtype");
    return vrs::KVWriteArgs{keys->data(), values->data(), slots->data(),
                            static_cast<int64_t>(tokens), keys->stride(0), values->stride(0)};
  }
};

int tree_attention_cpu(const TreeAttentionInputs<Cpu>& inputs, const NewKV& new_kv, int num_threads) {
  const vrs::TreeAttentionArgs args = inputs.args();
  check_attention_nodes(args);
  const std::optional<vrs::KVWriteArgs> write = new_kv.args(args);
  nb::gil_scoped_release release;
  if (write) vrs::write_kv_cpu(args, *write);
  vrs::tree_attention_cpu(args, num_threads);
  return static_cast<int>(args.num_nodes);
}

#ifdef VRS_WITH_CUDA
int pack_tree_masks_gpu(ConstVector<Cuda> parents,
                        ConstVector<Cuda> offsets, Output<Cuda, 1> depth,
                        std::optional<MaskMatrix<Cuda>> mask, std::uintptr_t stream) {
  const int words = check_pack_args(parents, offsets, depth, mask);
  const int trees = check_offsets_shape(offsets);
  vrs::PackTreeCudaArgs args{parents.data(), offsets.data(), static_cast<int>(parents.shape(0)),
                             trees, depth.data(), mask ? mask->data() : nullptr, words, stream};
  nb::gil_scoped_release release;
  vrs::pack_tree_masks_cuda(args);
  return trees;
}

using Workspace = nb::ndarray<double, nb::ndim<2>, nb::c_contig, Cuda>;
using DraftWorkspace = nb::ndarray<float, nb::ndim<2>, nb::c_contig, Cuda>;
using TokenWorkspace = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, Cuda>;

// The CUDA scratch rows (tree_cuda.h: TreeWorkspaces), each optional.
struct CudaWorkspaces {
  std::optional<Workspace> p;
  std::optional<DraftWorkspace> q;
  std::optional<Workspace> row;
  std::optional<TokenWorkspace> q_tokens;
  std::optional<DraftWorkspace> q_values;
};

template <typename Array>
auto data_or_null(std::optional<Array>& array) -> decltype(array->data()) {
  return array ? array->data() : nullptr;
}

int accept_trees_gpu(const TreeAcceptArgs<Cuda>& args, CudaWorkspaces work, std::uintptr_t stream) {
  const vrs::TreeBatch batch = args.batch();
  const int trees = check_offsets_shape(args.offsets);
  const auto fits = [&](const auto& array, int64_t cols) {
    return !array || (array->shape(0) == static_cast<size_t>(trees) &&
                      array->shape(1) == static_cast<size_t>(cols));
  };
  if (!fits(work.p, batch.vocab) || !fits(work.q, batch.vocab) || !fits(work.row, batch.vocab))
    throw std::invalid_argument("p_workspace, q_workspace and row_workspace must have shape [B, V]");
  const int64_t width = std::max<int64_t>(1, batch.draft_width);
  if (!fits(work.q_tokens, width) || !fits(work.q_values, width))
    throw std::invalid_argument("sparse workspaces must have shape [B, max(M, 1)]");
  const vrs::TreeWorkspaces workspaces{data_or_null(work.p), data_or_null(work.q),
                                       data_or_null(work.row), data_or_null(work.q_tokens),
                                       data_or_null(work.q_values)};
  nb::gil_scoped_release release;
  vrs::accept_trees_cuda(batch, trees, workspaces, stream);
  return trees;
}

int target_rows_gpu(const FloatMatrix<Cuda>& logits, const SamplingArgs<Cuda>& sampling,
                    DoubleMatrix<Cuda> out, std::uintptr_t stream) {
  const size_t rows = check_target_rows(logits, sampling, out);
  if (!sampling.temperature) throw std::invalid_argument("temperature, top_k and top_p are required");
  const vrs::TargetRowsArgs args{logits.data(), sampling.temperature->data(),
                                 sampling.top_k->data(), sampling.top_p->data(), out.data(),
                                 static_cast<int64_t>(rows), static_cast<int64_t>(logits.shape(1))};
  nb::gil_scoped_release release;
  vrs::target_rows_cuda(args, stream);
  return static_cast<int>(rows);
}

int tree_attention_gpu(const TreeAttentionInputs<Cuda>& inputs, std::uintptr_t stream) {
  const vrs::TreeAttentionArgs args = inputs.args();
  nb::gil_scoped_release release;
  vrs::tree_attention_cuda(args, stream);
  return static_cast<int>(args.num_nodes);
}
#endif

// Every block's pieces of the CUDA tree attention partition, computed on the host.
NewArray<int64_t, 2> tree_attention_pieces(ConstVector<Cpu> request, ConstVector<Cpu> context, ConstVector<Cpu> index,
                                           int tile_nodes) {
  const int64_t nodes = static_cast<int64_t>(request.shape(0));
  if (tile_nodes < 1) throw std::invalid_argument("tree_attention_pieces: tile_nodes must be at least 1");
  if (static_cast<int64_t>(context.shape(0)) != nodes || static_cast<int64_t>(index.shape(0)) != nodes)
    throw std::invalid_argument("tree_attention_pieces: node_request, node_context and node_index differ in length");
  const vrs::NodeRuns runs{request.data(), context.data(), index.data(), nodes, tile_nodes};
  std::vector<int64_t> rows;
  for (int64_t block = 0; block * tile_nodes < nodes; ++block) {
    for (int64_t begin = vrs::first_piece(runs, block); begin >= 0;) {
      const int64_t end = vrs::piece_end(runs, begin);
      rows.insert(rows.end(), {block, begin, end});
      begin = vrs::next_piece(runs, block, end);
    }
  }
  auto out = new_array<int64_t, 2>({rows.size() / 3, 3}, 0);
  std::copy(rows.begin(), rows.end(), out.data());
  return out;
}

}  // namespace

void bind_trees(nb::module_& m) {
  m.def(
      "pack_tree_masks",
      [](ConstVector<Cpu> parents, ConstVector<Cpu> offsets, Output<Cpu, 1> depth,
         std::optional<MaskMatrix<Cpu>> mask, int num_threads) {
        return pack_tree_masks_cpu(parents, offsets, depth, mask, num_threads);
      },
      nb::arg("parents"), nb::arg("offsets"), nb::arg("depth"), nb::arg("ancestor_mask").none(),
      nb::arg("num_threads") = 0,
      "Depth and (optionally) ancestor bitmask of every node of a batch of trees (CPU threads "
      "over trees, GIL released); fills the outputs.");
  m.def(
      "tree_attention",
      [](Floats<Cpu, 2> query, Floats<Cpu, 4> kv_cache, Floats<Cpu, 2> out,
         RowVector<Cpu> node_row, TableMatrix<Cpu> block_table,
         ConstVector<Cpu> node_request, ConstVector<Cpu> node_context,
         ConstVector<Cpu> node_index, ConstMaskMatrix<Cpu> ancestors, int heads, int layout,
         float scale, int num_threads, int window, float softcap,
         std::optional<FloatVector<Cpu>> sinks, std::optional<Floats<Cpu, 2>> new_keys,
         std::optional<Floats<Cpu, 2>> new_values, std::optional<RowVector<Cpu>> new_slots) {
        return tree_attention_cpu({query, kv_cache, out, node_row, block_table, node_request,
                                   node_context, node_index, ancestors, heads, layout, scale,
                                   window, softcap, sinks},
                                  {new_keys, new_values, new_slots}, num_threads);
      },
      nb::arg("query"), nb::arg("kv_cache"), nb::arg("out"), nb::arg("node_row"),
      nb::arg("block_table"), nb::arg("node_request"), nb::arg("node_context"),
      nb::arg("node_index"), nb::arg("ancestors"), nb::arg("heads"), nb::arg("layout"),
      nb::arg("scale"), nb::arg("num_threads") = 0, nb::arg("window") = 0,
      nb::arg("softcap") = 0.0f, nb::arg("sinks").none() = nb::none(),
      nb::arg("new_keys").none() = nb::none(), nb::arg("new_values").none() = nb::none(),
      nb::arg("new_slots").none() = nb::none(),
      "Tree attention of draft nodes over their paged context and ancestors (CPU threads, GIL "
      "released); overwrites rows node_row of out [tokens, heads * head_size]. With new_keys, "
      "new_values [tokens, kv_heads * head_size] and new_slots [tokens] int64 (CPU_VEC layout), "
      "first stores each token's key and value at its cache slot (< 0: none), as vLLM's "
      "cpu_attn_reshape_and_cache does.");
  m.def("tree_attention_pieces", &tree_attention_pieces, nb::arg("node_request"), nb::arg("node_context"),
        nb::arg("node_index"), nb::arg("tile_nodes"),
        "How the CUDA tree attention kernel shares nodes out between its thread blocks "
        "(tree_tiles.h): [pieces, 3] int64 rows (block, first node, end node), in each block's order.");
#ifdef VRS_WITH_CUDA
  m.def(
      "tree_attention",
      [](Floats<Cuda, 2> query, Floats<Cuda, 4> kv_cache, Floats<Cuda, 2> out,
         RowVector<Cuda> node_row, TableMatrix<Cuda> block_table,
         ConstVector<Cuda> node_request, ConstVector<Cuda> node_context,
         ConstVector<Cuda> node_index, ConstMaskMatrix<Cuda> ancestors, int heads, int layout,
         float scale, std::uintptr_t stream, int window, float softcap,
         std::optional<FloatVector<Cuda>> sinks) {
        return tree_attention_gpu({query, kv_cache, out, node_row, block_table, node_request,
                                   node_context, node_index, ancestors, heads, layout, scale,
                                   window, softcap, sinks},
                                  stream);
      },
      nb::arg("query"), nb::arg("kv_cache"), nb::arg("out"), nb::arg("node_row"),
      nb::arg("block_table"), nb::arg("node_request"), nb::arg("node_context"),
      nb::arg("node_index"), nb::arg("ancestors"), nb::arg("heads"), nb::arg("layout"),
      nb::arg("scale"), nb::arg("stream") = 0, nb::arg("window") = 0,
      nb::arg("softcap") = 0.0f, nb::arg("sinks").none() = nb::none(),
      "tree_attention on a CUDA device (one block per node and kv head).");
#endif
  m.def(
      "accept_trees",
      [](FloatMatrix<Cpu> scores, std::optional<FloatMatrix<Cpu>> draft_probs,
         ConstVector<Cpu> tokens, ConstVector<Cpu> parents, ConstVector<Cpu> offsets,
         ConstVector<Cpu> rules, SeedVector<Cpu> seeds, Output<Cpu, 2> out_tokens,
         Output<Cpu, 2> path_nodes, Output<Cpu, 1> num_accepted, int num_threads,
         std::optional<FloatVector<Cpu>> temperature, std::optional<ConstVector<Cpu>> top_k,
         std::optional<FloatVector<Cpu>> top_p, std::optional<TokenMatrix<Cpu>> draft_tokens,
         std::optional<FloatMatrix<Cpu>> draft_values,
         std::optional<PositionVector<Cpu>> positions) {
        return accept_trees_cpu({scores, draft_probs, tokens, parents, offsets, rules, seeds,
                                 out_tokens, path_nodes, num_accepted,
                                 {temperature, top_k, top_p}, {draft_tokens, draft_values},
                                 positions},
                                num_threads);
      },
      nb::arg("scores"), nb::arg("draft_probs").none(), nb::arg("tokens"), nb::arg("parents"),
      nb::arg("offsets"), nb::arg("rules"), nb::arg("seeds"), nb::arg("out_tokens"),
      nb::arg("path_nodes"), nb::arg("num_accepted"), nb::arg("num_threads") = 0,
      nb::arg("temperature").none() = nb::none(), nb::arg("top_k").none() = nb::none(),
      nb::arg("top_p").none() = nb::none(), nb::arg("draft_tokens").none() = nb::none(),
      nb::arg("draft_values").none() = nb::none(), nb::arg("positions").none() = nb::none(),
      "Tree verification (greedy, deterministic candidates, MCSS with/without replacement, "
      "keyed), CPU threads over requests, GIL released; fills the outputs. With temperature, "
      "top_k and top_p [B], scores are logits and rules 1-4 verify against the lazy target rows; "
      "draft_tokens/draft_values [N + B, M] are sparse draft rows (instead of draft_probs); "
      "positions [B] int64: each keyed request's root position.");
  m.def(
      "target_rows",
      [](FloatMatrix<Cpu> logits, FloatVector<Cpu> temperature, ConstVector<Cpu> top_k,
         FloatVector<Cpu> top_p, DoubleMatrix<Cpu> out, int num_threads) {
        return target_rows_cpu(logits, {temperature, top_k, top_p}, out, num_threads);
      },
      nb::arg("logits"), nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"),
      nb::arg("out"), nb::arg("num_threads") = 0,
      "The lazy target rows of accept_trees for whole logits rows [R, V] (unnormalised, "
      "float64 out [R, V]); CPU threads over rows, GIL released.");
#ifdef VRS_WITH_CUDA
  m.def(
      "pack_tree_masks",
      [](ConstVector<Cuda> parents, ConstVector<Cuda> offsets, Output<Cuda, 1> depth,
         std::optional<MaskMatrix<Cuda>> mask, std::uintptr_t stream) {
        return pack_tree_masks_gpu(parents, offsets, depth, mask, stream);
      },
      nb::arg("parents"), nb::arg("offsets"), nb::arg("depth"), nb::arg("ancestor_mask").none(),
      nb::arg("stream") = 0, "pack_tree_masks on a CUDA device (one thread per node).");
  m.def(
      "accept_trees",
      [](FloatMatrix<Cuda> scores, std::optional<FloatMatrix<Cuda>> draft_probs,
         ConstVector<Cuda> tokens, ConstVector<Cuda> parents, ConstVector<Cuda> offsets,
         ConstVector<Cuda> rules, SeedVector<Cuda> seeds, Output<Cuda, 2> out_tokens,
         Output<Cuda, 2> path_nodes, Output<Cuda, 1> num_accepted,
         std::optional<Workspace> p_workspace, std::optional<DraftWorkspace> q_workspace,
         std::uintptr_t stream, std::optional<FloatVector<Cuda>> temperature,
         std::optional<ConstVector<Cuda>> top_k, std::optional<FloatVector<Cuda>> top_p,
         std::optional<TokenMatrix<Cuda>> draft_tokens,
         std::optional<FloatMatrix<Cuda>> draft_values, std::optional<Workspace> row_workspace,
         std::optional<TokenWorkspace> sparse_token_workspace,
         std::optional<DraftWorkspace> sparse_value_workspace,
         std::optional<PositionVector<Cuda>> positions) {
        return accept_trees_gpu({scores, draft_probs, tokens, parents, offsets, rules, seeds,
                                 out_tokens, path_nodes, num_accepted,
                                 {temperature, top_k, top_p}, {draft_tokens, draft_values},
                                 positions},
                                {p_workspace, q_workspace, row_workspace, sparse_token_workspace,
                                 sparse_value_workspace},
                                stream);
      },
      nb::arg("scores"), nb::arg("draft_probs").none(), nb::arg("tokens"), nb::arg("parents"),
      nb::arg("offsets"), nb::arg("rules"), nb::arg("seeds"), nb::arg("out_tokens"),
      nb::arg("path_nodes"), nb::arg("num_accepted"), nb::arg("p_workspace").none(),
      nb::arg("q_workspace").none(), nb::arg("stream") = 0,
      nb::arg("temperature").none() = nb::none(), nb::arg("top_k").none() = nb::none(),
      nb::arg("top_p").none() = nb::none(), nb::arg("draft_tokens").none() = nb::none(),
      nb::arg("draft_values").none() = nb::none(), nb::arg("row_workspace").none() = nb::none(),
      nb::arg("sparse_token_workspace").none() = nb::none(),
      nb::arg("sparse_value_workspace").none() = nb::none(),
      nb::arg("positions").none() = nb::none(),
      "accept_trees on a CUDA device (one block per request); p_workspace [B, V] float64 for "
      "rules 1-3, q_workspace [B, V] float32 for rule 3 with draft_probs, row_workspace [B, V] "
      "float64 for lazy target rows or sparse draft rows, sparse_token_workspace / "
      "sparse_value_workspace [B, max(M, 1)] int32 / float32 for sparse draft rows, positions "
      "[B] int64 for the keyed rule.");
  m.def(
      "target_rows",
      [](FloatMatrix<Cuda> logits, FloatVector<Cuda> temperature, ConstVector<Cuda> top_k,
         FloatVector<Cuda> top_p, DoubleMatrix<Cuda> out, std::uintptr_t stream) {
        return target_rows_gpu(logits, {temperature, top_k, top_p}, out, stream);
      },
      nb::arg("logits"), nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"),
      nb::arg("out"), nb::arg("stream") = 0, "target_rows on a CUDA device (one block per row).");
#endif
}

}  // namespace vrs_bind
