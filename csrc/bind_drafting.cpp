// Bindings of the drafting kernels: context n-grams (CPU, CUDA), REST retrieval and the merge
// of N-Grammys drafts into trees (CPU).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "bindings.h"
#include "context_ngram.h"
#include "draft_merge.h"
#include "parallel.h"
#include "rest_retrieval.h"
#include "store_check.h"
#ifdef VRS_WITH_CUDA
#include "context_ngram_cuda.h"
#endif

namespace vrs_bind {
namespace {

using Cpu = nb::device::cpu;

// Work worth one thread, some 30-50 us, well above the cost of handing work to a sleeping pool
// worker (~5 us): context tokens scanned by context_ngram (vLLM's ngram proposer also starts
// threads from 8192 tokens), requests for REST, draft tokens merged.
constexpr int64_t kContextNgramGrain = 8192;
constexpr int64_t kRestGrain = 8;
constexpr int64_t kMergeGrain = 16384;

// ---- Context n-grams (context_ngram.h) ----

struct ContextNgramShapes {
  int64_t num_rows;
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
  const size_t num_rows = rows.shape(0);
  if (lengths.shape(0) != tokens.shape(0))
    throw std::invalid_argument("lengths must have one entry per row of tokens");
  if (drafts.shape(0) != num_rows || draft_lengths.shape(0) != num_rows ||
      counts.shape(0) != num_rows || match_len.shape(0) != num_rows)
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
  return {static_cast<int64_t>(num_rows), vrs::ContextNgramParams{q_min, q_max, w, k, max_matches}};
}

int context_ngram_cpu(TokenMatrix<Cpu> tokens, ConstVector<Cpu> lengths, ConstVector<Cpu> rows,
                      Output<Cpu, 3> drafts, Output<Cpu, 2> draft_lengths, Output<Cpu, 2> counts,
                      Output<Cpu, 1> match_len, int q_min, int q_max, int max_matches,
                      int num_threads) {
  const auto shapes = check_context_ngram_args(tokens, lengths, rows, drafts, draft_lengths,
                                               counts, match_len, q_min, q_max, max_matches);
  const int64_t work = check_rows(tokens, lengths, rows);
  const int64_t row_len = static_cast<int64_t>(tokens.shape(1));
  const auto& prm = shapes.params;
  const int32_t* token_data = tokens.data();
  const int32_t* length_data = lengths.data();
  const int32_t* row_data = rows.data();
  int32_t* draft_data = drafts.data();
  int32_t* draft_length_data = draft_lengths.data();
  int32_t* count_data = counts.data();
  int32_t* match_len_data = match_len.data();
  nb::gil_scoped_release release;
  const vrs::ThreadPlan plan{num_threads, work, kContextNgramGrain};
  vrs::parallel_for(shapes.num_rows, plan, [&](int64_t r) {
    int match_pos[vrs::kMaxContextMatches];
    int match_count[vrs::kMaxContextMatches];
    const int64_t row = row_data[r];
    match_len_data[r] = vrs::context_ngram_one(
        token_data + row * row_len, length_data[row], prm, match_pos, match_count,
        draft_data + r * prm.k * prm.w, draft_length_data + r * prm.k, count_data + r * prm.k);
  });
  return static_cast<int>(shapes.num_rows);
}

#ifdef VRS_WITH_CUDA
using Cuda = nb::device::cuda;

int context_ngram_gpu(TokenMatrix<Cuda> tokens, ConstVector<Cuda> lengths, ConstVector<Cuda> rows,
                      Output<Cuda, 3> drafts, Output<Cuda, 2> draft_lengths, Output<Cuda, 2> counts,
                      Output<Cuda, 1> match_len, int q_min, int q_max, int max_matches,
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

// ---- REST retrieval (rest_retrieval.h) ----

using AnyVector = nb::ndarray<nb::ro, nb::ndim<1>, nb::c_contig, Cpu>;
using OffsetVector = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, Cpu>;

// A datastore's arrays, checked once: tokens (uint16/uint32) with document separators, their
// suffix array (int32/int64, as long) and optional first-token offsets.
struct SuffixStore {
  AnyVector tokens;
  AnyVector suffix_array;
  uint32_t separator;
  std::optional<OffsetVector> offsets;

  SuffixStore(AnyVector tokens_, AnyVector suffix_array_, uint32_t separator_,
              std::optional<OffsetVector> offsets_)
      : tokens(tokens_), suffix_array(suffix_array_), separator(separator_), offsets(offsets_) {
    if (tokens.dtype() != nb::dtype<uint16_t>() && tokens.dtype() != nb::dtype<uint32_t>())
      throw std::invalid_argument("store tokens must be uint16 or uint32");
    if (suffix_array.dtype() != nb::dtype<int32_t>() && suffix_array.dtype() != nb::dtype<int64_t>())
      throw std::invalid_argument("suffix_array must be int32 or int64");
    if (suffix_array.shape(0) != tokens.shape(0))
      throw std::invalid_argument("store tokens and suffix_array must have the same length");
  }

  template <typename Tok, typename Idx>
  vrs::SuffixIndex<Tok, Idx> index() const {
    return {static_cast<const Tok*>(tokens.data()), static_cast<const Idx*>(suffix_array.data()),
            static_cast<int64_t>(tokens.shape(0)), separator,
            offsets ? offsets->data() : nullptr,
            offsets ? static_cast<int64_t>(offsets->shape(0)) : 0};
  }
};

// A sharded store's merged order (merged_order.h): its uint32 or uint64 entries, the shards'
// token counts in store order and the depth it is sorted to (checked once, kept alive).
struct MergedOrderStore {
  AnyVector entries;
  std::vector<int64_t> bases;
  int depth;

  MergedOrderStore(AnyVector entries_, const std::vector<int64_t>& shard_sizes, int depth_)
      : entries(entries_), bases(shard_sizes.size() + 1, 0), depth(depth_) {
    if (entries.dtype() != nb::dtype<uint32_t>() && entries.dtype() != nb::dtype<uint64_t>())
      throw std::invalid_argument("merged order entries must be uint32 or uint64");
    if (depth < 1) throw std::invalid_argument("a merged order's depth must be >= 1");
    for (size_t s = 0; s < shard_sizes.size(); ++s) {
      if (shard_sizes[s] < 0) throw std::invalid_argument("shard sizes must be >= 0");
      bases[s + 1] = bases[s] + shard_sizes[s];
    }
    if (static_cast<int64_t>(entries.shape(0)) != bases.back())
      throw std::invalid_argument("a merged order holds one entry per token of its shards");
  }

  vrs::MergedOrder view() const {
    return {entries.data(), entries.dtype() == nb::dtype<uint64_t>(), static_cast<int64_t>(entries.shape(0)),
            bases.data(), static_cast<int>(bases.size()) - 1, depth};
  }

  // The order belongs to exactly these shards (their sizes, in order).
  void check_shards(const std::vector<const SuffixStore*>& shards) const {
    bool same = shards.size() + 1 == bases.size();
    for (size_t s = 0; same && s < shards.size(); ++s)
      same = static_cast<int64_t>(shards[s]->tokens.shape(0)) == bases[s + 1] - bases[s];
    if (!same) throw std::invalid_argument("store_order was merged from other shards than store's");
  }
};

constexpr int kMaxContextStateVotes = 1024;  // a trie count stays far from int32's limit

void check_rest_params(const vrs::RestParams& prm) {
  if (prm.n_min < 1 || prm.n_max < prm.n_min)
    throw std::invalid_argument("need 1 <= n_min <= n_max");
  if (prm.max_matches < 0 || prm.cont_len < 1)
    throw std::invalid_argument("need max_matches >= 0 and cont_len >= 1");
  if (prm.top_k < 0 || prm.chain_len < 0)
    throw std::invalid_argument("need top_k >= 0 and chain_len >= 0");
  if (prm.context_max_matches < 1 || prm.context_max_matches > vrs::kMaxContextMatches)
    throw std::invalid_argument("context_max_matches must be in [1, " +
                                std::to_string(vrs::kMaxContextMatches) + "]");
  if (prm.output_max_matches < 0)
    throw std::invalid_argument("need output_max_matches >= 0");
  if (prm.context_state_votes < 0 || prm.context_state_votes > kMaxContextStateVotes)
    throw std::invalid_argument("context_state_votes must be in [0, " + std::to_string(kMaxContextStateVotes) + "]");
  if (!(prm.context_weight >= 0) || !(prm.min_ratio >= 0) || !(prm.output_weight >= 0) ||
      !(prm.dense_weight >= 0) || !(prm.live_weight >= 0))
    throw std::invalid_argument("weights must be >= 0");
}

// The result arrays (tokens and parents -1, the rest 0): trees only when top_k > 0, timings
// only when profiled.
struct RestArrays {
  std::optional<NewArray<int32_t, 2>> tree_tokens, tree_parents;
  std::optional<NewArray<int32_t, 1>> tree_size;
  std::optional<NewArray<float, 2>> tree_prob;
  std::optional<NewArray<int8_t, 2>> tree_source;
  NewArray<int32_t, 2> chain_tokens;
  NewArray<int32_t, 1> chain_size;
  NewArray<float, 2> chain_prob;
  NewArray<int8_t, 2> chain_source;
  NewArray<int32_t, 2> match_info;
  std::optional<NewArray<int64_t, 2>> timings;

  RestArrays(size_t rows, const vrs::RestParams& prm, bool profile)
      : chain_tokens(new_array<int32_t, 2>({rows, static_cast<size_t>(prm.chain_len)}, -1)),
        chain_size(new_array<int32_t, 1>({rows}, 0)),
        chain_prob(new_array<float, 2>({rows, static_cast<size_t>(prm.chain_len)}, 0)),
        chain_source(new_array<int8_t, 2>({rows, static_cast<size_t>(prm.chain_len)}, 0)),
        match_info(new_array<int32_t, 2>({rows, static_cast<size_t>(vrs::kMatchInfo)}, 0)) {
    if (prm.top_k > 0) {
      const size_t k = static_cast<size_t>(prm.top_k);
      tree_tokens = new_array<int32_t, 2>({rows, k}, -1);
      tree_parents = new_array<int32_t, 2>({rows, k}, -1);
      tree_size = new_array<int32_t, 1>({rows}, 0);
      tree_prob = new_array<float, 2>({rows, k}, 0);
      tree_source = new_array<int8_t, 2>({rows, k}, 0);
    }
    if (profile) timings = new_array<int64_t, 2>({rows, 4}, 0);
  }

  template <typename Array>
  static auto row_of(std::optional<Array>& array, int64_t r, int64_t width) {
    return array ? array->data() + r * width : nullptr;
  }

  vrs::RestOutput row(int64_t r, const vrs::RestParams& prm) {
    const int64_t chain = r * prm.chain_len;
    return {row_of(tree_tokens, r, prm.top_k), row_of(tree_parents, r, prm.top_k),
            row_of(tree_size, r, 1),           row_of(tree_prob, r, prm.top_k),
            row_of(tree_source, r, prm.top_k), chain_tokens.data() + chain,
            chain_size.data() + r,             chain_prob.data() + chain,
            chain_source.data() + chain,       match_info.data() + r * vrs::kMatchInfo,
            row_of(timings, r, 4)};
  }

  nb::dict as_dict() const {
    nb::dict out;
    out["tree_tokens"] = tree_tokens;
    out["tree_parents"] = tree_parents;
    out["tree_size"] = tree_size;
    out["tree_prob"] = tree_prob;
    out["tree_source"] = tree_source;
    out["chain_tokens"] = chain_tokens;
    out["chain_size"] = chain_size;
    out["chain_prob"] = chain_prob;
    out["chain_source"] = chain_source;
    out["match_info"] = match_info;
    out["timings_ns"] = timings;
    return out;
  }
};

using GivenTokens = nb::ndarray<const int32_t, nb::ndim<3>, nb::c_contig, Cpu>;

// Continuations the caller found for every requested row ([rows, k, len] tokens, [rows, k]
// lengths in [0, len], optional [rows] match lengths), checked; none when absent. `name` is
// the source's argument prefix (dense, learned, live).
struct GivenInput {
  const int32_t* tokens = nullptr;
  const int32_t* lengths = nullptr;
  const int32_t* match_len = nullptr;
  int k = 0;
  int len = 0;

  GivenInput(const std::string& name, const std::optional<GivenTokens>& given_tokens,
             const std::optional<TokenMatrix<Cpu>>& given_lengths,
             const std::optional<ConstVector<Cpu>>& given_match_len, size_t num_rows) {
    if (!given_tokens && !given_lengths && !given_match_len) return;
    if (!given_tokens || !given_lengths || given_tokens->shape(0) != num_rows ||
        given_lengths->shape(0) != num_rows || given_lengths->shape(1) != given_tokens->shape(1) ||
        (given_match_len && given_match_len->shape(0) != num_rows))
      throw std::invalid_argument(name + "_tokens [rows, k, len] and " + name + "_lengths [rows, k] (and " + name +
                                  "_match_len [rows]) go together, one row per requested row");
    k = static_cast<int>(given_tokens->shape(1));
    len = static_cast<int>(given_tokens->shape(2));
    tokens = given_tokens->data();
    lengths = given_lengths->data();
    match_len = given_match_len ? given_match_len->data() : nullptr;
    for (size_t i = 0; i < num_rows * k; ++i)
      if (lengths[i] < 0 || lengths[i] > len)
        throw std::invalid_argument(name + "_lengths must lie in [0, len]");
    for (size_t i = 0; match_len != nullptr && i < num_rows; ++i)
      if (match_len[i] < 0) throw std::invalid_argument(name + "_match_len must be >= 0");
  }

  // Row r's continuations, or none.
  std::optional<vrs::GivenContinuations> row(int64_t r) const {
    if (tokens == nullptr) return std::nullopt;
    return vrs::GivenContinuations{tokens + r * k * len, lengths + r * k, k, len,
                                   match_len == nullptr ? 0 : match_len[r]};
  }
};

using ChanceArray = nb::ndarray<const float, nb::ndim<4>, nb::c_contig, Cpu>;
using BucketVector = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, Cpu>;

// The calibration's chance table with its match-length and depth bucket lookups (each entry a
// valid bucket), checked; none when absent. Its values are not scanned (a step would pay for
// every bucket): a lookup clamps what it reads to [0, 1].
std::optional<vrs::ChanceTable> chance_table_of(const std::optional<ChanceArray>& chance,
                                                const std::optional<BucketVector>& length_bucket,
                                                const std::optional<BucketVector>& depth_bucket) {
  if (!chance && !length_bucket && !depth_bucket) return std::nullopt;
  if (!chance || !length_bucket || !depth_bucket)
    throw std::invalid_argument("chance_table, length_bucket and depth_bucket go together");
  const vrs::ChanceTable table{chance->data(), static_cast<int>(chance->shape(0)),
                               static_cast<int>(chance->shape(1)), static_cast<int>(chance->shape(2)),
                               static_cast<int>(chance->shape(3)), length_bucket->data(),
                               static_cast<int>(length_bucket->shape(0)), depth_bucket->data(),
                               static_cast<int>(depth_bucket->shape(0))};
  if (table.sources < vrs::kSourceCodes || table.lengths < 1 || table.depths < 1 || table.probs < 1 ||
      table.num_length_keys < 1 || table.num_depth_keys < 1)
    throw std::invalid_argument("chance_table must be [>= " + std::to_string(vrs::kSourceCodes) +
                                " sources, lengths, depths, probs] and the bucket lookups non-empty");
  check_bucket_lookup(table.length_bucket, table.num_length_keys, table.lengths, "length_bucket",
                      "chance_table.shape[1]");
  check_bucket_lookup(table.depth_bucket, table.num_depth_keys, table.depths, "depth_bucket", "chance_table.shape[2]");
  return table;
}

// What rest_retrieve takes beside the store and the rows: given continuations and the table.
struct RestInputs {
  GivenInput dense;
  GivenInput learned;
  GivenInput live;
  std::optional<vrs::ChanceTable> table;
  const vrs::ContextStates* states = nullptr;  // with state_slots [rows]: each row's slot (-1: none)
  const int32_t* state_slots = nullptr;

  // Row r's given continuations, held in `rows` (dense, learned, live) while they are used.
  vrs::RestExtras extras(int64_t r, std::array<std::optional<vrs::GivenContinuations>, 3>& rows) const {
    rows = {dense.row(r), learned.row(r), live.row(r)};
    const auto view = [](const std::optional<vrs::GivenContinuations>& row) { return row ? &*row : nullptr; };
    return {view(rows[0]), view(rows[1]), view(rows[2]), table ? &*table : nullptr, states,
            states == nullptr ? -1 : state_slots[r]};
  }
};

// The context states and each row's slot, checked (both or neither).
std::pair<const vrs::ContextStates*, const int32_t*> context_states_of(const vrs::ContextStates* states,
                                                                       const std::optional<ConstVector<Cpu>>& slots,
                                                                       size_t num_rows) {
  if ((states == nullptr) != !slots)
    throw std::invalid_argument("context_states and state_slots go together");
  if (states == nullptr) return {nullptr, nullptr};
  if (slots->shape(0) != num_rows)
    throw std::invalid_argument("state_slots must hold one slot per requested row");
  for (size_t r = 0; r < num_rows; ++r)
    if ((*slots)(r) < -1 || (*slots)(r) >= states->max_slots())
      throw std::out_of_range("state_slots[" + std::to_string(r) + "] = " + std::to_string((*slots)(r)) +
                              " is outside [-1, " + std::to_string(states->max_slots()) + ")");
  return {states, slots->data()};
}

template <typename Tok, typename Idx>
void run_rest(const vrs::StoreShards<Tok, Idx>* store, const vrs::OutputIndex* output,
              const RestInputs& inputs, const TokenMatrix<Cpu>& tokens, const ConstVector<Cpu>& lengths,
              const ConstVector<Cpu>& rows, const vrs::RestParams& prm, RestArrays& out,
              int num_threads) {
  const int64_t row_len = static_cast<int64_t>(tokens.shape(1));
  const int32_t* token_data = tokens.data();
  const int32_t* length_data = lengths.data();
  const int32_t* row_data = rows.data();
  const int64_t num_rows = static_cast<int64_t>(rows.shape(0));
  nb::gil_scoped_release release;
  std::unique_lock<std::mutex> states_lock;
  if (inputs.states != nullptr) states_lock = std::unique_lock<std::mutex>(inputs.states->mutex());
  vrs::parallel_for(num_rows, vrs::ThreadPlan{num_threads, num_rows, kRestGrain}, [&](int64_t r) {
    thread_local vrs::ContinuationTrie trie;
    const int64_t row = row_data[r];
    std::array<std::optional<vrs::GivenContinuations>, 3> given;
    vrs::rest_retrieve_one(store, output, inputs.extras(r, given), token_data + row * row_len,
                           length_data[row], prm, trie, out.row(r, prm));
  });
}

// fn(index) with the store's index typed by its token and suffix-array dtypes.
template <typename Fn>
auto visit_index(const SuffixStore& store, Fn&& fn) {
  const bool wide = store.suffix_array.dtype() == nb::dtype<int64_t>();
  if (store.tokens.dtype() == nb::dtype<uint16_t>())
    return wide ? fn(store.index<uint16_t, int64_t>()) : fn(store.index<uint16_t, int32_t>());
  return wide ? fn(store.index<uint32_t, int64_t>()) : fn(store.index<uint32_t, int32_t>());
}

// The shards' indexes, typed as the first's (tokens Tok, suffix array Idx).
template <typename Tok, typename Idx>
std::vector<vrs::SuffixIndex<Tok, Idx>> shard_indexes(const std::vector<const SuffixStore*>& stores) {
  std::vector<vrs::SuffixIndex<Tok, Idx>> shards;
  shards.reserve(stores.size());
  for (const SuffixStore* shard : stores) shards.push_back(shard->index<Tok, Idx>());
  return shards;
}

// fn(shards) with the shards typed by the token and suffix-array dtypes all shards of a store share.
template <typename Fn>
void visit_shards(const std::vector<const SuffixStore*>& stores, vrs::SelectionCache* cache,
                  const MergedOrderStore* order, Fn&& fn) {
  for (const SuffixStore* shard : stores)
    if (shard == nullptr || shard->tokens.dtype() != stores[0]->tokens.dtype() ||
        shard->suffix_array.dtype() != stores[0]->suffix_array.dtype() || shard->separator != stores[0]->separator)
      throw std::invalid_argument("the shards of a store must share their token and suffix-array dtypes and separator");
  if (order != nullptr) order->check_shards(stores);
  const std::optional<vrs::MergedOrder> order_view = order ? std::optional(order->view()) : std::nullopt;
  visit_index(*stores[0], [&](const auto& first) {
    using Tok = std::remove_cv_t<std::remove_pointer_t<decltype(first.tokens)>>;
    using Idx = std::remove_cv_t<std::remove_pointer_t<decltype(first.suffix_array)>>;
    const std::vector<vrs::SuffixIndex<Tok, Idx>> shards = shard_indexes<Tok, Idx>(stores);
    fn(vrs::StoreShards<Tok, Idx>{shards.data(), static_cast<int>(shards.size()), cache,
                                  order_view ? &*order_view : nullptr});
  });
}

// The output index's arrays: uint32 tokens and an int32 suffix array (OutputIndex).
std::optional<vrs::OutputIndex> output_index_of(const SuffixStore* output) {
  if (output == nullptr) return std::nullopt;
  if (output->tokens.dtype() != nb::dtype<uint32_t>() ||
      output->suffix_array.dtype() != nb::dtype<int32_t>())
    throw std::invalid_argument("the output index must hold uint32 tokens and an int32 suffix array");
  return output->index<uint32_t, int32_t>();
}

nb::dict rest_retrieve(std::optional<std::vector<const SuffixStore*>> store, const SuffixStore* output,
                       TokenMatrix<Cpu> tokens,
                       ConstVector<Cpu> lengths, ConstVector<Cpu> rows, const vrs::RestParams& prm,
                       std::optional<GivenTokens> dense_tokens, std::optional<TokenMatrix<Cpu>> dense_lengths,
                       std::optional<ConstVector<Cpu>> dense_match_len, std::optional<GivenTokens> learned_tokens,
                       std::optional<TokenMatrix<Cpu>> learned_lengths,
                       std::optional<ConstVector<Cpu>> learned_match_len, std::optional<GivenTokens> live_tokens,
                       std::optional<TokenMatrix<Cpu>> live_lengths,
                       std::optional<ConstVector<Cpu>> live_match_len, std::optional<ChanceArray> chance_table,
                       std::optional<BucketVector> length_bucket, std::optional<BucketVector> depth_bucket,
                       bool profile, int num_threads, vrs::SelectionCache* store_cache,
                       const MergedOrderStore* store_order, const vrs::ContextStates* context_states,
                       std::optional<ConstVector<Cpu>> state_slots) {
  check_rest_params(prm);
  check_rows(tokens, lengths, rows);
  const size_t num_rows = rows.shape(0);
  const auto [states, slots] = context_states_of(context_states, state_slots, num_rows);
  const RestInputs inputs{GivenInput("dense", dense_tokens, dense_lengths, dense_match_len, num_rows),
                          GivenInput("learned", learned_tokens, learned_lengths, learned_match_len, num_rows),
                          GivenInput("live", live_tokens, live_lengths, live_match_len, num_rows),
                          chance_table_of(chance_table, length_bucket, depth_bucket), states, slots};
  RestArrays out(num_rows, prm, profile);
  const std::optional<vrs::OutputIndex> output_index = output_index_of(output);
  const vrs::OutputIndex* out_index = output_index ? &*output_index : nullptr;
  if (!store || store->empty() || !prm.use_datastore) {
    run_rest<uint16_t, int32_t>(nullptr, out_index, inputs, tokens, lengths, rows, prm, out, num_threads);
  } else {
    visit_shards(*store, store_cache, store_order, [&](const auto& shards) {
      run_rest(&shards, out_index, inputs, tokens, lengths, rows, prm, out, num_threads);
    });
  }
  return out.as_dict();
}

// ---- Datastore checks at open (store_check.h) ----

// The first problem of the store's suffix array, as (the suffix array alone is at fault,
// message); None when the checks pass. Reads the whole suffix array once (GIL released).
std::optional<std::tuple<bool, std::string>> check_suffix_store(const SuffixStore& store, int64_t samples,
                                                               int compare_tokens, uint64_t seed) {
  if (samples < 0 || compare_tokens < 1)
    throw std::invalid_argument("need samples >= 0 and compare_tokens >= 1");
  vrs::StoreProblem found;
  {
    nb::gil_scoped_release release;
    found = visit_index(store, [&](const auto& index) {
      return vrs::check_suffix_index(index, samples, compare_tokens, seed);
    });
  }
  if (!found.found) return std::nullopt;
  return std::make_tuple(found.suffix_array_only, found.message);
}

// Occurrences of each token below vocab_size (separators skipped), and the index of the first
// token that is neither (-1: none; counting stopped there). GIL released.
std::tuple<NewArray<int64_t, 1>, int64_t> token_counts(AnyVector tokens, uint32_t separator, int64_t vocab_size) {
  if (vocab_size < 0) throw std::invalid_argument("vocab_size must be >= 0");
  const bool narrow = tokens.dtype() == nb::dtype<uint16_t>();
  if (!narrow && tokens.dtype() != nb::dtype<uint32_t>())
    throw std::invalid_argument("tokens must be uint16 or uint32");
  auto counts = new_array<int64_t, 1>({static_cast<size_t>(vocab_size)}, 0);
  int64_t* count_data = counts.data();
  const int64_t n = static_cast<int64_t>(tokens.shape(0));
  const void* data = tokens.data();
  int64_t bad;
  {
    nb::gil_scoped_release release;
    bad = narrow ? vrs::count_tokens(static_cast<const uint16_t*>(data), n, separator, count_data, vocab_size)
                 : vrs::count_tokens(static_cast<const uint32_t*>(data), n, separator, count_data, vocab_size);
  }
  return {counts, bad};
}

void bind_rest(nb::module_& m) {
  nb::class_<vrs::RestParams>(m, "RestParams",
                              "REST settings (kernels/rest.py's RestParams holds the defaults; "
                              "every field starts at 0 here and must be set).")
      .def(nb::init<>())
      .def_rw("n_min", &vrs::RestParams::n_min)
      .def_rw("n_max", &vrs::RestParams::n_max)
      .def_rw("max_matches", &vrs::RestParams::max_matches)
      .def_rw("cont_len", &vrs::RestParams::cont_len)
      .def_rw("top_k", &vrs::RestParams::top_k)
      .def_rw("chain_len", &vrs::RestParams::chain_len)
      .def_rw("min_ratio", &vrs::RestParams::min_ratio)
      .def_rw("tree_holds_chain", &vrs::RestParams::tree_holds_chain)
      .def_rw("use_datastore", &vrs::RestParams::use_datastore)
      .def_rw("use_context", &vrs::RestParams::use_context)
      .def_rw("context_weight", &vrs::RestParams::context_weight)
      .def_rw("context_max_matches", &vrs::RestParams::context_max_matches)
      .def_rw("context_loops", &vrs::RestParams::context_loops)
      .def_rw("context_state_votes", &vrs::RestParams::context_state_votes)
      .def_rw("output_weight", &vrs::RestParams::output_weight)
      .def_rw("output_max_matches", &vrs::RestParams::output_max_matches)
      .def_rw("dense_weight", &vrs::RestParams::dense_weight)
      .def_rw("live_weight", &vrs::RestParams::live_weight);
  nb::class_<vrs::SelectionCache>(m, "SelectionCache",
                                  "The continuations REST selected from a sharded store, remembered by query "
                                  "in `slots` slots (one per store: its entries index that store's shards).")
      .def(nb::init<int>(), nb::arg("slots"));
  nb::class_<SuffixStore>(m, "SuffixStore",
                          "A datastore's token array, suffix array and optional first-token "
                          "offsets, as REST reads them (checked once, kept alive).")
      .def(nb::init<AnyVector, AnyVector, uint32_t, std::optional<OffsetVector>>(),
           nb::arg("tokens"), nb::arg("suffix_array"), nb::arg("separator"),
           nb::arg("first_token_offsets").none() = nb::none());
  m.def("check_suffix_store", &check_suffix_store, nb::arg("store"), nb::arg("samples"),
        nb::arg("compare_tokens"), nb::arg("seed") = 0,
        "Quick checks of a store read from disk (GIL released): every suffix-array entry in range "
        "and the entries a permutation (sum and sum of squares), each first-token bucket's ends "
        "starting with its token (with first_token_offsets), and adjacent suffixes in order over "
        "compare_tokens tokens (every pair when there are at most `samples`, else `samples` "
        "random pairs drawn with seed). Returns None, or (the suffix array alone is at fault, "
        "what is wrong).");
  m.def("token_counts", &token_counts, nb::arg("tokens"), nb::arg("separator"), nb::arg("vocab_size"),
        "(counts [vocab_size] int64, index of the first token neither below vocab_size nor the "
        "separator or -1) of a uint16/uint32 token array (GIL released).");
  m.def("rest_retrieve", &rest_retrieve, nb::arg("store").none(), nb::arg("output").none(), nb::arg("tokens"),
        nb::arg("lengths"), nb::arg("rows"), nb::arg("params"), nb::arg("dense_tokens").none() = nb::none(),
        nb::arg("dense_lengths").none() = nb::none(), nb::arg("dense_match_len").none() = nb::none(),
        nb::arg("learned_tokens").none() = nb::none(), nb::arg("learned_lengths").none() = nb::none(),
        nb::arg("learned_match_len").none() = nb::none(), nb::arg("live_tokens").none() = nb::none(),
        nb::arg("live_lengths").none() = nb::none(), nb::arg("live_match_len").none() = nb::none(),
        nb::arg("chance_table").none() = nb::none(), nb::arg("length_bucket").none() = nb::none(),
        nb::arg("depth_bucket").none() = nb::none(), nb::arg("profile") = false, nb::arg("num_threads") = 0,
        nb::arg("store_cache").none() = nb::none(), nb::arg("store_order").none() = nb::none(),
        nb::arg("context_states").none() = nb::none(), nb::arg("state_slots").none() = nb::none(),
        "REST drafts for tokens[rows]: datastore (a list of SuffixStore shards searched as one "
        "suffix array over their concatenation, continuations sampled through store_order, a MergedOrder of those "
        "shards, else selected across them and remembered in store_cache; unless store is None or "
        "params.use_datastore is false) + output index (unless output is None) + given dense, learned-dense and "
        "live continuations + context trie (with context_states and each row's slot in state_slots, -1: none, the "
        "context occurrence whose last token's producing state is nearest the context's last token's counts "
        "params.context_state_votes times), top-k subtree and best chain, ranked by calibrated path chance with a "
        "chance_table, else by weight (CPU threads, GIL released). Returns a dict of new arrays: "
        "tree_tokens, tree_parents, tree_prob, tree_source [rows, top_k] and tree_size [rows] (None "
        "when top_k == 0), chain_tokens, chain_prob, chain_source [rows, chain_len], chain_size "
        "[rows], match_info [rows, 6], timings_ns [rows, 4] (None unless profile).");
}

// ---- A sharded store's merged order (merged_order.h) ----

using CutMatrix = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, Cpu>;
using OrderOutput = nb::ndarray<nb::ndim<1>, nb::c_contig, Cpu>;

// fn(merger) over the shards, typed by their dtypes.
template <typename Fn>
void visit_merger(const std::vector<const SuffixStore*>& shards, int depth, Fn&& fn) {
  if (shards.empty()) throw std::invalid_argument("a merged order needs at least one shard");
  if (depth < 1) throw std::invalid_argument("depth must be >= 1");
  visit_shards(shards, nullptr, nullptr, [&](const auto& store) {
    using Index = std::remove_cv_t<std::remove_pointer_t<decltype(store.shards)>>;
    fn(vrs::ShardMerger<Index>(store.shards, store.count, depth));
  });
}

NewArray<int64_t, 2> merged_order_cuts(const std::vector<const SuffixStore*>& shards, int parts, int depth) {
  if (parts < 1) throw std::invalid_argument("parts must be >= 1");
  std::vector<int64_t> cuts;
  {
    nb::gil_scoped_release release;
    visit_merger(shards, depth, [&](const auto& merger) { cuts = merger.cuts(parts); });
  }
  auto out = new_array<int64_t, 2>({static_cast<size_t>(parts) + 1, shards.size()}, 0);
  std::copy(cuts.begin(), cuts.end(), out.data());
  return out;
}

// Parts [first, last) of cuts merged into out, which starts where part `first` does.
void merge_shard_parts(const std::vector<const SuffixStore*>& shards, CutMatrix cuts, int first, int last,
                       int depth, OrderOutput out, int num_threads) {
  const int count = static_cast<int>(shards.size());
  if (static_cast<int>(cuts.shape(1)) != count || first < 0 || last <= first ||
      last >= static_cast<int>(cuts.shape(0)))
    throw std::invalid_argument("cuts must be [parts + 1, shards] and 0 <= first < last <= parts");
  const int64_t* cut = cuts.data();
  int64_t total = 0, entries = 0;
  for (int s = 0; s < count; ++s) {
    total += static_cast<int64_t>(shards[s]->tokens.shape(0));
    for (int k = first; k < last; ++k)
      if (cut[k * count + s] < 0 || cut[k * count + s] > cut[(k + 1) * count + s] ||
          cut[(k + 1) * count + s] > static_cast<int64_t>(shards[s]->tokens.shape(0)))
        throw std::invalid_argument("cuts must grow within each shard");
    entries += cut[last * count + s] - cut[first * count + s];
  }
  const bool wide = out.dtype() == nb::dtype<uint64_t>();
  if ((!wide && out.dtype() != nb::dtype<uint32_t>()) || static_cast<int64_t>(out.shape(0)) != entries)
    throw std::invalid_argument("out must be uint32 or uint64 with one entry per merged suffix");
  if (!wide && total > static_cast<int64_t>(UINT32_MAX)) throw std::invalid_argument("uint32 entries hold 2^32 tokens");
  nb::gil_scoped_release release;
  visit_merger(shards, depth, [&](const auto& merger) {
    vrs::parallel_for(last - first, vrs::ThreadPlan{num_threads, last - first, 1}, [&](int64_t i) {
      const int64_t* lo = cut + (first + i) * count;
      int64_t offset = 0;
      for (int s = 0; s < count; ++s) offset += lo[s] - cut[first * count + s];
      if (wide) merger.merge(lo, lo + count, static_cast<uint64_t*>(out.data()) + offset);
      else merger.merge(lo, lo + count, static_cast<uint32_t*>(out.data()) + offset);
    });
  });
}

void bind_merged_order(nb::module_& m) {
  nb::class_<MergedOrderStore>(m, "MergedOrder",
                               "A sharded store's merged order: one uint32/uint64 entry per token (the position "
                               "in the shards' concatenated tokens of the suffix at each rank), the shards' token "
                               "counts in store order and the depth it is sorted to (checked once, kept alive).")
      .def(nb::init<AnyVector, const std::vector<int64_t>&, int>(), nb::arg("entries"), nb::arg("shard_sizes"),
           nb::arg("depth"));
  m.def("merged_order_cuts", &merged_order_cuts, nb::arg("shards"), nb::arg("parts"), nb::arg("depth"),
        "[parts + 1, shards] int64: where each part of a merged order starts in every shard (list of "
        "SuffixStore), cut at evenly spaced suffixes of the largest (GIL released).");
  m.def("merge_shard_parts", &merge_shard_parts, nb::arg("shards"), nb::arg("cuts"), nb::arg("first"),
        nb::arg("last"), nb::arg("depth"), nb::arg("out"), nb::arg("num_threads") = 0,
        "Merge parts [first, last) of cuts into out (uint32/uint64, starting at part first): the shards' "
        "suffixes sorted by their first depth tokens, ties in shard order, as positions in their "
        "concatenated tokens (parts on the thread pool, GIL released).");
}

// ---- Merging drafts into trees (draft_merge.h) ----

using DraftBlock = nb::ndarray<const int32_t, nb::ndim<3>, nb::c_contig, Cpu>;
using DraftLengths = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, Cpu>;
using DraftWeights = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, Cpu>;

std::tuple<NewArray<int32_t, 2>, NewArray<int32_t, 2>, NewArray<int32_t, 1>, NewArray<float, 2>>
merge_drafts(DraftBlock drafts, DraftLengths lengths, std::optional<DraftWeights> weights,
             int num_threads) {
  const size_t rows = drafts.shape(0), k = drafts.shape(1), w = drafts.shape(2);
  if (lengths.shape(0) != rows || lengths.shape(1) != k)
    throw std::invalid_argument("lengths must have shape [rows, k]");
  if (weights && (weights->shape(0) != rows || weights->shape(1) != k))
    throw std::invalid_argument("weights must have shape [rows, k]");
  std::vector<float> unit;
  if (!weights) unit.assign(rows * k, 1.0f);
  const float* weight_data = weights ? weights->data() : unit.data();
  for (size_t i = 0; i < rows * k; ++i)
    if (lengths.data()[i] < 0 || static_cast<size_t>(lengths.data()[i]) > w)
      throw std::out_of_range("lengths[" + std::to_string(i / k) + ", " + std::to_string(i % k) +
                              "] = " + std::to_string(lengths.data()[i]) + " is outside [0, " +
                              std::to_string(w) + "]");
  auto tokens = new_array<int32_t, 2>({rows, k * w}, -1);
  auto parents = new_array<int32_t, 2>({rows, k * w}, -1);
  auto sizes = new_array<int32_t, 1>({rows}, 0);
  auto node_weights = new_array<float, 2>({rows, k * w}, 0.0f);
  float* node_weight_data = node_weights.data();
  const int32_t* draft_data = drafts.data();
  const int32_t* length_data = lengths.data();
  int32_t* token_data = tokens.data();
  int32_t* parent_data = parents.data();
  int32_t* size_data = sizes.data();
  const int64_t width = static_cast<int64_t>(k * w);
  {
    nb::gil_scoped_release release;
    const vrs::ThreadPlan plan{num_threads, static_cast<int64_t>(rows) * width, kMergeGrain};
    vrs::parallel_for(static_cast<int64_t>(rows), plan, [&](int64_t r) {
      thread_local vrs::DraftMerger merger;
      size_data[r] = merger.merge(draft_data + r * width, length_data + r * k,
                                  weight_data + r * k, static_cast<int>(k), static_cast<int>(w),
                                  token_data + r * width, parent_data + r * width,
                                  node_weight_data + r * width);
    });
  }
  return {tokens, parents, sizes, node_weights};
}

}  // namespace

void bind_drafting(nb::module_& m) {
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
  bind_rest(m);
  bind_merged_order(m);
  m.def("merge_drafts", &merge_drafts, nb::arg("drafts"), nb::arg("lengths"),
        nb::arg("weights").none() = nb::none(), nb::arg("num_threads") = 0,
        "Each row's k drafts [rows, k, w] (lengths [rows, k]) merged into one tree, nodes in the "
        "order first met (CPU threads, GIL released). Returns new arrays tree_tokens, "
        "tree_parents [rows, k * w] (-1 padded; parent -1 = the root), tree_size [rows] and "
        "tree_weight [rows, k * w]: the sum of weights [rows, k] (default 1) of the drafts "
        "through each node.");
}

}  // namespace vrs_bind
