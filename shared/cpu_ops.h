/* The compiled operators one source calls from another (cpu_layers.c builds a decoder layer of
 * them), declared once: each defining source includes this header, so a definition and its callers
 * cannot disagree on a signature. Also the bfloat16 widening the AVX512-BF16 loops share. */
#ifndef MM_CPU_OPS_H
#define MM_CPU_OPS_H
#include <stdint.h>

typedef uint16_t bf16;

/* cpu_kernels.c */
void mm_rms_norm(const bf16 *x, int64_t x_stride, const bf16 *weight, bf16 *out, int64_t rows, int64_t dim,
                 float eps);
void mm_rotate(bf16 *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim, const bf16 *cos,
               const bf16 *folded_sin);
void mm_silu_mul(const bf16 *restrict gate_up, bf16 *restrict out, int64_t rows, int64_t width);
/* cpu_attention.c */
void mm_decode_attention(const bf16 *q, int64_t q_stride, const bf16 *cache, int64_t block_size,
                         const int64_t *tables, int64_t width, const int64_t *lengths, bf16 *out, int64_t batch,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, float scale);
/* The same operators on float32 rows (cpu_kernels.c, cpu_attention.c) */
void mm_rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows, int64_t dim,
                     float eps);
void mm_rotate_f32(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim, const float *cos,
                   const float *folded_sin);
void mm_silu_mul_f32(const float *restrict gate_up, float *restrict out, int64_t rows, int64_t width);
void mm_decode_attention_f32(const float *q, int64_t q_stride, const float *cache, int64_t block_size,
                             const int64_t *tables, int64_t width, const int64_t *lengths, float *out,
                             int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale);
/* cpu_half.c */
void mm_half_product(const float *x, int64_t x_stride, int64_t rows, const uint16_t *w, int64_t n, int64_t k,
                     float scale, const float *bias, const float *residual, float *out);
/* cpu_packed.c */
void mm_packed_product(const bf16 *x, int64_t x_stride, int64_t rows, const bf16 *w, int64_t n, int64_t k,
                       const bf16 *bias, const bf16 *residual, bf16 *out, int64_t chunk);

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* 16 bfloat16 values as float32 (exact). */
static inline __m512 widen16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}
#endif

#endif
