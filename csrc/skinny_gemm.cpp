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

#if VRS_HAS_WIDE
// AVX-512: a panel's 16 columns fill one register, so a block takes two panels (or one at the
// end of a share) × up to 12 rows of x: 24 accumulators, each x broadcast folded into its
// multiply-add, each panel's weights asked into the cache a page ahead. Every output is still one
// lane's multiply-adds over k in order, as above: the same sums, bit for bit, as the AVX2 blocks
// compute.
constexpr int kWideLanes = 16;
constexpr int kWideRowBlock = 12;
// Each panel's weights asked for 64 k (4 KiB) ahead: the hardware prefetchers stop at every page
// (1 row: 31 -> 22 ms a pass over the model's layers, 8 rows: 41 -> 25 ms; 32 k ahead gained less).
constexpr int64_t kWidePrefetchLines = 64;

typedef float WideLanes __attribute__((vector_size(kWideLanes * sizeof(float))));

VRS_WIDE VRS_INLINE WideLanes wide_load(const float* p) {
  WideLanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

VRS_WIDE VRS_INLINE WideLanes wide_splat(float s) {
  const WideLanes v = {s};
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}

// y[m + r, columns of panels panel .. panel + P - 1] for r < M.
template <int M, int P>
VRS_WIDE VRS_INLINE void wide_block(const SkinnyGemmArgs& a, int64_t panel, int64_t m) {
  const int64_t K = a.in_features;
  const float* w = a.w + panel * K * kSkinnyGemmPanel;
  const float* x = a.x + m * K;
  WideLanes acc[M][P];
  for (int r = 0; r < M; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = WideLanes{};
  for (int64_t k = 0; k < K; ++k) {
    WideLanes wp[P];
    for (int p = 0; p < P; ++p) {
      __builtin_prefetch(w + (p * K + k + kWidePrefetchLines) * kSkinnyGemmPanel, 0, 3);
      wp[p] = wide_load(w + (p * K + k) * kSkinnyGemmPanel);
    }
    for (int r = 0; r < M; ++r) {
      const WideLanes xv = wide_splat(x[r * K + k]);
      for (int p = 0; p < P; ++p) acc[r][p] += wp[p] * xv;
    }
  }
  for (int p = 0; p < P; ++p) {
    const int64_t n = (panel + p) * kSkinnyGemmPanel, columns = std::min(kSkinnyGemmPanel, a.out_features - n);
    float* y = a.y + m * a.out_features + n;
    for (int r = 0; r < M; ++r, y += a.out_features) {
      float sums[kSkinnyGemmPanel];
      std::memcpy(sums, &acc[r][p], sizeof(sums));
      for (int64_t c = 0; c < columns; ++c) y[c] = sums[c] + (a.bias ? a.bias[n + c] : 0.0f);
    }
  }
}

template <int P>
VRS_WIDE VRS_INLINE void wide_blocks(const SkinnyGemmArgs& a, int64_t panel, int64_t& m, int64_t rows,
                                     int64_t count) {
  for (int64_t i = 0; i < count; ++i, m += rows) {
    switch (rows) {
      case 12: wide_block<12, P>(a, panel, m); break;
      case 11: wide_block<11, P>(a, panel, m); break;
      case 10: wide_block<10, P>(a, panel, m); break;
      case 9: wide_block<9, P>(a, panel, m); break;
      case 8: wide_block<8, P>(a, panel, m); break;
      case 7: wide_block<7, P>(a, panel, m); break;
      case 6: wide_block<6, P>(a, panel, m); break;
      case 5: wide_block<5, P>(a, panel, m); break;
      case 4: wide_block<4, P>(a, panel, m); break;
      case 3: wide_block<3, P>(a, panel, m); break;
      case 2: wide_block<2, P>(a, panel, m); break;
      default: wide_block<1, P>(a, panel, m); break;
    }
  }
}

// Panels [begin, end) for every row, two at a time, the rows in blocks of at most kWideRowBlock
// as even as they go.
VRS_WIDE void wide_panels(const SkinnyGemmArgs& a, int64_t begin, int64_t end) {
  const int64_t count = (a.rows + kWideRowBlock - 1) / kWideRowBlock, size = a.rows / count,
                larger = a.rows % count;
  for (int64_t panel = begin; panel < end; panel += 2) {
    int64_t m = 0;
    if (panel + 1 < end) {
      wide_blocks<2>(a, panel, m, size + 1, larger);
      wide_blocks<2>(a, panel, m, size, count - larger);
    } else {
      wide_blocks<1>(a, panel, m, size + 1, larger);
      wide_blocks<1>(a, panel, m, size, count - larger);
    }
  }
}
#else
void wide_panels(const SkinnyGemmArgs&, int64_t, int64_t) {}
#endif

// Panels [begin, end) for every row, on the widest vectors the CPU has.
void any_panels(const SkinnyGemmArgs& a, int64_t begin, int64_t end) {
  if (has_wide_lanes()) wide_panels(a, begin, end);
  else panels(a, begin, end);
}

struct TeamTask {
  const SkinnyGemmArgs* args;
  int64_t panels;
};

// One team member's share of the panels.
void run_share(void* context) {
  const auto& task = *static_cast<const TeamTask*>(context);
  const int64_t threads = omp_team_size(), me = omp_team_member();
  any_panels(*task.args, task.panels * me / threads, task.panels * (me + 1) / threads);
}

}  // namespace

int skinny_gemm_threads() { return omp_team_threads(); }

void skinny_gemm_cpu(const SkinnyGemmArgs& args) {
  const int64_t count = (args.out_features + kSkinnyGemmPanel - 1) / kSkinnyGemmPanel;
  const int64_t threads = std::min<int64_t>(skinny_gemm_threads(), count / kPanelsPerThread);
  if (threads <= 1) {
    any_panels(args, 0, count);
    return;
  }
  TeamTask task{&args, count};
  run_on_omp_team(static_cast<int>(threads), &run_share, &task);
}

}  // namespace vrs
