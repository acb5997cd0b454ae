// CPU skinny GEMM (skinny_gemm.h). The hot function is compiled for AVX-512, AVX2+FMA and
// baseline x86-64 (picked at load time); this file may contract multiply-adds (CMakeLists.txt):
// the result is compared with a float64 reference within a tolerance, as oneDNN's would be.
#include "skinny_gemm.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>

#include "isa_clones.h"

namespace vrs {
namespace {

constexpr int kLanes = 8;
constexpr int kWeightRows = 4;  // weight rows of a tile, read from memory once per call
constexpr int kInputRows = 3;   // rows of x per pass over a tile: 12 accumulators + 4 + 1 registers
// Output columns worth one more thread (smaller layers run on the calling thread alone).
constexpr int64_t kColumnsPerThread = 64;

typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

VRS_INLINE Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// y[m + c, n + r] for r < R, c < C: weight rows n.. and input rows m.., rows contiguous.
template <int R, int C>
VRS_INLINE void tile(const SkinnyGemmArgs& a, int64_t n, int64_t m) {
  const int64_t K = a.in_features;
  const float* w = a.w + n * K;
  const float* x = a.x + m * K;
  Lanes acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Lanes{};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Lanes wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load(w + r * K + k);
    for (int c = 0; c < C; ++c) {
      const Lanes xv = load(x + c * K + k);
      for (int r = 0; r < R; ++r) acc[r][c] += wv[r] * xv;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float sum = 0.0f;
      for (int lane = 0; lane < kLanes; ++lane) sum += acc[r][c][lane];
      for (int64_t j = k; j < K; ++j) sum += w[r * K + j] * x[c * K + j];
      a.y[(m + c) * a.out_features + n + r] = sum + (a.bias ? a.bias[n + r] : 0.0f);
    }
}

template <int R>
VRS_INLINE void column_block(const SkinnyGemmArgs& a, int64_t n) {
  int64_t m = 0;
  for (; m + kInputRows <= a.rows; m += kInputRows) tile<R, kInputRows>(a, n, m);
  if (a.rows - m == 2) tile<R, 2>(a, n, m);
  if (a.rows - m == 1) tile<R, 1>(a, n, m);
}

// Output columns [begin, end) of every row.
VRS_ISA_CLONES void columns(const SkinnyGemmArgs& a, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + kWeightRows <= end; n += kWeightRows) column_block<kWeightRows>(a, n);
  for (; n < end; ++n) column_block<1>(a, n);
}

// torch's OpenMP runtime (libgomp), looked up among the libraries already loaded.
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

struct TeamTask {
  const SkinnyGemmArgs* args;
  int64_t blocks;  // column blocks of kWeightRows; the last thread also takes the remainder
};

// One team member's share of the column blocks.
void run_share(void* context) {
  const auto& task = *static_cast<const TeamTask*>(context);
  const OpenMpTeam& team = OpenMpTeam::get();
  const int64_t threads = team.num_threads(), me = team.thread_num();
  const int64_t begin = task.blocks * me / threads * kWeightRows;
  const int64_t end = me + 1 == threads ? task.args->out_features : task.blocks * (me + 1) / threads * kWeightRows;
  columns(*task.args, begin, end);
}

}  // namespace

int skinny_gemm_threads() {
  const OpenMpTeam& team = OpenMpTeam::get();
  return team.parallel ? std::max(1, team.max_threads()) : 1;
}

void skinny_gemm_cpu(const SkinnyGemmArgs& args) {
  const OpenMpTeam& team = OpenMpTeam::get();
  const int64_t threads = std::min<int64_t>(skinny_gemm_threads(), args.out_features / kColumnsPerThread);
  if (threads <= 1) {
    columns(args, 0, args.out_features);
    return;
  }
  TeamTask task{&args, args.out_features / kWeightRows};
  team.parallel(&run_share, &task, static_cast<unsigned>(threads), 0);
}

}  // namespace vrs
