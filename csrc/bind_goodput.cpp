// Python bindings of the goodput budget's kernels for chains (chain_choice.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
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

// Checks that `pool` gives each of `sources` source codes a pool below `pools`.
void check_prior_pools(const int32_t* pool, size_t size, size_t sources, size_t pools) {
  if (size != sources) throw std::invalid_argument("pool must have one entry per source code");
  for (size_t s = 0; s < size; ++s)
    if (pool[s] < 0 || static_cast<size_t>(pool[s]) >= pools)
      throw std::invalid_argument("pool holds a pool outside first_accepted's rows");
}

vrs::ChainCalibration chain_calibration(const CpuArray<double, 4>& chances, const CpuArray<double, 4>& accepted,
                                        const CpuArray<double, 4>& observed, const CpuArray<double, 2>& first_accepted,
                                        const CpuArray<double, 2>& first_observed, const CpuArray<int32_t, 1>& pool,
                                        const CpuArray<int32_t, 1>& length_bucket,
                                        const CpuArray<int32_t, 1>& depth_bucket, double strength,
                                        double raw_prior_scale, double min_chance, double max_chance) {
  for (size_t d = 0; d < 4; ++d)
    if (accepted.shape(d) != chances.shape(d) || observed.shape(d) != chances.shape(d) || chances.shape(d) == 0)
      throw std::invalid_argument("chances, accepted and observed must share one non-empty 4-d shape");
  if (first_accepted.shape(1) != chances.shape(1) || first_observed.shape(1) != chances.shape(1) ||
      first_observed.shape(0) != first_accepted.shape(0))
    throw std::invalid_argument("first_accepted and first_observed must be [pools, match-length buckets]");
  check_prior_pools(pool.data(), pool.shape(0), chances.shape(0), first_accepted.shape(0));
  check_bucket_lookup(length_bucket.data(), length_bucket.shape(0), chances.shape(1), "length_bucket",
                      "chances.shape[1]");
  check_bucket_lookup(depth_bucket.data(), depth_bucket.shape(0), chances.shape(2), "depth_bucket", "chances.shape[2]");
  return {chances.data(), accepted.data(), observed.data(), first_accepted.data(), first_observed.data(), pool.data(),
          length_bucket.data(), static_cast<int>(length_bucket.shape(0)), depth_bucket.data(),
          static_cast<int>(depth_bucket.shape(0)), static_cast<int>(chances.shape(0)),
          static_cast<int>(chances.shape(1)), static_cast<int>(chances.shape(2)), static_cast<int>(chances.shape(3)),
          strength, raw_prior_scale, min_chance, max_chance};
}

std::tuple<NewArray<int64_t, 2>, NewArray<double, 2>, NewArray<bool, 2>> choose_chain_nodes(
    CpuArray<float, 2> prob, CpuArray<int8_t, 2> source, CpuArray<int32_t, 2> match_len, CpuArray<int32_t, 1> size,
    CpuArray<int32_t, 1> budgets, std::optional<CpuArray<bool, 1>> samples, int num_reqs, CpuArray<double, 4> chances,
    CpuArray<double, 4> accepted, CpuArray<double, 4> observed, CpuArray<double, 2> first_accepted,
    CpuArray<double, 2> first_observed, CpuArray<int32_t, 1> pool, CpuArray<int32_t, 1> length_bucket,
    CpuArray<int32_t, 1> depth_bucket, double strength, double raw_prior_scale, double min_chance, double max_chance,
    double base, double per_request, double per_token, double per_sampled_token, int64_t kernel_rows,
    double past_kernel_rows, double draft_seconds, double margin, std::optional<CpuArray<double, 2>> factor) {
  const size_t rows = prob.shape(0), width = prob.shape(1);
  if (source.shape(0) != rows || source.shape(1) != width || match_len.shape(0) != rows ||
      match_len.shape(1) != width)
    throw std::invalid_argument("prob, source and match_len must have one shape [rows, width]");
  if (size.shape(0) != rows || budgets.shape(0) != rows || (samples && samples->shape(0) != rows))
    throw std::invalid_argument("size, budgets and samples must have one entry per row");
  if (factor && (factor->shape(0) != rows || factor->shape(1) != width))
    throw std::invalid_argument("factor must have prob's shape [rows, width]");
  const vrs::ChainCalibration cal = chain_calibration(chances, accepted, observed, first_accepted, first_observed, pool,
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

template <typename T, size_t Dims>
using Writable = nb::ndarray<T, nb::ndim<Dims>, nb::c_contig, Cpu>;

// The 4-d shape every calibration array shares (one non-empty shape, or invalid_argument naming `what`).
template <typename First, typename... Rest>
void check_calibration_shape(const char* what, const First& first, const Rest&... rest) {
  for (size_t d = 0; d < 4; ++d) {
    if (first.shape(d) == 0) throw std::invalid_argument(std::string(what) + " must be non-empty");
    if (((rest.shape(d) != first.shape(d)) || ...))
      throw std::invalid_argument(std::string(what) + " must share one 4-d shape");
  }
}

using Tally = std::tuple<int64_t, int64_t, int64_t, int64_t>;

std::tuple<Tally, NewArray<int64_t, 2>> count_chain_outcomes(
    CpuArray<int32_t, 2> tokens, CpuArray<bool, 2> keep, CpuArray<int64_t, 2> bucket, CpuArray<double, 2> chance,
    CpuArray<int8_t, 2> source, std::optional<CpuArray<bool, 1>> unsent_first, CpuArray<int64_t, 1> step_rows,
    const std::vector<std::vector<int32_t>>& sampled, Writable<double, 4> accepted, Writable<double, 4> observed,
    Writable<double, 4> accepted_total, Writable<double, 4> observed_total, Writable<double, 4> predicted_total,
    std::optional<Writable<double, 1>> token_predicted, std::optional<Writable<double, 1>> token_accepted) {
  const size_t rows = tokens.shape(0), width = tokens.shape(1);
  for (size_t d = 0; d < 2; ++d)
    if (keep.shape(d) != tokens.shape(d) || bucket.shape(d) != tokens.shape(d) || chance.shape(d) != tokens.shape(d) ||
        source.shape(d) != tokens.shape(d))
      throw std::invalid_argument("tokens, keep, bucket, chance and source must have one shape [rows, width]");
  if (step_rows.shape(0) != rows || (unsent_first && unsent_first->shape(0) != rows))
    throw std::invalid_argument("step_rows and unsent_first must have one entry per pending row");
  check_calibration_shape("the calibration's counts", accepted, observed, accepted_total, observed_total,
                          predicted_total);
  if (token_predicted.has_value() != token_accepted.has_value() ||
      (token_predicted && token_predicted->shape(0) != token_accepted->shape(0)))
    throw std::invalid_argument("token_predicted and token_accepted must be given together, of one length");
  const int64_t cells = static_cast<int64_t>(accepted.size());
  const int64_t vocab = token_predicted ? static_cast<int64_t>(token_predicted->shape(0)) : 0;
  for (size_t i = 0; i < rows * width; ++i) {
    if (bucket.data()[i] < 0 || bucket.data()[i] >= cells)
      throw std::invalid_argument("bucket holds an index outside the calibration's buckets");
    if (token_predicted && tokens.data()[i] >= vocab)
      throw std::invalid_argument("tokens hold an id outside the token factors' table (grow it first)");
  }
  std::vector<const int32_t*> targets(sampled.size());
  std::vector<int> emitted(sampled.size());
  for (size_t r = 0; r < sampled.size(); ++r) {
    targets[r] = sampled[r].data();
    emitted[r] = static_cast<int>(sampled[r].size());
  }
  for (size_t r = 0; r < rows; ++r)
    if (step_rows.data()[r] < -1 || step_rows.data()[r] >= static_cast<int64_t>(sampled.size()))
      throw std::invalid_argument("step_rows must index sampled (or be -1: the request left the batch)");
  const int codes = static_cast<int>(accepted.shape(0));
  auto by_code = new_array<int64_t, 2>({2, static_cast<size_t>(codes)}, 0);
  vrs::OutcomeCounts counts{accepted.data(),
                            observed.data(),
                            accepted_total.data(),
                            observed_total.data(),
                            predicted_total.data(),
                            cells,
                            token_predicted ? token_predicted->data() : nullptr,
                            token_accepted ? token_accepted->data() : nullptr,
                            vocab,
                            by_code.data(),
                            by_code.data() + codes,
                            codes};
  const vrs::PendingChains in{static_cast<int>(rows), static_cast<int>(width), tokens.data(), keep.data(),
                              bucket.data(), chance.data(), source.data(),
                              unsent_first ? unsent_first->data() : nullptr, step_rows.data()};
  const vrs::OutcomeTally tally = vrs::count_chain_outcomes(in, targets.data(), emitted.data(), counts);
  return {Tally{tally.observed, tally.accepted, tally.unsent_observed, tally.unsent_accepted}, by_code};
}

double fill_chance_table(CpuArray<double, 4> accepted, CpuArray<double, 4> observed, double strength,
                         double raw_prior_scale, double min_chance, double max_chance, Writable<double, 4> chances,
                         Writable<float, 4> table, Writable<double, 2> first_accepted,
                         Writable<double, 2> first_observed, CpuArray<int32_t, 1> pool) {
  check_calibration_shape("accepted, observed, chances and table", accepted, observed, chances, table);
  if (first_accepted.shape(1) != accepted.shape(1) || first_observed.shape(1) != accepted.shape(1) ||
      first_observed.shape(0) != first_accepted.shape(0) || first_accepted.shape(0) == 0)
    throw std::invalid_argument("first_accepted and first_observed must be [pools, match-length buckets]");
  check_prior_pools(pool.data(), pool.shape(0), accepted.shape(0), first_accepted.shape(0));
  const vrs::CalibrationCounts in{accepted.data(),
                                  observed.data(),
                                  pool.data(),
                                  static_cast<int>(first_accepted.shape(0)),
                                  static_cast<int>(accepted.shape(0)),
                                  static_cast<int>(accepted.shape(1)),
                                  static_cast<int>(accepted.shape(2)),
                                  static_cast<int>(accepted.shape(3)),
                                  strength,
                                  raw_prior_scale,
                                  min_chance,
                                  max_chance};
  nb::gil_scoped_release release;
  return vrs::fill_chance_table(in, chances.data(), table.data(), first_accepted.data(), first_observed.data());
}

}  // namespace

void bind_goodput(nb::module_& m) {
  m.def("choose_chain_nodes", &choose_chain_nodes, nb::arg("prob"), nb::arg("source"), nb::arg("match_len"),
        nb::arg("size"), nb::arg("budgets"), nb::arg("samples").none(), nb::arg("num_reqs"), nb::arg("chances"),
        nb::arg("accepted"), nb::arg("observed"), nb::arg("first_accepted"), nb::arg("first_observed"),
        nb::arg("pool"), nb::arg("length_bucket"), nb::arg("depth_bucket"), nb::arg("strength"),
        nb::arg("raw_prior_scale"), nb::arg("min_chance"), nb::arg("max_chance"), nb::arg("base"),
        nb::arg("per_request"), nb::arg("per_token"), nb::arg("per_sampled_token"), nb::arg("kernel_rows"),
        nb::arg("past_kernel_rows"), nb::arg("draft_seconds"), nb::arg("margin"), nb::arg("factor").none() = nb::none(),
        "The goodput budget's choice among chain drafts ([rows, width] candidates, node j's parent "
        "node j - 1; factor: each node's token factor on its chance in the path products, None: "
        "none): returns new arrays bucket (int64), chance given the parent before the factor "
        "(float64, 0 past a row's size) and keep (bool), the nodes of the best expected rate.");
  m.def("count_chain_outcomes", &count_chain_outcomes, nb::arg("tokens"), nb::arg("keep"), nb::arg("bucket"),
        nb::arg("chance"), nb::arg("source"), nb::arg("unsent_first").none(), nb::arg("step_rows"),
        nb::arg("sampled"), nb::arg("accepted"), nb::arg("observed"), nb::arg("accepted_total"),
        nb::arg("observed_total"), nb::arg("predicted_total"), nb::arg("token_predicted").none(),
        nb::arg("token_accepted").none(),
        "Reads last step's chains (kept as the budget chose, [rows, width]) back from this step's "
        "sampled token lists (row r's: sampled[step_rows[r]], -1: gone) and adds their outcomes to "
        "the calibration's counts and the token factors' sums in place (None: off); returns "
        "(observed, accepted, unsent_observed, unsent_accepted) and a new int64 [2, sources] array "
        "of the nodes observed and accepted per source code.");
  m.def("fill_chance_table", &fill_chance_table, nb::arg("accepted"), nb::arg("observed"), nb::arg("strength"),
        nb::arg("raw_prior_scale"), nb::arg("min_chance"), nb::arg("max_chance"), nb::arg("chances"),
        nb::arg("table"), nb::arg("first_accepted"), nb::arg("first_observed"), nb::arg("pool"),
        "Every calibration bucket's chance into chances (float64) and table (float32), the depth-0 "
        "counts per prior pool (pool: each source code's) and match-length bucket into "
        "first_accepted and first_observed ([pools, lengths]); returns the best first chance.");
}

}  // namespace vrs_bind
