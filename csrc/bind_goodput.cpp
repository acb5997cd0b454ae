// Python bindings of the goodput budget's kernels for chains (chain_choice.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "chain_choice.h"

namespace vrs_bind {
namespace {

using Cpu = nb::device::cpu;
template <typename T, size_t Dims>
using CpuArray = nb::ndarray<const T, nb::ndim<Dims>, nb::c_contig, Cpu>;

vrs::ChainCalibration chain_calibration(const CpuArray<double, 4>& chances, const CpuArray<double, 4>& accepted,
                                        const CpuArray<double, 4>& observed, const CpuArray<double, 1>& first_accepted,
                                        const CpuArray<double, 1>& first_observed,
                                        const CpuArray<int32_t, 1>& length_bucket,
                                        const CpuArray<int32_t, 1>& depth_bucket, double strength,
                                        double raw_prior_scale, double min_chance, double max_chance) {
  for (size_t d = 0; d < 4; ++d)
    if (accepted.shape(d) != chances.shape(d) || observed.shape(d) != chances.shape(d) || chances.shape(d) == 0)
      throw std::invalid_argument("chances, accepted and observed must share one non-empty 4-d shape");
  if (first_accepted.shape(0) != chances.shape(1) || first_observed.shape(0) != chances.shape(1))
    throw std::invalid_argument("first_accepted and first_observed must have one entry per match-length bucket");
  check_bucket_lookup(length_bucket.data(), length_bucket.shape(0), chances.shape(1), "length_bucket",
                      "chances.shape[1]");
  check_bucket_lookup(depth_bucket.data(), depth_bucket.shape(0), chances.shape(2), "depth_bucket", "chances.shape[2]");
  return {chances.data(), accepted.data(), observed.data(), first_accepted.data(), first_observed.data(),
          length_bucket.data(), static_cast<int>(length_bucket.shape(0)), depth_bucket.data(),
          static_cast<int>(depth_bucket.shape(0)), static_cast<int>(chances.shape(0)),
          static_cast<int>(chances.shape(1)), static_cast<int>(chances.shape(2)), static_cast<int>(chances.shape(3)),
          strength, raw_prior_scale, min_chance, max_chance};
}

std::tuple<NewArray<int64_t, 2>, NewArray<double, 2>, NewArray<bool, 2>> choose_chain_nodes(
    CpuArray<float, 2> prob, CpuArray<int8_t, 2> source, CpuArray<int32_t, 2> match_len, CpuArray<int32_t, 1> size,
    CpuArray<int32_t, 1> budgets, std::optional<CpuArray<bool, 1>> samples, int num_reqs, CpuArray<double, 4> chances,
    CpuArray<double, 4> accepted, CpuArray<double, 4> observed, CpuArray<double, 1> first_accepted,
    CpuArray<double, 1> first_observed, CpuArray<int32_t, 1> length_bucket, CpuArray<int32_t, 1> depth_bucket,
    double strength, double raw_prior_scale, double min_chance, double max_chance, double base, double per_request,
    double per_token, double per_sampled_token, int64_t kernel_rows, double past_kernel_rows, double draft_seconds,
    double margin, std::optional<CpuArray<double, 2>> factor) {
  const size_t rows = prob.shape(0), width = prob.shape(1);
  if (source.shape(0) != rows || source.shape(1) != width || match_len.shape(0) != rows ||
      match_len.shape(1) != width)
    throw std::invalid_argument("prob, source and match_len must have one shape [rows, width]");
  if (size.shape(0) != rows || budgets.shape(0) != rows || (samples && samples->shape(0) != rows))
    throw std::invalid_argument("size, budgets and samples must have one entry per row");
  if (factor && (factor->shape(0) != rows || factor->shape(1) != width))
    throw std::invalid_argument("factor must have prob's shape [rows, width]");
  const vrs::ChainCalibration cal = chain_calibration(chances, accepted, observed, first_accepted, first_observed,
                                                      length_bucket, depth_bucket, strength, raw_prior_scale,
                                                      min_chance, max_chance);
  const vrs::ChainCandidates in{static_cast<int>(rows), static_cast<int>(width), prob.data(), source.data(),
                                match_len.data(), size.data(), budgets.data(),
                                samples ? samples->data() : nullptr, factor ? factor->data() : nullptr, num_reqs};
  auto bucket = new_array<int64_t, 2>({rows, width}, 0);
  auto chance = new_array<double, 2>({rows, width}, 0.0);
  auto keep = new_array<bool, 2>({rows, width}, false);
  {
    nb::gil_scoped_release release;
    thread_local vrs::ChainChooser chooser;
    chooser.choose(in, cal, {base, per_request, per_token, per_sampled_token, kernel_rows, past_kernel_rows},
                   draft_seconds, margin, bucket.data(), chance.data(), keep.data());
  }
  return {bucket, chance, keep};
}

std::tuple<NewArray<bool, 2>, NewArray<bool, 2>> chain_outcomes(CpuArray<int32_t, 2> tokens, CpuArray<bool, 2> keep,
                                                                 const std::vector<std::vector<int32_t>>& sampled) {
  const size_t rows = tokens.shape(0), width = tokens.shape(1);
  if (keep.shape(0) != rows || keep.shape(1) != width || sampled.size() != rows)
    throw std::invalid_argument("tokens, keep and sampled must have one row per drafted request, [rows, width]");
  auto accepted = new_array<bool, 2>({rows, width}, false);
  auto observed = new_array<bool, 2>({rows, width}, false);
  for (size_t r = 0; r < rows; ++r)
    vrs::chain_outcomes(tokens.data() + r * width, keep.data() + r * width, static_cast<int>(width),
                        sampled[r].data(), static_cast<int>(sampled[r].size()), accepted.data() + r * width,
                        observed.data() + r * width);
  return {accepted, observed};
}

}  // namespace

void bind_goodput(nb::module_& m) {
  m.def("choose_chain_nodes", &choose_chain_nodes, nb::arg("prob"), nb::arg("source"), nb::arg("match_len"),
        nb::arg("size"), nb::arg("budgets"), nb::arg("samples").none(), nb::arg("num_reqs"), nb::arg("chances"),
        nb::arg("accepted"), nb::arg("observed"), nb::arg("first_accepted"), nb::arg("first_observed"),
        nb::arg("length_bucket"), nb::arg("depth_bucket"), nb::arg("strength"), nb::arg("raw_prior_scale"),
        nb::arg("min_chance"), nb::arg("max_chance"), nb::arg("base"), nb::arg("per_request"),
        nb::arg("per_token"), nb::arg("per_sampled_token"), nb::arg("kernel_rows"), nb::arg("past_kernel_rows"),
        nb::arg("draft_seconds"), nb::arg("margin"), nb::arg("factor").none() = nb::none(),
        "The goodput budget's choice among chain drafts ([rows, width] candidates, node j's parent "
        "node j - 1; factor: each node's token factor on its chance in the path products, None: "
        "none): returns new arrays bucket (int64), chance given the parent before the factor "
        "(float64, 0 past a row's size) and keep (bool), the nodes of the best expected rate.");
  m.def("chain_outcomes", &chain_outcomes, nb::arg("tokens"), nb::arg("keep"), nb::arg("sampled"),
        "What verification made of each row's chain (tokens and kept nodes [rows, width]) given "
        "the tokens the target sampled for the row: new bool arrays accepted and observed.");
}

}  // namespace vrs_bind
