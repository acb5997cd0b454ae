// A small thread pool-free parallel-for: the calling thread plus (num_threads - 1) workers
// split [0, n) into contiguous chunks. Callers release the GIL before using it.
#pragma once

#include <algorithm>
#include <exception>
#include <thread>
#include <vector>

namespace vrs {

inline int resolve_num_threads(int requested, long n_items) {
  int threads = requested > 0 ? requested : static_cast<int>(std::thread::hardware_concurrency());
  threads = std::max(1, threads);
  return static_cast<int>(std::min<long>(threads, std::max<long>(1, n_items)));
}

template <typename Fn>
void parallel_for(long n_items, int num_threads, Fn&& fn) {
  const int threads = resolve_num_threads(num_threads, n_items);
  if (threads <= 1 || n_items <= 1) {
    for (long i = 0; i < n_items; ++i) fn(i);
    return;
  }
  std::vector<std::thread> workers;
  std::vector<std::exception_ptr> errors(threads);
  const long chunk = (n_items + threads - 1) / threads;
  auto run_chunk = [&](int t) {
    try {
      const long end = std::min(n_items, (t + 1) * chunk);
      for (long i = t * chunk; i < end; ++i) fn(i);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  for (int t = 1; t < threads; ++t) workers.emplace_back(run_chunk, t);
  run_chunk(0);
  for (auto& worker : workers) worker.join();
  for (auto& error : errors)
    if (error) std::rethrow_exception(error);
}

}  // namespace vrs
