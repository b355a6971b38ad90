/* CPU kernels for the decode step (AVX2 + FMA, OpenMP), built on first use by cpu_kernels.py. Where the CPU has
   AVX-512 (checked at run time, `gs_use_avx512`), the matmul and the decode attention take 16-lane versions compiled
   for it in the same library (the section between the target pragmas' push and pop).

   gs_qgemm: y[M, N] = x[M, K] @ W^T for block-quantized W (GGUF's Q4_1 and Q8_0 block formats, repacked):
     32 weights per block; Q4_1: value = d * q + m with q in 0..15, element j of a block in the low nibble of
     byte j (j < 16) or the high nibble of byte j - 16; Q8_0: value = d * q with q int8.
     Blocks are dequantized in registers, so the weights stay 4.5-8.5 bits in memory.
   gs_rmsnorm: RMSNorm of rows, optionally after adding x into the residual stream in place.
   gs_decode_attention: one query token per request over its KV slots (paged, page size 1), GQA.
   gs_decode_layers: a decode step's decoder layers in one call, made of the kernels above.
*/
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MB 8 /* rows of x that share one unpack of a weight block */
#ifndef PANEL_ROWS
#define PANEL_ROWS 9 /* AVX-512: batches of this many rows or more take the panel matmul */
#endif
#define PARALLEL_ROWS 64 /* RMSNorm, SiLU-mul and RoPE calls of this many rows (prefill) run on the OpenMP team */

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
    float s = hsum(acc);
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

static inline __attribute__((always_inline)) void unpack_block(int bits, const uint8_t *p, __m256 q[4]) {
    if (bits == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)p);
        const __m128i mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(b, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i))));
    }
}

/* Dot products of `mb` rows of x with one weight row. Each block is dequantized once into four vectors (d * q + m
   rounded as two operations, which reproduces the float weights transformers makes from the same blocks) and then
   used by every row. */
static inline __attribute__((always_inline)) void row_dots(int bits, int mb, const float *x, int K, int nb,
                                                           const uint8_t *qs, const float *d, const float *m,
                                                           float *out) {
    const int bytes = bits == 4 ? 16 : 32;
    __m256 acc[MB];
    for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256 w[4];
        unpack_block(bits, qs + (size_t)b * bytes, w);
        const __m256 dv = _mm256_set1_ps(d[b]);
        if (bits == 4) {
            const __m256 mv = _mm256_set1_ps(m[b]);
            for (int j = 0; j < 4; j++) w[j] = _mm256_add_ps(_mm256_mul_ps(dv, w[j]), mv);
        } else {
            for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(dv, w[j]);
        }
        for (int i = 0; i < mb; i++) {
            const float *xb = x + (size_t)i * K + (size_t)b * 32;
            __m256 a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[i]);
            a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), a);
            a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), a);
            acc[i] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), a);
        }
    }
    for (int i = 0; i < mb; i++) out[i] = hsum(acc[i]);
}

/* The same dot products with the scale applied once per block to sum(q * x), and the Q4_1 offset added after
   the loop as m . (block sums of x): fewer operations per weight, for the few-row (memory-bound) case. The
   result differs from row_dots only by float rounding. */
static inline __attribute__((always_inline)) void row_dots_scaled(int bits, int mb, const float *x, int K, int nb,
                                                                  const uint8_t *qs, const float *d, const float *m,
                                                                  const float *xsum, float *out) {
    const int bytes = bits == 4 ? 16 : 32;
    __m256 acc[4];
    for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256 q[4];
        unpack_block(bits, qs + (size_t)b * bytes, q);
        const __m256 dv = _mm256_broadcast_ss(d + b);
        for (int i = 0; i < mb; i++) {
            const float *xb = x + (size_t)i * K + (size_t)b * 32;
            __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
            __m256 u = _mm256_mul_ps(q[1], _mm256_loadu_ps(xb + 8));
            t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t);
            u = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), u);
            acc[i] = _mm256_fmadd_ps(dv, _mm256_add_ps(t, u), acc[i]);
        }
    }
    for (int i = 0; i < mb; i++) {
        float s = hsum(acc[i]);
        if (m != NULL) {
            const float *xs = xsum + (size_t)i * nb;
            for (int b = 0; b < nb; b++) s += m[b] * xs[b];
        }
        out[i] = s;
    }
}

#define DOTS(BITS)                                                              \
    switch (mb) {                                                               \
    case 1: row_dots(BITS, 1, x, K, nb, qs, d, m, out); break;                     \
    case 2: row_dots(BITS, 2, x, K, nb, qs, d, m, out); break;                     \
    case 3: row_dots(BITS, 3, x, K, nb, qs, d, m, out); break;                     \
    case 4: row_dots(BITS, 4, x, K, nb, qs, d, m, out); break;                     \
    case 5: row_dots(BITS, 5, x, K, nb, qs, d, m, out); break;                     \
    case 6: row_dots(BITS, 6, x, K, nb, qs, d, m, out); break;                     \
    case 7: row_dots(BITS, 7, x, K, nb, qs, d, m, out); break;                     \
    default: row_dots(BITS, 8, x, K, nb, qs, d, m, out); break;                    \
    }

static void dots_q4(int mb, const float *x, int K, int nb, const uint8_t *qs, const float *d, const float *m,
                    float *out) {
    DOTS(4)
}
static void dots_q8(int mb, const float *x, int K, int nb, const uint8_t *qs, const float *d, const float *m,
                    float *out) {
    DOTS(8)
}

/* 1 to 3 rows: one weight row per iteration, FN (row_dots_scaled or its AVX-512 twin) specialised on bits and M.
   Expects x, M, K, nb, bytes, qs, d, m, N, y, nthreads and xsum in scope. */
#define FEW_ROWS(FN)                                                                                       \
    _Pragma("omp parallel for num_threads(nthreads) schedule(guided, 8)")                                  \
    for (int n = 0; n < N; n++) {                                                                          \
        const uint8_t *qrow = qs + (size_t)n * nb * bytes;                                                 \
        const float *drow = d + (size_t)n * nb, *mrow = m == NULL ? NULL : m + (size_t)n * nb;             \
        float out[3];                                                                                      \
        if (bits == 4) {                                                                                   \
            if (M == 1) FN(4, 1, x, K, nb, qrow, drow, mrow, xsum, out);                                   \
            else if (M == 2) FN(4, 2, x, K, nb, qrow, drow, mrow, xsum, out);                              \
            else FN(4, 3, x, K, nb, qrow, drow, mrow, xsum, out);                                          \
        } else {                                                                                           \
            if (M == 1) FN(8, 1, x, K, nb, qrow, drow, NULL, xsum, out);                                   \
            else if (M == 2) FN(8, 2, x, K, nb, qrow, drow, NULL, xsum, out);                              \
            else FN(8, 3, x, K, nb, qrow, drow, NULL, xsum, out);                                          \
        }                                                                                                  \
        for (int i = 0; i < M; i++) y[(size_t)i * N + n] = out[i];                                         \
    }

int gs_use_avx512(int on);
static void qgemm512(int bits, const float *x, int M, int K, const uint8_t *qs, const float *d, const float *m,
                     int N, float *y, int nthreads);
static int qgemm512_panels(int bits, const float *x, int M, int K, const uint8_t *qs, const float *d, const float *m,
                           int N, float *y, int nthreads);
static void few_rows512(int bits, const float *x, int M, int K, const uint8_t *qs, const float *d, const float *m,
                        int N, float *y, int nthreads, const float *xsum);
static int attention512(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                        int64_t table_stride, const int64_t *row_of, const int64_t *lens, int B, int Hq, int Hkv,
                        int D, float scale, float *out, int nthreads);

/* bits: 4 (Q4_1, m given) or 8 (Q8_0, m NULL). K must be a multiple of 32. */
int gs_qgemm(int bits, const float *x, int M, int K, const uint8_t *qs, const float *d, const float *m, int N,
             float *y, int nthreads) {
    if (K % 32 != 0 || (bits != 4 && bits != 8)) return -1;
    const int nb = K / 32;
    const int bytes = bits == 4 ? 16 : 32;
    if (M <= 3) {
        float xsum[3 * 512]; /* block sums of x for the Q4_1 offsets; K up to 16384 */
        if (nb > 512) return -1;
        for (int i = 0; i < M * nb; i++) {
            const float *xb = x + (size_t)(i / nb) * K + (size_t)(i % nb) * 32;
            const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                           _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
            xsum[i] = hsum(s);
        }
        if (gs_use_avx512(-1)) {
            few_rows512(bits, x, M, K, qs, d, m, N, y, nthreads, xsum);
            return 0;
        }
        FEW_ROWS(row_dots_scaled)
        return 0;
    }
    if (M >= PANEL_ROWS && gs_use_avx512(-1)) return qgemm512_panels(bits, x, M, K, qs, d, m, N, y, nthreads);
    if (M >= 4 && gs_use_avx512(-1)) {
        qgemm512(bits, x, M, K, qs, d, m, N, y, nthreads);
        return 0;
    }
#pragma omp parallel for num_threads(nthreads) schedule(guided, 8)
    for (int n = 0; n < N; n++) {
        const uint8_t *qrow = qs + (size_t)n * nb * bytes;
        const float *drow = d + (size_t)n * nb, *mrow = m == NULL ? NULL : m + (size_t)n * nb;
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int mb = M - m0 < MB ? M - m0 : MB;
            float out[MB];
            if (bits == 4)
                dots_q4(mb, x + (size_t)m0 * K, K, nb, qrow, drow, mrow, out);
            else
                dots_q8(mb, x + (size_t)m0 * K, K, nb, qrow, drow, mrow, out);
            for (int i = 0; i < mb; i++) y[(size_t)(m0 + i) * N + n] = out[i];
        }
    }
    return 0;
}

/* ---- AVX-512 matmul for batches of 4 rows or more (compiled for AVX-512, chosen at run time) --------------------
   A tile of up to 8 rows of x and 2 weight rows: each weight block is dequantized once into two 16-lane vectors
   and used by all 8 rows, each x vector loaded once and used by both weight rows (16 accumulators, 22 registers
   of 32). Dequantization is the same two roundings as above, so the weights are the same values. */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma")
#endif

static inline __attribute__((always_inline)) void dequant16(int bits, const uint8_t *p, float d, float m,
                                                            __m512 w[2]) {
    const __m512 dv = _mm512_set1_ps(d);
    if (bits == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)p);
        const __m128i mask = _mm_set1_epi8(15);
        const __m512 mv = _mm512_set1_ps(m);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
        w[0] = _mm512_add_ps(_mm512_mul_ps(dv, lo), mv);
        w[1] = _mm512_add_ps(_mm512_mul_ps(dv, hi), mv);
    } else {
        w[0] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
        w[1] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))));
    }
}

/* y[i, n + j] for i < mr, j < nr: rows x[0..mr) against weight rows n, n + 1. */
static inline __attribute__((always_inline)) void tile512(int bits, int mr, int nr, const float *x, int K, int nb,
                                                          const uint8_t *qs, const float *d, const float *m, int n,
                                                          float *y, int N) {
    const int bytes = bits == 4 ? 16 : 32;
    __m512 acc[8][2];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512 w[2][2];
        for (int j = 0; j < nr; j++) {
            const size_t blk = (size_t)(n + j) * nb + b;
            dequant16(bits, qs + blk * bytes, d[blk], m == NULL ? 0.0f : m[blk], w[j]);
        }
        for (int i = 0; i < mr; i++) {
            const float *xb = x + (size_t)i * K + (size_t)b * 32;
            __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            /* Keep x in registers: left alone, the compiler folds the loads into both weight rows' FMAs (a
               load per FMA), which measured 15% slower. */
            __asm__("" : "+v"(x0), "+v"(x1));
            for (int j = 0; j < nr; j++) {
                acc[i][j] = _mm512_fmadd_ps(x0, w[j][0], acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(x1, w[j][1], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[(size_t)i * N + n + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#define TILE512(BITS, MR)                                                                                  \
    case MR:                                                                                               \
        if (nr == 2) tile512(BITS, MR, 2, xr, K, nb, qs, d, m, n, yr, N);                                  \
        else tile512(BITS, MR, 1, xr, K, nb, qs, d, m, n, yr, N);                                          \
        break;
#define TILES512(BITS)                                                                                     \
    switch (mr) {                                                                                          \
        TILE512(BITS, 1) TILE512(BITS, 2) TILE512(BITS, 3) TILE512(BITS, 4)                                \
        TILE512(BITS, 5) TILE512(BITS, 6) TILE512(BITS, 7) default: TILE512(BITS, 8)                       \
    }

static void qgemm512(int bits, const float *x, int M, int K, const uint8_t *qs, const float *d, const float *m,
                     int N, float *y, int nthreads) {
    const int nb = K / 32, pairs = (N + 1) / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int p = 0; p < pairs; p++) {
        const int n = 2 * p, nr = N - n >= 2 ? 2 : 1;
        for (int m0 = 0; m0 < M; m0 += 8) {
            const int mr = M - m0 < 8 ? M - m0 : 8;
            const float *xr = x + (size_t)m0 * K;
            float *yr = y + (size_t)m0 * N;
            if (bits == 4) {
                TILES512(4)
            } else {
                TILES512(8)
            }
        }
    }
}

/* 9 rows or more, in groups of 16: x transposed so that one vector holds a k-th element of all 16 rows; a panel of
   16 weight rows is dequantized, KC values at a time, into a buffer whose scalars are broadcast into the FMAs. One
   accumulator per weight row holds its dot products with all 16 rows: no horizontal sums, and about one load per
   FMA (the broadcast) instead of x and weights both streamed. */
#ifndef PANEL
#define PANEL 16
#endif
#ifndef KC
#define KC 256
#endif

static void panel512(int bits, const float *xt, int K, int nb, const uint8_t *qs, const float *d, const float *m,
                     int n0, int nr, float *y, int N, int rows) {
    const int bytes = bits == 4 ? 16 : 32;
    float wb[PANEL * KC] __attribute__((aligned(64)));
    __m512 acc[PANEL];
    for (int j = 0; j < PANEL; j++) acc[j] = _mm512_setzero_ps();
    if (nr < PANEL) memset(wb, 0, sizeof(wb));
    for (int k0 = 0; k0 < K; k0 += KC) {
        const int kc = K - k0 < KC ? K - k0 : KC;
        for (int j = 0; j < nr; j++)
            for (int b = 0; b < kc / 32; b++) {
                const size_t blk = (size_t)(n0 + j) * nb + k0 / 32 + b;
                __m512 w[2];
                dequant16(bits, qs + blk * bytes, d[blk], m == NULL ? 0.0f : m[blk], w);
                _mm512_store_ps(wb + j * KC + b * 32, w[0]);
                _mm512_store_ps(wb + j * KC + b * 32 + 16, w[1]);
            }
        for (int k = 0; k < kc; k++) {
            const __m512 xv = _mm512_load_ps(xt + (size_t)(k0 + k) * 16);
            for (int j = 0; j < PANEL; j++) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(wb[j * KC + k]), xv, acc[j]);
        }
    }
    float col[16] __attribute__((aligned(64)));
    for (int j = 0; j < nr; j++) {
        _mm512_store_ps(col, acc[j]);
        for (int i = 0; i < rows; i++) y[(size_t)i * N + n0 + j] = col[i];
    }
}

static int qgemm512_panels(int bits, const float *x, int M, int K, const uint8_t *qs, const float *d, const float *m,
                           int N, float *y, int nthreads) {
    const int nb = K / 32, panels = (N + PANEL - 1) / PANEL;
    float *xt = aligned_alloc(64, (size_t)K * 16 * sizeof(float));
    if (xt == NULL) return -2;
    for (int g = 0; g < M; g += 16) {
        const int rows = M - g < 16 ? M - g : 16;
        /* One masked gather per k: lane i reads row g + i (rows past M read as zero). */
        const __m512i stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  _mm512_set1_epi32(K));
        const __mmask16 live = (__mmask16)((1u << rows) - 1u);
        const float *xg = x + (size_t)g * K;
        for (int k = 0; k < K; k++)
            _mm512_store_ps(xt + (size_t)k * 16,
                            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, stride, xg + k, 4));
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int p = 0; p < panels; p++) {
            const int n0 = p * PANEL, nr = N - n0 < PANEL ? N - n0 : PANEL;
            panel512(bits, xt, K, nb, qs, d, m, n0, nr, y + (size_t)g * N, N, rows);
        }
    }
    free(xt);
    return 0;
}

/* 1 to 3 rows (memory-bound): row_dots_scaled's arithmetic, 16 lanes wide. */
static inline __attribute__((always_inline)) void few_dots512(int bits, int mb, const float *x, int K, int nb,
                                                              const uint8_t *qs, const float *d, const float *m,
                                                              const float *xsum, float *out) {
    const int bytes = bits == 4 ? 16 : 32;
    __m512 acc[3];
    for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = qs + (size_t)b * bytes;
        __m512 q0, q1;
        if (bits == 4) {
            const __m128i v = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(15);
            q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
            q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
        } else {
            q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
            q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        }
        const __m512 dv = _mm512_set1_ps(d[b]);
        for (int i = 0; i < mb; i++) {
            const float *xb = x + (size_t)i * K + (size_t)b * 32;
            const __m512 t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xb)));
            acc[i] = _mm512_fmadd_ps(dv, t, acc[i]);
        }
    }
    for (int i = 0; i < mb; i++) out[i] = _mm512_reduce_add_ps(acc[i]) + (m == NULL ? 0.0f : dot(m, xsum + (size_t)i * nb, nb));
}

static void few_rows512(int bits, const float *x, int M, int K, const uint8_t *qs, const float *d, const float *m,
                        int N, float *y, int nthreads, const float *xsum) {
    const int nb = K / 32, bytes = bits == 4 ? 16 : 32;
    FEW_ROWS(few_dots512)
}

#define PREFETCH_ROWS 8

/* exp of 16 lanes: exp8's polynomial. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
    __m512 fx = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                                   _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(0.693359375f)));
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* One (request, KV head) of decode attention for G query heads of width 16 * DV (G * DV <= 16): the scores of
   every KV row, their softmax, then the V rows weighted into G outputs held in registers. p: G * Lp floats. */
static inline __attribute__((always_inline)) void attn_task512(int G, int DV, const float *qb, const float *k_cache,
                                                               const float *v_cache, const int32_t *slots, int L,
                                                               int Lp, int Hkv, int kvh, float scale, float *p,
                                                               float *ob) {
    const int D = 16 * DV;
    __m512 qv[16];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < DV; j++) qv[g * DV + j] = _mm512_loadu_ps(qb + g * D + 16 * j);
    for (int t = 0; t < L; t++) {
        const float *kt = k_cache + ((size_t)slots[t] * Hkv + kvh) * D;
        if (t + PREFETCH_ROWS < L) { /* the slots are scattered: fetch rows ahead of use */
            const size_t ahead = ((size_t)slots[t + PREFETCH_ROWS] * Hkv + kvh) * D;
            for (int j = 0; j < D; j += 16) {
                _mm_prefetch((const char *)(k_cache + ahead + j), _MM_HINT_T0);
                _mm_prefetch((const char *)(v_cache + ahead + j), _MM_HINT_T1);
            }
        }
        for (int g = 0; g < G; g++) {
            __m512 acc = _mm512_mul_ps(qv[g * DV], _mm512_loadu_ps(kt));
            for (int j = 1; j < DV; j++) acc = _mm512_fmadd_ps(qv[g * DV + j], _mm512_loadu_ps(kt + 16 * j), acc);
            p[(size_t)g * Lp + t] = scale * _mm512_reduce_add_ps(acc);
        }
    }
    float inv[16];
    for (int g = 0; g < G; g++) {
        float *pg = p + (size_t)g * Lp;
        for (int t = L; t < Lp; t++) pg[t] = -INFINITY;
        __m512 vm = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < Lp; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(pg + t));
        vm = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
        __m512 vs = _mm512_setzero_ps();
        for (int t = 0; t < Lp; t += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(pg + t), vm));
            _mm512_storeu_ps(pg + t, e);
            vs = _mm512_add_ps(vs, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(vs);
    }
    __m512 o[16];
    for (int i = 0; i < G * DV; i++) o[i] = _mm512_setzero_ps();
    for (int t = 0; t < L; t++) {
        const float *vt = v_cache + ((size_t)slots[t] * Hkv + kvh) * D;
        __m512 v[8];
        for (int j = 0; j < DV; j++) v[j] = _mm512_loadu_ps(vt + 16 * j);
        for (int g = 0; g < G; g++) {
            const __m512 pv = _mm512_set1_ps(p[(size_t)g * Lp + t]);
            for (int j = 0; j < DV; j++) o[g * DV + j] = _mm512_fmadd_ps(pv, v[j], o[g * DV + j]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < DV; j++)
            _mm512_storeu_ps(ob + g * D + 16 * j, _mm512_mul_ps(o[g * DV + j], _mm512_set1_ps(inv[g])));
}

#define ATTN512(GG, DD)                                                                                    \
    case GG * 16 + DD:                                                                                     \
        attn_task512(GG, DD, qb, k_cache, v_cache, slots, L, Lp, Hkv, kvh, scale, p, ob);                 \
        break;

/* gs_decode_attention for G * D / 16 <= 16 with D = 64 or 128; returns 1 if it cannot take the shape. */
static int attention512(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                        int64_t table_stride, const int64_t *row_of, const int64_t *lens, int B, int Hq, int Hkv,
                        int D, float scale, float *out, int nthreads) {
    const int G = Hq / Hkv, DV = D / 16;
    if ((D != 64 && D != 128) || G * DV > 16) return 1;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
    for (int task = 0; task < B * Hkv; task++) {
        const int b = task / Hkv, kvh = task % Hkv, L = (int)lens[b];
        const int Lp = (L + 15) & ~15;
        float local[4096];
        float *p = (size_t)G * (Lp > 0 ? Lp : 16) <= 4096 ? local : malloc(sizeof(float) * (size_t)G * Lp);
        if (p == NULL) {
            failed = 1;
            continue;
        }
        const int32_t *slots = table + row_of[b] * table_stride;
        const float *qb = q + ((size_t)b * Hq + kvh * G) * D;
        float *ob = out + ((size_t)b * Hq + kvh * G) * D;
        switch (G * 16 + DV) {
            ATTN512(1, 4) ATTN512(2, 4) ATTN512(3, 4) ATTN512(4, 4)
            ATTN512(1, 8) ATTN512(2, 8)
            default: failed = 2; /* G * DV <= 16 leaves only these */
        }
        if (p != local) free(p);
    }
    return failed ? -2 : 0;
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

static int avx512 = -1; /* -1: not yet asked; gs_use_avx512 sets it */

/* Turn the AVX-512 matmul on (where the CPU has it) or off; returns whether it is on. on < 0: only ask. */
int gs_use_avx512(int on) {
    if (on >= 0 || avx512 < 0) {
        __builtin_cpu_init();
        const int has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
        avx512 = has && on != 0;
    }
    return avx512;
}

/* out = rmsnorm(x) * w row by row; with residual != NULL, residual += x first and the norm is of the sum. The sum of
   squares is accumulated in double. Rows go to the OpenMP team (torch's threads) only in prefill-sized calls:
   at decode sizes a parallel region gained under 1 ms a step, and each one is a barrier that waits for a
   preempted thread on a busy machine. */
void gs_rmsnorm(const float *x, float *residual, const float *w, float eps, int M, int N, float *out) {
#pragma omp parallel for if (M >= PARALLEL_ROWS) schedule(static)
    for (int i = 0; i < M; i++) {
        const float *xi = x + (size_t)i * N;
        float *src = (float *)xi;
        if (residual != NULL) {
            src = residual + (size_t)i * N;
            int j = 0;
            for (; j + 8 <= N; j += 8)
                _mm256_storeu_ps(src + j, _mm256_add_ps(_mm256_loadu_ps(src + j), _mm256_loadu_ps(xi + j)));
            for (; j < N; j++) src[j] += xi[j];
        }
        __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
        int j = 0;
        for (; j + 8 <= N; j += 8) {
            const __m256 v = _mm256_loadu_ps(src + j);
            const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
            acc0 = _mm256_fmadd_pd(lo, lo, acc0);
            acc1 = _mm256_fmadd_pd(hi, hi, acc1);
        }
        double lanes[4];
        _mm256_storeu_pd(lanes, _mm256_add_pd(acc0, acc1));
        double ss = lanes[0] + lanes[1] + lanes[2] + lanes[3];
        for (; j < N; j++) ss += (double)src[j] * src[j];
        const float r = 1.0f / sqrtf((float)(ss / N) + eps);
        const __m256 rv = _mm256_set1_ps(r);
        float *o = out + (size_t)i * N;
        j = 0;
        for (; j + 8 <= N; j += 8)
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(src + j), rv)));
        for (; j < N; j++) o[j] = w[j] * (src[j] * r);
    }
}

/* exp of 8 lanes (Cephes' polynomial; relative error about 2e-7 for |x| < 88). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                              _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* q [B, Hq, D]; k_cache / v_cache [slots, Hkv, D]; table [rows, table_stride] int32 slots; row_of [B] int64;
   lens [B] int64 (the new token's KV is already stored); out [B, Hq, D]. One task per (request, KV head): the
   query heads of a group share each K/V row load. */
int gs_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                        int64_t table_stride, const int64_t *row_of, const int64_t *lens, int B, int Hq, int Hkv,
                        int D, float scale, float *out, int nthreads) {
    if (gs_use_avx512(-1) && attention512(q, k_cache, v_cache, table, table_stride, row_of, lens, B, Hq, Hkv, D,
                                          scale, out, nthreads) == 0)
        return 0;
    const int G = Hq / Hkv;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
    for (int task = 0; task < B * Hkv; task++) {
        const int b = task / Hkv, kvh = task % Hkv, L = (int)lens[b];
        const int Lp = (L + 7) & ~7;
        const int32_t *slots = table + row_of[b] * table_stride;
        float *p = (float *)malloc(sizeof(float) * (size_t)G * (Lp > 0 ? Lp : 8));
        if (p == NULL) {
            failed = 1;
            continue;
        }
        for (int t = 0; t < L; t++) {
            const float *kt = k_cache + ((size_t)slots[t] * Hkv + kvh) * D;
            for (int g = 0; g < G; g++) p[(size_t)g * Lp + t] = scale * dot(q + ((size_t)b * Hq + kvh * G + g) * D, kt, D);
        }
        for (int g = 0; g < G; g++) {
            float *pg = p + (size_t)g * Lp;
            float mx = -INFINITY;
            for (int t = 0; t < L; t++) mx = pg[t] > mx ? pg[t] : mx;
            for (int t = L; t < Lp; t++) pg[t] = -INFINITY;
            __m256 vs = _mm256_setzero_ps();
            const __m256 vm = _mm256_set1_ps(mx);
            for (int t = 0; t < Lp; t += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pg + t), vm));
                _mm256_storeu_ps(pg + t, e);
                vs = _mm256_add_ps(vs, e);
            }
            const float inv = 1.0f / hsum(vs);
            float *o = out + ((size_t)b * Hq + kvh * G + g) * D;
            for (int j = 0; j < D; j++) o[j] = 0.0f;
            for (int t = 0; t < L; t++) {
                const float *vt = v_cache + ((size_t)slots[t] * Hkv + kvh) * D;
                const float pt = pg[t] * inv;
                const __m256 pv = _mm256_set1_ps(pt);
                int j = 0;
                for (; j + 8 <= D; j += 8)
                    _mm256_storeu_ps(o + j, _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + j), _mm256_loadu_ps(o + j)));
                for (; j < D; j++) o[j] += pt * vt[j];
            }
        }
        free(p);
    }
    return failed ? -2 : 0;
}

/* RoPE (rotate-half) on the q and k of qkv [T, (Hq + 2 Hkv) * D] and the K/V cache store: q goes to q_out
   [T, Hq, D], rotated k and v to their slots loc[t]. cos/sin: [positions, D/2]. The arithmetic is torch's
   (x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product rounded), so the values are the same. */
void gs_rope_store(const float *qkv, int T, int Hq, int Hkv, int D, const float *cos_tab, const float *sin_tab,
                   const int64_t *positions, float *k_cache, float *v_cache, const int64_t *loc, float *q_out) {
    const int half = D / 2, width = (Hq + 2 * Hkv) * D;
#pragma omp parallel for if (T >= PARALLEL_ROWS) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *row = qkv + (size_t)t * width;
        const float *c = cos_tab + positions[t] * half, *s = sin_tab + positions[t] * half;
        for (int h = 0; h < Hq + Hkv; h++) {
            const float *x = row + (size_t)h * D;
            float *o = h < Hq ? q_out + ((size_t)t * Hq + h) * D : k_cache + ((size_t)loc[t] * Hkv + (h - Hq)) * D;
            for (int j = 0; j < half; j++) {
                const float x1 = x[j], x2 = x[j + half];
                const float a = x1 * c[j], b = x2 * s[j], e = x2 * c[j], f = x1 * s[j];
                o[j] = a - b;
                o[j + half] = e + f;
            }
        }
        const float *v = row + (size_t)(Hq + Hkv) * D;
        float *vo = v_cache + (size_t)loc[t] * Hkv * D;
        for (int j = 0; j < Hkv * D; j++) vo[j] = v[j];
    }
}

/* out[t, j] = silu(gu[t, j]) * gu[t, I + j] for gu [T, 2I]. */
void gs_silu_mul(const float *gu, int T, int I, float *out) {
#pragma omp parallel for if (T >= PARALLEL_ROWS) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * I, *u = g + I;
        float *o = out + (size_t)t * I;
        int j = 0;
        for (; j + 8 <= I; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(sig, _mm256_loadu_ps(u + j)));
        }
        for (; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* A decode step's decoder layers in one call (the model's per-layer Python glue cost ~7 ms a step on two cores).
   Each layer runs the kernels above in the order the Python path calls them, on the same inputs, so the result is
   the same bit for bit. One projection's block-quantized weight: */
typedef struct {
    int bits, N;
    const uint8_t *qs;
    const float *d, *m;
} gs_qmat;

typedef struct {
    const float *ln1, *ln2; /* input and post-attention RMSNorm weights [H] */
    gs_qmat qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* [slots, Hkv, D] */
} gs_layer;

/* x [M, H]: the embeddings in, overwritten; out [M, H]: rmsnorm(last layer's output + residual) with final_norm.
   work: M * (3 H + (Hq + 2 Hkv) D + 2 Hq D + 3 I) floats. Returns 0, or the first kernel's error. */
int gs_decode_layers(const gs_layer *layers, int L, int M, int H, int Hq, int Hkv, int D, int I, float eps,
                     float scale, const float *final_norm, float *x, const float *cos_tab, const float *sin_tab,
                     const int64_t *positions, const int64_t *loc, const int32_t *table, int64_t table_stride,
                     const int64_t *rows, const int64_t *lens, float *work, float *out, int nthreads) {
    float *res = work, *h = res + (size_t)M * H, *o = h + (size_t)M * H;
    float *qkv = o + (size_t)M * H, *q = qkv + (size_t)M * (Hq + 2 * Hkv) * D, *attn = q + (size_t)M * Hq * D;
    float *gu = attn + (size_t)M * Hq * D, *act = gu + (size_t)M * 2 * I;
    int rc;
    for (int l = 0; l < L; l++) {
        const gs_layer *ly = layers + l;
        if (l == 0) { /* the residual stream starts as the embeddings */
            memcpy(res, x, sizeof(float) * (size_t)M * H);
            gs_rmsnorm(x, NULL, ly->ln1, eps, M, H, h);
        } else {
            gs_rmsnorm(x, res, ly->ln1, eps, M, H, h);
        }
        if ((rc = gs_qgemm(ly->qkv.bits, h, M, H, ly->qkv.qs, ly->qkv.d, ly->qkv.m, ly->qkv.N, qkv, nthreads)))
            return rc;
        gs_rope_store(qkv, M, Hq, Hkv, D, cos_tab, sin_tab, positions, ly->k_cache, ly->v_cache, loc, q);
        if ((rc = gs_decode_attention(q, ly->k_cache, ly->v_cache, table, table_stride, rows, lens, M, Hq, Hkv, D,
                                      scale, attn, nthreads)))
            return rc;
        if ((rc = gs_qgemm(ly->o.bits, attn, M, Hq * D, ly->o.qs, ly->o.d, ly->o.m, ly->o.N, o, nthreads))) return rc;
        gs_rmsnorm(o, res, ly->ln2, eps, M, H, h);
        if ((rc = gs_qgemm(ly->gate_up.bits, h, M, H, ly->gate_up.qs, ly->gate_up.d, ly->gate_up.m, ly->gate_up.N,
                           gu, nthreads)))
            return rc;
        gs_silu_mul(gu, M, I, act);
        if ((rc = gs_qgemm(ly->down.bits, act, M, I, ly->down.qs, ly->down.d, ly->down.m, ly->down.N, x, nthreads)))
            return rc;
    }
    gs_rmsnorm(x, res, final_norm, eps, M, H, out);
    return 0;
}
