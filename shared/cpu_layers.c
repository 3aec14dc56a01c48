/* A decode step's decoder layers in one call (shared/cpu_layers.py).
 *
 * The layer of llm_stage/model_runner.py, operator for operator: the same compiled functions
 * (cpu_kernels.c's norm, rotation and SiLU, cpu_attention.c's attention, cpu_packed.c's
 * products in bfloat16, cpu_half.c's float16-weight products in float32) on the same inputs, so
 * the result is the Python loop's bit for bit. Only the ~10
 * calls a layer from Python go: on the `mid` checkpoint (24 layers) ~240 ctypes calls and tensor
 * allocations, ~2 ms of a ~22 ms decode step on the AMD EPYC, during which the kernels' helper
 * threads idle.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_ops.h"

/* One layer's weights: norms (their projection's input scale folded in), packed projections
 * (cpu_packed.c's layout in bfloat16, cpu_half.c's in float32), and its K/V cache; the norms, the
 * bias and the cache in the step's type (bfloat16 or float32). */
typedef struct {
    const void *input_norm, *post_norm;
    const void *qkv, *qkv_bias, *o, *gate_up, *down;
    void *cache;          /* (slots, 2 * kv_heads, head_dim): a slot's keys, then its values */
    int64_t chunks[4][2]; /* bfloat16: partial-sum lengths of qkv, o, gate_up, down: one row, more */
    float scales[4];      /* float32: the output scale of qkv, o, gate_up, down (a power of two) */
} mm_layer_t;

/* The stack's shape. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
} mm_stack_t;

/* Values (of the step's type) of scratch decode_layers needs for `rows` rows. */
int64_t mm_decode_scratch(const mm_stack_t *s, int64_t rows) {
    return rows * (s->hidden + (s->heads + 2 * s->kv_heads) * s->head_dim + s->heads * s->head_dim +
                   3 * s->intermediate);
}

/* Layers first .. last of `rows` single-token decodes, `hidden` (rows, hidden) updated in place.
 * cos, folded_sin: (rows, head_dim) rotary tables (model_runner.fold_sin); slots: (rows,) cache
 * slot of each row's token; tables (rows, width) block ids and lengths (rows,): what each row
 * attends over (mm_decode_attention). */
void mm_decode_layers(const mm_stack_t *s, const mm_layer_t *layers, int64_t first, int64_t last, bf16 *hidden,
                      int64_t rows, const bf16 *cos, const bf16 *folded_sin, const int64_t *slots,
                      const int64_t *tables, int64_t width, const int64_t *lengths, bf16 *scratch) {
    const int64_t h = s->hidden, attn_n = s->heads * s->head_dim, kv_n = 2 * s->kv_heads * s->head_dim;
    const int64_t qkv_n = attn_n + kv_n, inter = s->intermediate;
    const int many = rows > 1;
    bf16 *x = scratch, *qkv = x + rows * h, *attn = qkv + rows * qkv_n, *gate_up = attn + rows * attn_n;
    bf16 *act = gate_up + rows * 2 * inter;
    for (int64_t l = first; l < last; l++) {
        const mm_layer_t *w = layers + l;
        bf16 *cache = w->cache;
        mm_rms_norm(hidden, h, w->input_norm, x, rows, h, s->eps);
        mm_packed_product(x, h, rows, w->qkv, qkv_n, h, w->qkv_bias, NULL, qkv, w->chunks[0][many]);
        mm_rotate(qkv, qkv_n, rows, s->heads + s->kv_heads, s->head_dim, cos, folded_sin);
        for (int64_t r = 0; r < rows; r++)
            memcpy(cache + slots[r] * kv_n, qkv + r * qkv_n + attn_n, (size_t)kv_n * sizeof(bf16));
        mm_decode_attention(qkv, qkv_n, cache, s->block_size, tables, width, lengths, attn, rows, s->heads,
                            s->kv_heads, s->head_dim, s->scale);
        /* the residual joins the sums inside the product: hidden is read, then written, per output */
        mm_packed_product(attn, attn_n, rows, w->o, h, attn_n, NULL, hidden, hidden, w->chunks[1][many]);
        mm_rms_norm(hidden, h, w->post_norm, x, rows, h, s->eps);
        mm_packed_product(x, h, rows, w->gate_up, 2 * inter, h, NULL, NULL, gate_up, w->chunks[2][many]);
        mm_silu_mul(gate_up, act, rows, inter);
        mm_packed_product(act, inter, rows, w->down, h, inter, NULL, hidden, hidden, w->chunks[3][many]);
    }
}

/* mm_decode_layers on float32 rows, cache and norms, float16-weight products (cpu_half.c). A
 * product whose residual is `hidden` writes to x (free by then) and is copied back: cpu_half.c
 * keeps running sums in its output, which must not be the residual it adds at the end. */
void mm_decode_layers_f32(const mm_stack_t *s, const mm_layer_t *layers, int64_t first, int64_t last,
                          float *hidden, int64_t rows, const float *cos, const float *folded_sin,
                          const int64_t *slots, const int64_t *tables, int64_t width, const int64_t *lengths,
                          float *scratch) {
    const int64_t h = s->hidden, attn_n = s->heads * s->head_dim, kv_n = 2 * s->kv_heads * s->head_dim;
    const int64_t qkv_n = attn_n + kv_n, inter = s->intermediate;
    const size_t hidden_bytes = (size_t)(rows * h) * sizeof(float);
    float *x = scratch, *qkv = x + rows * h, *attn = qkv + rows * qkv_n, *gate_up = attn + rows * attn_n;
    float *act = gate_up + rows * 2 * inter;
    for (int64_t l = first; l < last; l++) {
        const mm_layer_t *w = layers + l;
        float *cache = w->cache;
        mm_rms_norm_f32(hidden, h, w->input_norm, x, rows, h, s->eps);
        mm_half_product(x, h, rows, w->qkv, qkv_n, h, w->scales[0], w->qkv_bias, NULL, qkv);
        mm_rotate_f32(qkv, qkv_n, rows, s->heads + s->kv_heads, s->head_dim, cos, folded_sin);
        for (int64_t r = 0; r < rows; r++)
            memcpy(cache + slots[r] * kv_n, qkv + r * qkv_n + attn_n, (size_t)kv_n * sizeof(float));
        mm_decode_attention_f32(qkv, qkv_n, cache, s->block_size, tables, width, lengths, attn, rows, s->heads,
                                s->kv_heads, s->head_dim, s->scale);
        mm_half_product(attn, attn_n, rows, w->o, h, attn_n, w->scales[1], NULL, hidden, x);
        memcpy(hidden, x, hidden_bytes);
        mm_rms_norm_f32(hidden, h, w->post_norm, x, rows, h, s->eps);
        mm_half_product(x, h, rows, w->gate_up, 2 * inter, h, w->scales[2], NULL, NULL, gate_up);
        mm_silu_mul_f32(gate_up, act, rows, inter);
        mm_half_product(act, inter, rows, w->down, h, inter, w->scales[3], NULL, hidden, x);
        memcpy(hidden, x, hidden_bytes);
    }
}
