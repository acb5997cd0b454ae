// CPU helpers of the tree kernels: the e row of the lazy target rows (tree_accept.h), eight
// lanes at a time. Every lane performs TargetWeight's and exp_neg's operations in their order
// (IEEE per lane, no contraction: CMakeLists.txt), so the result is theirs bit for bit; the
// loop is compiled for AVX-512, AVX2 and baseline x86-64 (picked at load time).
#include <cstring>

// Vectors of 64 bytes pass only into always-inlined functions of one ISA clone.
#pragma GCC diagnostic ignored "-Wpsabi"

#include "tree_accept.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VRS_ISA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VRS_ISA_CLONES
#endif

namespace vrs {
namespace {

constexpr int kLanes = 8;
typedef double VDouble __attribute__((vector_size(kLanes * sizeof(double))));
typedef int64_t VLong __attribute__((vector_size(kLanes * sizeof(int64_t))));
typedef float VFloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VInt __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t VKey __attribute__((vector_size(kLanes * sizeof(uint32_t))));

VRS_ISA_CLONES void store_target_weights_isa(const float* logits, const uint32_t* keys,
                                             int64_t n, uint32_t min_key, double temperature,
                                             double max_x, double* dst) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    VFloat l;
    VKey k{};  // min_key 0 keeps all, and needs no keys
    std::memcpy(&l, logits + i, sizeof l);
    if (min_key > 0) std::memcpy(&k, keys + i, sizeof k);
    const VFloat zero_f{};
    l = l != l ? zero_f - INFINITY : l;  // canonical_logit: NaN -> -inf, -0 -> +0
    l = l == 0.0f ? zero_f : l;
    const VInt kept = k >= min_key;
    bool any_kept = false;  // most chunks have none under a small top-k
    for (int lane = 0; lane < kLanes; ++lane) any_kept |= kept[lane] != 0;
    if (!any_kept) {
      const VDouble none{};
      std::memcpy(dst + i, &none, sizeof none);
      continue;
    }
    const VDouble x = __builtin_convertvector(l, VDouble) / temperature;
    const VLong use = __builtin_convertvector(kept, VLong) & (x != -INFINITY);
    const VDouble zero{};
    const VDouble y = x - max_x;
    const VLong inside = y >= kExpFloor;
    const VDouble exp_y = exp_neg_inside<VDouble, VLong>(inside ? y : zero);
    const VDouble e = x == max_x ? zero + 1.0 : (inside ? exp_y : zero);
    const VDouble out = use ? e : zero;
    std::memcpy(dst + i, &out, sizeof out);
  }
  const TargetWeight<CachedKeys> weight{logits, CachedKeys{keys}, min_key, temperature, max_x};
  for (; i < n; ++i) dst[i] = weight(i);
}

}  // namespace

void store_target_weights(const float* logits, const uint32_t* keys, int64_t n, uint32_t min_key,
                          double temperature, double max_x, double* dst) {
  store_target_weights_isa(logits, keys, n, min_key, temperature, max_x, dst);
}

}  // namespace vrs
