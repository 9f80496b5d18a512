/*
 * The draft forward on CPU in one call: a Llama/Qwen2-style decoder run for one token per
 * request over budgeted views of vLLM's paged KV cache (TokenSwift's draft forward, paper
 * Sec 3.3, and the self-speculative chains' forwards), with the weights in a packed copy of
 * the proposer's own (bf16 or fp32). Built into the same library as verify_attention.c
 * (vllm_tokenswift/kernels/build.py) and called through ctypes by
 * vllm_tokenswift/kernels/draft_forward.py, which checks every shape and index before the call.
 *
 * Why: on one AVX2 core a draft forward through vLLM's eager model path cost 7-9 ms on the
 * demo model (12.6M parameters) whatever the view's length: the weights' matmuls through
 * oneDNN (about 4 ms for 50 MB of fp32 weights) and the per-op work of an eager PyTorch
 * forward (norms, rotary, residuals, metadata, hooks: 3-4 ms). Here each linear layer is one
 * pass over a packed panel copy of its weight for all rows, every other op is a loop over the
 * row, and nothing returns to Python between layers; with bf16 weights a forward reads half the
 * bytes (the draft only has to be close to the target: vLLM's rejection sampler verifies every
 * draft token against the full model, so the output does not change).
 *
 * Weights: W [N, K] (y = x W^T) packed as panels of 16 output rows, [ceil(N/16)][K][16]
 * (rows past N zero), in fp32 or bf16 (the high 16 bits of the fp32 value, rounded to
 * nearest even by the packer; a bf16 panel row stores its 16 columns interleaved, c0, c8,
 * c1, c9, ..., c7, c15). Biases, norms and the rotary table stay fp32.
 *
 * Per layer (vLLM's LlamaDecoderLayer / Qwen2DecoderLayer, fp32 activations):
 *   r += h (from the second layer on; r = embedding first); h = rmsnorm(r) * ln1
 *   qkv = h Wqkv^T (+ b); q, k rotated at the row's position (cos/sin from vLLM's rotary
 *   cos_sin_cache, NeoX or GPT-J pairing, the first rot_dim dims); k, v written into the
 *   row's slot of the layer's cache (vLLM's CPU "vec" layout, see verify_attention.c);
 *   a = attention(q, the view's blocks) (tokenswift_verify_attention_f32, one query token);
 *   r += a Wo^T (+ b); h = rmsnorm(r) * ln2; g|u = h Wgu^T; h = (silu(g) * u) Wdown^T
 * then prenorm = r + h, hidden = rmsnorm(prenorm) * final_norm.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* verify_attention.c, linked into the same library */
int tokenswift_verify_attention_f32(const float* query, int64_t q_stride, float* out,
                                    int64_t out_stride, const float* cache,
                                    const int32_t* block_table, int64_t bt_stride,
                                    const int32_t* q_start, const int32_t* q_len,
                                    const int32_t* seq_len, const int32_t* bt_row,
                                    int32_t num_reqs, int32_t Hq, int32_t Hkv, int32_t D,
                                    int32_t bs, float scale, int32_t num_splits,
                                    float* scratch);

/* Return codes besides the attention's own (negative, -1..-7): kernels/draft_forward.py
 * maps each to its message (DRAFT_ERROR_MESSAGES). */
enum {
    TSD_OK = 0,
    TSD_E_SHAPE = -101,   /* a model dimension is not positive, or rot_dim odd or > head_dim */
    TSD_E_DTYPE = -102,   /* weight dtype neither 0 (fp32) nor 1 (bf16) */
    TSD_E_ROWS = -103,    /* n < 1, or a position outside the rotary table */
    TSD_E_NO_MEMORY = -104,
};

#define W_F32 0
#define W_BF16 1

/* One decoder layer's parameters (pointers into tensors the Python side keeps alive). */
typedef struct {
    const float* ln1;      /* [H] */
    const void* w_qkv;     /* packed [(Hq + 2 Hkv) D, H] */
    const float* b_qkv;    /* [(Hq + 2 Hkv) D] or NULL */
    const void* w_o;       /* packed [H, Hq D] */
    const float* b_o;      /* [H] or NULL */
    const float* ln2;      /* [H] */
    const void* w_gu;      /* packed [2 I, H]: gate rows then up rows */
    const float* b_gu;     /* [2 I] or NULL */
    const void* w_down;    /* packed [H, I] */
    const float* b_down;   /* [H] or NULL */
    float* kv_cache;       /* the layer's cache, [num_blocks, Hkv, 2 bs D] (vec layout) */
} tsd_layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, block_size;
    int32_t rot_dim, neox, wdtype;
    float eps, scale;
    int64_t max_pos;            /* rows of cos_sin */
    const float* cos_sin;       /* [max_pos, rot_dim]: cos (rot_dim / 2) then sin */
    const float* final_norm;    /* [H] */
    const tsd_layer* layers;    /* [num_layers] */
} tsd_model;

static void* alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) & ~(size_t)63); }

/* ---------------------------------------------------------------- packed linear layers */

/* 16 bf16 values of a panel row, stored interleaved (c0, c8, c1, c9, ..., c7, c15: see
 * pack_weight): the even 16-bit halves shifted up are columns 0-7, the odd halves masked are
 * columns 8-15, two cheap integer ops instead of two widening shuffles. */
static inline void bf16x16(const uint16_t* p, __m256* lo, __m256* hi) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xFFFF0000u)));
}

#define R1(M) M(0)
#define R2(M) R1(M) M(1)
#define R3(M) R2(M) M(2)
#define R4(M) R3(M) M(3)
#define LD_DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
#define LD_FMA(r)                                                                  \
    {                                                                              \
        const __m256 a = _mm256_broadcast_ss(x + (int64_t)(r) * K + k);            \
        c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                                 \
        c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                                 \
    }
#define LD_STORE(r)                                                                \
    _mm256_storeu_ps(tile + (r) * 16, c##r##0);                                    \
    _mm256_storeu_ps(tile + (r) * 16 + 8, c##r##1);

/* tile[nr][16] = x[nr][0:K] @ panel[0:K][16], nr <= 4 rows */
#define PANEL_KERNEL(NR)                                                                     \
    static void panel_f32_##NR(const float* pan, const float* x, int K, float* tile) {       \
        R##NR(LD_DECL)                                                                       \
        for (int k = 0; k < K; ++k) {                                                        \
            const __m256 b0 = _mm256_loadu_ps(pan + (int64_t)k * 16);                        \
            const __m256 b1 = _mm256_loadu_ps(pan + (int64_t)k * 16 + 8);                    \
            R##NR(LD_FMA)                                                                    \
        }                                                                                    \
        R##NR(LD_STORE)                                                                      \
    }                                                                                        \
    static void panel_bf16_##NR(const uint16_t* pan, const float* x, int K, float* tile) {   \
        R##NR(LD_DECL)                                                                       \
        for (int k = 0; k < K; ++k) {                                                        \
            __m256 b0, b1;                                                                   \
            bf16x16(pan + (int64_t)k * 16, &b0, &b1);                                        \
            R##NR(LD_FMA)                                                                    \
        }                                                                                    \
        R##NR(LD_STORE)                                                                      \
    }
PANEL_KERNEL(1)
PANEL_KERNEL(2)
PANEL_KERNEL(3)
PANEL_KERNEL(4)

/* y[M][N] = x[M][K] @ W^T (+ bias), W packed (see the file doc); rows in groups of <= 4, each
 * panel read once per group. Row strides: x K, y N. */
static void linear(const void* w, int wdtype, const float* bias, const float* x, int M, int K,
                   int N, float* y) {
    const int panels = (N + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        float tile[4 * 16];
        const int cols = N - p * 16 < 16 ? N - p * 16 : 16;
        for (int i0 = 0; i0 < M; i0 += 4) {
            const int nr = M - i0 < 4 ? M - i0 : 4;
            const float* xr = x + (int64_t)i0 * K;
            if (wdtype == W_BF16) {
                const uint16_t* pan = (const uint16_t*)w + (int64_t)p * 16 * K;
                switch (nr) {
                    case 1: panel_bf16_1(pan, xr, K, tile); break;
                    case 2: panel_bf16_2(pan, xr, K, tile); break;
                    case 3: panel_bf16_3(pan, xr, K, tile); break;
                    default: panel_bf16_4(pan, xr, K, tile); break;
                }
            } else {
                const float* pan = (const float*)w + (int64_t)p * 16 * K;
                switch (nr) {
                    case 1: panel_f32_1(pan, xr, K, tile); break;
                    case 2: panel_f32_2(pan, xr, K, tile); break;
                    case 3: panel_f32_3(pan, xr, K, tile); break;
                    default: panel_f32_4(pan, xr, K, tile); break;
                }
            }
            for (int r = 0; r < nr; ++r) {
                float* yr = y + (int64_t)(i0 + r) * N + p * 16;
                for (int c = 0; c < cols; ++c)
                    yr[c] = tile[r * 16 + c] + (bias ? bias[p * 16 + c] : 0.0f);
            }
        }
    }
}

/* y = x @ W^T for a packed W, exported for the LM head (logits of the draft rows). */
int tokenswift_packed_linear(const void* w, int32_t wdtype, const float* bias, const float* x,
                             int32_t M, int32_t K, int32_t N, float* y) {
    if (wdtype != W_F32 && wdtype != W_BF16) return TSD_E_DTYPE;
    if (M < 0 || K < 1 || N < 1) return TSD_E_SHAPE;
    if (M > 0) linear(w, wdtype, bias, x, M, K, N, y);
    return TSD_OK;
}

/* ---------------------------------------------------------------- element-wise parts */

static void rmsnorm(const float* x, const float* w, int H, float eps, float* y) {
    double ss = 0.0;
    for (int i = 0; i < H; ++i) ss += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(ss / H) + eps);
    for (int i = 0; i < H; ++i) y[i] = x[i] * inv * w[i];
}

/* rotate `heads` heads of D values in place at one position (vLLM RotaryEmbedding) */
static void rope(float* v, int heads, int D, int rot, int neox, const float* cs) {
    const int half = rot / 2;
    const float* cs_cos = cs;
    const float* cs_sin = cs + half;
    for (int h = 0; h < heads; ++h) {
        float* x = v + (int64_t)h * D;
        if (neox) {
            for (int i = 0; i < half; ++i) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * cs_cos[i] - x2 * cs_sin[i];
                x[i + half] = x2 * cs_cos[i] + x1 * cs_sin[i];
            }
        } else {
            for (int i = 0; i < half; ++i) {
                const float x1 = x[2 * i], x2 = x[2 * i + 1];
                x[2 * i] = x1 * cs_cos[i] - x2 * cs_sin[i];
                x[2 * i + 1] = x2 * cs_cos[i] + x1 * cs_sin[i];
            }
        }
    }
}

/* ---------------------------------------------------------------- the forward */

/*
 * n rows (one token each): x_in [n, H] their embeddings, positions and slots [n] (int64),
 * per layer l a block table tables[l] (int32, row r of stride bt_strides[l], the row's view)
 * and seq_lens [n] (the view's tokens, the row's own included). Writes prenorm [n, H] and
 * hidden [n, H], and each layer's rotated query into q_out [num_layers, n, Hq D] unless NULL.
 * Returns 0, a TSD_E_* code, or the attention's own negative code (then the outputs are
 * partial; the K/V of the rows' slots may be written).
 */
int tokenswift_draft_forward(const tsd_model* m, int32_t n, const float* x_in,
                             const int64_t* positions, const int64_t* slots,
                             const int32_t* const* tables, const int64_t* bt_strides,
                             const int32_t* seq_lens, float* prenorm, float* hidden, float* q_out) {
    const int H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim;
    const int I = m->inter, bs = m->block_size, L = m->num_layers;
    if (H < 1 || Hq < 1 || Hkv < 1 || D < 1 || I < 1 || bs < 1 || L < 1 || m->rot_dim < 0 ||
        m->rot_dim % 2 || m->rot_dim > D)
        return TSD_E_SHAPE;
    if (m->wdtype != W_F32 && m->wdtype != W_BF16) return TSD_E_DTYPE;
    if (n < 1) return TSD_E_ROWS;
    for (int r = 0; r < n; ++r)
        if (positions[r] < 0 || positions[r] >= m->max_pos || slots[r] < 0) return TSD_E_ROWS;
    const int QD = Hq * D, KVD = Hkv * D, QKV = QD + 2 * KVD;
    const int W = QKV > 2 * I ? (QKV > H ? QKV : H) : (2 * I > H ? 2 * I : H);
    float* res = prenorm; /* the residual stream lives in the output */
    float* h = (float*)alloc64(sizeof(float) * (size_t)n * H);
    float* big = (float*)alloc64(sizeof(float) * (size_t)n * W);
    float* q = (float*)alloc64(sizeof(float) * (size_t)n * QD);
    float* att = (float*)alloc64(sizeof(float) * (size_t)n * QD);
    float* act = (float*)alloc64(sizeof(float) * (size_t)n * I);
    int32_t* meta = (int32_t*)malloc(sizeof(int32_t) * 3 * (size_t)n);
    int rc = TSD_OK;
    if (!(h && big && q && att && act && meta)) { rc = TSD_E_NO_MEMORY; goto done; }
    int32_t* q_start = meta;
    int32_t* q_len = meta + n;
    int32_t* bt_row = meta + 2 * n;
    for (int r = 0; r < n; ++r) { q_start[r] = r; q_len[r] = 1; bt_row[r] = r; }
    memcpy(res, x_in, sizeof(float) * (size_t)n * H);
    const int64_t head_stride = (int64_t)2 * bs * D, block_stride = head_stride * Hkv;
    for (int l = 0; l < L; ++l) {
        const tsd_layer* ly = &m->layers[l];
        for (int r = 0; r < n; ++r) rmsnorm(res + (int64_t)r * H, ly->ln1, H, m->eps, h + (int64_t)r * H);
        linear(ly->w_qkv, m->wdtype, ly->b_qkv, h, n, H, QKV, big);
        for (int r = 0; r < n; ++r) {
            float* row = big + (int64_t)r * QKV;
            const float* cs = m->cos_sin + positions[r] * (int64_t)m->rot_dim;
            if (m->rot_dim) {
                rope(row, Hq, D, m->rot_dim, m->neox, cs);
                rope(row + QD, Hkv, D, m->rot_dim, m->neox, cs);
            }
            memcpy(q + (int64_t)r * QD, row, sizeof(float) * QD);
            if (q_out) memcpy(q_out + ((int64_t)l * n + r) * QD, row, sizeof(float) * QD);
            const int64_t b = slots[r] / bs, off = slots[r] % bs;
            for (int kh = 0; kh < Hkv; ++kh) {
                float* base = ly->kv_cache + b * block_stride + kh * head_stride;
                const float* kk = row + QD + (int64_t)kh * D;
                const float* vv = row + QD + KVD + (int64_t)kh * D;
                for (int d = 0; d < D; ++d) base[(int64_t)d * bs + off] = kk[d];
                memcpy(base + (int64_t)bs * D + off * D, vv, sizeof(float) * D);
            }
        }
        rc = tokenswift_verify_attention_f32(q, QD, att, QD, ly->kv_cache, tables[l], bt_strides[l],
                                             q_start, q_len, seq_lens, bt_row, n, Hq, Hkv, D, bs,
                                             m->scale, 1, NULL);
        if (rc != 0) goto done;
        linear(ly->w_o, m->wdtype, ly->b_o, att, n, QD, H, h);
        for (int64_t i = 0; i < (int64_t)n * H; ++i) res[i] += h[i];
        for (int r = 0; r < n; ++r) rmsnorm(res + (int64_t)r * H, ly->ln2, H, m->eps, h + (int64_t)r * H);
        linear(ly->w_gu, m->wdtype, ly->b_gu, h, n, H, 2 * I, big);
        for (int r = 0; r < n; ++r) {
            const float* g = big + (int64_t)r * 2 * I;
            float* a = act + (int64_t)r * I;
            for (int i = 0; i < I; ++i) a[i] = g[i] / (1.0f + expf(-g[i])) * g[I + i];
        }
        linear(ly->w_down, m->wdtype, ly->b_down, act, n, I, H, h);
        for (int64_t i = 0; i < (int64_t)n * H; ++i) res[i] += h[i];
    }
    for (int r = 0; r < n; ++r) rmsnorm(res + (int64_t)r * H, m->final_norm, H, m->eps, hidden + (int64_t)r * H);
done:
    free(h); free(big); free(q); free(att); free(act); free(meta);
    return rc;
}
