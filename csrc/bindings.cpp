// Python bindings of vllm_retrieval_spec._C. Arrays cross as NumPy arrays or any DLPack
// producer (torch tensors included); no PyTorch headers are used.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "context_ngram.h"
#include "parallel.h"
#include "rest_retrieval.h"
#include "tree_accept.h"
#include "tree_pack.h"
#ifdef VRS_WITH_CUDA
#include "context_ngram_cuda.h"
#include "tree_cuda.h"
#endif

namespace nb = nanobind;

namespace {

template <typename Device>
using TokenMatrix = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, Device>;
template <typename Device>
using ConstVector = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, Device>;
template <typename Device, size_t Dims>
using Output = nb::ndarray<int32_t, nb::ndim<Dims>, nb::c_contig, Device>;

struct ContextNgramShapes {
  long num_rows;
  vrs::ContextNgramParams params;
};

template <typename Device>
ContextNgramShapes check_context_ngram_args(const TokenMatrix<Device>& tokens,
                                            const ConstVector<Device>& lengths,
                                            const ConstVector<Device>& rows,
                                            const Output<Device, 3>& drafts,
                                            const Output<Device, 2>& draft_lengths,
                                            const Output<Device, 2>& counts,
                                            const Output<Device, 1>& match_len, int q_min,
                                            int q_max, int max_matches) {
  const long num_rows = static_cast<long>(rows.shape(0));
  if (lengths.shape(0) != tokens.shape(0))
    throw std::invalid_argument("lengths must have one entry per row of tokens");
  if (drafts.shape(0) != rows.shape(0) || draft_lengths.shape(0) != rows.shape(0) ||
      counts.shape(0) != rows.shape(0) || match_len.shape(0) != rows.shape(0))
    throw std::invalid_argument("every output needs one row per entry of rows");
  const int k = static_cast<int>(drafts.shape(1));
  const int w = static_cast<int>(drafts.shape(2));
  if (k < 1 || w < 1) throw std::invalid_argument("drafts must have shape [rows, k >= 1, w >= 1]");
  if (draft_lengths.shape(1) != drafts.shape(1) || counts.shape(1) != drafts.shape(1))
    throw std::invalid_argument("draft_lengths and counts must have shape [rows, k]");
  if (q_min < 1 || q_max < q_min)
    throw std::invalid_argument("need 1 <= q_min <= q_max, got q_min=" + std::to_string(q_min) +
                                ", q_max=" + std::to_string(q_max));
  if (max_matches < 1 || max_matches > vrs::kMaxContextMatches)
    throw std::invalid_argument("max_matches must be in [1, " +
                                std::to_string(vrs::kMaxContextMatches) + "], got " +
                                std::to_string(max_matches));
  return {num_rows, vrs::ContextNgramParams{q_min, q_max, w, k, max_matches}};
}

// Rows must index tokens, and each row's length must fit the row.
void check_rows(const TokenMatrix<nb::device::cpu>& tokens,
                const ConstVector<nb::device::cpu>& lengths,
                const ConstVector<nb::device::cpu>& rows) {
  if (lengths.shape(0) != tokens.shape(0))
    throw std::invalid_argument("lengths must have one entry per row of tokens");
  const long num_token_rows = static_cast<long>(tokens.shape(0));
  const long row_len = static_cast<long>(tokens.shape(1));
  for (size_t r = 0; r < rows.shape(0); ++r) {
    const long row = rows(r);
    if (row < 0 || row >= num_token_rows)
      throw std::out_of_range("rows[" + std::to_string(r) + "] = " + std::to_string(row) +
                              " is outside tokens' " + std::to_string(num_token_rows) + " rows");
    if (lengths(row) < 0 || lengths(row) > row_len)
      throw std::out_of_range("lengths[" + std::to_string(row) + "] = " +
                              std::to_string(lengths(row)) + " is outside [0, " +
                              std::to_string(row_len) + "]");
  }
}

int context_ngram_cpu(TokenMatrix<nb::device::cpu> tokens, ConstVector<nb::device::cpu> lengths,
                      ConstVector<nb::device::cpu> rows, Output<nb::device::cpu, 3> drafts,
                      Output<nb::device::cpu, 2> draft_lengths, Output<nb::device::cpu, 2> counts,
                      Output<nb::device::cpu, 1> match_len, int q_min, int q_max, int max_matches,
                      int num_threads) {
  const auto shapes = check_context_ngram_args(tokens, lengths, rows, drafts, draft_lengths,
                                               counts, match_len, q_min, q_max, max_matches);
  check_rows(tokens, lengths, rows);
  const long row_len = static_cast<long>(tokens.shape(1));
  const auto& prm = shapes.params;
  const int32_t* token_data = tokens.data();
  const int32_t* length_data = lengths.data();
  const int32_t* row_data = rows.data();
  int32_t* draft_data = drafts.data();
  int32_t* draft_length_data = draft_lengths.data();
  int32_t* count_data = counts.data();
  int32_t* match_len_data = match_len.data();
  {
    nb::gil_scoped_release release;
    vrs::parallel_for(shapes.num_rows, num_threads, [&](long r) {
      int match_pos[vrs::kMaxContextMatches];
      int match_count[vrs::kMaxContextMatches];
      const long row = row_data[r];
      match_len_data[r] = vrs::context_ngram_one(
          token_data + row * row_len, length_data[row], prm, match_pos, match_count,
          draft_data + r * prm.k * prm.w, draft_length_data + r * prm.k, count_data + r * prm.k);
    });
  }
  return static_cast<int>(shapes.num_rows);
}

#ifdef VRS_WITH_CUDA
int context_ngram_gpu(TokenMatrix<nb::device::cuda> tokens, ConstVector<nb::device::cuda> lengths,
                      ConstVector<nb::device::cuda> rows, Output<nb::device::cuda, 3> drafts,
                      Output<nb::device::cuda, 2> draft_lengths, Output<nb::device::cuda, 2> counts,
                      Output<nb::device::cuda, 1> match_len, int q_min, int q_max, int max_matches,
                      std::uintptr_t stream) {
  const auto shapes = check_context_ngram_args(tokens, lengths, rows, drafts, draft_lengths,
                                               counts, match_len, q_min, q_max, max_matches);
  vrs::ContextNgramCudaArgs args{tokens.data(),        static_cast<int64_t>(tokens.shape(1)),
                                 lengths.data(),       rows.data(),
                                 static_cast<int>(shapes.num_rows), shapes.params,
                                 drafts.data(),        draft_lengths.data(),
                                 counts.data(),        match_len.data(),
                                 stream};
  nb::gil_scoped_release release;
  vrs::context_ngram_cuda(args);
  return static_cast<int>(shapes.num_rows);
}
#endif

using AnyVector = nb::ndarray<nb::ro, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

struct RestOutputs {
  Output<nb::device::cpu, 2> tree_tokens;
  Output<nb::device::cpu, 2> tree_parents;
  Output<nb::device::cpu, 1> tree_size;
  Output<nb::device::cpu, 2> chain_tokens;
  Output<nb::device::cpu, 1> chain_size;
  Output<nb::device::cpu, 2> match_info;
  std::optional<nb::ndarray<int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>> timings;

  void check(long num_rows) const {
    const bool rows_ok = tree_tokens.shape(0) == static_cast<size_t>(num_rows) &&
                         tree_parents.shape(0) == tree_tokens.shape(0) &&
                         tree_size.shape(0) == tree_tokens.shape(0) &&
                         chain_tokens.shape(0) == tree_tokens.shape(0) &&
                         chain_size.shape(0) == tree_tokens.shape(0) &&
                         match_info.shape(0) == tree_tokens.shape(0);
    if (!rows_ok) throw std::invalid_argument("every output needs one row per entry of rows");
    if (tree_parents.shape(1) != tree_tokens.shape(1))
      throw std::invalid_argument("tree_tokens and tree_parents must have shape [rows, top_k]");
    if (match_info.shape(1) != 3) throw std::invalid_argument("match_info must have shape [rows, 3]");
    if (timings && (timings->shape(0) != static_cast<size_t>(num_rows) || timings->shape(1) != 4))
      throw std::invalid_argument("timings must have shape [rows, 4]");
  }
};

template <typename Tok, typename Idx>
void run_rest(const vrs::SuffixIndex<Tok, Idx>* index, const TokenMatrix<nb::device::cpu>& tokens,
              const ConstVector<nb::device::cpu>& lengths, const ConstVector<nb::device::cpu>& rows,
              RestOutputs& out, const vrs::RestParams& prm, int num_threads) {
  const long num_rows = static_cast<long>(rows.shape(0));
  const long row_len = static_cast<long>(tokens.shape(1));
  const int32_t* token_data = tokens.data();
  const int32_t* length_data = lengths.data();
  const int32_t* row_data = rows.data();
  const int top_k = static_cast<int>(out.tree_tokens.shape(1));
  const int chain_len = static_cast<int>(out.chain_tokens.shape(1));
  int32_t* tree_tokens = out.tree_tokens.data();
  int32_t* tree_parents = out.tree_parents.data();
  int32_t* tree_size = out.tree_size.data();
  int32_t* chain_tokens = out.chain_tokens.data();
  int32_t* chain_size = out.chain_size.data();
  int32_t* match_info = out.match_info.data();
  int64_t* timings = out.timings ? out.timings->data() : nullptr;
  nb::gil_scoped_release release;
  vrs::parallel_for(num_rows, num_threads, [&](long r) {
    thread_local vrs::ContinuationTrie trie;
    const long row = row_data[r];
    std::fill(tree_tokens + r * top_k, tree_tokens + (r + 1) * top_k, -1);
    std::fill(tree_parents + r * top_k, tree_parents + (r + 1) * top_k, -1);
    std::fill(chain_tokens + r * chain_len, chain_tokens + (r + 1) * chain_len, -1);
    vrs::RestOutput view{tree_tokens + r * top_k, tree_parents + r * top_k, tree_size + r,
                         chain_tokens + r * chain_len, chain_size + r, match_info + r * 3,
                         timings ? timings + r * 4 : nullptr};
    vrs::rest_retrieve_one(index, token_data + row * row_len, length_data[row], prm, trie, view);
  });
}

using OffsetVector = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

template <typename Tok>
void dispatch_suffix_array(const std::optional<AnyVector>& store_tokens,
                           const std::optional<AnyVector>& suffix_array, uint32_t separator,
                           const std::optional<OffsetVector>& offsets,
                           const TokenMatrix<nb::device::cpu>& tokens,
                           const ConstVector<nb::device::cpu>& lengths,
                           const ConstVector<nb::device::cpu>& rows, RestOutputs& out,
                           const vrs::RestParams& prm, int num_threads) {
  const auto* tok = static_cast<const Tok*>(store_tokens->data());
  const int64_t size = static_cast<int64_t>(store_tokens->shape(0));
  const int64_t* offset_data = offsets ? offsets->data() : nullptr;
  const int64_t num_offsets = offsets ? static_cast<int64_t>(offsets->shape(0)) : 0;
  if (suffix_array->dtype() == nb::dtype<int32_t>()) {
    vrs::SuffixIndex<Tok, int32_t> index{tok, static_cast<const int32_t*>(suffix_array->data()),
                                         size, separator, offset_data, num_offsets};
    run_rest(&index, tokens, lengths, rows, out, prm, num_threads);
  } else if (suffix_array->dtype() == nb::dtype<int64_t>()) {
    vrs::SuffixIndex<Tok, int64_t> index{tok, static_cast<const int64_t*>(suffix_array->data()),
                                         size, separator, offset_data, num_offsets};
    run_rest(&index, tokens, lengths, rows, out, prm, num_threads);
  } else {
    throw std::invalid_argument("suffix_array must be int32 or int64");
  }
}

int rest_retrieve(std::optional<AnyVector> store_tokens, std::optional<AnyVector> suffix_array,
                  uint32_t separator, std::optional<OffsetVector> offsets,
                  TokenMatrix<nb::device::cpu> tokens,
                  ConstVector<nb::device::cpu> lengths, ConstVector<nb::device::cpu> rows,
                  RestOutputs out, int n_min, int n_max, int max_matches, int cont_len,
                  double min_ratio, bool use_datastore, bool use_context, double context_weight,
                  int context_max_matches, int num_threads) {
  const long num_rows = static_cast<long>(rows.shape(0));
  out.check(num_rows);
  check_rows(tokens, lengths, rows);
  if (n_min < 1 || n_max < n_min) throw std::invalid_argument("need 1 <= n_min <= n_max");
  if (max_matches < 0 || cont_len < 1) throw std::invalid_argument("need max_matches >= 0 and cont_len >= 1");
  if (context_max_matches < 1 || context_max_matches > vrs::kMaxContextMatches)
    throw std::invalid_argument("context_max_matches must be in [1, " + std::to_string(vrs::kMaxContextMatches) + "]");
  if (context_weight < 0 || min_ratio < 0) throw std::invalid_argument("weights must be >= 0");
  const vrs::RestParams prm{n_min, n_max, max_matches, cont_len,
                            static_cast<int>(out.tree_tokens.shape(1)),
                            static_cast<int>(out.chain_tokens.shape(1)), min_ratio, use_datastore,
                            use_context, context_weight, context_max_matches};
  const bool has_store = store_tokens.has_value() && suffix_array.has_value();
  if (use_datastore && !has_store) throw std::invalid_argument("use_datastore needs store_tokens and suffix_array");
  if (!has_store) {
    run_rest<uint16_t, int32_t>(nullptr, tokens, lengths, rows, out, prm, num_threads);
    return static_cast<int>(num_rows);
  }
  if (store_tokens->shape(0) != suffix_array->shape(0))
    throw std::invalid_argument("store_tokens and suffix_array must have the same length");
  if (offsets && (offsets->shape(0) < 1 || offsets->data()[offsets->shape(0) - 1] > static_cast<int64_t>(suffix_array->shape(0))))
    throw std::invalid_argument("first_token_offsets do not fit this suffix array");
  if (store_tokens->dtype() == nb::dtype<uint16_t>())
    dispatch_suffix_array<uint16_t>(store_tokens, suffix_array, separator, offsets, tokens, lengths, rows, out, prm, num_threads);
  else if (store_tokens->dtype() == nb::dtype<uint32_t>())
    dispatch_suffix_array<uint32_t>(store_tokens, suffix_array, separator, offsets, tokens, lengths, rows, out, prm, num_threads);
  else
    throw std::invalid_argument("store_tokens must be uint16 or uint32");
  return static_cast<int>(num_rows);
}

// ---- Tree packing and verification (tree_pack.h, tree_accept.h) ----

template <typename Device>
using FloatMatrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, Device>;
template <typename Device>
using SeedVector = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, Device>;
template <typename Device>
using MaskMatrix = nb::ndarray<uint64_t, nb::ndim<2>, nb::c_contig, Device>;

// Threads for the tree kernels: as requested, or (0) one per ~2^18 values of work, since
// starting a thread costs about as much as scanning that many.
int tree_threads(int num_threads, int64_t work) {
  if (num_threads > 0) return num_threads;
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<int>(std::clamp<int64_t>(work >> 18, 1, cores));
}

// Number of trees; offsets must have B + 1 entries.
template <typename Device>
int check_offsets_shape(const ConstVector<Device>& offsets) {
  if (offsets.shape(0) < 1) throw std::invalid_argument("offsets must have B + 1 >= 1 entries");
  return static_cast<int>(offsets.shape(0) - 1);
}

// Host offsets must start at 0, never decrease and end at num_nodes (memory safety of the walk).
void check_offsets_values(const ConstVector<nb::device::cpu>& offsets, long num_nodes) {
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

int pack_tree_masks_cpu(ConstVector<nb::device::cpu> parents, ConstVector<nb::device::cpu> offsets,
                        Output<nb::device::cpu, 1> depth,
                        std::optional<MaskMatrix<nb::device::cpu>> mask, int num_threads) {
  const int words = check_pack_args(parents, offsets, depth, mask);
  check_offsets_values(offsets, static_cast<long>(parents.shape(0)));
  const int trees = check_offsets_shape(offsets);
  const int32_t* parent_data = parents.data();
  const int32_t* offset_data = offsets.data();
  int32_t* depth_data = depth.data();
  uint64_t* mask_data = mask ? mask->data() : nullptr;
  nb::gil_scoped_release release;
  const int threads = tree_threads(num_threads, static_cast<int64_t>(parents.shape(0)) * 64);
  vrs::parallel_for(trees, threads, [&](long b) {
    const int32_t begin = offset_data[b];
    for (int32_t i = begin; i < offset_data[b + 1]; ++i) {
      uint64_t* row = mask_data != nullptr ? mask_data + static_cast<int64_t>(i) * words : nullptr;
      depth_data[i] = vrs::pack_node(parent_data + begin, i - begin, row, words);
    }
  });
  return trees;
}

template <typename Device>
struct TreeAcceptArgs {
  FloatMatrix<Device> scores;
  std::optional<FloatMatrix<Device>> draft_probs;
  ConstVector<Device> tokens, parents, offsets, rules;
  SeedVector<Device> seeds;
  Output<Device, 2> out_tokens, path_nodes;
  Output<Device, 1> num_accepted;

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
    return vrs::TreeBatch{scores.data(),    draft_probs ? draft_probs->data() : nullptr,
                          static_cast<int64_t>(scores.shape(1)),
                          tokens.data(),    parents.data(),
                          offsets.data(),   rules.data(),
                          seeds.data(),     static_cast<int>(out_tokens.shape(1)),
                          out_tokens.data(), path_nodes.data(),
                          num_accepted.data()};
  }
};

int accept_trees_cpu(const TreeAcceptArgs<nb::device::cpu>& args, int num_threads) {
  const vrs::TreeBatch batch = args.batch();
  check_offsets_values(args.offsets, static_cast<long>(args.parents.shape(0)));
  const int trees = check_offsets_shape(args.offsets);
  const bool needs_q = batch.draft_probs != nullptr;
  nb::gil_scoped_release release;
  const int threads = tree_threads(num_threads, trees * batch.vocab);
  vrs::parallel_for(trees, threads, [&](long b) {
    thread_local std::vector<double> p_work;
    thread_local std::vector<float> q_work;
    p_work.resize(batch.vocab);
    if (needs_q) q_work.resize(batch.vocab);
    vrs::CpuOps ops{batch.vocab};
    vrs::accept_request(batch, static_cast<int>(b), ops, p_work.data(),
                        needs_q ? q_work.data() : nullptr);
  });
  return trees;
}

#ifdef VRS_WITH_CUDA
int pack_tree_masks_gpu(ConstVector<nb::device::cuda> parents,
                        ConstVector<nb::device::cuda> offsets, Output<nb::device::cuda, 1> depth,
                        std::optional<MaskMatrix<nb::device::cuda>> mask, std::uintptr_t stream) {
  const int words = check_pack_args(parents, offsets, depth, mask);
  const int trees = check_offsets_shape(offsets);
  vrs::PackTreeCudaArgs args{parents.data(), offsets.data(), static_cast<int>(parents.shape(0)),
                             trees, depth.data(), mask ? mask->data() : nullptr, words, stream};
  nb::gil_scoped_release release;
  vrs::pack_tree_masks_cuda(args);
  return trees;
}

using Workspace = nb::ndarray<double, nb::ndim<2>, nb::c_contig, nb::device::cuda>;
using DraftWorkspace = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cuda>;

int accept_trees_gpu(const TreeAcceptArgs<nb::device::cuda>& args,
                     std::optional<Workspace> p_work, std::optional<DraftWorkspace> q_work,
                     std::uintptr_t stream) {
  const vrs::TreeBatch batch = args.batch();
  const int trees = check_offsets_shape(args.offsets);
  const auto fits = [&](size_t rows, size_t cols) {
    return rows == static_cast<size_t>(trees) && cols == static_cast<size_t>(batch.vocab);
  };
  if ((p_work && !fits(p_work->shape(0), p_work->shape(1))) ||
      (q_work && !fits(q_work->shape(0), q_work->shape(1))))
    throw std::invalid_argument("workspaces must have shape [B, V]");
  nb::gil_scoped_release release;
  vrs::accept_trees_cuda(batch, trees, p_work ? p_work->data() : nullptr,
                         q_work ? q_work->data() : nullptr, stream);
  return trees;
}
#endif

std::vector<std::string> backends() {
  std::vector<std::string> names{"cpu"};
#ifdef VRS_WITH_CUDA
  names.emplace_back("cuda");
#endif
  return names;
}

int device_count() {
#ifdef VRS_WITH_CUDA
  return vrs::cuda_device_count();
#else
  return 0;
#endif
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "Hot paths of vllm_retrieval_spec (CPU threads; CUDA when built with nvcc).";
  m.attr("MAX_CONTEXT_MATCHES") = vrs::kMaxContextMatches;
  m.def("backends", &backends, "Backends this build was compiled with, e.g. ['cpu', 'cuda'].");
  m.def("cuda_device_count", &device_count,
        "CUDA devices visible to this build (0 without CUDA support, driver or device).");
  m.def("context_ngram", &context_ngram_cpu, nb::arg("tokens"), nb::arg("lengths"),
        nb::arg("rows"), nb::arg("drafts"), nb::arg("draft_lengths"), nb::arg("counts"),
        nb::arg("match_len"), nb::arg("q_min"), nb::arg("q_max"), nb::arg("max_matches"),
        nb::arg("num_threads") = 0,
        "Context n-gram drafts for tokens[rows] (CPU, threads, GIL released); fills the outputs.");
  m.def(
      "rest_retrieve",
      [](std::optional<AnyVector> store_tokens, std::optional<AnyVector> suffix_array,
         uint32_t separator, std::optional<OffsetVector> first_token_offsets,
         TokenMatrix<nb::device::cpu> tokens,
         ConstVector<nb::device::cpu> lengths, ConstVector<nb::device::cpu> rows,
         Output<nb::device::cpu, 2> tree_tokens, Output<nb::device::cpu, 2> tree_parents,
         Output<nb::device::cpu, 1> tree_size, Output<nb::device::cpu, 2> chain_tokens,
         Output<nb::device::cpu, 1> chain_size, Output<nb::device::cpu, 2> match_info,
         std::optional<nb::ndarray<int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>> timings,
         int n_min, int n_max, int max_matches, int cont_len, double min_ratio,
         bool use_datastore, bool use_context, double context_weight, int context_max_matches,
         int num_threads) {
        return rest_retrieve(store_tokens, suffix_array, separator, first_token_offsets, tokens,
                             lengths, rows,
                             RestOutputs{tree_tokens, tree_parents, tree_size, chain_tokens,
                                         chain_size, match_info, timings},
                             n_min, n_max, max_matches, cont_len, min_ratio, use_datastore,
                             use_context, context_weight, context_max_matches, num_threads);
      },
      nb::arg("store_tokens").none(), nb::arg("suffix_array").none(), nb::arg("separator"),
      nb::arg("first_token_offsets").none(), nb::arg("tokens"), nb::arg("lengths"), nb::arg("rows"), nb::arg("tree_tokens"),
      nb::arg("tree_parents"), nb::arg("tree_size"), nb::arg("chain_tokens"),
      nb::arg("chain_size"), nb::arg("match_info"), nb::arg("timings").none(),
      nb::arg("n_min"), nb::arg("n_max"), nb::arg("max_matches"), nb::arg("cont_len"),
      nb::arg("min_ratio"), nb::arg("use_datastore"), nb::arg("use_context"),
      nb::arg("context_weight"), nb::arg("context_max_matches"), nb::arg("num_threads") = 0,
      "REST drafts for tokens[rows]: datastore + context trie, top-k subtree and best chain "
      "(CPU threads, GIL released); fills the outputs.");
  m.def(
      "pack_tree_masks",
      [](ConstVector<nb::device::cpu> parents, ConstVector<nb::device::cpu> offsets,
         Output<nb::device::cpu, 1> depth, std::optional<MaskMatrix<nb::device::cpu>> mask,
         int num_threads) { return pack_tree_masks_cpu(parents, offsets, depth, mask, num_threads); },
      nb::arg("parents"), nb::arg("offsets"), nb::arg("depth"), nb::arg("ancestor_mask").none(),
      nb::arg("num_threads") = 0,
      "Depth and (optionally) ancestor bitmask of every node of a batch of trees (CPU threads "
      "over trees, GIL released); fills the outputs.");
  m.def(
      "accept_trees",
      [](FloatMatrix<nb::device::cpu> scores, std::optional<FloatMatrix<nb::device::cpu>> draft_probs,
         ConstVector<nb::device::cpu> tokens, ConstVector<nb::device::cpu> parents,
         ConstVector<nb::device::cpu> offsets, ConstVector<nb::device::cpu> rules,
         SeedVector<nb::device::cpu> seeds, Output<nb::device::cpu, 2> out_tokens,
         Output<nb::device::cpu, 2> path_nodes, Output<nb::device::cpu, 1> num_accepted,
         int num_threads) {
        return accept_trees_cpu({scores, draft_probs, tokens, parents, offsets, rules, seeds,
                                 out_tokens, path_nodes, num_accepted},
                                num_threads);
      },
      nb::arg("scores"), nb::arg("draft_probs").none(), nb::arg("tokens"), nb::arg("parents"),
      nb::arg("offsets"), nb::arg("rules"), nb::arg("seeds"), nb::arg("out_tokens"),
      nb::arg("path_nodes"), nb::arg("num_accepted"), nb::arg("num_threads") = 0,
      "Tree verification (greedy, deterministic candidates, MCSS with/without replacement), "
      "CPU threads over requests, GIL released; fills the outputs.");
#ifdef VRS_WITH_CUDA
  m.def(
      "pack_tree_masks",
      [](ConstVector<nb::device::cuda> parents, ConstVector<nb::device::cuda> offsets,
         Output<nb::device::cuda, 1> depth, std::optional<MaskMatrix<nb::device::cuda>> mask,
         std::uintptr_t stream) { return pack_tree_masks_gpu(parents, offsets, depth, mask, stream); },
      nb::arg("parents"), nb::arg("offsets"), nb::arg("depth"), nb::arg("ancestor_mask").none(),
      nb::arg("stream") = 0, "pack_tree_masks on a CUDA device (one thread per node).");
  m.def(
      "accept_trees",
      [](FloatMatrix<nb::device::cuda> scores, std::optional<FloatMatrix<nb::device::cuda>> draft_probs,
         ConstVector<nb::device::cuda> tokens, ConstVector<nb::device::cuda> parents,
         ConstVector<nb::device::cuda> offsets, ConstVector<nb::device::cuda> rules,
         SeedVector<nb::device::cuda> seeds, Output<nb::device::cuda, 2> out_tokens,
         Output<nb::device::cuda, 2> path_nodes, Output<nb::device::cuda, 1> num_accepted,
         std::optional<Workspace> p_workspace, std::optional<DraftWorkspace> q_workspace,
         std::uintptr_t stream) {
        return accept_trees_gpu({scores, draft_probs, tokens, parents, offsets, rules, seeds,
                                 out_tokens, path_nodes, num_accepted},
                                p_workspace, q_workspace, stream);
      },
      nb::arg("scores"), nb::arg("draft_probs").none(), nb::arg("tokens"), nb::arg("parents"),
      nb::arg("offsets"), nb::arg("rules"), nb::arg("seeds"), nb::arg("out_tokens"),
      nb::arg("path_nodes"), nb::arg("num_accepted"), nb::arg("p_workspace").none(),
      nb::arg("q_workspace").none(), nb::arg("stream") = 0,
      "accept_trees on a CUDA device (one block per request); p_workspace [B, V] float64 for "
      "rules 1-3, q_workspace [B, V] float32 for rule 3.");
  m.def("context_ngram", &context_ngram_gpu, nb::arg("tokens"), nb::arg("lengths"),
        nb::arg("rows"), nb::arg("drafts"), nb::arg("draft_lengths"), nb::arg("counts"),
        nb::arg("match_len"), nb::arg("q_min"), nb::arg("q_max"), nb::arg("max_matches"),
        nb::arg("stream") = 0,
        "Context n-gram drafts on a CUDA device (one thread per request) on the given stream.");
#endif
}
