// parallel_for on a persistent, process-wide thread pool, and team_parallel_for on the OpenMP
// team torch runs on.
//
// The pool is created on first use; its workers sleep on a condition variable between calls,
// so thread-local workspaces (e.g. REST's trie) persist from one call to the next. A kernel
// states its work and the work worth one thread (its grain): below two grains, or with one
// thread allowed, it runs on the calling thread alone. Callers release the GIL first.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>

namespace vrs {

// Cores this process may run on (its CPU affinity), at least 1.
int available_cores();

// How a kernel may split: at most `max_threads` threads (0: one per available core) and at
// most one per `grain` units of its `work`.
struct ThreadPlan {
  int max_threads;
  int64_t work;
  int64_t grain;

  int threads(int64_t n_items) const {
    const int64_t most = grain > 0 ? std::min(work / grain, n_items) : n_items;
    if (most <= 1 || max_threads == 1) return 1;  // no affinity query on the small-batch path
    const int64_t cap = max_threads > 0 ? max_threads : available_cores();
    return static_cast<int>(std::min(cap, most));
  }
};

// Runs task(context), which must not throw, on the caller and on up to participants - 1 pool
// workers, those that wake before the caller's own run returns; returns once all have returned.
// Returns false, running nothing, when another call holds the pool (a second Python thread, or
// a nested call): the caller then runs alone.
bool run_on_pool(int participants, void (*task)(void*) noexcept, void* context);

// Whether torch's OpenMP team (libgomp, looked up among the libraries already loaded) is there.
bool has_omp_team();

// torch's OpenMP team: its size, or 1 without one. Kernels that run between torch's operators
// use it rather than the pool: its threads spin a while after each operator, so a second set of
// threads would wait for the cores.
int omp_team_threads();

// Runs task(context) on `threads` members of torch's OpenMP team (the caller one of them);
// false, running nothing, without a team.
bool run_on_omp_team(int threads, void (*task)(void*), void* context);

// Inside a task run by run_on_omp_team: this member's number and the team's size.
int omp_team_member();
int omp_team_size();

namespace detail {

// Items [0, n) handed out in chunks to whichever participant asks next; the first exception
// stops the hand-out and is rethrown to the caller.
template <typename Fn>
struct SharedLoop {
  Fn& fn;
  int64_t n_items;
  int64_t chunk;
  std::atomic<int64_t> next{0};
  std::mutex error_mutex;
  std::exception_ptr error;

  SharedLoop(Fn& fn_, int64_t n_items_, int64_t chunk_)
      : fn(fn_), n_items(n_items_), chunk(chunk_) {}

  static void run(void* self) noexcept { static_cast<SharedLoop*>(self)->drain(); }

  void drain() noexcept {
    try {
      for (int64_t begin; (begin = next.fetch_add(chunk)) < n_items;)
        for (int64_t i = begin, end = std::min(n_items, begin + chunk); i < end; ++i) fn(i);
    } catch (...) {
      next.store(n_items);
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
};

// fn over [0, n_items) shared by the `threads` participants `start` runs (run_on_pool or
// run_on_omp_team); false when it ran nothing.
template <typename Fn, typename Start>
bool run_shared(int64_t n_items, int threads, Fn& fn, Start start) {
  SharedLoop<Fn> loop(fn, n_items, std::max<int64_t>(1, n_items / (8 * threads)));
  if (!start(threads, &SharedLoop<Fn>::run, &loop)) return false;
  if (loop.error) std::rethrow_exception(loop.error);
  return true;
}

}  // namespace detail

// fn(i) for every i in [0, n_items), on plan.threads(n_items) threads (the caller included).
template <typename Fn>
void parallel_for(int64_t n_items, const ThreadPlan& plan, Fn&& fn) {
  const int threads = plan.threads(n_items);
  if (threads > 1 && detail::run_shared(n_items, threads, fn, run_on_pool)) return;
  for (int64_t i = 0; i < n_items; ++i) fn(i);
}

// parallel_for on torch's OpenMP team (plan's threads, at most the team's size) where there is
// one, else on the pool. A team of one thread (torch.set_num_threads(1)) runs it on the caller.
// (The team's size, not this thread's affinity, bounds it: vLLM's CPU worker pins each member of
// the team to one core, the calling thread included.)
template <typename Fn>
void team_parallel_for(int64_t n_items, const ThreadPlan& plan, Fn&& fn) {
  if (!has_omp_team()) return parallel_for(n_items, plan, fn);
  const int team = omp_team_threads();
  const ThreadPlan on_team{plan.max_threads > 0 ? std::min(plan.max_threads, team) : team, plan.work, plan.grain};
  const int threads = on_team.threads(n_items);
  if (threads > 1 && detail::run_shared(n_items, threads, fn, run_on_omp_team)) return;
  for (int64_t i = 0; i < n_items; ++i) fn(i);
}

}  // namespace vrs
