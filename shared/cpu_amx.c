/* Weight products of a few rows (decode steps) on AMX, over oneDNN's packed bfloat16 weights
 * (shared/linear.py), on the caller and the kernels' helper threads (cpu_pool.c).
 *
 * A decode step multiplies each weight by one row per running sequence: its time is the weights'
 * bytes over the memory's speed, plus what the kernel adds. This one streams each weight once,
 * in the layout oneDNN packed it into at load ([N/64][K/2][64][2]: blocks of 64 outputs, inside a
 * block the inputs in pairs, the pair of each output side by side), with the instruction oneDNN's
 * own kernel uses (TDPBF16PS: four float32 accumulator tiles of 16 outputs, the inputs 32 at a
 * time, in input order), then adds the bias and a residual to the float32 sums and rounds once to
 * bfloat16, as oneDNN does: linear.py uses it only where a probe at load finds it equal to
 * oneDNN's product bit for bit. A task is one block of 64 outputs.
 *
 * Built only where the compiler targets AMX (-march=native on such a CPU); mm_amx_ready() says
 * whether it was and whether the kernel lets this process use the tiles.
 */
#define _GNU_SOURCE
#include <stdint.h>

#include "cpu_pool.h"

typedef uint16_t bf16;

#define BLOCK 64    /* outputs a block holds: four tiles of 16 float32 columns */
#define CHUNK 32    /* inputs one tile product consumes: 16 pairs */
#define MAX_ROWS 16 /* rows a tile holds */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

typedef struct {
    const bf16 *x, *w, *bias, *residual;
    bf16 *out;
    int64_t x_stride, rows, n, k;
} product_t;

static __thread int64_t configured_rows; /* this thread's tile configuration (0: none) */

int mm_amx_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* Back to the initial state: a thread holding no tile data switches faster, and oneDNN's kernels
 * on the caller's thread configure their own. */
void mm_tiles_release(void) {
    if (configured_rows) _tile_release();
    configured_rows = 0;
}

static inline __m512 widen16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
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
static void block_rows(const product_t *j, int64_t b, int64_t r0, int64_t rows) {
    const int64_t chunks = j->k / CHUNK, chunk_elems = CHUNK * BLOCK;
    const bf16 *wb = j->w + b * chunks * chunk_elems, *x = j->x + r0 * j->x_stride;
    float sums[MAX_ROWS][BLOCK];
    configure(rows);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
        const bf16 *wc = wb + c * chunk_elems;
        /* The next chunk's 4 KiB into L1 while this one multiplies: 3-5% faster than the hardware
         * prefetchers alone (prefetching 2 chunks ahead, or into L2 only, gained less or lost). */
        for (int line = 0; line < CHUNK * BLOCK * 2; line += 64)
            _mm_prefetch((const char *)(wc + chunk_elems) + line, _MM_HINT_T0);
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
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = (r0 + r) * j->n + b * BLOCK;
        for (int i = 0; i < BLOCK; i += 16) {
            __m512 v = _mm512_loadu_ps(&sums[r][i]);
            if (j->bias) v = _mm512_add_ps(v, widen16(j->bias + b * BLOCK + i));
            if (j->residual) v = _mm512_add_ps(v, widen16(j->residual + at + i));
            _mm256_storeu_si256((void *)(j->out + at + i), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* Task b: every row times block b, 16 rows at a time (after the first 16, the block's weights come
 * from this core's cache). */
static void product_block(const void *ctx, int64_t b) {
    const product_t *j = ctx;
    for (int64_t r0 = 0; r0 < j->rows; r0 += MAX_ROWS)
        block_rows(j, b, r0, j->rows - r0 < MAX_ROWS ? j->rows - r0 : MAX_ROWS);
}

/* out = round(x @ w.T + bias + residual): x (rows, k) with row stride x_stride,
 * w packed (n, k) with n % 64 == 0 and k % 32 == 0, bias (n) or NULL, residual (rows, n)
 * contiguous or NULL, out (rows, n) contiguous. */
void mm_amx_product(const bf16 *x, int64_t x_stride, int64_t rows, const bf16 *w, int64_t n, int64_t k,
                    const bf16 *bias, const bf16 *residual, bf16 *out) {
    const product_t product = {x, w, bias, residual, out, x_stride, rows, n, k};
    mm_pool_run(product_block, &product, n / BLOCK);
    mm_tiles_release();
}

#else
int mm_amx_ready(void) { return 0; }
void mm_tiles_release(void) {}
void mm_amx_product(const bf16 *x, int64_t x_stride, int64_t rows, const bf16 *w, int64_t n, int64_t k,
                    const bf16 *bias, const bf16 *residual, bf16 *out) {
    (void)x, (void)x_stride, (void)rows, (void)w, (void)n, (void)k, (void)bias, (void)residual, (void)out;
}
#endif
