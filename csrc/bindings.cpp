// The module vllm_retrieval_spec._C: backends, the thread pool's probe, and the kernels bound
// in bind_drafting.cpp and bind_trees.cpp.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bindings.h"
#include "context_ngram.h"
#include "isa_clones.h"
#include "parallel.h"
#include "skinny_gemm.h"
#ifdef VRS_WITH_CUDA
#include "context_ngram_cuda.h"
#endif

namespace vrs_bind {

int64_t check_rows(const TokenMatrix<nb::device::cpu>& tokens,
                   const ConstVector<nb::device::cpu>& lengths,
                   const ConstVector<nb::device::cpu>& rows) {
  if (lengths.shape(0) != tokens.shape(0))
    throw std::invalid_argument("lengths must have one entry per row of tokens");
  const int64_t num_token_rows = static_cast<int64_t>(tokens.shape(0));
  const int64_t row_len = static_cast<int64_t>(tokens.shape(1));
  int64_t total = 0;
  for (size_t r = 0; r < rows.shape(0); ++r) {
    const int64_t row = rows(r);
    if (row < 0 || row >= num_token_rows)
      throw std::out_of_range("rows[" + std::to_string(r) + "] = " + std::to_string(row) +
                              " is outside tokens' " + std::to_string(num_token_rows) + " rows");
    if (lengths(row) < 0 || lengths(row) > row_len)
      throw std::out_of_range("lengths[" + std::to_string(row) + "] = " +
                              std::to_string(lengths(row)) + " is outside [0, " +
                              std::to_string(row_len) + "]");
    total += lengths(row);
  }
  return total;
}

void check_bucket_lookup(const int32_t* lookup, size_t count, int64_t axis_size, const std::string& name,
                         const std::string& axis) {
  if (count == 0) throw std::invalid_argument(name + " is empty");
  for (size_t i = 0; i < count; ++i)
    if (lookup[i] < 0 || lookup[i] >= axis_size)
      throw std::invalid_argument(name + " entries must lie in [0, " + axis + "), not " + name + "[" +
                                  std::to_string(i) + "] = " + std::to_string(lookup[i]));
}

}  // namespace vrs_bind

namespace {

namespace nb = nanobind;

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

// Runs n_items items through parallel_for (one work unit each); returns the hash of the
// thread that ran each item. Item fail_at throws; each item spins for busy_ns.
std::vector<uint64_t> thread_pool_probe(int64_t n_items, int num_threads, int64_t grain,
                                        int64_t fail_at, int64_t busy_ns, bool on_team) {
  if (n_items < 0) throw std::invalid_argument("n_items must be >= 0");
  std::vector<uint64_t> ran_on(static_cast<size_t>(n_items));
  nb::gil_scoped_release release;
  const vrs::ThreadPlan plan{num_threads, n_items, grain};
  const auto item = [&](int64_t i) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(busy_ns);
    while (std::chrono::steady_clock::now() < until) {
    }
    if (i == fail_at) throw std::runtime_error("thread_pool_probe: item " + std::to_string(i));
    ran_on[i] = std::hash<std::thread::id>{}(std::this_thread::get_id());
  };
  if (on_team) vrs::team_parallel_for(n_items, plan, item);
  else vrs::parallel_for(n_items, plan, item);
  return ran_on;
}

// The skinny GEMM on tensors the caller packed and checked (kernels/skinny_gemm.py): raw addresses, so that
// a layer's call costs no DLPack exchange (~120 calls a model step).
void skinny_gemm(uintptr_t x, uintptr_t weight, uintptr_t bias, uintptr_t out, int64_t rows, int64_t in_features,
                 int64_t out_features) {
  if (!x || !weight || !out) throw std::invalid_argument("skinny_gemm: x, weight and out must be non-null");
  if (rows < 1 || in_features < 1 || out_features < 1)
    throw std::invalid_argument("skinny_gemm: rows, in_features and out_features must be >= 1");
  nb::gil_scoped_release release;
  vrs::skinny_gemm_cpu({reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(weight),
                        reinterpret_cast<const float*>(bias), reinterpret_cast<float*>(out), rows, in_features,
                        out_features});
}

// The screened head (skinny_gemm.h) on tensors the caller packed and checked (kernels/skinny_gemm.py).
bool screened_head(uintptr_t x, uintptr_t weight_bf16, uintptr_t weight, uintptr_t norms, uintptr_t panel_norms,
                   uintptr_t out, int64_t rows, int64_t in_features, int64_t out_features, int64_t valid_features,
                   bool pairs) {
  if (!x || !weight_bf16 || !weight || !norms || !panel_norms || !out)
    throw std::invalid_argument("screened_head: x, the weights, norms and out must be non-null");
  if (rows < 1 || in_features < 1 || valid_features < 1 || valid_features > out_features)
    throw std::invalid_argument("screened_head: need rows, in_features >= 1 and 1 <= valid_features <= out_features");
  nb::gil_scoped_release release;
  return vrs::screened_head_cpu({reinterpret_cast<const float*>(x), reinterpret_cast<const uint16_t*>(weight_bf16),
                                 reinterpret_cast<const float*>(weight), reinterpret_cast<const float*>(norms),
                                 reinterpret_cast<const float*>(panel_norms), reinterpret_cast<float*>(out), nullptr,
                                 rows, in_features, out_features, valid_features, pairs, nullptr});
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "Hot paths of vllm_retrieval_spec (CPU threads; CUDA when built with nvcc).";
  m.attr("MAX_CONTEXT_MATCHES") = vrs::kMaxContextMatches;
  m.def("backends", &backends, "Backends this build was compiled with, e.g. ['cpu', 'cuda'].");
  m.def("cuda_device_count", &device_count,
        "CUDA devices visible to this build (0 without CUDA support, driver or device).");
  m.def("available_cores", &vrs::available_cores,
        "Cores this process may run on (its CPU affinity): the threads num_threads=0 allows.");
  m.def("thread_pool_probe", &thread_pool_probe, nb::arg("n_items"), nb::arg("num_threads") = 0,
        nb::arg("grain") = 1, nb::arg("fail_at") = -1, nb::arg("busy_ns") = 0, nb::arg("on_team") = false,
        "Diagnostics of the kernels' thread pool: runs n_items items (one work unit each, "
        "`grain` units worth a thread), each spinning busy_ns, item fail_at raising "
        "RuntimeError, on the pool or (on_team) on torch's OpenMP team; returns the hash of the "
        "thread that ran each item.");
  m.def("skinny_gemm", &skinny_gemm, nb::arg("x"), nb::arg("weight"), nb::arg("bias"), nb::arg("out"),
        nb::arg("rows"), nb::arg("in_features"), nb::arg("out_features"),
        "out = x @ weight.T (+ bias) for float32 CPU buffers given by address (bias 0: none): x [rows, "
        "in_features], weight packed [ceil(out_features / SKINNY_GEMM_PANEL), in_features, SKINNY_GEMM_PANEL], "
        "out [rows, out_features], all contiguous. Use vllm_retrieval_spec.kernels.skinny_gemm, which packs "
        "and checks the tensors.");
  m.def("screened_head", &screened_head, nb::arg("x"), nb::arg("weight_bf16"), nb::arg("weight"), nb::arg("norms"),
        nb::arg("panel_norms"), nb::arg("out"), nb::arg("rows"), nb::arg("in_features"), nb::arg("out_features"), nb::arg("valid_features"),
        nb::arg("pairs"),
        "out = x @ weight.T exactly (as skinny_gemm) on the panels that may hold each row's largest of the first "
        "valid_features outputs, -inf elsewhere, screened by the bfloat16 copy of the packed weight (norms: each "
        "output's weight row norm, rounded up; panel_norms: each panel's largest; pairs: weight_bf16 in k-pairs, "
        "[panels, ceil(in / 2), 16, 2], for the bfloat16 dot product); False when x or an output is not finite or "
        "for more rows than screened_head_max_rows(pairs). Use vllm_retrieval_spec.kernels.skinny_gemm.ScreenedHead.");
  m.def("screened_head_max_rows", &vrs::screened_head_max_rows, nb::arg("pairs"),
        "Rows up to which screened_head runs (past them the full head is the faster), on the blocks in use.");
  m.def("screened_head_pairs", &vrs::screened_head_pairs,
        "Whether this CPU runs screened_head's bfloat16 dot product (AVX512_BF16): its weights then go in k-pairs.");
  m.attr("SKINNY_GEMM_PANEL") = vrs::kSkinnyGemmPanel;
  m.def("skinny_gemm_threads", &vrs::skinny_gemm_threads,
        "Threads skinny_gemm runs on: torch's OpenMP team once torch is loaded, else 1.");
  m.def("use_wide_lanes", &vrs::use_wide_lanes, nb::arg("enabled"),
        "Turns the skinny GEMM's and the attention kernel's AVX-512 paths on (where the CPU has "
        "AVX-512F and VL, as at start) or off (their AVX2 blocks: the same sums, bit for bit); "
        "returns whether they were on. For tests and benchmarks.");
  m.def("cpu_has_wide_lanes", &vrs::cpu_has_wide_lanes,
        "Whether this CPU runs the skinny GEMM's and the attention kernel's AVX-512 paths (AVX-512F and VL).");
  vrs_bind::bind_drafting(m);
  vrs_bind::bind_trees(m);
  vrs_bind::bind_live(m);
  vrs_bind::bind_goodput(m);
}
