/*
 * Multi-query causal attention over vLLM's CPU paged KV cache ("vec" layout, fp32),
 * for requests that verify draft tokens: q = 1 + k query tokens per request attend to
 * the whole context. Built by vllm_tokenswift/kernels/build.py (cc -O3 -mavx2 -mfma
 * -fopenmp) and called through ctypes by vllm_tokenswift/kernels/verify_attention.py, which
 * checks every index this file follows (block ids against the cache, block-table rows and
 * width, query-token ranges, the scratch size) before the call: the checks here are only
 * the O(num_reqs) ones that need no tensor shape.
 *
 * Why: vLLM 0.32's CPU kernel shares a KV head's pass among its query heads only when
 * the GQA group divides 8 (MaxQHeadNumPerIteration of the vec ISA), and otherwise
 * reads the whole KV once per query head; with 3 query heads per KV head (SmolLM2, the
 * demo model) a request with q tokens reads the context 3x per KV head and multiplies
 * in tiles of at most 8 rows. Here every (request, KV head) is one pass over the
 * context: all q * G rows of the group (G = query heads per KV head) multiply each K/V
 * block while it is in cache, with an online softmax (flash-decoding style).
 *
 * Cache layout (vLLM cpu_attn.py / cpu_attn_vec.hpp, ISA "vec"): the layer's cache is
 * [num_blocks, num_kv_heads, 2 * block_size * head_dim] floats per (block, head):
 * K transposed [head_dim, block_size] (column-major K), then V [block_size, head_dim].
 *
 * Memory: one decode step streams every layer's whole KV cache (100 MB at 16K tokens on
 * the demo model), far more than the L3, so the kernel would wait on DRAM latency at every
 * block. It does not: while a block is multiplied, the next block's K and V are
 * requested one 64-byte line per micro-kernel iteration (a prefetch stream threaded
 * through both products, struct pf_stream), so the loads spread over the block's
 * arithmetic instead of queueing in a burst, and the products read the block straight
 * from the cache tensor (by then in L2). On this machine's one core this made the op for
 * q = 3 at 16K about 1.5x faster than a burst prefetch with a block copy, and for q = 1
 * about 2x faster than vLLM's own one-token kernel (docs/bench/long/README.md).
 *
 * Work items are (request, KV head, KV split); splits are merged with their max and
 * sum. OpenMP is torch's own runtime (libgomp.so.1 is already loaded by torch when
 * this library is), so the worker's thread count and core binding apply.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Return codes of tokenswift_verify_attention_f32: 0, or one of these (nothing written to
 * out then). kernels/verify_attention.py maps each to its own message (ERROR_MESSAGES);
 * tests/test_verify_attention.py checks that every code here has one. */
enum {
    TS_OK = 0,
    TS_E_HEADS = -1,      /* Hq or Hkv not positive, or Hq not a multiple of Hkv */
    TS_E_HEAD_DIM = -2,   /* D not a positive multiple of 32 */
    TS_E_BLOCK_SIZE = -3, /* bs not a positive multiple of 16 */
    TS_E_SPLITS = -4,     /* num_splits < 1, or num_splits > 1 without scratch */
    TS_E_NUM_REQS = -5,   /* num_reqs < 0 */
    TS_E_REQUEST = -6,    /* a request with q_len < 1, seq_len < q_len, q_start < 0 or bt_row < 0 */
    TS_E_NO_MEMORY = -7,  /* a thread's work buffers could not be allocated */
};

#define MAX_ROWS 6
/* the block whose K and V are prefetched while one is multiplied: this many ahead */
#define PREFETCH_BLOCKS 1

/* A prefetch stream: the lines [p, end) still to request, one per micro-kernel iteration
 * (into L2: the products read K^T by 16-column tiles, 64 lines 512 bytes apart, which L2
 * serves well once the lines are there). */
typedef struct {
    const char* p;
    const char* end;
} pf_stream;

static inline void pf_step(const char** p, const char* end) {
    if (*p < end) {
        _mm_prefetch(*p, _MM_HINT_T1);
        *p += 64;
    }
}

/* exp(x) for 8 floats (Cephes polynomial, as in avx_mathfun; relative error ~1e-7). */
static inline __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f);
    const __m256 lo = _mm256_set1_ps(-88.3762626647949f);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 c1 = _mm256_set1_ps(0.693359375f);
    const __m256 c2 = _mm256_set1_ps(-2.12194440e-4f);
    const __m256 half = _mm256_set1_ps(0.5f);
    const __m256 one = _mm256_set1_ps(1.0f);
    x = _mm256_min_ps(x, hi);
    x = _mm256_max_ps(x, lo);
    __m256 fx = _mm256_fmadd_ps(x, log2e, half);
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, c1, x);
    x = _mm256_fnmadd_ps(fx, c2, x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, one);
    __m256i e = _mm256_cvttps_epi32(fx);
    e = _mm256_add_epi32(e, _mm256_set1_epi32(127));
    e = _mm256_slli_epi32(e, 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* 64-byte aligned memory (C11 wants the size a multiple of the alignment) */
static void* alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) & ~(size_t)63); }

static inline float hmax256(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

static inline float hsum256(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

/* Register-blocked micro-GEMM: C[NR][16] (+)= A[NR][0:K] (row stride lda) @ B[0:K][16]
 * (row stride ldb), C row stride ldc. Both products of the attention use it: QK (A = the
 * scaled queries, B = K^T of the block, K = head_dim) and PV (A = the probabilities,
 * B = V of the block, K = the block's visible tokens). The 2 * NR accumulators are named
 * variables: an array of __m256 made GCC store every one of them to the stack on every
 * k. NR <= 6 keeps 12 accumulators + 2 B rows + 1 broadcast in AVX2's 16 registers. */
#define R1(M) M(0)
#define R2(M) R1(M) M(1)
#define R3(M) R2(M) M(2)
#define R4(M) R3(M) M(3)
#define R5(M) R4(M) M(4)
#define R6(M) R5(M) M(5)
#define MG_DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
#define MG_LOAD(r)                                                                       \
    c##r##0 = _mm256_loadu_ps(c + (int64_t)(r) * ldc);                                   \
    c##r##1 = _mm256_loadu_ps(c + (int64_t)(r) * ldc + 8);
#define MG_FMA(r)                                                                        \
    {                                                                                    \
        const __m256 ab = _mm256_broadcast_ss(a + (int64_t)(r) * lda + k);               \
        c##r##0 = _mm256_fmadd_ps(ab, b0, c##r##0);                                      \
        c##r##1 = _mm256_fmadd_ps(ab, b1, c##r##1);                                      \
    }
#define MG_STORE(r)                                                                      \
    _mm256_storeu_ps(c + (int64_t)(r) * ldc, c##r##0);                                   \
    _mm256_storeu_ps(c + (int64_t)(r) * ldc + 8, c##r##1);
#define MICRO_GEMM(NR)                                                                   \
    static inline void mgemm_##NR(const float* a, int64_t lda, const float* b,           \
                                  int64_t ldb, int K, float* c, int64_t ldc, int acc,    \
                                  pf_stream* ps) {                                       \
        R##NR(MG_DECL)                                                                   \
        if (acc) { R##NR(MG_LOAD) }                                                      \
        const char* pf = ps->p;                                                          \
        const char* const pf_end = ps->end;                                              \
        for (int k = 0; k < K; ++k) {                                                    \
            pf_step(&pf, pf_end);                                                        \
            const __m256 b0 = _mm256_loadu_ps(b + (int64_t)k * ldb);                     \
            const __m256 b1 = _mm256_loadu_ps(b + (int64_t)k * ldb + 8);                 \
            R##NR(MG_FMA)                                                                \
        }                                                                                \
        R##NR(MG_STORE)                                                                  \
        ps->p = pf;                                                                      \
    }
MICRO_GEMM(1)
MICRO_GEMM(2)
MICRO_GEMM(3)
MICRO_GEMM(4)
MICRO_GEMM(5)
MICRO_GEMM(6)

/* Row groups of at most MAX_ROWS rows, as even as possible (15 rows: 5, 5, 5). */
static inline int row_group(int M, int i0) {
    const int groups = (M + MAX_ROWS - 1) / MAX_ROWS;
    const int base = M / groups, extra = M % groups;
    /* the first `extra` groups take base + 1 rows */
    const int g = i0 < extra * (base + 1) ? i0 / (base + 1) : extra + (i0 - extra * (base + 1)) / base;
    return g < extra ? base + 1 : base;
}

/* C[M][0:ncols] (+)= A[M][0:K] @ B[0:K][0:ncols], ncols a multiple of 16; advances the
 * prefetch stream ps by one line per micro-kernel iteration. */
static void gemm(const float* a, int64_t lda, int M, const float* b, int64_t ldb, int K, int ncols,
                 float* c, int64_t ldc, int acc, pf_stream* ps) {
    for (int c0 = 0; c0 < ncols; c0 += 16) {
        for (int i0 = 0; i0 < M;) {
            const int nr = row_group(M, i0);
            const float* aa = a + (int64_t)i0 * lda;
            const float* bb = b + c0;
            float* cc = c + (int64_t)i0 * ldc + c0;
            switch (nr) {
                case 1: mgemm_1(aa, lda, bb, ldb, K, cc, ldc, acc, ps); break;
                case 2: mgemm_2(aa, lda, bb, ldb, K, cc, ldc, acc, ps); break;
                case 3: mgemm_3(aa, lda, bb, ldb, K, cc, ldc, acc, ps); break;
                case 4: mgemm_4(aa, lda, bb, ldb, K, cc, ldc, acc, ps); break;
                case 5: mgemm_5(aa, lda, bb, ldb, K, cc, ldc, acc, ps); break;
                default: mgemm_6(aa, lda, bb, ldb, K, cc, ldc, acc, ps); break;
            }
            i0 += nr;
        }
    }
}

/* Prefetch [p, p + bytes) into L2, one 64-byte line at a time. */
static inline void prefetch_l2(const void* p, int64_t bytes) {
    const char* c = (const char*)p;
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T1);
}

/* One work item: rows of (request r, KV head h) over KV blocks [b0, b1).
 * Leaves the un-normalised accumulator acc[M][D], the running max mx[M] and sum l[M]. */
static void attend_split(const float* qs, int M, int G, int D, int bs, const float* cache,
                         int64_t block_stride, int64_t head_stride, const int32_t* bt, int b0,
                         int b1, int seq_len, int q_len, float* s, float* acc, float* mx, float* l) {
    const int ctx = seq_len - q_len; /* tokens before the first query token */
    const int64_t kv_bytes = (int64_t)2 * bs * D * (int64_t)sizeof(float);
    for (int i = 0; i < M; ++i) { mx[i] = -INFINITY; l[i] = 0.0f; }
    memset(acc, 0, sizeof(float) * (size_t)M * D);
    /* the first blocks have nothing to hide behind: request them at once */
    for (int b = b0; b < b0 + PREFETCH_BLOCKS && b < b1; ++b)
        prefetch_l2(cache + (int64_t)bt[b] * block_stride + head_stride, kv_bytes);
    for (int b = b0; b < b1; ++b) {
        const int pos0 = b * bs;
        int valid = seq_len - pos0;
        if (valid > bs) valid = bs;
        /* K^T and V of this (block, head), read in place; the block PREFETCH_BLOCKS ahead
           streams in during the two products */
        const float* kt = cache + (int64_t)bt[b] * block_stride + head_stride;
        const float* v = kt + (int64_t)bs * D;
        pf_stream ps = {0, 0};
        if (b + PREFETCH_BLOCKS < b1) {
            ps.p = (const char*)(cache + (int64_t)bt[b + PREFETCH_BLOCKS] * block_stride + head_stride);
            ps.end = ps.p + kv_bytes;
        }
        const int ncols = (valid + 15) & ~15;
        gemm(qs, D, M, kt, bs, D, ncols, s, bs, 0, &ps);             /* S = Q K^T (scaled Q) */
        int tmax = 0;
        for (int i = 0; i < M; ++i) {
            const int t = i / G; /* query token of row i (rows are token-major) */
            int lim = ctx + t + 1 - pos0;
            if (lim > valid) lim = valid;
            float* si = s + (int64_t)i * bs;
            if (lim <= 0) { /* this block is entirely in the row's future */
                memset(si, 0, sizeof(float) * (size_t)ncols);
                continue;
            }
            if (lim > tmax) tmax = lim;
            /* row max over the visible columns */
            int c = 0;
            __m256 vm = _mm256_set1_ps(-INFINITY);
            for (; c + 8 <= lim; c += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(si + c));
            float bm = hmax256(vm);
            for (; c < lim; ++c) bm = si[c] > bm ? si[c] : bm;
            const float m_new = bm > mx[i] ? bm : mx[i];
            const float corr = expf(mx[i] - m_new); /* 0 on the first visible block */
            mx[i] = m_new;
            const __m256 vmn = _mm256_set1_ps(m_new);
            __m256 vs = _mm256_setzero_ps();
            c = 0;
            for (; c + 8 <= lim; c += 8) {
                const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(si + c), vmn));
                _mm256_storeu_ps(si + c, e);
                vs = _mm256_add_ps(vs, e);
            }
            float sum = hsum256(vs);
            for (; c < lim; ++c) { si[c] = expf(si[c] - m_new); sum += si[c]; }
            for (; c < ncols; ++c) si[c] = 0.0f; /* future or unwritten slots */
            l[i] = l[i] * corr + sum;
            if (corr != 1.0f) {
                float* ai = acc + (int64_t)i * D;
                const __m256 vc = _mm256_set1_ps(corr);
                for (int d = 0; d < D; d += 8)
                    _mm256_storeu_ps(ai + d, _mm256_mul_ps(_mm256_loadu_ps(ai + d), vc));
            }
        }
        if (tmax > 0) gemm(s, bs, M, v, D, tmax, D, acc, D, 1, &ps);  /* acc += P V */
        if (ps.p < ps.end) prefetch_l2(ps.p, ps.end - ps.p); /* lines the products left over */
    }
}

/*
 * query:   fp32, token t of request r at query + (q_start[r] + t) * q_stride, heads
 *          contiguous (head j at + j * D).
 * out:     fp32, same indexing with out_stride.
 * cache:   the layer's KV cache base (fp32), layout above.
 * block_table: int32 [*, bt_stride]; request r uses row bt_row[r].
 * q_start, q_len, seq_len, bt_row: int32 [num_reqs]; seq_len counts the query tokens.
 * num_splits: KV splits per (request, KV head); scratch: fp32, at least
 *             num_reqs * Hkv * num_splits * max_M * (D + 2) floats when num_splits > 1
 *             (max_M = max(q_len) * Hq / Hkv).
 * Returns 0, or a negative TS_E_* code (nothing written to out then: on TS_E_NO_MEMORY
 * every thread stops before its first item once any thread's allocation failed).
 * Not checked here (the caller does): block ids in [0, num_blocks), bt_row below the
 * table's rows, ceil(seq_len / bs) <= the table's width, q_start + q_len <= the tokens of
 * query and out, the scratch size.
 */
int tokenswift_verify_attention_f32(const float* query, int64_t q_stride, float* out,
                                    int64_t out_stride, const float* cache,
                                    const int32_t* block_table, int64_t bt_stride,
                                    const int32_t* q_start, const int32_t* q_len,
                                    const int32_t* seq_len, const int32_t* bt_row,
                                    int32_t num_reqs, int32_t Hq, int32_t Hkv, int32_t D,
                                    int32_t bs, float scale, int32_t num_splits,
                                    float* scratch) {
    if (Hkv <= 0 || Hq <= 0 || Hq % Hkv != 0) return TS_E_HEADS;
    if (D <= 0 || D % 32 != 0) return TS_E_HEAD_DIM;
    if (bs <= 0 || bs % 16 != 0) return TS_E_BLOCK_SIZE;
    if (num_splits < 1 || (num_splits > 1 && scratch == NULL)) return TS_E_SPLITS;
    if (num_reqs < 0) return TS_E_NUM_REQS;
    const int G = Hq / Hkv;
    int max_q = 0;
    for (int r = 0; r < num_reqs; ++r) {
        if (q_len[r] < 1 || seq_len[r] < q_len[r] || q_start[r] < 0 || bt_row[r] < 0) return TS_E_REQUEST;
        max_q = q_len[r] > max_q ? q_len[r] : max_q;
    }
    if (num_reqs == 0) return TS_OK;
    const int max_M = max_q * G;
    const int64_t head_stride = (int64_t)2 * bs * D;
    const int64_t block_stride = head_stride * Hkv;
    const int64_t items = (int64_t)num_reqs * Hkv * num_splits;
    const int64_t part = (int64_t)max_M * (D + 2);
    int alloc_failed = 0;

#pragma omp parallel
    {
        float* qs = (float*)alloc64(sizeof(float) * ((size_t)max_M * D + 16));
        float* s = (float*)alloc64(sizeof(float) * ((size_t)max_M * bs + 16));
        float* acc = (float*)alloc64(sizeof(float) * ((size_t)max_M * D + 16));
        float* mx = (float*)alloc64(sizeof(float) * ((size_t)max_M + 16));
        float* l = (float*)alloc64(sizeof(float) * ((size_t)max_M + 16));
#ifdef TOKENSWIFT_TEST_ALLOC_FAIL
        /* test hook (tests/test_verify_attention.py builds a copy with it): the last thread's
           allocation "fails" */
        if (omp_get_thread_num() == omp_get_num_threads() - 1) { free(acc); acc = NULL; }
#endif
        if (!(qs && s && acc && mx && l)) {
#pragma omp atomic write
            alloc_failed = 1;
        }
        /* Nothing is written before every thread knows whether all allocations succeeded:
           after the barrier (a flush) all threads read the same flag and either all run the
           worksharing loop or none does, so a failure leaves out (and scratch) untouched. */
#pragma omp barrier
        int any_failed;
#pragma omp atomic read
        any_failed = alloc_failed;
        if (!any_failed) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            {
                const int r = (int)(it / ((int64_t)Hkv * num_splits));
                const int h = (int)((it / num_splits) % Hkv);
                const int sp = (int)(it % num_splits);
                const int ql = q_len[r], sl = seq_len[r];
                const int M = ql * G;
                const int nblk = (sl + bs - 1) / bs;
                const int per = (nblk + num_splits - 1) / num_splits;
                const int b0 = sp * per;
                const int b1 = b0 + per < nblk ? b0 + per : nblk;
                /* rows token-major: row t * G + g is query head h * G + g of token t */
                for (int t = 0; t < ql; ++t)
                    for (int g = 0; g < G; ++g) {
                        const float* src = query + (int64_t)(q_start[r] + t) * q_stride +
                                           (int64_t)(h * G + g) * D;
                        float* dst = qs + (int64_t)(t * G + g) * D;
                        for (int d = 0; d < D; ++d) dst[d] = src[d] * scale;
                    }
                const int32_t* bt = block_table + (int64_t)bt_row[r] * bt_stride;
                if (b0 >= b1) { /* an empty split */
                    if (num_splits > 1) {
                        float* p = scratch + it * part;
                        for (int i = 0; i < M; ++i) { p[i] = -INFINITY; p[max_M + i] = 0.0f; }
                    }
                    continue;
                }
                attend_split(qs, M, G, D, bs, cache, block_stride, (int64_t)h * head_stride, bt,
                             b0, b1, sl, ql, s, acc, mx, l);
                if (num_splits == 1) {
                    for (int i = 0; i < M; ++i) {
                        const int t = i / G, g = i % G;
                        float* dst = out + (int64_t)(q_start[r] + t) * out_stride +
                                     (int64_t)(h * G + g) * D;
                        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
                        for (int d = 0; d < D; ++d) dst[d] = acc[(int64_t)i * D + d] * inv;
                    }
                } else {
                    float* p = scratch + it * part;
                    memcpy(p, mx, sizeof(float) * M);
                    memcpy(p + max_M, l, sizeof(float) * M);
                    memcpy(p + 2 * max_M, acc, sizeof(float) * (size_t)M * D);
                }
            }
        }
        }
        free(qs); free(s); free(acc); free(mx); free(l);
    }
    if (alloc_failed) return TS_E_NO_MEMORY;
    if (num_splits == 1) return TS_OK;

    /* merge the splits of every (request, KV head) */
#pragma omp parallel for schedule(static)
    for (int64_t rh = 0; rh < (int64_t)num_reqs * Hkv; ++rh) {
        const int r = (int)(rh / Hkv), h = (int)(rh % Hkv);
        const int M = q_len[r] * G;
        const float* base = scratch + rh * num_splits * part;
        for (int i = 0; i < M; ++i) {
            float m = -INFINITY;
            for (int sp = 0; sp < num_splits; ++sp) {
                const float v = base[sp * part + i];
                m = v > m ? v : m;
            }
            const int t = i / G, g = i % G;
            float* dst = out + (int64_t)(q_start[r] + t) * out_stride + (int64_t)(h * G + g) * D;
            float denom = 0.0f;
            for (int d = 0; d < D; ++d) dst[d] = 0.0f;
            for (int sp = 0; sp < num_splits; ++sp) {
                const float* p = base + sp * part;
                if (p[i] == -INFINITY) continue;
                const float w = expf(p[i] - m);
                denom += w * p[max_M + i];
                const float* a = p + 2 * max_M + (int64_t)i * D;
                for (int d = 0; d < D; ++d) dst[d] += w * a[d];
            }
            const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
            for (int d = 0; d < D; ++d) dst[d] *= inv;
        }
    }
    return TS_OK;
}
