// Python bindings of vllm_retrieval_spec._C. Arrays cross as NumPy arrays or any DLPack
// producer (torch tensors included); no PyTorch headers are used.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>

#include <stdexcept>
#include <string>
#include <vector>

#include "context_ngram.h"
#include "parallel.h"
#include "rest_retrieval.h"
#ifdef VRS_WITH_CUDA
#include "context_ngram_cuda.h"
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
#ifdef VRS_WITH_CUDA
  m.def("context_ngram", &context_ngram_gpu, nb::arg("tokens"), nb::arg("lengths"),
        nb::arg("rows"), nb::arg("drafts"), nb::arg("draft_lengths"), nb::arg("counts"),
        nb::arg("match_len"), nb::arg("q_min"), nb::arg("q_max"), nb::arg("max_matches"),
        nb::arg("stream") = 0,
        "Context n-gram drafts on a CUDA device (one thread per request) on the given stream.");
#endif
}
