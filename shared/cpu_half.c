/* Weight products over float16 weights with float32 rows and float32 sums (shared/linear.py's
 * "fp16" layout: a bfloat16 checkpoint served in float32 on a CPU without bfloat16 instructions),
 * on the caller and the kernels' helper threads (cpu_pool.c).
 *
 * A decode step's time is the weights' bytes over the memory's speed: float16 weights are half the
 * bytes of float32 ones. FBGEMM's float16 product (inside torch) read them at ~14 GB/s for one row
 * on a 2-core Intel Xeon whose float32 sum reads 23, and rounds a row differently with the number of
 * rows beside it. This one streams each weight once at any row count, and sums every output the same
 * way whatever the rows: one float32 fused multiply-add chain over the inputs in input order,
 * started at zero, then times `scale` (a power of two: exact), plus the bias, plus the residual.
 * So a row's result never depends on its batch.
 *
 * Layout (packed once at load): panels of 16 outputs, [n/16][k][16] float16: a panel's 16 weights
 * of one input side by side (32 bytes), its inputs in order. A task is a group of GROUP panels for a
 * range of ROW_CHUNK rows; inside it the inputs go in blocks of K_BLOCK (the panels' block stays in
 * this core's cache while the rows' tiles pass over it), the running sums kept in `out` between
 * blocks (float32 stored and loaded back: no rounding, the chain is unchanged).
 *
 * Two instruction sets: AVX512F (16 outputs a register) and AVX2 with F16C and FMA (two registers).
 * mm_half_isa() says which one runs (0: neither was built, and linear.py never calls in).
 */
#include <stdint.h>

#include "cpu_ops.h"
#include "cpu_pool.h"

#define PANEL 16     /* outputs a panel holds */
#define GROUP 4      /* panels a task holds: 64 outputs */
#define ROW_CHUNK 96 /* rows a task holds, at most */
#define K_BLOCK 512  /* inputs a pass over a group's panels takes */
#define TILE_ROWS 6  /* rows a tile's sums hold in registers */

typedef struct {
    const float *x, *bias, *residual;
    const uint16_t *w;
    float *out;
    int64_t x_stride, rows, n, k;
    float scale;
} half_job;

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#include <immintrin.h>

#if defined(__AVX512F__)
#define ISA 2
typedef __m512 v16;
/* panels a tile takes for R rows: 4 x 6 sums + 4 weights + 1 input in 32 registers */
#define TILE_PANELS(R) 4
static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 v_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const void *)p)); }
static inline v16 v_fma(float a, v16 b, v16 acc) { return _mm512_fmadd_ps(_mm512_set1_ps(a), b, acc); }
static inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v_scale(v16 a, float s) { return _mm512_mul_ps(a, _mm512_set1_ps(s)); }
#else
#define ISA 1
typedef struct {
    __m256 lo, hi;
} v16;
/* 16 registers: one row 2 panels (4 sums), two rows 2 (8), more rows 1 (up to 12), + weights + input */
#define TILE_PANELS(R) ((R) <= 2 ? 2 : 1)
static inline v16 v_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 v_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v_store(float *p, v16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline v16 v_half(const uint16_t *p) {
    return (v16){_mm256_cvtph_ps(_mm_loadu_si128((const void *)p)),
                 _mm256_cvtph_ps(_mm_loadu_si128((const void *)(p + 8)))};
}
static inline v16 v_fma(float a, v16 b, v16 acc) {
    const __m256 s = _mm256_set1_ps(a);
    return (v16){_mm256_fmadd_ps(s, b.lo, acc.lo), _mm256_fmadd_ps(s, b.hi, acc.hi)};
}
static inline v16 v_add(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline v16 v_scale(v16 a, float s) {
    const __m256 m = _mm256_set1_ps(s);
    return (v16){_mm256_mul_ps(a.lo, m), _mm256_mul_ps(a.hi, m)};
}
#endif

/* Rows r0 .. r0 + R times panels p0 .. p0 + G over inputs k0 .. k1 (R and G constants once inlined:
 * the sums stay in registers). The sums start at zero (k0 == 0) or from `out`; after the last input
 * they are scaled, the bias and the residual added, in that order. */
static inline __attribute__((always_inline)) void tile(const half_job *j, int64_t r0, const int R, int64_t p0,
                                                       const int G, int64_t k0, int64_t k1) {
    v16 sums[TILE_ROWS][GROUP];
    float *out = j->out + r0 * j->n + p0 * PANEL;
    const float *x = j->x + r0 * j->x_stride;
    const uint16_t *w = j->w + p0 * j->k * PANEL;
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) sums[r][g] = k0 ? v_load(out + r * j->n + g * PANEL) : v_zero();
    for (int64_t i = k0; i < k1; i++) {
        v16 weights[GROUP];
        for (int g = 0; g < G; g++) weights[g] = v_half(w + (g * j->k + i) * PANEL);
        for (int r = 0; r < R; r++) {
            const float in = x[r * j->x_stride + i];
            for (int g = 0; g < G; g++) sums[r][g] = v_fma(in, weights[g], sums[r][g]);
        }
    }
    const int last = k1 == j->k;
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            v16 v = sums[r][g];
            const int64_t at = (r0 + r) * j->n + (p0 + g) * PANEL;
            if (last) {
                v = v_scale(v, j->scale);
                if (j->bias) v = v_add(v, v_load(j->bias + (p0 + g) * PANEL));
                if (j->residual) v = v_add(v_load(j->residual + at), v);
            }
            v_store(j->out + at, v);
        }
}

/* Rows r0 .. r0 + R (R <= TILE_ROWS) times panels p0 .. p1 over inputs k0 .. k1. */
static inline __attribute__((always_inline)) void panels(const half_job *j, int64_t r0, const int R, int64_t p0,
                                                         int64_t p1, int64_t k0, int64_t k1) {
    int64_t p = p0;
    for (; p + TILE_PANELS(R) <= p1; p += TILE_PANELS(R)) tile(j, r0, R, p, TILE_PANELS(R), k0, k1);
    for (; p < p1; p++) tile(j, r0, R, p, 1, k0, k1);
}

/* Task t: panel group t % groups, row chunk t / groups. */
static void half_task(const void *ctx, int64_t t) {
    const half_job *j = ctx;
    const int64_t panel_count = j->n / PANEL, groups = (panel_count + GROUP - 1) / GROUP;
    const int64_t p0 = t % groups * GROUP, p1 = p0 + GROUP < panel_count ? p0 + GROUP : panel_count;
    const int64_t first = t / groups * ROW_CHUNK, end = first + ROW_CHUNK < j->rows ? first + ROW_CHUNK : j->rows;
    for (int64_t k0 = 0; k0 < j->k; k0 += K_BLOCK) {
        const int64_t k1 = k0 + K_BLOCK < j->k ? k0 + K_BLOCK : j->k;
        for (int64_t r0 = first; r0 < end; r0 += TILE_ROWS) {
            switch (end - r0 < TILE_ROWS ? end - r0 : TILE_ROWS) {
            case 1: panels(j, r0, 1, p0, p1, k0, k1); break;
            case 2: panels(j, r0, 2, p0, p1, k0, k1); break;
            case 3: panels(j, r0, 3, p0, p1, k0, k1); break;
            case 4: panels(j, r0, 4, p0, p1, k0, k1); break;
            case 5: panels(j, r0, 5, p0, p1, k0, k1); break;
            default: panels(j, r0, 6, p0, p1, k0, k1); break;
            }
        }
    }
}

int mm_half_isa(void) { return ISA; }
#else
int mm_half_isa(void) { return 0; }
#endif

/* out = (x @ w.T) * scale + bias + residual: x (rows, k) float32 with row stride x_stride, w float16
 * in panels (n, k) with n % 16 == 0, bias (n) or NULL, residual (rows, n) contiguous or NULL, out
 * (rows, n) contiguous float32 (not the residual). Only after mm_half_isa() said nonzero. */
void mm_half_product(const float *x, int64_t x_stride, int64_t rows, const uint16_t *w, int64_t n, int64_t k,
                     float scale, const float *bias, const float *residual, float *out) {
    const half_job product = {x, bias, residual, w, out, x_stride, rows, n, k, scale};
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
    const int64_t groups = (n / PANEL + GROUP - 1) / GROUP, chunks = (rows + ROW_CHUNK - 1) / ROW_CHUNK;
    mm_pool_run(half_task, &product, groups * chunks);
#else
    (void)product;
#endif
}
