/* Every decoder layer of a decode-only step in one call: the CPU counterpart of replaying a CUDA
 * graph. At a few rows each C kernel of a layer runs in microseconds, while the Python around it
 * (modules, wrappers, ctypes argument conversion, tensor allocation) costs ~300 us a layer. This
 * loop calls the very same kernels, on the same bf16 buffers, in the order the modules do
 * (nanoserve/models/llama.py), so its result is bit for bit theirs; nanoserve/kernels/
 * cpu_decode_layers.py decides when it applies and holds the module path as its reference.
 *
 * Per layer (a Qwen3-style pre-norm layer; rows = decode sequences, one token each):
 *   h = rms_norm(x [+ residual])  -> qkv = h . Wqkv  -> q, k = qk_norm_rope(qkv)  -> cache <- k, v
 *   a = decode_attention(q)  -> o = a . Wo  -> h = rms_norm(o + residual)  -> gu = h . Wgu
 *   x = silu(gate) * up . Wdown
 */
#include <stdint.h>
#include <string.h>

/* cpu_kernels.c and cpu_int8.c */
void rms_norm_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *residual_out, const uint16_t *weight,
                   uint16_t *out, int64_t rows, int64_t dim, float eps, int num_threads);
void qk_norm_rope_bf16(const uint16_t *q_in, const uint16_t *k_in, int64_t in_stride, uint16_t *q_out,
                       uint16_t *k_out, const uint16_t *q_weight, const uint16_t *k_weight, const int64_t *positions,
                       const float *cos_sin, int64_t tokens, int64_t num_q_heads, int64_t num_k_heads,
                       int64_t head_dim, float eps, int num_threads);
void store_kv_rows(const uint8_t *key, int64_t key_stride, const uint8_t *value, int64_t value_stride,
                   uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, int64_t num_tokens, int64_t row_bytes);
int paged_decode_f32(const void *q, void *out, const void *k_cache, const void *v_cache, int cache_dtype,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens, int64_t num_seqs,
                     int64_t max_keys, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                     int64_t kv_per_item, float scale, int io_bf16, int num_threads);
void silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int num_threads);
int panel_gemm_bf16(const void *x, int64_t M, int64_t K, const uint16_t *panels, int64_t N, const float *bias,
                    void *y, int io, int num_threads);
int int8_gemm_w8a16(const void *x, int64_t M, int64_t K, const int8_t *panels, int64_t Kp, const float *scales,
                    int64_t group, int64_t N, const float *bias, void *y, int io, int num_threads);
int int4_gemm_w4a16(const void *x, int64_t M, int64_t K, const int8_t *panels, const float *scales,
                    const float *offsets, int64_t group, int64_t N, const float *bias, void *y, int io, int num_threads);
int int4_gemm_w4a8(const void *x, int64_t M, int64_t K, const int8_t *panels, const float *scales,
                   const float *offsets, int64_t group, int64_t N, const float *bias, void *y, int io, int num_threads);

int int8_gemm_vnni(const void *x, int64_t M, int64_t K, const int8_t *panels, const float *scales,
                   const float *offsets, int64_t group, int64_t N, const float *bias, void *y, int io, int num_threads);

int dpbf16_gemm(const uint16_t *x, int64_t M, int64_t K, const uint16_t *panels, int64_t N, const float *bias,
                void *y, int y_bf16, int num_threads);

enum { GEMM_PANEL = 0, GEMM_W8A16 = 1, GEMM_W4A16 = 2, GEMM_W4A8 = 3, GEMM_VNNI8 = 4, GEMM_DPBF16 = 5 };
#define IO_BF16 3 /* IO_X_BF16 | IO_Y_BF16 of cpu_kernels.c: bf16 rows in and out */

/* One linear layer's packed weight, as its Python GEMM object holds it (kernels/cpu_gemm.py). */
typedef struct {
    int64_t kind, in_features, out_features, padded_in, group;
    const void *panels;
    const float *scales, *offsets, *bias;
} DecodeGemm;

typedef struct {
    DecodeGemm qkv, o, gate_up, down;
    const uint16_t *input_norm, *post_norm, *q_norm, *k_norm;
    void *k_cache, *v_cache;
} DecodeLayer;

/* The shapes, this step's metadata and the scratch rows every layer reuses. */
typedef struct {
    int64_t rows, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int64_t bt_stride, max_keys, kv_per_item, cache_dtype, num_threads;
    float eps, qk_eps, scale;
    const float *cos_sin;
    const int64_t *positions, *slots;
    const int32_t *block_tables, *context_lens;
    uint16_t *h, *qkv, *q, *k, *attn, *o, *gate_up, *act;
} DecodeStep;

static int run_gemm(const DecodeGemm *g, const uint16_t *x, int64_t rows, uint16_t *y, int num_threads) {
    switch (g->kind) {
        case GEMM_PANEL:
            return panel_gemm_bf16(x, rows, g->in_features, g->panels, g->out_features, g->bias, y, IO_BF16,
                                   num_threads);
        case GEMM_W8A16:
            return int8_gemm_w8a16(x, rows, g->in_features, g->panels, g->padded_in, g->scales, g->group,
                                   g->out_features, g->bias, y, IO_BF16, num_threads);
        case GEMM_W4A16:
            return int4_gemm_w4a16(x, rows, g->in_features, g->panels, g->scales, g->offsets, g->group,
                                   g->out_features, g->bias, y, IO_BF16, num_threads);
        case GEMM_W4A8:
            return int4_gemm_w4a8(x, rows, g->in_features, g->panels, g->scales, g->offsets, g->group,
                                  g->out_features, g->bias, y, IO_BF16, num_threads);
        case GEMM_DPBF16:
            return dpbf16_gemm(x, rows, g->in_features, g->panels, g->out_features, g->bias, y, 1, num_threads);
        case GEMM_VNNI8:
            return int8_gemm_vnni(x, rows, g->in_features, g->panels, g->scales, g->offsets, g->group,
                                  g->out_features, g->bias, y, IO_BF16, num_threads);
        default:
            return 3;
    }
}

/* x [rows, hidden] (the embeddings) in, the last layer's MLP output out (in place); residual
   [rows, hidden] gets the running residual. Returns 0, or the failing kernel's code (2: out of
   memory) with the layer index in *failed_layer. */
int decode_layers_bf16(const DecodeLayer *layers, int64_t num_layers, const DecodeStep *s, uint16_t *x,
                       uint16_t *residual, int64_t *failed_layer) {
    const int64_t rows = s->rows, hidden = s->hidden, hd = s->head_dim;
    const int64_t q_width = s->num_heads * hd, kv_width = s->num_kv_heads * hd, qkv_width = q_width + 2 * kv_width;
    const int threads = (int)s->num_threads;
    for (int64_t i = 0; i < num_layers; i++) {
        const DecodeLayer *L = layers + i;
        int rc;
        *failed_layer = i;
        if (i == 0) {  /* h = norm(x), residual = x */
            rms_norm_bf16(x, NULL, NULL, L->input_norm, s->h, rows, hidden, s->eps, threads);
            memcpy(residual, x, (size_t)(rows * hidden) * sizeof(uint16_t));
        } else {
            rms_norm_bf16(x, residual, residual, L->input_norm, s->h, rows, hidden, s->eps, threads);
        }
        if ((rc = run_gemm(&L->qkv, s->h, rows, s->qkv, threads))) return rc;
        qk_norm_rope_bf16(s->qkv, s->qkv + q_width, qkv_width, s->q, s->k, L->q_norm, L->k_norm, s->positions,
                          s->cos_sin, rows, s->num_heads, s->num_kv_heads, hd, s->qk_eps, threads);
        store_kv_rows((const uint8_t *)s->k, kv_width * 2, (const uint8_t *)(s->qkv + q_width + kv_width),
                      qkv_width * 2, L->k_cache, L->v_cache, s->slots, rows, kv_width * 2);
        if ((rc = paged_decode_f32(s->q, s->attn, L->k_cache, L->v_cache, (int)s->cache_dtype, s->block_tables,
                                   s->bt_stride, s->context_lens, rows, s->max_keys, s->num_heads, s->num_kv_heads,
                                   hd, s->block_size, s->kv_per_item, s->scale, 1, threads)))
            return rc;
        if ((rc = run_gemm(&L->o, s->attn, rows, s->o, threads))) return rc;
        rms_norm_bf16(s->o, residual, residual, L->post_norm, s->h, rows, hidden, s->eps, threads);
        if ((rc = run_gemm(&L->gate_up, s->h, rows, s->gate_up, threads))) return rc;
        silu_mul_bf16(s->gate_up, s->act, rows, s->intermediate, threads);
        if ((rc = run_gemm(&L->down, s->act, rows, x, threads))) return rc;
    }
    return 0;
}
