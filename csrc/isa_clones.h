// Hot CPU functions compiled for AVX-512, AVX2+FMA and baseline x86-64, the clone picked at load
// time (GCC on x86-64; one build elsewhere), and the helpers they inline into every clone.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VRS_ISA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VRS_ISA_CLONES
#endif
#define VRS_INLINE inline __attribute__((always_inline))
// A lambda's body is a function of its own, compiled for baseline x86-64 unless it is inlined
// into the clone that calls it: lambdas in a cloned function's hot loops carry this.
#define VRS_LAMBDA_INLINE __attribute__((always_inline))
