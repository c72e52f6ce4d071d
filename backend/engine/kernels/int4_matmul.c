/* int4_matmul: y = x W^T for W held as 4-bit groups of 32 along K, each group's values
 * d * q + m (q in 0..15; d, m float32: a GGUF Q4_1 block, exactly), float32 activations and
 * float32 sums (AVX2 + FMA). Built and loaded by backend/engine/int4_linear.py.
 *
 * q:  N rows of K/2 bytes; in group g (16 bytes), byte j holds element j in its low nibble and
 *     element j + 16 in its high one.
 * d, m: [N][G] (G = K / 32).  x: [M][K].  xs: [M][G], the sums of x over each group.
 * y:  [M][N]; rows n0 .. n1 - 1 of W are computed.
 * y[r][n] = sum_g d[n][g] * (sum_j q[n][g][j] * x[r][32 g + j]) + m[n][g] * xs[r][g]
 */
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one group's sum_j q_j x_j as 8 partial sums */
static inline __m256 group_dot(const uint8_t *qg, const float *xg) {
    const __m128i low = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)qg);
    __m128i lo = _mm_and_si128(b, low);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(xg));
    __m256 p2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(xg + 16));
    p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(xg + 8), p);
    p2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(xg + 24), p2);
    return _mm256_add_ps(p, p2);
}

/* rows r .. r + 3 of x against row n of W: each group's nibbles converted once, used 4 times */
static inline void four_rows(const uint8_t *qn, const float *dn, const float *mn, const float *x, const float *xs,
                             float *y, long N, long K, long G, long r, long n) {
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps(), t2 = _mm256_setzero_ps(), t3 = _mm256_setzero_ps();
    for (long g = 0; g < G; g++) {
        __m128i b = _mm_loadu_si128((const __m128i *)(qn + 16 * g));
        __m128i lo = _mm_and_si128(b, low);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        __m256 dg = _mm256_set1_ps(dn[g]);
#define ROW(i, t)                                                                                 \
        {                                                                                         \
            const float *xg = x + (r + i) * K + 32 * g;                                           \
            __m256 p = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));                                    \
            p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), p);                                  \
            p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), p);                                 \
            p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), p);                                 \
            t = _mm256_fmadd_ps(dg, p, t);                                                        \
        }
        ROW(0, t0) ROW(1, t1) ROW(2, t2) ROW(3, t3)
#undef ROW
    }
    __m256 t[4] = {t0, t1, t2, t3};
    for (long i = 0; i < 4; i++) {
        const float *xsr = xs + (r + i) * G;
        float s = hsum(t[i]);
        for (long g = 0; g < G; g++) s += mn[g] * xsr[g];
        y[(r + i) * N + n] = s;
    }
}

void int4_matmul(const uint8_t *q, const float *d, const float *m, const float *x, const float *xs, float *y,
                 long M, long N, long K, long n0, long n1) {
    const long G = K / 32;
    long r = 0;
    for (; r + 4 <= M; r += 4)  /* blocks of 4 rows: the nibbles converted once per block */
        for (long n = n0; n < n1; n++)
            four_rows(q + n * (K / 2), d + n * G, m + n * G, x, xs, y, N, K, G, r, n);
    for (; r < M; r++) {  /* the rest one row at a time, two groups at a time */
        const float *xr = x + r * K, *xsr = xs + r * G;
        for (long n = n0; n < n1; n++) {
            const uint8_t *qn = q + n * (K / 2);
            const float *dn = d + n * G, *mn = m + n * G;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            float s = 0.f;
            long g = 0;
            for (; g + 2 <= G; g += 2) {
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(dn[g]), group_dot(qn + 16 * g, xr + 32 * g), a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(dn[g + 1]), group_dot(qn + 16 * (g + 1), xr + 32 * (g + 1)), a1);
                s += mn[g] * xsr[g] + mn[g + 1] * xsr[g + 1];
            }
            for (; g < G; g++) {
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(dn[g]), group_dot(qn + 16 * g, xr + 32 * g), a0);
                s += mn[g] * xsr[g];
            }
            y[r * N + n] = hsum(_mm256_add_ps(a0, a1)) + s;
        }
    }
}
