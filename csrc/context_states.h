// The target's hidden states of each request in flight, kept by the position of the token each
// produced, so that REST can follow the context occurrence whose last token was produced by the
// state nearest the one that produced the context's last token (benchmarks/copy_ceiling.py
// --dense: +4-9% tokens a step over the latest occurrence).
//
// A slot per request (the caller maps request ids to slots and releases a slot when its request
// finishes); a slot's states grow with its positions, each stored as a unit vector. Positions a
// state was not written for (a cached prefix, position 0) are unknown.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace vrs {

class ContextStates {
 public:
  ContextStates(int dim, int max_slots, int64_t max_positions)
      : dim_(dim), max_positions_(max_positions), slots_(static_cast<size_t>(max_slots)) {
    if (dim < 1 || max_slots < 1 || max_positions < 1)
      throw std::invalid_argument("ContextStates needs dim, max_slots and max_positions >= 1");
  }

  // Held by whoever reads or writes the states with the GIL released.
  std::mutex& mutex() const { return mutex_; }

  int dim() const { return dim_; }
  int max_slots() const { return static_cast<int>(slots_.size()); }
  int64_t max_positions() const { return max_positions_; }

  // Stores `state` (dim floats) as slot's state at position, scaled to unit length (a zero or
  // non-finite state stays unknown).
  void write(int32_t slot, int64_t position, const float* state) {
    check(slot, position);
    double norm = 0;
    for (int i = 0; i < dim_; ++i) norm += static_cast<double>(state[i]) * state[i];
    if (!(norm > 0) || !std::isfinite(norm)) return;
    Slot& s = slots_[static_cast<size_t>(slot)];
    if (s.known.size() <= static_cast<size_t>(position)) {
      const size_t size = std::min<size_t>(std::max<size_t>(2 * s.known.size(), position + 1), max_positions_);
      s.known.resize(size, 0);
      s.values.resize(size * dim_);
    }
    const float scale = static_cast<float>(1.0 / std::sqrt(norm));
    float* out = s.values.data() + position * dim_;
    for (int i = 0; i < dim_; ++i) out[i] = state[i] * scale;
    s.known[static_cast<size_t>(position)] = 1;
  }

  // Forgets slot's states and frees their memory.
  void release(int32_t slot) {
    check(slot, 0);
    Slot& s = slots_[static_cast<size_t>(slot)];
    std::vector<float>().swap(s.values);
    std::vector<uint8_t>().swap(s.known);
  }

  // Slot's unit state at position, or nullptr when unknown.
  const float* at(int32_t slot, int64_t position) const {
    if (slot < 0 || static_cast<size_t>(slot) >= slots_.size() || position < 0) return nullptr;
    const Slot& s = slots_[static_cast<size_t>(slot)];
    if (static_cast<size_t>(position) >= s.known.size() || !s.known[static_cast<size_t>(position)]) return nullptr;
    return s.values.data() + position * dim_;
  }

  int64_t memory_bytes() const {
    int64_t bytes = 0;
    for (const Slot& s : slots_) bytes += s.values.capacity() * sizeof(float) + s.known.capacity();
    return bytes;
  }

  // Of the m context occurrences match_pos[i] of the context's last q tokens (n tokens), the one
  // whose last token's producing state is nearest (largest cosine) the state that produced the
  // context's last token; -1 when fewer than two are known or that state is unknown.
  int nearest_occurrence(int32_t slot, const int* match_pos, int m, int q, int n) const {
    const float* current = at(slot, n - 1);
    if (current == nullptr || m < 2) return -1;
    int best = -1, known = 0;
    float best_cosine = 0;
    for (int i = 0; i < m; ++i) {
      const float* state = at(slot, match_pos[i] + q - 1);
      if (state == nullptr) continue;
      const float cosine = dot(state, current);
      if (best < 0 || cosine > best_cosine) best = i, best_cosine = cosine;
      ++known;
    }
    return known >= 2 ? best : -1;
  }

 private:
  struct Slot {
    std::vector<float> values;   // [positions, dim]
    std::vector<uint8_t> known;  // [positions]
  };

  void check(int32_t slot, int64_t position) const {
    if (slot < 0 || static_cast<size_t>(slot) >= slots_.size())
      throw std::out_of_range("context state slot " + std::to_string(slot) + " is outside [0, " +
                              std::to_string(slots_.size()) + ")");
    if (position < 0 || position >= max_positions_)
      throw std::out_of_range("context state position " + std::to_string(position) + " is outside [0, " +
                              std::to_string(max_positions_) + ")");
  }

  // Eight partial sums: the compiler vectorises them without reassociating a single one.
  float dot(const float* a, const float* b) const {
    float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= dim_; i += 8)
      for (int j = 0; j < 8; ++j) partial[j] += a[i + j] * b[i + j];
    float sum = 0;
    for (; i < dim_; ++i) sum += a[i] * b[i];
    for (float p : partial) sum += p;
    return sum;
  }

  mutable std::mutex mutex_;
  int dim_;
  int64_t max_positions_;
  std::vector<Slot> slots_;
};

}  // namespace vrs
