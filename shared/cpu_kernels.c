/* The decoder layer's small operators on bfloat16 rows, one pass each (shared/cpu_kernels.py), and
 * on float32 rows (a float32 model's): RMSNorm, the rotary embeddings (the decoder's, a vision
 * tower's) and SiLU times up. Attention is in cpu_attention.c.
 *
 * Compiled on the machine that runs it (-march=native), loaded with ctypes. Every row is computed
 * the same way whatever the number of rows: a row alone equals that row among many (what a cache
 * hit relies on). Rounding follows eager PyTorch's: operands widened to float32, each operator's
 * result rounded to bfloat16 to nearest even, so the rotary embedding equals eager's bit for bit;
 * the RMSNorm's sum of squares runs in another order than torch's, and the SiLU's exp is a
 * polynomial of ~1 float32 ulp (results within a bfloat16 rounding of eager's).
 *
 * OpenMP: the process's own libgomp (torch's, already loaded) runs the parallel loops over rows,
 * only where the work is large enough to be worth waking the other threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_lanes.h"
#include "cpu_ops.h"


/* Each operator below for bfloat16 rows (mm_NAME) and for float32 rows (mm_NAME_f32): LOAD widens an
 * element to float32, STORE rounds a float32 to the element type (both the identity for float32). */

/* out = x / rms(x) * weight per row of dim values; float32 inside, rounded once (torch's order). */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE) \
void NAME(const T *x, int64_t x_stride, const T *weight, T *out, int64_t rows, int64_t dim, float eps) {          \
_Pragma("omp parallel for schedule(static) if (rows * dim >= PARALLEL_VALUES)")                                   \
    for (int64_t r = 0; r < rows; r++) {                                                                          \
        const T *xr = x + r * x_stride;                                                                           \
        T *o = out + r * dim;                                                                                     \
        lanes_t acc = {0};                                                                                        \
        int64_t i = 0;                                                                                            \
        for (; i + LANES <= dim; i += LANES) {                                                                    \
            float v[LANES];                                                                                       \
            for (int l = 0; l < LANES; l++) v[l] = LOAD(xr[i + l]);                                               \
            acc += load_lanes(v) * load_lanes(v);                                                                 \
        }                                                                                                         \
        for (; i < dim; i++) acc[i % LANES] += LOAD(xr[i]) * LOAD(xr[i]);                                         \
        float scale = 1.0f / sqrtf(fold(acc) / (float)dim + eps);                                                 \
        for (int64_t d = 0; d < dim; d++) o[d] = STORE(LOAD(xr[d]) * scale * LOAD(weight[d]));                    \
    }                                                                                                             \
}

DEFINE_RMS_NORM(mm_rms_norm, bf16, widen, narrow)
DEFINE_RMS_NORM(mm_rms_norm_f32, float, same, same)

/* Rotary embedding in place on heads of head_dim values (rows, heads, head_dim), rows row_stride
 * apart: x * cos + rotate_half(x) * sin, each product and the sum rounded as eager rounds them.
 * folded_sin is sin with its first half negated (rotate_half's sign); cos and folded_sin are
 * (rows, head_dim). */
#define DEFINE_ROTATE(NAME, T, LOAD, STORE) \
void NAME(T *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim, const T *cos,                  \
          const T *folded_sin) {                                                                                  \
    int64_t half = head_dim / 2;                                                                                  \
_Pragma("omp parallel for schedule(static) if (rows * heads * head_dim >= PARALLEL_VALUES)")                      \
    for (int64_t r = 0; r < rows; r++) {                                                                          \
        const T *c = cos + r * head_dim, *s = folded_sin + r * head_dim;                                          \
        for (int64_t h = 0; h < heads; h++) {                                                                     \
            T *v = x + r * row_stride + h * head_dim;                                                             \
            float orig[head_dim];                                                                                 \
            for (int64_t d = 0; d < head_dim; d++) orig[d] = LOAD(v[d]);                                          \
            for (int64_t d = 0; d < head_dim; d++) {                                                              \
                float partner = orig[d < half ? d + half : d - half];                                             \
                float rotated = LOAD(STORE(partner * LOAD(s[d])));                                                \
                float scaled = LOAD(STORE(orig[d] * LOAD(c[d])));                                                 \
                v[d] = STORE(scaled + rotated);                                                                   \
            }                                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
}

DEFINE_ROTATE(mm_rotate, bf16, widen, narrow)
DEFINE_ROTATE(mm_rotate_f32, float, same, same)

/* A vision tower's rotary embedding (transformers' apply_rotary_pos_emb_vision): x (rows, heads,
 * head_dim) bfloat16 (mm_rotate_vision) or float32 (mm_rotate_vision_f32), rows and heads
 * row_stride and head_stride apart; cos and sin float32 (rows, head_dim). In float32 x * cos +
 * rotate_half(x) * sin, rounded to x's type once into out (rows, heads, head_dim) contiguous: the
 * reference's operations in its order, so its result bit for bit. */
#define DEFINE_ROTATE_VISION(NAME, T, LOAD, STORE) \
void NAME(const T *restrict x, int64_t row_stride, int64_t head_stride, int64_t rows, int64_t heads,                \
          int64_t head_dim, const float *restrict cos, const float *restrict sin, T *restrict out) {              \
    int64_t half = head_dim / 2;                                                                                  \
_Pragma("omp parallel for schedule(static) if (rows * heads * head_dim >= PARALLEL_VALUES)")                      \
    for (int64_t r = 0; r < rows; r++) {                                                                          \
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;                                             \
        for (int64_t h = 0; h < heads; h++) {                                                                     \
            const T *v = x + r * row_stride + h * head_stride;                                                    \
            T *o = out + (r * heads + h) * head_dim;                                                              \
            for (int64_t d = 0; d < half; d++) o[d] = STORE(LOAD(v[d]) * c[d] + -LOAD(v[d + half]) * s[d]);      \
            for (int64_t d = half; d < head_dim; d++) o[d] = STORE(LOAD(v[d]) * c[d] + LOAD(v[d - half]) * s[d]); \
        }                                                                                                         \
    }                                                                                                             \
}

DEFINE_ROTATE_VISION(mm_rotate_vision, bf16, widen, narrow)
DEFINE_ROTATE_VISION(mm_rotate_vision_f32, float, same, same)

/* out = silu(gate) * up per row of gate_up = [gate | up] (rows, 2 * width): SiLU rounded, then
 * the product rounded, as eager's two operators. Two passes over a stack buffer of a few hundred
 * values: gcc vectorizes each well, the fused loop badly (~8x slower on AVX-512). */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE) \
void NAME(const T *restrict gate_up, T *restrict out, int64_t rows, int64_t width) {                              \
_Pragma("omp parallel for schedule(static) if (rows * width >= PARALLEL_VALUES)")                                 \
    for (int64_t r = 0; r < rows; r++) {                                                                          \
        const T *restrict g = gate_up + r * 2 * width, *restrict u = g + width;                                   \
        T *restrict o = out + r * width;                                                                          \
        float act[256];                                                                                           \
        for (int64_t start = 0; start < width; start += 256) {                                                    \
            int64_t n = width - start < 256 ? width - start : 256;                                                \
            for (int64_t d = 0; d < n; d++) {                                                                     \
                float x = LOAD(g[start + d]);                                                                     \
                act[d] = x / (1.0f + exp_approx(-x));                                                             \
            }                                                                                                     \
            for (int64_t d = 0; d < n; d++) o[start + d] = STORE(LOAD(STORE(act[d])) * LOAD(u[start + d]));       \
        }                                                                                                         \
    }                                                                                                             \
}

DEFINE_SILU_MUL(mm_silu_mul, bf16, widen, narrow)
DEFINE_SILU_MUL(mm_silu_mul_f32, float, same, same)
