// The live index: the tokens (prompt and output so far) of the requests still in flight, so
// that parallel requests with shared structure draft from each other (issue 22, item 3).
//
// Tokens live in one ring of `capacity` entries in the order they were appended, over all
// requests: appending the capacity + 1-th token evicts the oldest one, so memory is fixed at
// construction. Each entry links to the previous and next token of its request, and, for each
// n-gram length n, to the previous entry ending the same n-gram (a hash chain, newest first);
// n-grams are hashed from the request's own indexed tokens, so the ring is consistent whatever
// the caller passes.
// A request that enters with more than `max_request_tokens` tokens is indexed from its last
// `max_request_tokens`. Removing a request unlinks its entries from it at once (they stay in the
// ring, owned by no one, until overwritten); nothing else keeps it.
//
// Lookup for one row, with n from the longest length down: the occurrences of the row's last n
// tokens (all n still in the ring) newest first; the first `max_walk` of them are examined and
// those of live requests other than the row's own, followed by at least one token, are matches
// (at most max_matches), each giving up to cont_len following tokens. The first length with a
// match is the row's match length. Lookups only read: rows may run on several threads.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace vrs {

constexpr int kMaxLiveNgram = 64;
constexpr int kMaxLiveLengths = 8;

struct LiveIndexParams {
  int64_t capacity;            // tokens kept in the ring
  std::vector<int> lengths;    // n-gram lengths indexed, strictly decreasing, in [1, kMaxLiveNgram]
  int64_t max_request_tokens;  // most tokens of one request indexed when it enters (its last ones)
  int max_walk;                // most occurrences of one n-gram examined per row and length
};

// One row's lookup result: up to k continuations of up to len tokens (-1 padded).
struct LiveRowOutput {
  int32_t* tokens;   // [k, len]
  int32_t* lengths;  // [k]
  int32_t* match_len;
  int k;
  int len;
};

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t ngram_hash(const int32_t* tokens, int n) {
  uint64_t h = 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(n);
  for (int i = 0; i < n; ++i) h = mix64(h ^ static_cast<uint32_t>(tokens[i]));
  return h;
}

class LiveIndex {
 public:
  explicit LiveIndex(LiveIndexParams params) : p_(std::move(params)) {
    check_params();
    const int64_t c = p_.capacity;
    buckets_ = 1;
    while (buckets_ < c) buckets_ <<= 1;
    const size_t lengths = p_.lengths.size();
    token_.assign(c, -1);
    owner_.assign(c, kNoOwner);
    prev_.assign(c, -1);
    next_.assign(c, -1);
    hash_.assign(c * lengths, 0);
    chain_.assign(c * lengths, -1);
    heads_.assign(buckets_ * static_cast<int64_t>(lengths), -1);
  }

  // Brings request `id` up to context[0, length): appends the tokens past those indexed; starts
  // the request over when the context no longer extends them (shorter, or another last token).
  void sync(const std::string& id, const int32_t* context, int64_t length) {
    auto found = slot_of_.find(id);
    if (found != slot_of_.end()) {
      const Request& request = requests_[found->second];
      if (length >= request.length &&
          (request.length == request.start || context[request.length - 1] == request.last_token)) {
        append(found->second, context, length);
        return;
      }
      forget(found);
    }
    const int slot = new_slot(id);
    Request& request = requests_[slot];
    request.start = request.length = std::max<int64_t>(0, length - p_.max_request_tokens);
    append(slot, context, length);
  }

  // Forgets request `id` (unknown ids are ignored).
  void remove(const std::string& id) {
    auto found = slot_of_.find(id);
    if (found != slot_of_.end()) forget(found);
  }

  // The slot of request `id`, or -1 (pass it to lookup as the row's own request).
  int slot(const std::string& id) const {
    auto found = slot_of_.find(id);
    return found == slot_of_.end() ? kNoOwner : found->second;
  }

  // Matches of the context's suffix in live requests other than own_slot (see the top).
  void lookup(int own_slot, const int32_t* context, int64_t length, const LiveRowOutput& out) const {
    *out.match_len = 0;
    for (size_t li = 0; li < p_.lengths.size(); ++li) {
      const int n = p_.lengths[li];
      if (n > length) continue;
      const int found = matches(li, own_slot, context + length - n, out);
      if (found > 0) {
        *out.match_len = n;
        return;
      }
    }
  }

  int64_t capacity() const { return p_.capacity; }
  int64_t appended() const { return appended_; }
  int64_t live_requests() const { return static_cast<int64_t>(slot_of_.size()); }

  // Tokens of live requests still in the ring.
  int64_t live_tokens() const {
    int64_t total = 0;
    for (int64_t g = window_start(); g < appended_; ++g) total += owner_[g % p_.capacity] != kNoOwner;
    return total;
  }

  int64_t memory_bytes() const {
    int64_t ids = 0;
    for (const auto& entry : slot_of_) ids += static_cast<int64_t>(entry.first.capacity()) + 64;
    int64_t recent = 0;
    for (const Request& request : requests_) recent += bytes(request.recent);
    return bytes(token_) + bytes(owner_) + bytes(prev_) + bytes(next_) + bytes(hash_) +
           bytes(chain_) + bytes(heads_) + bytes(requests_) + bytes(free_slots_) + bytes(scratch_) +
           recent + ids;
  }

 private:
  static constexpr int kNoOwner = -1;

  struct Request {
    int64_t start = 0;        // first indexed position of the request's context
    int64_t length = 0;       // positions indexed up to
    int64_t last_global = -1;  // entry of its last token
    int32_t last_token = -1;
    std::vector<int32_t> recent;  // its last (longest length - 1) tokens indexed, for the n-grams to come
  };

  template <typename T>
  static int64_t bytes(const std::vector<T>& v) {
    return static_cast<int64_t>(v.capacity() * sizeof(T));
  }

  void check_params() const {
    if (p_.capacity < 2 || p_.capacity > (int64_t{1} << 40))
      throw std::invalid_argument("live index capacity must be in [2, 2^40] tokens, got " +
                                  std::to_string(p_.capacity));
    const size_t count = p_.lengths.size();
    if (count < 1 || count > static_cast<size_t>(kMaxLiveLengths))
      throw std::invalid_argument("live index needs 1 to " + std::to_string(kMaxLiveLengths) +
                                  " n-gram lengths, got " + std::to_string(count));
    for (size_t i = 0; i < count; ++i) {
      const int n = p_.lengths[i];
      if (n < 1 || n > kMaxLiveNgram || (i > 0 && n >= p_.lengths[i - 1]))
        throw std::invalid_argument("live index n-gram lengths must decrease strictly within [1, " +
                                    std::to_string(kMaxLiveNgram) + "], got " + std::to_string(n) +
                                    " at position " + std::to_string(i));
    }
    if (p_.max_request_tokens < 1 || p_.max_request_tokens > p_.capacity)
      throw std::invalid_argument("live index max_request_tokens must be in [1, capacity], got " +
                                  std::to_string(p_.max_request_tokens));
    if (p_.max_walk < 1)
      throw std::invalid_argument("live index max_walk must be >= 1, got " +
                                  std::to_string(p_.max_walk));
  }

  int64_t window_start() const { return std::max<int64_t>(0, appended_ - p_.capacity); }
  bool in_ring(int64_t g) const { return g >= window_start() && g < appended_ && g >= 0; }
  int64_t at(int64_t g) const { return g % p_.capacity; }

  int new_slot(const std::string& id) {
    int slot;
    if (free_slots_.empty()) {
      slot = static_cast<int>(requests_.size());
      requests_.emplace_back();
    } else {
      slot = free_slots_.back();
      free_slots_.pop_back();
      requests_[slot] = Request{};
    }
    slot_of_.emplace(id, slot);
    return slot;
  }

  // Unlinks the request's entries still in the ring from it and frees its slot.
  void forget(std::unordered_map<std::string, int>::iterator found) {
    const int slot = found->second;
    for (int64_t g = requests_[slot].last_global; in_ring(g) && owner_[at(g)] == slot;
         g = prev_[at(g)])
      owner_[at(g)] = kNoOwner;
    free_slots_.push_back(slot);
    slot_of_.erase(found);
  }

  // Appends context[request.length, length); n-grams are hashed from the request's own indexed
  // tokens (its recent ones, then the new ones), never from earlier parts of context.
  void append(int slot, const int32_t* context, int64_t length) {
    Request& request = requests_[slot];
    if (length <= request.length) return;
    check_tokens(context, request.length, length);
    scratch_.assign(request.recent.begin(), request.recent.end());
    const int64_t base = request.length - static_cast<int64_t>(scratch_.size());  // position of scratch_[0]
    scratch_.insert(scratch_.end(), context + request.length, context + length);
    for (int64_t pos = request.length; pos < length; ++pos) {
      const int64_t g = appended_++;
      const int64_t i = at(g);
      const int64_t prev = in_ring(request.last_global) ? request.last_global : -1;
      token_[i] = context[pos];
      owner_[i] = slot;
      prev_[i] = prev;
      next_[i] = -1;
      if (prev >= 0) next_[at(prev)] = g;
      link_ngrams(g, scratch_.data() + (pos - base), pos - request.start);
      request.last_global = g;
      request.last_token = context[pos];
    }
    request.length = length;
    const size_t keep = std::min(scratch_.size(), static_cast<size_t>(p_.lengths.front() - 1));
    request.recent.assign(scratch_.end() - static_cast<std::ptrdiff_t>(keep), scratch_.end());
  }

  static void check_tokens(const int32_t* context, int64_t from, int64_t to) {
    for (int64_t pos = from; pos < to; ++pos)
      if (context[pos] < 0)
        throw std::invalid_argument("token " + std::to_string(context[pos]) + " at position " +
                                    std::to_string(pos) + " is negative (token ids are >= 0)");
  }

  // Pushes entry g (the token at *last, `before` tokens after the request's first indexed one)
  // on the hash chain of every n-gram ending there within the request.
  void link_ngrams(int64_t g, const int32_t* last, int64_t before) {
    const size_t count = p_.lengths.size();
    const int64_t i = at(g);
    for (size_t li = 0; li < count; ++li) {
      const int n = p_.lengths[li];
      chain_[i * count + li] = -1;
      if (n - 1 > before) continue;
      const uint64_t h = ngram_hash(last - n + 1, n);
      int64_t& head = heads_[static_cast<int64_t>(li) * buckets_ + static_cast<int64_t>(h & (buckets_ - 1))];
      hash_[i * count + li] = h;
      chain_[i * count + li] = head;
      head = g;
    }
  }

  // Whether the n tokens ending at entry g (all in the ring) equal query[0, n).
  bool ends_with(int64_t g, const int32_t* query, int n) const {
    for (int k = n - 1; k >= 0; --k) {
      if (!in_ring(g) || token_[at(g)] != query[k]) return false;
      g = prev_[at(g)];
    }
    return true;
  }

  // Fills out with the matches of query (the n-gram of length index li); returns their count.
  int matches(size_t li, int own_slot, const int32_t* query, const LiveRowOutput& out) const {
    const size_t count = p_.lengths.size();
    const int n = p_.lengths[li];
    const uint64_t h = ngram_hash(query, n);
    int64_t g = heads_[static_cast<int64_t>(li) * buckets_ + static_cast<int64_t>(h & (buckets_ - 1))];
    int walked = 0, found = 0;
    for (; in_ring(g) && walked < p_.max_walk && found < out.k; g = chain_[at(g) * count + li]) {
      const int64_t i = at(g);
      if (hash_[i * count + li] != h || !ends_with(g, query, n)) continue;
      ++walked;
      if (owner_[i] == kNoOwner || owner_[i] == own_slot || next_[i] < 0) continue;
      out.lengths[found] = continuation(next_[i], out.len, out.tokens + static_cast<int64_t>(found) * out.len);
      ++found;
    }
    return found;
  }

  // Copies up to len tokens of a request from entry g on; returns how many.
  int continuation(int64_t g, int len, int32_t* dest) const {
    int copied = 0;
    for (; copied < len && g >= 0; ++copied, g = next_[at(g)]) dest[copied] = token_[at(g)];
    return copied;
  }

  LiveIndexParams p_;
  int64_t buckets_ = 1;
  int64_t appended_ = 0;
  std::vector<int32_t> token_;
  std::vector<int32_t> owner_;
  std::vector<int64_t> prev_;
  std::vector<int64_t> next_;
  std::vector<uint64_t> hash_;   // [capacity, lengths]
  std::vector<int64_t> chain_;   // [capacity, lengths]: the previous entry in the same bucket
  std::vector<int64_t> heads_;   // [lengths, buckets]: the newest entry of each bucket
  std::vector<int32_t> scratch_;  // append's window over a request's recent and new tokens
  std::vector<Request> requests_;
  std::vector<int> free_slots_;
  std::unordered_map<std::string, int> slot_of_;
};

}  // namespace vrs
