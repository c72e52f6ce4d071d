/* float_products.c: products with float32 or float16 weights as torch holds them (f32_matmul,
 * f16_matmul), a 512-bit version (AVX-512 F) and a 256-bit one (AVX2, FMA, F16C) of each. */
#include "group_matmul.h"

/* ---------------------------------------------------------------- float32 and float16 weights
 * f32_matmul: y = x W^T for W float32 [N][K] as torch holds it (read in place, no copy);
 * f16_matmul: the same for W float16 [N][K], each weight widened to float32 in registers (F16C).
 * K a multiple of 16. Each output is one dot product: float32 lanes summed along K, then across
 * the lanes (the order differs from MKL's, so outputs may differ from F.linear's in the last bits).
 * A block is NR rows of W times R rows of x, NR * R sums in registers: each weight read once per
 * pass of up to F32_ROWS rows of x. Kernel 2: 512-bit (AVX-512 F), kernel 1: 256-bit (AVX2). */
#define F32_ROWS 8
#define F32_TARGET "avx512f,avx2,fma,f16c"

/* 16 weights from w + at (float32, or float16 when half), as float32 */
static inline __attribute__((always_inline, target(F32_TARGET))) __m512 weights16(const void *w, long at, int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at)));
    return _mm512_loadu_ps((const float *)w + at);
}

ALWAYS_INLINE __m256 weights8(const void *w, long at, int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + at)));
    return _mm256_loadu_ps((const float *)w + at);
}

static inline __attribute__((always_inline, target(F32_TARGET))) void f32_block512(int half, int NR, int R,
                                                                                      const void *w, const float *x,
                                                                                      float *y, long N, long K, long n,
                                                                                      long r) {
    __m512 acc[8][F32_ROWS];
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < R; i++) acc[j][i] = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 16) {
        __m512 xv[F32_ROWS];
        for (int i = 0; i < R; i++) xv[i] = _mm512_loadu_ps(x + (r + i) * K + k);
        for (int j = 0; j < NR; j++) {
            const __m512 wv = weights16(w, (n + j) * K + k, half);
            for (int i = 0; i < R; i++) acc[j][i] = _mm512_fmadd_ps(wv, xv[i], acc[j][i]);
        }
    }
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < R; i++) y[(r + i) * N + n + j] = _mm512_reduce_add_ps(acc[j][i]);
}

ALWAYS_INLINE void f32_block256(int half, int NR, int R, const void *w, const float *x, float *y, long N, long K,
                                long n, long r) {
    __m256 acc[4][4];
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < R; i++) acc[j][i] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 8) {
        __m256 xv[4];
        for (int i = 0; i < R; i++) xv[i] = _mm256_loadu_ps(x + (r + i) * K + k);
        for (int j = 0; j < NR; j++) {
            const __m256 wv = weights8(w, (n + j) * K + k, half);
            for (int i = 0; i < R; i++) acc[j][i] = _mm256_fmadd_ps(wv, xv[i], acc[j][i]);
        }
    }
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < R; i++) y[(r + i) * N + n + j] = hsum(acc[j][i]);
}

/* rows n0 .. n1 - 1 of W against every row of x (n0 and n1 multiples of 8, or n1 = N) */
static inline __attribute__((always_inline, target(F32_TARGET))) void f32_rows512(int half, const void *w,
                                                                                     const float *x, float *y, long M,
                                                                                     long N, long K, long n0, long n1) {
    for (long r = 0; r < M; r += F32_ROWS) {
        const long R = M - r < F32_ROWS ? M - r : F32_ROWS;
        long n = n0;
        if (R <= 4) {
            for (; n + 8 <= n1; n += 8) switch (R) { /* 8 rows of W: 8 R sums */
                case 1: f32_block512(half, 8, 1, w, x, y, N, K, n, r); break;
                case 2: f32_block512(half, 8, 2, w, x, y, N, K, n, r); break;
                case 3: f32_block512(half, 4, 3, w, x, y, N, K, n, r); f32_block512(half, 4, 3, w, x, y, N, K, n + 4, r); break;
                default: f32_block512(half, 4, 4, w, x, y, N, K, n, r); f32_block512(half, 4, 4, w, x, y, N, K, n + 4, r); break;
                }
        } else {
            for (; n + 2 <= n1; n += 2) switch (R) { /* 2 rows of W: up to 16 sums */
                case 5: f32_block512(half, 2, 5, w, x, y, N, K, n, r); break;
                case 6: f32_block512(half, 2, 6, w, x, y, N, K, n, r); break;
                case 7: f32_block512(half, 2, 7, w, x, y, N, K, n, r); break;
                default: f32_block512(half, 2, 8, w, x, y, N, K, n, r); break;
                }
        }
        for (; n < n1; n++)
            for (long i = 0; i < R; i++) f32_block512(half, 1, 1, w, x, y, N, K, n, r + i);
    }
}

ALWAYS_INLINE void f32_rows256(int half, const void *w, const float *x, float *y, long M, long N, long K, long n0,
                               long n1) {
    for (long r = 0; r < M; r += 4) {
        const long R = M - r < 4 ? M - r : 4;
        long n = n0;
        for (; n + 4 <= n1; n += 4) switch (R) {
            case 1: f32_block256(half, 4, 1, w, x, y, N, K, n, r); break;
            case 2: f32_block256(half, 4, 2, w, x, y, N, K, n, r); break;
            case 3: f32_block256(half, 2, 3, w, x, y, N, K, n, r); f32_block256(half, 2, 3, w, x, y, N, K, n + 2, r); break;
            default: f32_block256(half, 2, 4, w, x, y, N, K, n, r); f32_block256(half, 2, 4, w, x, y, N, K, n + 2, r); break;
            }
        for (; n < n1; n++)
            for (long i = 0; i < R; i++) f32_block256(half, 1, 1, w, x, y, N, K, n, r + i);
    }
}

/* the four versions, each compiled once: 512-bit or 256-bit, float32 or float16 weights */
__attribute__((target(F32_TARGET))) void rows512_f32(const void *w, const float *x, float *y, long M, long N,
                                                           long K, long n0, long n1) {
    f32_rows512(0, w, x, y, M, N, K, n0, n1);
}
__attribute__((target(F32_TARGET))) void rows512_f16(const void *w, const float *x, float *y, long M, long N,
                                                           long K, long n0, long n1) {
    f32_rows512(1, w, x, y, M, N, K, n0, n1);
}
void rows256_f32(const void *w, const float *x, float *y, long M, long N, long K, long n0, long n1) {
    f32_rows256(0, w, x, y, M, N, K, n0, n1);
}
void rows256_f16(const void *w, const float *x, float *y, long M, long N, long K, long n0, long n1) {
    f32_rows256(1, w, x, y, M, N, K, n0, n1);
}

typedef struct {
    int kernel, half;
    const void *w;
    const float *x;
    float *y;
    long M, N, K;
} F32Product;

/* units [u0, u1): rows [8 u0, min(8 u1, N)) of W */
static void f32_part(const void *ctx, long u0, long u1, long thread) {
    (void)thread;
    const F32Product *p = ctx;
    const long n0 = 8 * u0, n1 = 8 * u1 < p->N ? 8 * u1 : p->N;
    const Kernels *k = &KERNELS[p->kernel];
    (p->half ? k->rows_f16 : k->rows_f32)(p->w, p->x, p->y, p->M, p->N, p->K, n0, n1);
}

static int float_matmul(int half, const void *w, const float *x, float *y, long M, long N, long K, long threads,
                        long kernel) {
    if (K % 16 || (kernel != 1 && kernel != 2) || (kernel == 2 && !tiles_supported())) return -2;
    const F32Product product = {(int)kernel, half, w, x, y, M, N, K};
    run_job(f32_part, &product, N >= 64 * threads ? threads : 1, (N + 7) / 8);
    return 0;
}

/* kernel: 1 (AVX2) or 2 (AVX-512). 0: done; -2: K not a multiple of 16, or a kernel this CPU does not run */
int f32_matmul(const float *w, const float *x, float *y, long M, long N, long K, long threads, long kernel) {
    return float_matmul(0, w, x, y, M, N, K, threads, kernel);
}

int f16_matmul(const uint16_t *w, const float *x, float *y, long M, long N, long K, long threads, long kernel) {
    return float_matmul(1, w, x, y, M, N, K, threads, kernel);
}
