/* Weight products of a few rows (decode steps) over oneDNN's packed bfloat16 weights
 * (shared/linear.py), on the caller and the kernels' helper threads (cpu_pool.c).
 *
 * A decode step multiplies each weight by one row per running sequence: its time is the weights'
 * bytes over the memory's speed, plus what the kernel adds. This one streams each weight once,
 * in the layout oneDNN packed it into at load ([N/64][K/2][64][2]: blocks of 64 outputs, inside a
 * block the inputs in pairs, the pair of each output side by side), with the instruction oneDNN's
 * own kernel uses on this CPU, then adds the bias and a residual to the float32 sums and rounds
 * once to bfloat16, as oneDNN does: linear.py uses it only where a probe at load finds it equal to
 * oneDNN's product bit for bit. A task is one block of 64 outputs. Two instruction sets:
 *
 * - AMX (TDPBF16PS: four float32 accumulator tiles of 16 outputs, the inputs 32 at a time, in
 *   input order), where the compiler targets it and the kernel lets this process use the tiles;
 * - AVX512-BF16 (VDPBF16PS: one input pair times 16 outputs a register, the pairs in input order,
 *   four registers a row for a block), on a CPU without AMX (AMD Zen 4, for one).
 *
 * mm_packed_isa() says which one runs (0: neither was built, and linear.py never calls in).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>

#include "cpu_ops.h"
#include "cpu_pool.h"

#define BLOCK 64 /* outputs a block holds: four registers (or tiles) of 16 float32 columns */

typedef struct {
    const bf16 *x, *w, *bias, *residual;
    bf16 *out;
    int64_t x_stride, rows, n, k;
    int64_t chunk; /* AVX512-BF16: input pairs a partial sum takes before it joins the total (0: all) */
} product_t;

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define LANES 16   /* float32 sums a register holds */
#define VEC_ROWS 6 /* rows one AVX512-BF16 pass takes: 24 sums + 4 weights + 1 input in 32 registers */

/* out[row, 16 outputs of block b from i] = round(sums + bias + residual), added in float32. */
static inline void finish16(const product_t *j, int64_t row, int64_t b, int i, __m512 v) {
    const int64_t at = row * j->n + b * BLOCK + i;
    if (j->bias) v = _mm512_add_ps(v, widen16(j->bias + b * BLOCK + i));
    if (j->residual) v = _mm512_add_ps(v, widen16(j->residual + at));
    _mm256_storeu_si256((void *)(j->out + at), (__m256i)_mm512_cvtneps_pbh(v));
}

/* sums[r] += input pairs c0 .. c1 of row r times the block's weights wb, in order. The weights stream
 * with no software prefetch: on the AMD EPYC (Zen 4) the hardware prefetchers alone took 96 `mid`
 * decode products ~6% faster than prefetching 0.5-4 KiB ahead, at the machine's plain read rate. */
static inline __attribute__((always_inline)) void vec_pairs(const bf16 *wb, const bf16 *x, int64_t x_stride,
                                                            int64_t c0, int64_t c1, const int R, __m512 sums[][4]) {
    for (int64_t p = c0; p < c1; p++) {
        const bf16 *wp = wb + p * 2 * BLOCK;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);
            const __m512bh in = (__m512bh)_mm512_set1_epi32(pair);
            sums[r][0] = _mm512_dpbf16_ps(sums[r][0], in, w0);
            sums[r][1] = _mm512_dpbf16_ps(sums[r][1], in, w1);
            sums[r][2] = _mm512_dpbf16_ps(sums[r][2], in, w2);
            sums[r][3] = _mm512_dpbf16_ps(sums[r][3], in, w3);
        }
    }
}

/* Rows r0 .. r0 + R times block b on AVX512-BF16 (R a constant once inlined: the sums stay in
 * registers). Each input pair, broadcast, meets the block's 64 output pairs in four registers; the
 * pairs are summed in order, in partial sums of j->chunk pairs added to the total one by one (the
 * order oneDNN's kernel sums in, which linear.py's probe finds). */
static inline __attribute__((always_inline)) void vec_rows(const product_t *j, int64_t b, int64_t r0, const int R) {
    const int64_t pairs = j->k / 2, chunk = j->chunk ? j->chunk : pairs;
    const bf16 *wb = j->w + b * j->k * BLOCK, *x = j->x + r0 * j->x_stride;
    __m512 totals[VEC_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) totals[r][q] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < pairs; c0 += chunk) {
        __m512 sums[VEC_ROWS][4];
        for (int r = 0; r < R; r++)
            for (int q = 0; q < 4; q++) sums[r][q] = _mm512_setzero_ps();
        vec_pairs(wb, x, j->x_stride, c0, c0 + chunk < pairs ? c0 + chunk : pairs, R, sums);
        for (int r = 0; r < R; r++)
            for (int q = 0; q < 4; q++) totals[r][q] = _mm512_add_ps(totals[r][q], sums[r][q]);
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) finish16(j, r0 + r, b, q * LANES, totals[r][q]);
}

/* Task b on AVX512-BF16: every row times block b, VEC_ROWS at a time (after the first pass the
 * block's weights come from this core's cache). */
static void vec_block(const void *ctx, int64_t b) {
    const product_t *j = ctx;
    for (int64_t r0 = 0; r0 < j->rows; r0 += VEC_ROWS) {
        switch (j->rows - r0 < VEC_ROWS ? j->rows - r0 : VEC_ROWS) {
        case 1: vec_rows(j, b, r0, 1); break;
        case 2: vec_rows(j, b, r0, 2); break;
        case 3: vec_rows(j, b, r0, 3); break;
        case 4: vec_rows(j, b, r0, 4); break;
        case 5: vec_rows(j, b, r0, 5); break;
        default: vec_rows(j, b, r0, 6); break;
        }
    }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define CHUNK 32     /* inputs one tile product consumes: 16 pairs */
#define TILE_ROWS 16 /* rows a tile holds */
#define L2_AHEAD 4  /* chunks ahead the weights are asked into L2 */

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int tiles;                        /* the AMX path runs (mm_packed_isa) */
static __thread int64_t configured_rows; /* this thread's tile configuration (0: none) */

/* Back to the initial state: a thread holding no tile data switches faster, and oneDNN's kernels
 * on the caller's thread configure their own. */
void mm_tiles_release(void) {
    if (configured_rows) _tile_release();
    configured_rows = 0;
}

/* Tiles 0-3: the sums (rows x 16 float32), 4: the rows' inputs (rows x 32 bf16), 5-7: weights
 * (16 pairs x 16 outputs x 2). */
static void configure(int64_t rows) {
    if (configured_rows == rows) return;
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t < 5 ? (uint8_t)rows : CHUNK / 2;
    }
    _tile_loadconfig(&cfg);
    configured_rows = rows;
}

/* Rows r0 .. r0 + rows (rows <= 16) times block b. */
static void tile_rows(const product_t *j, int64_t b, int64_t r0, int64_t rows) {
    const int64_t chunks = j->k / CHUNK, chunk_elems = CHUNK * BLOCK;
    const bf16 *wb = j->w + b * chunks * chunk_elems, *x = j->x + r0 * j->x_stride;
    float sums[TILE_ROWS][BLOCK];
    configure(rows);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
        const bf16 *wc = wb + c * chunk_elems;
        /* The next chunk's 4 KiB into L1 and the fourth one on into L2, within the block (the next
         * block is another task's). On one 2-core AMX Xeon VM (2026-12-07) a decode step's 96
         * products, back to back, took over a plain read of their bytes: 2.3x without software
         * prefetch, 1.4-1.6x with the next chunk into L1 alone (on another such VM, 2026-12-06, that
         * was only 3-5% faster than none), 1.31-1.32x with the L2 prefetch 4 chunks on (2 or 3
         * chunks on: 1.36-1.43x, 8: 1.50x). */
        if (c + 1 < chunks)
            for (int line = 0; line < CHUNK * BLOCK * 2; line += 64)
                _mm_prefetch((const char *)(wc + chunk_elems) + line, _MM_HINT_T0);
        if (c + L2_AHEAD < chunks)
            for (int line = 0; line < CHUNK * BLOCK * 2; line += 64)
                _mm_prefetch((const char *)(wc + L2_AHEAD * chunk_elems) + line, _MM_HINT_T1);
        _tile_loadd(4, x + c * CHUNK, j->x_stride * 2);
        _tile_loadd(5, wc, BLOCK * 4);
        _tile_loadd(6, wc + 32, BLOCK * 4);
        _tile_loadd(7, wc + 64, BLOCK * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, wc + 96, BLOCK * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, &sums[0][0], BLOCK * 4);
    _tile_stored(1, &sums[0][16], BLOCK * 4);
    _tile_stored(2, &sums[0][32], BLOCK * 4);
    _tile_stored(3, &sums[0][48], BLOCK * 4);
    for (int64_t r = 0; r < rows; r++)
        for (int i = 0; i < BLOCK; i += LANES) finish16(j, r0 + r, b, i, _mm512_loadu_ps(&sums[r][i]));
}

/* Task b on AMX: every row times block b, 16 rows at a time (after the first 16, the block's
 * weights come from this core's cache). */
static void tile_block(const void *ctx, int64_t b) {
    const product_t *j = ctx;
    for (int64_t r0 = 0; r0 < j->rows; r0 += TILE_ROWS)
        tile_rows(j, b, r0, j->rows - r0 < TILE_ROWS ? j->rows - r0 : TILE_ROWS);
}

/* 2: AMX (once a process, asks the kernel for the tile registers; oneDNN asks too, where it uses
 * them), 1: AVX512-BF16 where the kernel refuses. */
int mm_packed_isa(void) {
    static int asked;
    if (!asked) tiles = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0, asked = 1;
    return tiles ? 2 : 1;
}
#else
void mm_tiles_release(void) {}
#if defined(__AVX512BF16__)
int mm_packed_isa(void) { return 1; }
#else
int mm_packed_isa(void) { return 0; }
#endif
#endif

/* out = round(x @ w.T + bias + residual): x (rows, k) with row stride x_stride,
 * w packed (n, k) with n % 64 == 0 and k % 32 == 0, bias (n) or NULL, residual (rows, n)
 * contiguous or NULL, out (rows, n) contiguous; chunk: see product_t. Only after mm_packed_isa()
 * said nonzero. */
void mm_packed_product(const bf16 *x, int64_t x_stride, int64_t rows, const bf16 *w, int64_t n, int64_t k,
                       const bf16 *bias, const bf16 *residual, bf16 *out, int64_t chunk) {
    const product_t product = {x, w, bias, residual, out, x_stride, rows, n, k, chunk};
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (tiles) {
        mm_pool_run(tile_block, &product, n / BLOCK);
        mm_tiles_release();
        return;
    }
#endif
#if defined(__AVX512BF16__)
    mm_pool_run(vec_block, &product, n / BLOCK);
#else
    (void)product;
#endif
}
