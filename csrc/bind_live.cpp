// Bindings of the state kept of requests in flight: the live index of their tokens (live_index.h)
// and their hidden states by position (context_states.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "context_states.h"
#include "live_index.h"
#include "parallel.h"

namespace vrs_bind {
namespace {

using Cpu = nb::device::cpu;
using RequestIds = std::vector<std::optional<std::string>>;

// Rows looked up worth one thread (each walks a few hash chains).
constexpr int64_t kLiveGrain = 8;
constexpr int kMaxLiveMatches = 65536;
constexpr int kMaxLiveContinuation = 4096;

// The index and the lock that keeps a second Python thread from changing it mid-lookup.
struct LiveIndexHandle {
  vrs::LiveIndex index;
  std::mutex mutex;

  LiveIndexHandle(int64_t capacity, std::vector<int> lengths, int64_t max_request_tokens,
                  int max_walk)
      : index(vrs::LiveIndexParams{capacity, std::move(lengths), max_request_tokens, max_walk}) {}
};

void check_request_rows(const RequestIds& req_ids, const TokenMatrix<Cpu>& tokens,
                        const ConstVector<Cpu>& num_tokens) {
  if (num_tokens.shape(0) != tokens.shape(0))
    throw std::invalid_argument("num_tokens must have one entry per row of token_ids");
  if (req_ids.size() > tokens.shape(0))
    throw std::invalid_argument("req_ids has " + std::to_string(req_ids.size()) +
                                " entries but token_ids only " + std::to_string(tokens.shape(0)) +
                                " rows");
}

void update(LiveIndexHandle& handle, const RequestIds& req_ids, TokenMatrix<Cpu> tokens,
            ConstVector<Cpu> num_tokens) {
  check_request_rows(req_ids, tokens, num_tokens);
  const int64_t width = static_cast<int64_t>(tokens.shape(1));
  for (size_t row = 0; row < req_ids.size(); ++row)
    if (req_ids[row] && (num_tokens(row) < 0 || num_tokens(row) > width))
      throw std::out_of_range("num_tokens[" + std::to_string(row) + "] = " +
                              std::to_string(num_tokens(row)) + " is outside [0, " +
                              std::to_string(width) + "]");
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(handle.mutex);
  for (size_t row = 0; row < req_ids.size(); ++row)
    if (req_ids[row])
      handle.index.sync(*req_ids[row], tokens.data() + row * width, num_tokens(row));
}

void remove(LiveIndexHandle& handle, const std::vector<std::string>& req_ids) {
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(handle.mutex);
  for (const std::string& id : req_ids) handle.index.remove(id);
}

void check_lookup_args(const RequestIds& req_ids, const ConstVector<Cpu>& rows, int max_matches,
                       int cont_len) {
  if (max_matches < 1 || max_matches > kMaxLiveMatches)
    throw std::invalid_argument("max_matches must be in [1, " + std::to_string(kMaxLiveMatches) +
                                "], got " + std::to_string(max_matches));
  if (cont_len < 1 || cont_len > kMaxLiveContinuation)
    throw std::invalid_argument("cont_len must be in [1, " + std::to_string(kMaxLiveContinuation) +
                                "], got " + std::to_string(cont_len));
  for (size_t r = 0; r < rows.shape(0); ++r)
    if (static_cast<size_t>(rows(r)) >= req_ids.size())
      throw std::out_of_range("rows[" + std::to_string(r) + "] = " + std::to_string(rows(r)) +
                              " has no entry in req_ids (" + std::to_string(req_ids.size()) + ")");
}

std::tuple<NewArray<int32_t, 3>, NewArray<int32_t, 2>, NewArray<int32_t, 1>> lookup(
    LiveIndexHandle& handle, const RequestIds& req_ids, TokenMatrix<Cpu> tokens,
    ConstVector<Cpu> num_tokens, ConstVector<Cpu> rows, int max_matches, int cont_len,
    int num_threads) {
  check_request_rows(req_ids, tokens, num_tokens);
  check_rows(tokens, num_tokens, rows);
  check_lookup_args(req_ids, rows, max_matches, cont_len);
  const size_t n = rows.shape(0), k = static_cast<size_t>(max_matches);
  const size_t len = static_cast<size_t>(cont_len);
  auto out_tokens = new_array<int32_t, 3>({n, k, len}, -1);
  auto out_lengths = new_array<int32_t, 2>({n, k}, 0);
  auto match_len = new_array<int32_t, 1>({n}, 0);
  const int64_t width = static_cast<int64_t>(tokens.shape(1));
  int32_t* token_data = out_tokens.data();
  int32_t* length_data = out_lengths.data();
  int32_t* match_data = match_len.data();
  {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(handle.mutex);
    std::vector<int> own(n);
    for (size_t r = 0; r < n; ++r) {
      const auto& id = req_ids[rows(r)];
      own[r] = id ? handle.index.slot(*id) : -1;
    }
    const vrs::LiveIndex& index = handle.index;
    const vrs::ThreadPlan plan{num_threads, static_cast<int64_t>(n), kLiveGrain};
    vrs::parallel_for(static_cast<int64_t>(n), plan, [&](int64_t r) {
      const int64_t row = rows(r);
      const vrs::LiveRowOutput out{token_data + r * k * len, length_data + r * k, match_data + r,
                                   max_matches, cont_len};
      index.lookup(own[r], tokens.data() + row * width, num_tokens(row), out);
    });
  }
  return {out_tokens, out_lengths, match_len};
}

template <typename Value>
Value locked(LiveIndexHandle& handle, Value (vrs::LiveIndex::*read)() const) {
  std::lock_guard<std::mutex> lock(handle.mutex);
  return (handle.index.*read)();
}

using Int64Vector = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, Cpu>;
using StateMatrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, Cpu>;

void write_states(vrs::ContextStates& states, ConstVector<Cpu> slots, Int64Vector positions, StateMatrix values) {
  const size_t count = slots.shape(0);
  if (positions.shape(0) != count || values.shape(0) != count ||
      values.shape(1) != static_cast<size_t>(states.dim()))
    throw std::invalid_argument("slots [n], positions [n] and states [n, " + std::to_string(states.dim()) +
                                "] go together");
  for (size_t i = 0; i < count; ++i)
    if (slots(i) < 0 || slots(i) >= states.max_slots() || positions(i) < 0 ||
        positions(i) >= states.max_positions())
      throw std::out_of_range("slots[" + std::to_string(i) + "] = " + std::to_string(slots(i)) + ", positions[" +
                              std::to_string(i) + "] = " + std::to_string(positions(i)) + " are outside [0, " +
                              std::to_string(states.max_slots()) + ") x [0, " +
                              std::to_string(states.max_positions()) + ")");
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(states.mutex());
  for (size_t i = 0; i < count; ++i) states.write(slots(i), positions(i), values.data() + i * states.dim());
}

void release_slot(vrs::ContextStates& states, int32_t slot) {
  if (slot < 0 || slot >= states.max_slots())
    throw std::out_of_range("slot " + std::to_string(slot) + " is outside [0, " +
                            std::to_string(states.max_slots()) + ")");
  std::lock_guard<std::mutex> lock(states.mutex());
  states.release(slot);
}

}  // namespace

void bind_live(nb::module_& m) {
  nb::class_<vrs::ContextStates>(
      m, "ContextStates",
      "Hidden states (dim floats, stored as unit vectors) of up to max_slots requests in flight by the position "
      "of the token each produced, below max_positions; REST's context source follows the occurrence whose "
      "last token's producing state is nearest the context's last token's (csrc/context_states.h).")
      .def(nb::init<int, int, int64_t>(), nb::arg("dim"), nb::arg("max_slots"), nb::arg("max_positions"))
      .def("write", &write_states, nb::arg("slots"), nb::arg("positions"), nb::arg("states"),
           "Store states[i] as slot slots[i]'s state at positions[i] (GIL released).")
      .def("release", &release_slot, nb::arg("slot"), "Forget a slot's states and free their memory.")
      .def("known", [](const vrs::ContextStates& s, int32_t slot, int64_t position) {
             std::lock_guard<std::mutex> lock(s.mutex());
             return s.at(slot, position) != nullptr;
           }, nb::arg("slot"), nb::arg("position"), "Whether slot's state at position was written.")
      .def_prop_ro("dim", &vrs::ContextStates::dim)
      .def_prop_ro("memory_bytes", [](const vrs::ContextStates& s) {
        std::lock_guard<std::mutex> lock(s.mutex());
        return s.memory_bytes();
      }, "Bytes the states hold.");

  nb::class_<LiveIndexHandle>(
      m, "LiveIndex",
      "The tokens of requests in flight in a ring of `capacity` tokens (oldest evicted), with "
      "hash chains of their n-grams of each length in `lengths` (strictly decreasing); a request "
      "entering with more than max_request_tokens tokens keeps its last ones; a lookup examines "
      "at most max_walk occurrences per length (csrc/live_index.h).")
      .def(nb::init<int64_t, std::vector<int>, int64_t, int>(), nb::arg("capacity"),
           nb::arg("lengths"), nb::arg("max_request_tokens"), nb::arg("max_walk"))
      .def("update", &update, nb::arg("req_ids"), nb::arg("token_ids"), nb::arg("num_tokens"),
           "Index request req_ids[i]'s context token_ids[i, :num_tokens[i]] (None: skip the row): "
           "appends the tokens past those indexed, or starts the request over when the context "
           "does not extend them (GIL released).")
      .def("remove", &remove, nb::arg("req_ids"),
           "Forget these requests at once (unknown ids are ignored).")
      .def("lookup", &lookup, nb::arg("req_ids"), nb::arg("token_ids"), nb::arg("num_tokens"),
           nb::arg("rows"), nb::arg("max_matches"), nb::arg("cont_len"), nb::arg("num_threads") = 0,
           "For each of rows: the longest indexed suffix of token_ids[row, :num_tokens[row]] found "
           "in live requests other than req_ids[row], and up to max_matches continuations of up "
           "to cont_len tokens, newest first (CPU threads, GIL released). Returns new arrays "
           "tokens [rows, max_matches, cont_len] (-1 padded), lengths [rows, max_matches] and "
           "match_len [rows] (0: none).")
      .def_prop_ro("capacity", [](LiveIndexHandle& h) { return locked(h, &vrs::LiveIndex::capacity); })
      .def_prop_ro("appended_tokens",
                   [](LiveIndexHandle& h) { return locked(h, &vrs::LiveIndex::appended); },
                   "Tokens appended since the index was created.")
      .def_prop_ro("live_requests",
                   [](LiveIndexHandle& h) { return locked(h, &vrs::LiveIndex::live_requests); })
      .def_prop_ro("live_tokens",
                   [](LiveIndexHandle& h) { return locked(h, &vrs::LiveIndex::live_tokens); },
                   "Tokens of live requests still in the ring (scans the ring).")
      .def_prop_ro("memory_bytes",
                   [](LiveIndexHandle& h) { return locked(h, &vrs::LiveIndex::memory_bytes); },
                   "Bytes the index holds (ring, hash heads, requests).");
}

}  // namespace vrs_bind
