// The process-wide thread pool behind parallel_for (parallel.h).
#include "parallel.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>

#include <condition_variable>
#include <thread>

namespace vrs {

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

namespace {

// Workers are started on demand and never stopped; one job runs at a time (busy_). A job has
// `participants - 1` seats for workers; the caller closes them once it has run out of work, so
// it never waits for a worker that the scheduler had not woken by then (a loaded machine).
class ThreadPool {
 public:
  bool try_run(int participants, void (*task)(void*) noexcept, void* context) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    grow(participants - 1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = task;
      context_ = context;
      open_seats_ = participants - 1;
      ++generation_;
    }
    wake_.notify_all();
    task(context);
    std::unique_lock<std::mutex> lock(mutex_);
    open_seats_ = 0;
    done_.wait(lock, [this] { return running_ == 0; });
    return true;
  }

 private:
  void grow(int workers) {
    for (; num_workers_ < workers; ++num_workers_) std::thread([this] { work(); }).detach();
  }

  void work() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen && open_seats_ > 0; });
      seen = generation_;
      --open_seats_;
      ++running_;
      lock.unlock();
      task_(context_);
      lock.lock();
      if (--running_ == 0) done_.notify_one();
    }
  }

  std::mutex busy_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  int num_workers_ = 0;
  void (*task_)(void*) noexcept = nullptr;
  void* context_ = nullptr;
  int open_seats_ = 0;
  int running_ = 0;
  uint64_t generation_ = 0;
};

// Never destroyed (workers may sleep in it at exit); a forked child, which has none of the
// parent's threads, starts a fresh one and leaks the parent's.
std::atomic<ThreadPool*> g_pool{nullptr};

void forget_pool_in_child() { g_pool.store(nullptr); }

ThreadPool& pool() {
  ThreadPool* current = g_pool.load(std::memory_order_acquire);
  if (current != nullptr) return *current;
  static const int registered = pthread_atfork(nullptr, nullptr, forget_pool_in_child);
  (void)registered;
  auto* created = new ThreadPool();
  if (g_pool.compare_exchange_strong(current, created, std::memory_order_acq_rel)) return *created;
  delete created;  // another thread won the race; ours never started a worker
  return *current;
}

}  // namespace

bool run_on_pool(int participants, void (*task)(void*) noexcept, void* context) {
  return pool().try_run(participants, task, context);
}

namespace {

struct OpenMpTeam {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;
  int (*max_threads)() = nullptr;

  OpenMpTeam() {
    parallel = reinterpret_cast<decltype(parallel)>(dlsym(RTLD_DEFAULT, "GOMP_parallel"));
    thread_num = reinterpret_cast<decltype(thread_num)>(dlsym(RTLD_DEFAULT, "omp_get_thread_num"));
    num_threads = reinterpret_cast<decltype(num_threads)>(dlsym(RTLD_DEFAULT, "omp_get_num_threads"));
    max_threads = reinterpret_cast<decltype(max_threads)>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
    if (!thread_num || !num_threads || !max_threads) parallel = nullptr;
  }

  static const OpenMpTeam& get() {
    static const OpenMpTeam team;
    return team;
  }
};

}  // namespace

bool has_omp_team() { return OpenMpTeam::get().parallel != nullptr; }

int omp_team_threads() {
  const OpenMpTeam& team = OpenMpTeam::get();
  return team.parallel ? std::max(1, team.max_threads()) : 1;
}

bool run_on_omp_team(int threads, void (*task)(void*), void* context) {
  const OpenMpTeam& team = OpenMpTeam::get();
  if (!team.parallel) return false;
  team.parallel(task, context, static_cast<unsigned>(threads), 0);
  return true;
}

int omp_team_member() { return OpenMpTeam::get().thread_num(); }

int omp_team_size() { return OpenMpTeam::get().num_threads(); }

}  // namespace vrs
