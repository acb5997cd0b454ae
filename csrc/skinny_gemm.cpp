// CPU skinny GEMM (skinny_gemm.h). The hot function is compiled for AVX-512, AVX2+FMA and
// baseline x86-64 (picked at load time); this file may contract multiply-adds (CMakeLists.txt):
// the result is compared with a float64 reference within a tolerance, as oneDNN's would be.
#include "skinny_gemm.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "isa_clones.h"

#if VRS_HAS_WIDE
#include <immintrin.h>
#endif
#include "parallel.h"

namespace vrs {
namespace {

constexpr int kLanes = 8;
constexpr int kRowBlock = 6;  // rows of x per block: 12 accumulators + 2 weight vectors + 1 broadcast
// Panels worth one more thread (smaller layers run on the calling thread alone).
constexpr int64_t kPanelsPerThread = 4;

typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));

VRS_INLINE Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A vector of bfloat16 weights as floats (a bfloat16 is a float's upper half).
template <typename Floats, typename Bfloat16s, typename Words>
VRS_INLINE Floats from_bf16(const uint16_t* p) {
  Bfloat16s h;
  std::memcpy(&h, p, sizeof(h));
  const Words words = __builtin_convertvector(h, Words) << 16;
  Floats v;
  std::memcpy(&v, &words, sizeof(v));
  return v;
}

VRS_INLINE Lanes load(const uint16_t* p) { return from_bf16<Lanes, Halves, Words>(p); }

VRS_INLINE void store(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }

// One float in every lane (a single broadcast load; `Lanes{} + s` costs an add more).
VRS_INLINE Lanes splat(float s) {
  const Lanes v = {s};
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
}

// The weights a pass reads: the skinny GEMM's float32 panels, the screened head's bfloat16 ones.
VRS_INLINE const float* weights(const SkinnyGemmArgs& a) { return a.w; }
VRS_INLINE const uint16_t* weights(const ScreenedHeadArgs& a) { return a.w_bf16; }

// A block's sums for one row of y, `panel`'s 16 columns: the skinny GEMM's outputs (plus bias)...
VRS_INLINE void finish_row(const SkinnyGemmArgs& a, int64_t row, int64_t panel, const float* sums) {
  const int64_t n = panel * kSkinnyGemmPanel, columns = std::min(kSkinnyGemmPanel, a.out_features - n);
  float* y = a.y + row * a.out_features + n;
  for (int64_t c = 0; c < columns; ++c) y[c] = sums[c] + (a.bias ? a.bias[n + c] : 0.0f);
}

// ... or the screened head's approximate outputs and the panel's largest valid one (-inf: none).
VRS_INLINE void finish_row(const ScreenedHeadArgs& a, int64_t row, int64_t panel, const float* sums) {
  const int64_t n = panel * kSkinnyGemmPanel, columns = std::min(kSkinnyGemmPanel, a.out_features - n);
  std::memcpy(a.y + row * a.out_features + n, sums, columns * sizeof(float));
  const int64_t valid = std::min(kSkinnyGemmPanel, a.valid_features - n);
  float largest = -INFINITY;
  if (valid == kSkinnyGemmPanel) {  // the usual panel: a tree of vector maxima
    Lanes v = load(sums), w = load(sums + kLanes);
    v = v > w ? v : w;
    const Lanes half = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v = half > v ? half : v;
    for (int c = 0; c < 4; ++c) largest = v[c] > largest ? v[c] : largest;
  } else {
    for (int64_t c = 0; c < valid; ++c) largest = sums[c] > largest ? sums[c] : largest;
  }
  a.panel_max[row * ((a.out_features + kSkinnyGemmPanel - 1) / kSkinnyGemmPanel) + panel] = largest;
}

// Rows m .. m + M - 1 of y, one panel's columns.
template <int M, typename Args>
VRS_INLINE void block(const Args& a, int64_t panel, int64_t m) {
  const int64_t K = a.in_features;
  const auto* w = weights(a) + panel * K * kSkinnyGemmPanel;
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
  for (int r = 0; r < M; ++r) {
    float sums[kSkinnyGemmPanel];
    store(sums, acc[r][0]);
    store(sums + kLanes, acc[r][1]);
    finish_row(a, m + r, panel, sums);
  }
}

// `count` blocks of `rows` rows (1 to kRowBlock) of x from row m on, m advanced past them.
template <typename Args>
VRS_INLINE void blocks(const Args& a, int64_t panel, int64_t& m, int64_t rows, int64_t count) {
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
template <typename Args>
VRS_INLINE void narrow_pass(const Args& a, int64_t begin, int64_t end) {
  const int64_t count = (a.rows + kRowBlock - 1) / kRowBlock, size = a.rows / count, larger = a.rows % count;
  for (int64_t panel = begin; panel < end; ++panel) {
    int64_t m = 0;
    blocks(a, panel, m, size + 1, larger);
    blocks(a, panel, m, size, count - larger);
  }
}

VRS_ISA_CLONES void panels(const SkinnyGemmArgs& a, int64_t begin, int64_t end) { narrow_pass(a, begin, end); }
VRS_ISA_CLONES void bf16_panels(const ScreenedHeadArgs& a, int64_t begin, int64_t end) { narrow_pass(a, begin, end); }

#if VRS_HAS_WIDE
// AVX-512: a panel's 16 columns fill one register, so a block takes two panels (or one at the
// end of a share) × up to 12 rows of x: 24 accumulators, each x broadcast folded into its
// multiply-add, each panel's weights asked into the cache a page ahead. Every output is still one
// lane's multiply-adds over k in order, as above: the same sums, bit for bit, as the AVX2 blocks
// compute.
constexpr int kWideLanes = 16;
constexpr int kWideRowBlock = 12;
// Each panel's weights asked for 4 KiB ahead: the hardware prefetchers stop at every page (1 row:
// 31 -> 22 ms a pass over the model's layers, 8 rows: 41 -> 25 ms; 2 KiB ahead gained less).
constexpr int64_t kWidePrefetchBytes = 4096;

typedef float WideLanes __attribute__((vector_size(kWideLanes * sizeof(float))));
typedef uint16_t WideHalves __attribute__((vector_size(kWideLanes * sizeof(uint16_t))));
typedef uint32_t WideWords __attribute__((vector_size(kWideLanes * sizeof(uint32_t))));

VRS_WIDE VRS_INLINE WideLanes wide_load(const float* p) {
  WideLanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

VRS_WIDE VRS_INLINE WideLanes wide_load(const uint16_t* p) { return from_bf16<WideLanes, WideHalves, WideWords>(p); }

VRS_WIDE VRS_INLINE WideLanes wide_splat(float s) {
  const WideLanes v = {s};
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}

// Rows m .. m + M - 1 of y, the columns of panels panel .. panel + P - 1.
template <int M, int P, typename Args>
VRS_WIDE VRS_INLINE void wide_block(const Args& a, int64_t panel, int64_t m) {
  const int64_t K = a.in_features;
  const auto* w = weights(a) + panel * K * kSkinnyGemmPanel;
  const int64_t ahead = kWidePrefetchBytes / (kSkinnyGemmPanel * sizeof(*w));
  const float* x = a.x + m * K;
  WideLanes acc[M][P];
  for (int r = 0; r < M; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = WideLanes{};
  for (int64_t k = 0; k < K; ++k) {
    WideLanes wp[P];
    for (int p = 0; p < P; ++p) {
      __builtin_prefetch(w + (p * K + k + ahead) * kSkinnyGemmPanel, 0, 3);
      wp[p] = wide_load(w + (p * K + k) * kSkinnyGemmPanel);
    }
    for (int r = 0; r < M; ++r) {
      const WideLanes xv = wide_splat(x[r * K + k]);
      for (int p = 0; p < P; ++p) acc[r][p] += wp[p] * xv;
    }
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < M; ++r) {
      float sums[kSkinnyGemmPanel];
      std::memcpy(sums, &acc[r][p], sizeof(sums));
      finish_row(a, m + r, panel + p, sums);
    }
}

// The bfloat16 dot product's block (AVX512_BF16): each lane multiplies a k-pair of x (rounded to
// bfloat16) by its column's k-pair of weights and adds both to its float32 sum, one instruction a
// pair.
template <int M, int P>
VRS_WIDE_BF16 VRS_INLINE void dot_block(const ScreenedHeadArgs& a, int64_t panel, int64_t m) {
  const int64_t pairs = (a.in_features + 1) / 2;
  const uint16_t* w = a.w_bf16 + panel * pairs * 2 * kSkinnyGemmPanel;
  const int64_t ahead = kWidePrefetchBytes / (2 * kSkinnyGemmPanel * sizeof(*w));
  const uint32_t* x = a.x_pairs + m * pairs;
  __m512 acc[M][P];
  for (int r = 0; r < M; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i wp[P];
    for (int p = 0; p < P; ++p) {
      __builtin_prefetch(w + (p * pairs + j + ahead) * 2 * kSkinnyGemmPanel, 0, 3);
      wp[p] = _mm512_loadu_si512(w + (p * pairs + j) * 2 * kSkinnyGemmPanel);
    }
    for (int r = 0; r < M; ++r) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(x[r * pairs + j]));
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)wp[p], (__m512bh)xv);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < M; ++r) {
      float sums[kSkinnyGemmPanel];
      _mm512_storeu_ps(sums, acc[r][p]);
      finish_row(a, m + r, panel + p, sums);
    }
}

// The body of a wide pass over panels [begin, end) of `a`: two panels at a time (one at the end
// of a share), each block BLOCK<rows, panels>(a, panel, m) of at most kWideRowBlock rows. A pair's
// first block reads its weights from memory, the blocks after it from the cache, so the first takes
// kWideRowBlock rows (the most arithmetic to overlap with the stream) and the others share the
// rest as evenly as it goes: 16 rows are 12 + 4, not 8 + 8 (a pass over SmolLM2-135M's 120 layers
// on a 2-core AMD EPYC, three alternating runs: 8-12% less time at 13 and 16 rows, 3% at 20, the
// same at 24 and 32). Macros, not templates, so that each pass keeps its own target (a function
// cannot inline one of a wider target).
#define VRS_WIDE_ROWS(BLOCK, P, rows)                       \
  switch (rows) {                                           \
    case 12: BLOCK<12, P>(a, panel, m); break;              \
    case 11: BLOCK<11, P>(a, panel, m); break;              \
    case 10: BLOCK<10, P>(a, panel, m); break;              \
    case 9: BLOCK<9, P>(a, panel, m); break;                \
    case 8: BLOCK<8, P>(a, panel, m); break;                \
    case 7: BLOCK<7, P>(a, panel, m); break;                \
    case 6: BLOCK<6, P>(a, panel, m); break;                \
    case 5: BLOCK<5, P>(a, panel, m); break;                \
    case 4: BLOCK<4, P>(a, panel, m); break;                \
    case 3: BLOCK<3, P>(a, panel, m); break;                \
    case 2: BLOCK<2, P>(a, panel, m); break;                \
    default: BLOCK<1, P>(a, panel, m); break;               \
  }
#define VRS_WIDE_PASS(BLOCK)                                                                  \
  const int64_t count = (a.rows + kWideRowBlock - 1) / kWideRowBlock,                          \
                first = std::min<int64_t>(a.rows, kWideRowBlock), others = std::max<int64_t>(count - 1, 1), \
                size = (a.rows - first) / others, larger = (a.rows - first) % others;           \
  for (int64_t panel = begin; panel < end; panel += 2) {                                      \
    int64_t m = 0;                                                                            \
    for (int64_t i = 0; i < count; ++i) {                                                     \
      const int64_t rows = i == 0 ? first : size + (i - 1 < larger);                          \
      if (panel + 1 < end) {                                                                  \
        VRS_WIDE_ROWS(BLOCK, 2, rows)                                                         \
      } else {                                                                                \
        VRS_WIDE_ROWS(BLOCK, 1, rows)                                                         \
      }                                                                                       \
      m += rows;                                                                              \
    }                                                                                         \
  }

VRS_WIDE void wide_panels(const SkinnyGemmArgs& a, int64_t begin, int64_t end) { VRS_WIDE_PASS(wide_block) }
VRS_WIDE void wide_bf16_panels(const ScreenedHeadArgs& a, int64_t begin, int64_t end) {
  VRS_WIDE_PASS(wide_block)
}
VRS_WIDE_BF16 void dot_panels(const ScreenedHeadArgs& a, int64_t begin, int64_t end) { VRS_WIDE_PASS(dot_block) }
#undef VRS_WIDE_PASS
#undef VRS_WIDE_ROWS
#else
void wide_panels(const SkinnyGemmArgs&, int64_t, int64_t) {}
void wide_bf16_panels(const ScreenedHeadArgs&, int64_t, int64_t) {}
void dot_panels(const ScreenedHeadArgs&, int64_t, int64_t) {}
#endif

// Panels [begin, end) for every row, on the widest vectors the CPU has.
void any_panels(const SkinnyGemmArgs& a, int64_t begin, int64_t end) {
  if (has_wide_lanes()) wide_panels(a, begin, end);
  else panels(a, begin, end);
}

// The screened head's bfloat16 pass: the dot product on k-pairs, else the blocks on bfloat16.
void any_bf16_panels(const ScreenedHeadArgs& a, int64_t begin, int64_t end) {
  if (a.pairs) dot_panels(a, begin, end);
  else if (has_wide_lanes()) wide_bf16_panels(a, begin, end);
  else bf16_panels(a, begin, end);
}

// A float rounded to bfloat16 (to nearest, ties to even; finite values).
uint32_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

// x in bfloat16 k-pairs, [rows, ceil(K / 2)] (an odd K's last pair padded with 0).
std::vector<uint32_t> x_in_pairs(const ScreenedHeadArgs& a) {
  const int64_t K = a.in_features, pairs = (K + 1) / 2;
  std::vector<uint32_t> out(a.rows * pairs);
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t j = 0; j < pairs; ++j) {
      const float* x = a.x + r * K + 2 * j;
      out[r * pairs + j] = to_bf16(x[0]) | (2 * j + 1 < K ? to_bf16(x[1]) << 16 : 0u);
    }
  return out;
}

// `pass(args, begin, end)` over `count` panels, shared by the OpenMP team (panels worth it).
template <typename Args, void (*Pass)(const Args&, int64_t, int64_t)>
void over_panels(const Args& args, int64_t count) {
  struct Task {
    const Args* args;
    int64_t panels;
  };
  const int64_t threads = std::min<int64_t>(omp_team_threads(), count / kPanelsPerThread);
  if (threads <= 1) {
    Pass(args, 0, count);
    return;
  }
  Task task{&args, count};
  run_on_omp_team(static_cast<int>(threads), [](void* context) {
    const auto& t = *static_cast<const Task*>(context);
    const int64_t size = omp_team_size(), me = omp_team_member();
    Pass(*t.args, t.panels * me / size, t.panels * (me + 1) / size);
  }, &task);
}

// Rows up to which the bfloat16 pass and its exact panels beat the full head (2-core AMD EPYC, the
// head of SmolLM2-135M: 0.58x the full head's time at 1 row, 0.78x at 8 and 0.94x at 16 on 16-lane
// blocks; 0.69x at 1, 0.90x at 4 and 1.03x at 6 on 8-lane blocks, whose weights take two
// conversions a register). The dot product, twice an FMA's multiply-adds a register, keeps its lead
// past the skinny GEMM's rows against oneDNN's full head: 0.66-0.85x its time from 48 to 256 rows
// on SmolLM2's head, 0.59-0.71x from 48 to 128 on Gemma-3-270m's (262,144 tokens).
constexpr int64_t kScreenedRowsWide = 16;
constexpr int64_t kScreenedRowsNarrow = 4;
constexpr int64_t kScreenedRowsDot = 256;

// How far a bfloat16 pass's output may lie from the exact one, per unit of |x|·|w_n|: the
// weights' rounding (2^-8 relative) and, with pairs, x's, and both sums' float32 roundings over
// in_features terms (gamma = (K + 1)·2^-24 / (1 - (K + 1)·2^-24), the screen's terms bounded by
// (1 + 2^-8)^2·|x|·|w_n|), with slack for the bound's own arithmetic.
double screen_bound(int64_t in_features, bool pairs) {
  const double unit = std::ldexp(1.0, -24), bf16 = std::ldexp(1.0, -8), x_rounding = pairs ? bf16 : 0.0;
  const double gamma = (in_features + 1) * unit / (1.0 - (in_features + 1) * unit);
  return (bf16 + x_rounding + bf16 * x_rounding + gamma * (1.0 + (1.0 + bf16) * (1.0 + x_rounding))) *
         (1.0 + std::ldexp(1.0, -20));
}

// One row of y (its bfloat16 pass done): -inf but on the panels that may hold the row's largest
// valid output, computed exactly. The exact largest output is at least the lower bound of every
// output of the panel with the largest approximate one; a panel whose largest approximate output
// plus its largest bound falls short of that cannot hold it. False when an output is not finite.
bool keep_candidate_panels(const ScreenedHeadArgs& a, int64_t row, double bound) {
  const int64_t K = a.in_features, N = a.out_features, panels = (N + kSkinnyGemmPanel - 1) / kSkinnyGemmPanel;
  const float* x = a.x + row * K;
  const float* panel_max = a.panel_max + row * panels;
  float* y = a.y + row * N;
  double x_norm = 0.0;
  for (int64_t k = 0; k < K; ++k) x_norm += static_cast<double>(x[k]) * x[k];
  x_norm = std::sqrt(x_norm);
  // Beside the relative bound: subnormals, rounded to bfloat16 within 2^-134 each, or flushed to 0
  // by the dot product (inputs and sums below 2^-126): at most K·2^-125·(1 + |x| + |w_n|) in all.
  const double scale = bound * x_norm, floor = std::ldexp(static_cast<double>(K), -125);
  const auto within = [&](double w_norm) { return scale * w_norm + floor * (1.0 + x_norm + w_norm); };
  const int64_t top = std::max_element(panel_max, panel_max + panels) - panel_max;
  double lower = -INFINITY;
  for (int64_t n = top * kSkinnyGemmPanel; n < std::min(a.valid_features, (top + 1) * kSkinnyGemmPanel); ++n)
    lower = std::max(lower, y[n] - within(a.norms[n]));
  if (!std::isfinite(lower)) return false;
  const SkinnyGemmArgs exact{x, a.w, nullptr, y, 1, K, N};
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n = p * kSkinnyGemmPanel, columns = std::min(kSkinnyGemmPanel, N - n);
    if (!(panel_max[p] + within(a.panel_norms[p]) >= lower)) {
      std::fill(y + n, y + n + columns, -INFINITY);
      continue;
    }
    any_panels(exact, p, p + 1);
    for (int64_t c = 0; c < columns; ++c)
      if (!std::isfinite(y[n + c])) return false;
  }
  return true;
}

}  // namespace

int skinny_gemm_threads() { return omp_team_threads(); }

void skinny_gemm_cpu(const SkinnyGemmArgs& args) {
  over_panels<SkinnyGemmArgs, any_panels>(args, (args.out_features + kSkinnyGemmPanel - 1) / kSkinnyGemmPanel);
}

int64_t screened_head_max_rows(bool pairs) {
  return pairs ? kScreenedRowsDot : has_wide_lanes() ? kScreenedRowsWide : kScreenedRowsNarrow;
}

bool screened_head_pairs() { return cpu_has_bf16_dot(); }

bool screened_head_cpu(const ScreenedHeadArgs& args) {
  if (args.rows > screened_head_max_rows(args.pairs) || (args.pairs && !cpu_has_bf16_dot())) return false;
  for (int64_t i = 0; i < args.rows * args.in_features; ++i)
    if (!std::isfinite(args.x[i])) return false;
  std::vector<float> panel_max(args.rows * ((args.out_features + kSkinnyGemmPanel - 1) / kSkinnyGemmPanel));
  ScreenedHeadArgs with_scratch = args;
  with_scratch.panel_max = panel_max.data();
  const std::vector<uint32_t> x_pairs = args.pairs ? x_in_pairs(args) : std::vector<uint32_t>();
  with_scratch.x_pairs = x_pairs.data();
  over_panels<ScreenedHeadArgs, any_bf16_panels>(with_scratch,
                                                 (args.out_features + kSkinnyGemmPanel - 1) / kSkinnyGemmPanel);
  struct Rows {
    const ScreenedHeadArgs* args;
    double bound;
    std::atomic<bool> finite{true};
  } task{&with_scratch, screen_bound(args.in_features, args.pairs)};
  const auto rows = [](void* context) {
    auto& t = *static_cast<Rows*>(context);
    const int64_t size = omp_team_size(), me = omp_team_member(), count = t.args->rows;
    for (int64_t row = count * me / size; row < count * (me + 1) / size; ++row)
      if (!keep_candidate_panels(*t.args, row, t.bound)) t.finite = false;
  };
  const int threads = static_cast<int>(std::min<int64_t>(omp_team_threads(), args.rows));
  if (threads <= 1 || !run_on_omp_team(threads, rows, &task))
    for (int64_t row = 0; row < args.rows; ++row)
      if (!keep_candidate_panels(with_scratch, row, task.bound)) return false;
  return task.finite;
}

}  // namespace vrs
