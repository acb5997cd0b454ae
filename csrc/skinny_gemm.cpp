// CPU skinny GEMM (skinny_gemm.h). The hot function is compiled for AVX-512, AVX2+FMA and
// baseline x86-64 (picked at load time); this file may contract multiply-adds (CMakeLists.txt):
// the result is compared with a float64 reference within a tolerance, as oneDNN's would be.
#include "skinny_gemm.h"

#include <algorithm>
#include <cstring>

#include "isa_clones.h"
#include "parallel.h"

namespace vrs {
namespace {

constexpr int kLanes = 8;
constexpr int kRowBlock = 6;  // rows of x per block: 12 accumulators + 2 weight vectors + 1 broadcast
// Panels worth one more thread (smaller layers run on the calling thread alone).
constexpr int64_t kPanelsPerThread = 4;

typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

VRS_INLINE Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

VRS_INLINE void store(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }

// One float in every lane (a single broadcast load; `Lanes{} + s` costs an add more).
VRS_INLINE Lanes splat(float s) {
  const Lanes v = {s};
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
}

// y[m + r, panel's columns] for r < M.
template <int M>
VRS_INLINE void block(const SkinnyGemmArgs& a, int64_t panel, int64_t m) {
  const int64_t K = a.in_features;
  const float* w = a.w + panel * K * kSkinnyGemmPanel;
  const float* x = a.x + m * K;
  Lanes acc[M][2];
  for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = Lanes{};
  for (int64_t k = 0; k < K; ++k) {
    const Lanes w0 = load(w + k * kSkinnyGemmPanel), w1 = load(w + k * kSkinnyGemmPanel + kLanes);
    for (int r = 0; r < M; ++r) {
      const Lanes xv = splat(x[r * K + k]);
      acc[r][0] += w0 * xv;
      acc[r][1] += w1 * xv;
    }
  }
  const int64_t n = panel * kSkinnyGemmPanel, columns = std::min(kSkinnyGemmPanel, a.out_features - n);
  float* y = a.y + m * a.out_features + n;
  for (int r = 0; r < M; ++r, y += a.out_features) {
    float sums[kSkinnyGemmPanel];
    store(sums, acc[r][0]);
    store(sums + kLanes, acc[r][1]);
    for (int64_t c = 0; c < columns; ++c) y[c] = sums[c] + (a.bias ? a.bias[n + c] : 0.0f);
  }
}

// `count` blocks of `rows` rows (1 to kRowBlock) of x from row m on, m advanced past them.
VRS_INLINE void blocks(const SkinnyGemmArgs& a, int64_t panel, int64_t& m, int64_t rows, int64_t count) {
  for (int64_t i = 0; i < count; ++i, m += rows) {
    switch (rows) {
      case 6: block<6>(a, panel, m); break;
      case 5: block<5>(a, panel, m); break;
      case 4: block<4>(a, panel, m); break;
      case 3: block<3>(a, panel, m); break;
      case 2: block<2>(a, panel, m); break;
      default: block<1>(a, panel, m); break;
    }
  }
}

// Panels [begin, end) for every row; the rows split into blocks of at most kRowBlock, as even as
// they go (8 rows: 4 + 4, not 6 + 2, a block of few rows being bound by its loads).
VRS_ISA_CLONES void panels(const SkinnyGemmArgs& a, int64_t begin, int64_t end) {
  const int64_t count = (a.rows + kRowBlock - 1) / kRowBlock, size = a.rows / count, larger = a.rows % count;
  for (int64_t panel = begin; panel < end; ++panel) {
    int64_t m = 0;
    blocks(a, panel, m, size + 1, larger);
    blocks(a, panel, m, size, count - larger);
  }
}

struct TeamTask {
  const SkinnyGemmArgs* args;
  int64_t panels;
};

// One team member's share of the panels.
void run_share(void* context) {
  const auto& task = *static_cast<const TeamTask*>(context);
  const int64_t threads = omp_team_size(), me = omp_team_member();
  panels(*task.args, task.panels * me / threads, task.panels * (me + 1) / threads);
}

}  // namespace

int skinny_gemm_threads() { return omp_team_threads(); }

void skinny_gemm_cpu(const SkinnyGemmArgs& args) {
  const int64_t count = (args.out_features + kSkinnyGemmPanel - 1) / kSkinnyGemmPanel;
  const int64_t threads = std::min<int64_t>(skinny_gemm_threads(), count / kPanelsPerThread);
  if (threads <= 1) {
    panels(args, 0, count);
    return;
  }
  TeamTask task{&args, count};
  run_on_omp_team(static_cast<int>(threads), &run_share, &task);
}

}  // namespace vrs
