// Hot CPU functions compiled for AVX-512, AVX2+FMA and baseline x86-64, the clone picked at load
// time (GCC on x86-64; one build elsewhere), and the helpers they inline into every clone; and
// functions of their own for AVX-512 (VRS_WIDE) with the switch that picks them.
#pragma once

#include <atomic>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VRS_ISA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
// A function of its own for AVX-512 (16 floats a register), called where has_wide_lanes().
#define VRS_WIDE __attribute__((target("arch=x86-64-v4")))
// A VRS_WIDE function that also runs the bfloat16 dot product (AVX512_BF16), where cpu_has_bf16_dot().
#define VRS_WIDE_BF16 __attribute__((target("arch=x86-64-v4,avx512bf16")))
#define VRS_HAS_WIDE 1
#else
#define VRS_ISA_CLONES
#define VRS_HAS_WIDE 0
#endif
#define VRS_INLINE inline __attribute__((always_inline))
// A lambda's body is a function of its own, compiled for baseline x86-64 unless it is inlined
// into the clone that calls it: lambdas in a cloned function's hot loops carry this.
#define VRS_LAMBDA_INLINE __attribute__((always_inline))

namespace vrs {

// Whether this CPU runs VRS_WIDE functions (AVX-512F and VL; checked once).
inline bool cpu_has_wide_lanes() {
#if VRS_HAS_WIDE
  static const bool wide = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  return wide;
#else
  return false;
#endif
}

// Whether the kernels take their VRS_WIDE paths: where the CPU has them, unless use_wide_lanes
// turned them off (tests and benchmarks compare the two paths, which give the same sums).
inline std::atomic<bool>& wide_lanes_switch() {
  static std::atomic<bool> on{cpu_has_wide_lanes()};
  return on;
}

inline bool has_wide_lanes() { return wide_lanes_switch().load(std::memory_order_relaxed); }

// Whether this CPU runs VRS_WIDE_BF16 functions (AVX-512 as above and AVX512_BF16; checked once).
inline bool cpu_has_bf16_dot() {
#if VRS_HAS_WIDE
  static const bool dot = cpu_has_wide_lanes() && __builtin_cpu_supports("avx512bf16");
  return dot;
#else
  return false;
#endif
}

// Turns the wide paths on (where the CPU has them) or off; returns whether they were on.
inline bool use_wide_lanes(bool enabled) { return wide_lanes_switch().exchange(enabled && cpu_has_wide_lanes()); }

}  // namespace vrs
