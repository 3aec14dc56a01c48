/* What the kernels' sources share (cpu_kernels.c, cpu_attention.c): bfloat16 widening and
 * rounding, the float32 exp, and LANES-wide float vectors whose sums run in the same order on
 * every machine. Static inline: each source gets its own copy, inlined where it is used. */
#ifndef MM_CPU_LANES_H
#define MM_CPU_LANES_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_ops.h"

/* 16 where AVX-512 holds them in one register (and off x86); 8 on x86 without it (AVX2): there a
 * 16-lane value takes two of its 16 registers, the kernels' sums no longer fit and spill (prefill
 * attention of a 512-token, 14-head layer: 91 ms with 16 lanes, 5.9 ms with 8 on AMD EPYC Zen 3).
 * The order of the sums follows the width: rows still never depend on their batch. */
#if defined(__AVX512F__) || !defined(__x86_64__)
#define LANES 16
#else
#define LANES 8
#endif
#define PARALLEL_VALUES (1 << 16) /* below this many values a loop stays on the calling thread */

static inline float widen(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, NaN to the quiet NaN (c10::BFloat16's rounding). */
static inline bf16 narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return f != f ? (bf16)0x7fc0 : (bf16)rounded;
}

/* Cephes' expf polynomial of x after its reduction by n ln 2 (n = x / ln 2 rounded), for a float
 * or a vector of them (exp_approx, exp_lanes): P = exp(x - n ln 2), to be scaled by 2^n. */
#define EXP_REDUCED(T, x, n, P)                                                                          \
    do {                                                                                                 \
        T r_ = (x) - (n) * 0.693359375f;                                                                 \
        r_ = r_ - (n) * -2.12194440e-4f;                                                                 \
        P = r_ * 1.9875691500e-4f + 1.3981999507e-3f;                                                    \
        P = P * r_ + 8.3334519073e-3f;                                                                   \
        P = P * r_ + 4.1665795894e-2f;                                                                   \
        P = P * r_ + 1.6666665459e-1f;                                                                   \
        P = P * r_ + 5.0000001201e-1f;                                                                   \
        P = P * r_ * r_ + r_ + 1.0f;                                                                     \
    } while (0)

/* exp on float32 (Cephes' expf polynomial after reduction by ln 2), branch free so loops vectorize. */
static inline float exp_approx(float x) {
    x = x > 88.3762626647949f ? 88.3762626647949f : x;
    x = x < -87.3365447504019f ? -87.3365447504019f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f), p;
    EXP_REDUCED(float, x, n, p);
    union { uint32_t bits; float value; } scale = {.bits = (uint32_t)((int32_t)n + 127) << 23};
    return p * scale.value;
}

/* LANES floats as one value (GCC/Clang vector extensions): lowered to whatever registers the CPU
 * has, so the sums below run in the same order on every machine of a width. */
typedef float lanes_t __attribute__((vector_size(LANES * sizeof(float))));
typedef float half_t __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef float quarter_t __attribute__((vector_size(LANES / 4 * sizeof(float))));

static inline lanes_t load_lanes(const float *p) {
    lanes_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The LANES running sums added pairwise: lane l + lane l+8 (16 lanes), then + l+4, then + l+2,
 * then + l+1. */
static inline float fold(lanes_t acc) {
    half_t lo, hi;
    memcpy(&lo, &acc, sizeof lo);
    memcpy(&hi, (const char *)&acc + sizeof lo, sizeof hi);
    half_t h = lo + hi;
#if LANES == 16
    quarter_t a, b;
    memcpy(&a, &h, sizeof a);
    memcpy(&b, (const char *)&h + sizeof a, sizeof b);
    quarter_t q = a + b;
    return (q[0] + q[2]) + (q[1] + q[3]);
#else
    return (h[0] + h[2]) + (h[1] + h[3]);
#endif
}

static inline float same(float v) { return v; }

#endif
