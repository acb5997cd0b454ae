// Python bindings of vllm_retrieval_spec._C. Arrays cross as NumPy arrays or any DLPack
// producer (torch tensors included); no PyTorch headers are used.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "context_ngram.h"
#include "parallel.h"
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

int context_ngram_cpu(TokenMatrix<nb::device::cpu> tokens, ConstVector<nb::device::cpu> lengths,
                      ConstVector<nb::device::cpu> rows, Output<nb::device::cpu, 3> drafts,
                      Output<nb::device::cpu, 2> draft_lengths, Output<nb::device::cpu, 2> counts,
                      Output<nb::device::cpu, 1> match_len, int q_min, int q_max, int max_matches,
                      int num_threads) {
  const auto shapes = check_context_ngram_args(tokens, lengths, rows, drafts, draft_lengths,
                                               counts, match_len, q_min, q_max, max_matches);
  const long num_token_rows = static_cast<long>(tokens.shape(0));
  const long row_len = static_cast<long>(tokens.shape(1));
  for (long r = 0; r < shapes.num_rows; ++r) {
    const long row = rows(r);
    if (row < 0 || row >= num_token_rows)
      throw std::out_of_range("rows[" + std::to_string(r) + "] = " + std::to_string(row) +
                              " is outside tokens' " + std::to_string(num_token_rows) + " rows");
    if (lengths(row) < 0 || lengths(row) > row_len)
      throw std::out_of_range("lengths[" + std::to_string(row) + "] = " +
                              std::to_string(lengths(row)) + " is outside [0, " +
                              std::to_string(row_len) + "]");
  }
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
#ifdef VRS_WITH_CUDA
  m.def("context_ngram", &context_ngram_gpu, nb::arg("tokens"), nb::arg("lengths"),
        nb::arg("rows"), nb::arg("drafts"), nb::arg("draft_lengths"), nb::arg("counts"),
        nb::arg("match_len"), nb::arg("q_min"), nb::arg("q_max"), nb::arg("max_matches"),
        nb::arg("stream") = 0,
        "Context n-gram drafts on a CUDA device (one thread per request) on the given stream.");
#endif
}
