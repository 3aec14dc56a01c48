/* Attention on the CPU (shared/cpu_kernels.py), for bfloat16 or float32 rows: a decode step's
 * one query token a sequence over the paged cache, a prefill's query rows over the paged cache
 * (causal), and a vision tower's rows over their own item (no mask).
 *
 * Compiled with cpu_kernels.c into one library. Scores, softmax and weighted sums in float32; a
 * row's arithmetic depends only on its own query and the keys and values it attends over, never
 * on which other rows, sequences or items share the call (what a cache hit relies on).
 *
 * Threads: decode attention runs on the kernels' own helper threads where they were started
 * (cpu_pool.c: no wake-up per call) from a few thousand cached values on, else on OpenMP's above
 * a larger size; prefill attention on the helpers where they were started (else on the caller);
 * vision attention, in the encoder, on OpenMP's threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_lanes.h"
#include "cpu_ops.h"
#include "cpu_pool.h"

#define POOL_VALUES (1 << 14) /* decode attention over this many cached values goes to the helpers (cpu_pool.c) */
#define AHEAD 16 /* decode attention prefetches the cache slot this many tokens ahead (the cache is cold in a step) */

/* Sum of a[i] * b[i] in LANES running sums, then folded. */
static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    lanes_t acc = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc += load_lanes(a + i) * load_lanes(b + i);
    for (; i < n; i++) acc[i % LANES] += a[i] * b[i];
    return fold(acc);
}

/* exp(s - max s) in place over one query's scores, and their sum: a softmax whose division is left
 * to the caller (prefill attention divides each output's head_dim sums instead of every score;
 * softmax_ divides each score). */
static float exp_sum_(float *s, int64_t length) {
    float top[LANES];
    for (int l = 0; l < LANES; l++) top[l] = -INFINITY;
    int64_t t = 0;
    for (; t + LANES <= length; t += LANES)
        for (int l = 0; l < LANES; l++) top[l] = s[t + l] > top[l] ? s[t + l] : top[l];
    for (; t < length; t++) top[t % LANES] = s[t] > top[t % LANES] ? s[t] : top[t % LANES];
    float most = top[0];
    for (int l = 1; l < LANES; l++) most = top[l] > most ? top[l] : most;
    for (t = 0; t < length; t++) s[t] = exp_approx(s[t] - most);
    lanes_t sums = {0};
    for (t = 0; t + LANES <= length; t += LANES) sums += load_lanes(s + t);
    for (; t < length; t++) sums[t % LANES] += s[t];
    return fold(sums);
}

/* Softmax of one query's scores in place. */
static void softmax_(float *s, int64_t length) {
    float total = exp_sum_(s, length);
    for (int64_t t = 0; t < length; t++) s[t] /= total;
}

/* One query token of each of `batch` sequences attending over its cached keys and values, for a
 * cache of bfloat16 (mm_decode_attention) or of float32 (mm_decode_attention_f32; q and out too).
 *
 * q: (batch, heads, head_dim), rows q_stride apart. cache: blocks of block_size slots, a slot
 * holding kv_heads keys then kv_heads values of head_dim each. tables: (batch, width) block ids;
 * lengths: (batch,) tokens each sequence attends over. out: (batch, heads, head_dim). Query head h
 * reads kv head h / (heads / kv_heads). Scores, softmax and the weighted sum in float32. */
/* One kv head g of sequence b: the group of query heads reading it. head_dim is a constant where
 * the caller passes one (64, 128), so the loops over it unroll and stay in registers. */
#define DEFINE_ATTEND_HEAD(NAME, T, LOAD, STORE) \
static inline void NAME(const T *restrict q, const T *restrict cache, int64_t block_size,                               \
                               const int64_t *restrict table, int64_t length, T *restrict out,                          \
                               int64_t group, int64_t kv_heads, int64_t g, const int64_t head_dim, float scale) {       \
    int64_t slot = 2 * kv_heads * head_dim;                                                                             \
    float *restrict scores = malloc(sizeof(float) * (size_t)(group * length + 2 * group * head_dim));                   \
    float *restrict query = scores + group * length, *restrict acc = query + group * head_dim;                          \
    for (int64_t j = 0; j < group * head_dim; j++) {                                                                    \
        query[j] = LOAD(q[j]);                                                                                          \
        acc[j] = 0.0f;                                                                                                  \
    }                                                                                                                   \
    float row[head_dim];                                                                                                \
    for (int64_t t = 0; t < length; t++) { /* scores: one key against the group's queries */                            \
        const T *k = cache + (table[t / block_size] * block_size + t % block_size) * slot + g * head_dim;               \
        if (t + AHEAD < length) { /* the slot AHEAD tokens on: its key now, its value for the second pass */            \
            int64_t next = t + AHEAD;                                                                                   \
            const T *ahead = cache + (table[next / block_size] * block_size + next % block_size) * slot;                \
            for (int64_t line = 0; line < head_dim * (int64_t)sizeof(T); line += 64) {                                  \
                __builtin_prefetch((const char *)(ahead + g * head_dim) + line);                                        \
                __builtin_prefetch((const char *)(ahead + (kv_heads + g) * head_dim) + line);                           \
            }                                                                                                           \
        }                                                                                                               \
        for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(k[d]);                                                     \
        for (int64_t j = 0; j < group; j++) scores[j * length + t] = dot(query + j * head_dim, row, head_dim) * scale;  \
    }                                                                                                                   \
    for (int64_t j = 0; j < group; j++) softmax_(scores + j * length, length);                                         \
    for (int64_t t = 0; t < length; t++) { /* one value into every query's sum */                                       \
        const T *v = cache + (table[t / block_size] * block_size + t % block_size) * slot + (kv_heads + g) * head_dim;  \
        for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(v[d]);                                                     \
        for (int64_t j = 0; j < group; j++) {                                                                           \
            float p = scores[j * length + t];                                                                           \
            float *restrict a = acc + j * head_dim;                                                                     \
            for (int64_t d = 0; d < head_dim; d++) a[d] += p * row[d];                                                  \
        }                                                                                                               \
    }                                                                                                                   \
    for (int64_t j = 0; j < group * head_dim; j++) out[j] = STORE(acc[j]);                                              \
    free(scores);                                                                                                       \
}

DEFINE_ATTEND_HEAD(attend_head, bf16, widen, narrow)
DEFINE_ATTEND_HEAD(attend_head_f32, float, same, same)

#if defined(__AVX512BF16__)
#define SCORE_HEADS 4 /* query heads one pass over the keys scores: 4 x head_dim/32 query registers */
#define VALUE_HEADS 8 /* query heads one pass over a 32-wide slice of the values sums: 16 registers */

/* Scores of query heads j0 .. j0 + H against every key: VDPBF16PS over bfloat16 pairs (each product
 * exact in float32, summed in float32), head_dim / 32 registers a key. */
static inline __attribute__((always_inline)) void vec_scores(const bf16 *q, const bf16 *cache, int64_t block_size,
                                                             const int64_t *table, int64_t length, int64_t slot,
                                                             int64_t key, const int64_t head_dim, float scale,
                                                             float *scores, int64_t j0, const int H) {
    __m512bh qv[SCORE_HEADS][8];
    for (int j = 0; j < H; j++)
        for (int64_t i = 0; i < head_dim / 32; i++)
            qv[j][i] = (__m512bh)_mm512_loadu_si512(q + (j0 + j) * head_dim + i * 32);
    for (int64_t t = 0; t < length; t++) {
        const bf16 *k = cache + (table[t / block_size] * block_size + t % block_size) * slot + key;
        if (j0 == 0 && t + AHEAD < length) { /* the cache is cold in a step: the key AHEAD tokens on */
            int64_t next = t + AHEAD;
            const bf16 *ahead = cache + (table[next / block_size] * block_size + next % block_size) * slot + key;
            for (int64_t line = 0; line < head_dim * 2; line += 64)
                _mm_prefetch((const char *)ahead + line, _MM_HINT_T0);
        }
        __m512 acc[SCORE_HEADS];
        for (int j = 0; j < H; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < head_dim / 32; i++) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + i * 32);
            for (int j = 0; j < H; j++) acc[j] = _mm512_dpbf16_ps(acc[j], qv[j][i], kv);
        }
        for (int j = 0; j < H; j++) scores[(j0 + j) * length + t] = _mm512_reduce_add_ps(acc[j]) * scale;
    }
}

/* acc[j, d0 .. d0 + 32] = sum over t of p[j, t] * value[t, d0 .. d0 + 32] for heads j0 .. j0 + H,
 * float32 fused multiply-adds in token order. */
static inline __attribute__((always_inline)) void vec_values(const float *p, const bf16 *cache, int64_t block_size,
                                                             const int64_t *table, int64_t length, int64_t slot,
                                                             int64_t value, int64_t head_dim, float *acc, int64_t j0,
                                                             int64_t d0, const int H) {
    __m512 sums[VALUE_HEADS][2];
    for (int j = 0; j < H; j++) sums[j][0] = sums[j][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t++) {
        const bf16 *v = cache + (table[t / block_size] * block_size + t % block_size) * slot + value + d0;
        const __m512 v0 = widen16(v), v1 = widen16(v + 16);
        for (int j = 0; j < H; j++) {
            const __m512 w = _mm512_set1_ps(p[(j0 + j) * length + t]);
            sums[j][0] = _mm512_fmadd_ps(w, v0, sums[j][0]);
            sums[j][1] = _mm512_fmadd_ps(w, v1, sums[j][1]);
        }
    }
    for (int j = 0; j < H; j++) {
        _mm512_storeu_ps(acc + (j0 + j) * head_dim + d0, sums[j][0]);
        _mm512_storeu_ps(acc + (j0 + j) * head_dim + d0 + 16, sums[j][1]);
    }
}

/* attend_head on a bfloat16 cache with AVX512-BF16, head_dim a multiple of 32 up to 256: the keys
 * read once per SCORE_HEADS query heads, the values once per VALUE_HEADS heads and 32-wide slice,
 * the sums in registers (the generic loop keeps the group's in memory: ~2.5x slower). */
static inline __attribute__((always_inline)) void attend_head_vec(const bf16 *restrict q, const bf16 *restrict cache,
                                                                  int64_t block_size, const int64_t *restrict table,
                                                                  int64_t length, bf16 *restrict out, int64_t group,
                                                                  int64_t kv_heads, int64_t g, const int64_t head_dim,
                                                                  float scale) {
    const int64_t slot = 2 * kv_heads * head_dim, key = g * head_dim, value = (kv_heads + g) * head_dim;
    float *scores = malloc(sizeof(float) * (size_t)(group * length + group * head_dim));
    float *acc = scores + group * length;
    for (int64_t j0 = 0; j0 < group; j0 += SCORE_HEADS) {
        switch (group - j0 < SCORE_HEADS ? group - j0 : SCORE_HEADS) {
        case 1: vec_scores(q, cache, block_size, table, length, slot, key, head_dim, scale, scores, j0, 1); break;
        case 2: vec_scores(q, cache, block_size, table, length, slot, key, head_dim, scale, scores, j0, 2); break;
        case 3: vec_scores(q, cache, block_size, table, length, slot, key, head_dim, scale, scores, j0, 3); break;
        default: vec_scores(q, cache, block_size, table, length, slot, key, head_dim, scale, scores, j0, 4); break;
        }
    }
    for (int64_t j = 0; j < group; j++) softmax_(scores + j * length, length);
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32)
        for (int64_t j0 = 0; j0 < group; j0 += VALUE_HEADS) {
#define VALUES(H) vec_values(scores, cache, block_size, table, length, slot, value, head_dim, acc, j0, d0, H)
            switch (group - j0 < VALUE_HEADS ? group - j0 : VALUE_HEADS) {
            case 1: VALUES(1); break;
            case 2: VALUES(2); break;
            case 3: VALUES(3); break;
            case 4: VALUES(4); break;
            case 5: VALUES(5); break;
            case 6: VALUES(6); break;
            case 7: VALUES(7); break;
            default: VALUES(8); break;
            }
#undef VALUES
        }
    for (int64_t j = 0; j < group * head_dim; j++) out[j] = narrow(acc[j]);
    free(scores);
}
#endif

/* A bfloat16 cache: attend_head_vec where the CPU and head_dim allow, else attend_head. */
static inline __attribute__((always_inline)) void attend_head_bf16(const bf16 *q, const bf16 *cache, int64_t block_size,
                                                                   const int64_t *table, int64_t length, bf16 *out,
                                                                   int64_t group, int64_t kv_heads, int64_t g,
                                                                   const int64_t head_dim, float scale) {
#if defined(__AVX512BF16__)
    if (head_dim % 32 == 0 && head_dim <= 256) {
        attend_head_vec(q, cache, block_size, table, length, out, group, kv_heads, g, head_dim, scale);
        return;
    }
#endif
    attend_head(q, cache, block_size, table, length, out, group, kv_heads, g, head_dim, scale);
}

typedef struct {
    const void *q, *cache;
    const int64_t *tables, *lengths;
    void *out;
    int64_t q_stride, block_size, width, heads, kv_heads, head_dim;
    float scale;
} attention_t;

/* Task b * kv_heads + g: kv head g of sequence b. */
#define DEFINE_DECODE_ATTENTION(NAME, T, HEAD) \
static void NAME##_task(const void *ctx, int64_t task) {                                                         \
    const attention_t *a = ctx;                                                                                  \
    int64_t group = a->heads / a->kv_heads, b = task / a->kv_heads, g = task % a->kv_heads;                      \
    const T *qg = (const T *)a->q + b * a->q_stride + g * group * a->head_dim;                                   \
    T *o = (T *)a->out + (b * a->heads + g * group) * a->head_dim;                                               \
    const int64_t *table = a->tables + b * a->width;                                                             \
    const T *cache = a->cache;                                                                                   \
    if (a->head_dim == 64)                                                                                       \
        HEAD(qg, cache, a->block_size, table, a->lengths[b], o, group, a->kv_heads, g, 64, a->scale);            \
    else if (a->head_dim == 128)                                                                                 \
        HEAD(qg, cache, a->block_size, table, a->lengths[b], o, group, a->kv_heads, g, 128, a->scale);           \
    else                                                                                                         \
        HEAD(qg, cache, a->block_size, table, a->lengths[b], o, group, a->kv_heads, g, a->head_dim, a->scale);   \
}                                                                                                                \
void NAME(const T *q, int64_t q_stride, const T *cache, int64_t block_size,                                      \
                         const int64_t *tables, int64_t width, const int64_t *lengths, T *out,                   \
                         int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale) {        \
    const attention_t a = {q, cache, tables, lengths, out, q_stride, block_size, width, heads, kv_heads,         \
                           head_dim, scale};                                                                     \
    int64_t longest = 0, tasks = batch * kv_heads;                                                               \
    for (int64_t b = 0; b < batch; b++) longest = lengths[b] > longest ? lengths[b] : longest;                   \
    if (mm_pool_helpers() > 0 && tasks > 1 && tasks * longest * head_dim >= POOL_VALUES) {                       \
        mm_pool_run(NAME##_task, &a, tasks);                                                                     \
        return;                                                                                                  \
    }                                                                                                            \
_Pragma("omp parallel for schedule(static) if (tasks * longest * head_dim >= PARALLEL_VALUES * 16)")             \
    for (int64_t task = 0; task < tasks; task++) NAME##_task(&a, task);                                          \
}

DEFINE_DECODE_ATTENTION(mm_decode_attention, bf16, attend_head_bf16)
DEFINE_DECODE_ATTENTION(mm_decode_attention_f32, float, attend_head_f32)

/* From here to the end (prefill and vision attention) multiply-adds are fused, unlike the rest of
 * the library (cpu_kernels.py's -ffp-contract=off): their products are the work (1.3-1.5x faster),
 * and a fused multiply-add is as deterministic as a product and a sum, so a row's bits still
 * depend only on its own inputs. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

/* Prefill attention: query rows start .. start + rows - 1 of one sequence, row r attending over the
 * keys and values of tokens 0 .. start + r (its own included: the step's K/V are in the cache
 * already), for bfloat16 (mm_prefill_attention) or float32 (mm_prefill_attention_f32) q, K, V and
 * out. q: (rows, heads, head_dim), rows q_stride apart.
 * Token j's key for kv head g is at k + slot(j) * k_stride + g * head_dim, its value likewise from v
 * with v_stride, where slot(j) = table[j / block_size] * block_size + j % block_size: a paged cache
 * (k and v the two halves of its slots) or, with one block, plain rows. out: (rows, heads,
 * head_dim) contiguous.
 *
 * First each kv head's keys are laid out once, transposed in float32 tiles of LANES keys, so a
 * query's scores for LANES keys are head_dim vector products and sums (no folding of lanes per key),
 * and its values widened once. Then a task is PREFILL_ROWS rows of one kv head, four rows a pass,
 * their sums in registers. A row's arithmetic does not depend on which task, chunk or step
 * computes it: each score sums over head_dim in order, the softmax (exp_sum_) runs over the row's
 * own keys with its division left to the outputs (head_dim divisions, not one a key), each output
 * sums over keys in order. So a prompt computed in one step, in chunks, or after a prefix hit gives
 * each row the same attention from the same K/V. */
#define PREFILL_ROWS 16
#define PREFILL_QUERIES 4 /* query rows of one head scored and summed together */

/* Loaded once, used by four products: without this gcc folds the load into each product (one
 * 64-byte load a multiply, where the loads, not the arithmetic, then bound the loop). Only where
 * LANES floats fit one register (AVX-512): elsewhere no register holds them, and the constraint
 * would stop the source from compiling. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__AVX512F__)
#define KEEP_IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define KEEP_IN_REGISTER(x) (void)(x)
#endif
#define LAYOUT_TILES 8 /* key tiles one layout task widens */

typedef struct {
    const void *q, *k, *v;
    const int64_t *table;
    void *out;
    int64_t q_stride, k_stride, v_stride, block_size, rows, start, heads, kv_heads, head_dim, blocks;
    float scale;
    int64_t tiles; /* key tiles of LANES keys: all the call's keys, the last tile padded */
    float *layout; /* per kv head: its keys as tiles of head_dim x LANES, then its values (keys x head_dim) */
} prefill_t;

/* Scores of PREFILL_QUERIES queries x (PREFILL_QUERIES x head_dim) against keys 0 .. LANES * tiles - 1
 * (kt: tiles of head_dim x LANES), scaled, into s (PREFILL_QUERIES rows of `width`): two tiles of
 * four queries a pass, eight independent sums in registers, each over head_dim in order. */
static inline __attribute__((always_inline)) void prefill_scores(const float *restrict x, const float *restrict kt,
                                                                  int64_t tiles, const int64_t head_dim, float scale,
                                                                  float *restrict s, int64_t width) {
    for (int64_t t = 0; t < tiles; t += 2) {
        const float *a = kt + t * head_dim * LANES, *b = t + 1 < tiles ? a + head_dim * LANES : a;
        lanes_t acc[2][PREFILL_QUERIES] = {{{0}}};
        for (int64_t i = 0; i < head_dim; i++) {
            lanes_t ka = load_lanes(a + i * LANES), kb = load_lanes(b + i * LANES);
            KEEP_IN_REGISTER(ka);
            KEEP_IN_REGISTER(kb);
            for (int m = 0; m < PREFILL_QUERIES; m++) {
                acc[0][m] += x[m * head_dim + i] * ka;
                acc[1][m] += x[m * head_dim + i] * kb;
            }
        }
        for (int m = 0; m < PREFILL_QUERIES; m++) {
            acc[0][m] *= scale;
            acc[1][m] *= scale;
            memcpy(s + m * width + t * LANES, &acc[0][m], sizeof(lanes_t));
            if (t + 1 < tiles) memcpy(s + m * width + (t + 1) * LANES, &acc[1][m], sizeof(lanes_t));
        }
    }
}

/* out (PREFILL_QUERIES x head_dim) = for each query m, sum over keys j < n of p[m][j] * values[j]
 * (values: n x head_dim float32), in key order; p zero past each query's own keys (a zero weight
 * leaves a sum as it was, so each query's sum is its keys' alone). */
static inline __attribute__((always_inline)) void prefill_values(const float *restrict p, int64_t width,
                                                                  const float *restrict values, int64_t n,
                                                                  const int64_t head_dim, float *restrict out) {
    lanes_t acc[PREFILL_QUERIES][head_dim / LANES];
    for (int m = 0; m < PREFILL_QUERIES; m++)
        for (int64_t k = 0; k < head_dim / LANES; k++) acc[m][k] = (lanes_t){0};
    for (int64_t j = 0; j < n; j++)
        for (int64_t k = 0; k < head_dim / LANES; k++) {
            lanes_t v = load_lanes(values + j * head_dim + k * LANES);
            KEEP_IN_REGISTER(v);
            for (int m = 0; m < PREFILL_QUERIES; m++) acc[m][k] += p[m * width + j] * v;
        }
    memcpy(out, acc, sizeof acc);
}

#define DEFINE_PREFILL_TASK(NAME, T, LOAD, STORE) \
/* Layout task t: LAYOUT_TILES key tiles of one kv head, widened and transposed once for every row. */                 \
static void NAME##_layout(const void *ctx, int64_t task) {                                                              \
    const prefill_t *a = ctx;                                                                                           \
    int64_t parts = (a->tiles + LAYOUT_TILES - 1) / LAYOUT_TILES, g = task / parts, part = task % parts;               \
    int64_t d = a->head_dim, keys = a->start + a->rows;                                                                 \
    float *kt = a->layout + g * a->tiles * LANES * d * 2, *values = kt + a->tiles * LANES * d;                          \
    int64_t last = (part + 1) * LAYOUT_TILES * LANES < a->tiles * LANES ? (part + 1) * LAYOUT_TILES * LANES            \
                                                                        : a->tiles * LANES;                             \
    for (int64_t j = part * LAYOUT_TILES * LANES; j < last; j++) {                                                      \
        float *col = kt + (j / LANES) * d * LANES + j % LANES;                                                          \
        if (j >= keys) {                                                                                                \
            for (int64_t i = 0; i < d; i++) col[i * LANES] = 0.0f;                                                      \
            continue;                                                                                                   \
        }                                                                                                               \
        int64_t slot = a->table[j / a->block_size] * a->block_size + j % a->block_size;                                \
        const T *k = (const T *)a->k + slot * a->k_stride + g * d, *v = (const T *)a->v + slot * a->v_stride + g * d; \
        for (int64_t i = 0; i < d; i++) col[i * LANES] = LOAD(k[i]);                                                    \
        for (int64_t i = 0; i < d; i++) values[j * d + i] = LOAD(v[i]);                                                 \
    }                                                                                                                   \
}                                                                                                                       \
static inline __attribute__((always_inline)) void NAME##_rows(const prefill_t *a, int64_t g, int64_t r0, int64_t r1, \
                                                               const int64_t head_dim) {                               \
    int64_t group = a->heads / a->kv_heads;                                                                             \
    int64_t width = a->tiles * LANES + LANES; /* a query's scores, padded for the second tile of a pass */             \
    const float *kt = a->layout + g * a->tiles * LANES * head_dim * 2, *values = kt + a->tiles * LANES * head_dim;      \
    float *restrict s = malloc(sizeof(float) * (size_t)(PREFILL_QUERIES * (width + 2 * head_dim)));                    \
    float *restrict x = s + PREFILL_QUERIES * width, *restrict o = x + PREFILL_QUERIES * head_dim;                     \
    for (int64_t h = g * group; h < (g + 1) * group; h++)                                                              \
        for (int64_t r = r0; r < r1; r += PREFILL_QUERIES) { /* rows r .. r + 3 of head h (the last repeated) */      \
            int64_t last = r + PREFILL_QUERIES <= r1 ? r + PREFILL_QUERIES - 1 : r1 - 1;                             \
            int64_t n = a->start + last + 1;                                                                           \
            for (int m = 0; m < PREFILL_QUERIES; m++) {                                                                \
                int64_t row = r + m < last ? r + m : last;                                                            \
                const T *qh = (const T *)a->q + row * a->q_stride + h * head_dim;                                      \
                for (int64_t i = 0; i < head_dim; i++) x[m * head_dim + i] = LOAD(qh[i]);                            \
            }                                                                                                          \
            prefill_scores(x, kt, (n + LANES - 1) / LANES, head_dim, a->scale, s, width);                             \
            float total[PREFILL_QUERIES];                                                                              \
            for (int m = 0; m < PREFILL_QUERIES; m++) {                                                                \
                int64_t own = a->start + (r + m < last ? r + m : last) + 1;                                           \
                total[m] = exp_sum_(s + m * width, own);                                                               \
                for (int64_t j = own; j < n; j++) s[m * width + j] = 0.0f;                                             \
            }                                                                                                          \
            prefill_values(s, width, values, n, head_dim, o);                                                          \
            for (int m = 0; m < PREFILL_QUERIES && r + m <= last; m++) {                                              \
                T *out = (T *)a->out + ((r + m) * a->heads + h) * head_dim;                                            \
                for (int64_t i = 0; i < head_dim; i++) out[i] = STORE(o[m * head_dim + i] / total[m]);                \
            }                                                                                                          \
        }                                                                                                              \
    free(s);                                                                                                            \
}                                                                                                                       \
/* Row task t: the latest row blocks first (they attend over the most keys), kv heads innermost. */            \
static void NAME##_task(const void *ctx, int64_t task) {                                                                \
    const prefill_t *a = ctx;                                                                                           \
    int64_t g = task % a->kv_heads, block = a->blocks - 1 - task / a->kv_heads;                                         \
    int64_t r0 = block * PREFILL_ROWS, r1 = r0 + PREFILL_ROWS < a->rows ? r0 + PREFILL_ROWS : a->rows;                  \
    if (a->head_dim == 16)                                                                                              \
        NAME##_rows(a, g, r0, r1, 16);                                                                                  \
    else if (a->head_dim == 32)                                                                                         \
        NAME##_rows(a, g, r0, r1, 32);                                                                                  \
    else if (a->head_dim == 64)                                                                                         \
        NAME##_rows(a, g, r0, r1, 64);                                                                                  \
    else                                                                                                                \
        NAME##_rows(a, g, r0, r1, 128);                                                                                 \
}                                                                                                                       \
static void NAME##_run(mm_task_fn fn, const prefill_t *a, int64_t tasks) {                                              \
    if (mm_pool_helpers() > 0 && tasks > 1)                                                                             \
        mm_pool_run(fn, a, tasks);                                                                                      \
    else                                                                                                                \
        for (int64_t task = 0; task < tasks; task++) fn(a, task);                                                       \
}                                                                                                                       \
void NAME(const T *q, int64_t q_stride, const T *k, int64_t k_stride, const T *v, int64_t v_stride,                  \
          int64_t block_size, const int64_t *table, int64_t rows, int64_t start, T *out, int64_t heads,                 \
          int64_t kv_heads, int64_t head_dim, float scale) {                                                            \
    int64_t blocks = (rows + PREFILL_ROWS - 1) / PREFILL_ROWS, tiles = (start + rows + LANES - 1) / LANES;              \
    prefill_t a = {q,    k,     v,        table,    out,    q_stride, k_stride, v_stride, block_size,                  \
                   rows, start, heads, kv_heads, head_dim, blocks, scale,    tiles,    NULL};                           \
    a.layout = malloc(sizeof(float) * (size_t)(kv_heads * tiles * LANES * head_dim * 2));                              \
    NAME##_run(NAME##_layout, &a, kv_heads * ((tiles + LAYOUT_TILES - 1) / LAYOUT_TILES));                             \
    NAME##_run(NAME##_task, &a, blocks * kv_heads);                                                                     \
    free(a.layout);                                                                                                     \
}

DEFINE_PREFILL_TASK(mm_prefill_attention, bf16, widen, narrow)
DEFINE_PREFILL_TASK(mm_prefill_attention_f32, float, same, same)

/* Vision attention: every row of one image (or video chunk) attends over all of its n rows, no
 * mask (a vision tower's attention within one item of its batch), for bfloat16
 * (mm_vision_attention) or float32 (mm_vision_attention_f32) q, k, v and out. q, k, v: (n, heads,
 * head_dim) with rows q_stride, k_stride, v_stride apart and heads head_dim apart; out: (n, heads,
 * head_dim) contiguous.
 *
 * Rows in lanes: a task is LANES rows of one head, their queries (times the scale) transposed into
 * head_dim registers of LANES rows, so one key's score for all LANES rows is head_dim multiply-adds
 * of a broadcast key element, and the softmax's maximum and sum are per lane (no folding). Three
 * passes over the row block's scores (n x LANES floats): scores and their maximum, exp and sum,
 * then the weighted values, head_dim sums of a broadcast value element times LANES weights. A row's
 * arithmetic depends only on its own query and the item's keys and values: which rows share its
 * task, or which other items share the tower's batch, never changes its bits. */
#define VISION_KEYS 8 /* keys one pass scores together: independent sums in flight */
#define VISION_SUMS 64 /* keys summed apart before joining a row's total (as close as torch's blocked sums) */
typedef struct {
    const void *q, *k, *v;
    void *out;
    int64_t q_stride, k_stride, v_stride, n, heads, head_dim, blocks;
    float scale;
    float *keys; /* per head: its keys then its values, (n, head_dim) float32 each */
} vision_t;

typedef int32_t lanes_mask_t __attribute__((vector_size(LANES * sizeof(int32_t))));
static inline lanes_t lanes_max(lanes_t a, lanes_t b) {
    lanes_mask_t keep = a >= b, x, y;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    x = (x & keep) | (y & ~keep);
    memcpy(&a, &x, sizeof a);
    return a;
}

/* exp_approx on LANES values at once (x <= 0 here: a score less the maximum), in registers: the
 * range reduction rounds to nearest by adding and removing 1.5 * 2^23. */
static inline lanes_t exp_lanes(lanes_t x) {
    const lanes_t low = (lanes_t){0} - 87.3365447504019f, round = (lanes_t){0} + 12582912.0f;
    x = lanes_max(x, low);
    lanes_t n = (x * 1.44269504088896341f + round) - round, p;
    EXP_REDUCED(lanes_t, x, n, p);
    lanes_mask_t bits = (__builtin_convertvector(n, lanes_mask_t) + 127) << 23;
    lanes_t scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline __attribute__((always_inline)) void vision_rows(const vision_t *a, int64_t h, const float *restrict qt,
                                                               float *restrict s, float *restrict o,
                                                               const int64_t head_dim) {
    const float *restrict k = a->keys + h * a->n * head_dim * 2, *restrict v = k + a->n * head_dim;
    int64_t n = a->n;
    lanes_t top = {0};
    for (int l = 0; l < LANES; l++) top[l] = -INFINITY;
    int64_t j = 0;
    for (; j + VISION_KEYS <= n; j += VISION_KEYS) {
        lanes_t acc[VISION_KEYS] = {{0}};
        for (int64_t d = 0; d < head_dim; d++) {
            lanes_t x = load_lanes(qt + d * LANES);
            for (int m = 0; m < VISION_KEYS; m++) acc[m] += k[(j + m) * head_dim + d] * x;
        }
        for (int m = 0; m < VISION_KEYS; m++) {
            memcpy(s + (j + m) * LANES, &acc[m], sizeof(lanes_t));
            top = lanes_max(top, acc[m]);
        }
    }
    for (; j < n; j++) {
        lanes_t acc = {0};
        for (int64_t d = 0; d < head_dim; d++) acc += k[j * head_dim + d] * load_lanes(qt + d * LANES);
        memcpy(s + j * LANES, &acc, sizeof(lanes_t));
        top = lanes_max(top, acc);
    }
    lanes_t total = {0};
    for (int64_t j0 = 0; j0 < n; j0 += VISION_SUMS) {
        lanes_t part = {0};
        for (j = j0; j < n && j < j0 + VISION_SUMS; j++) {
            lanes_t p = exp_lanes(load_lanes(s + j * LANES) - top);
            memcpy(s + j * LANES, &p, sizeof p);
            part += p;
        }
        total += part;
    }
    for (int64_t d0 = 0; d0 < head_dim; d0 += LANES) {
        lanes_t acc[LANES] = {{0}};
        for (int64_t j0 = 0; j0 < n; j0 += VISION_SUMS) {
            lanes_t part[LANES] = {{0}};
            for (j = j0; j < n && j < j0 + VISION_SUMS; j++) {
                lanes_t p = load_lanes(s + j * LANES);
                for (int64_t d = 0; d < LANES; d++) part[d] += v[j * head_dim + d0 + d] * p;
            }
            for (int64_t d = 0; d < LANES; d++) acc[d] += part[d];
        }
        for (int64_t d = 0; d < LANES; d++) {
            lanes_t r = acc[d] / total;
            memcpy(o + (d0 + d) * LANES, &r, sizeof(lanes_t));
        }
    }
}
#define DEFINE_VISION_ATTENTION(NAME, T, LOAD, STORE) \
static void NAME##_task(const vision_t *a, int64_t task, float *scratch) {                                          \
    int64_t h = task % a->heads, r0 = task / a->heads * LANES, d = a->head_dim;                                  \
    float *qt = scratch, *o = qt + d * LANES, *s = o + d * LANES;                                               \
    const T *q = a->q;                                                                                           \
    for (int64_t i = 0; i < d; i++)                                                                              \
        for (int l = 0; l < LANES; l++)                                                                          \
            qt[i * LANES + l] = r0 + l < a->n ? LOAD(q[(r0 + l) * a->q_stride + h * d + i]) * a->scale : 0.0f;         \
    if (d == 16)                                                                                                 \
        vision_rows(a, h, qt, s, o, 16);                                                                         \
    else if (d == 32)                                                                                            \
        vision_rows(a, h, qt, s, o, 32);                                                                         \
    else if (d == 64)                                                                                            \
        vision_rows(a, h, qt, s, o, 64);                                                                         \
    else                                                                                                         \
        vision_rows(a, h, qt, s, o, d);                                                                          \
    for (int l = 0; l < LANES && r0 + l < a->n; l++)                                                             \
        for (int64_t i = 0; i < d; i++) ((T *)a->out)[((r0 + l) * a->heads + h) * d + i] = STORE(o[i * LANES + l]); \
}                                                                                                                \
void NAME(const T *q, int64_t q_stride, const T *k, int64_t k_stride, const T *v, int64_t v_stride, int64_t n,  \
          int64_t heads, int64_t head_dim, float scale, T *out) {                                               \
    int64_t blocks = (n + LANES - 1) / LANES, d = head_dim;                                                       \
    vision_t a = {q, k, v, out, q_stride, k_stride, v_stride, n, heads, head_dim, blocks, scale, NULL};           \
    a.keys = malloc(sizeof(float) * (size_t)(heads * n * d * 2));                                                 \
_Pragma("omp parallel for schedule(static) if (n * heads * d >= PARALLEL_VALUES)")                               \
    for (int64_t j = 0; j < n; j++)                                                                              \
        for (int64_t g = 0; g < heads; g++) {                                                                    \
            float *kk = a.keys + g * n * d * 2 + j * d, *vv = kk + n * d;                                        \
            for (int64_t i = 0; i < d; i++) kk[i] = LOAD(k[j * k_stride + g * d + i]);                           \
            for (int64_t i = 0; i < d; i++) vv[i] = LOAD(v[j * v_stride + g * d + i]);                           \
        }                                                                                                        \
_Pragma("omp parallel if (blocks * heads > 1 && n * n * heads * d >= PARALLEL_VALUES)")                          \
    {                                                                                                            \
        float *scratch = malloc(sizeof(float) * (size_t)(2 * d * LANES + n * LANES));                            \
_Pragma("omp for schedule(dynamic)")                                                                             \
        for (int64_t task = 0; task < blocks * heads; task++) NAME##_task(&a, task, scratch);                    \
        free(scratch);                                                                                           \
    }                                                                                                            \
    free(a.keys);                                                                                                \
}

DEFINE_VISION_ATTENTION(mm_vision_attention, bf16, widen, narrow)
DEFINE_VISION_ATTENTION(mm_vision_attention_f32, float, same, same)
#pragma GCC pop_options
