/* group_avx2.c: kernel 1 of the group products (group_matmul.c's layouts), for every CPU the
 * library runs on (AVX2, FMA, F16C). */
#include "group_matmul.h"

/* ---------------------------------------------------------------- kernel 1: AVX2
 * Each tile as two halves of 8 rows, whose bytes are the first and the second 32 of each 64-byte
 * chunk (4 bits; the 128-bit lanes 0-1 and 2-3 of kernel 2's registers) or 16 of each step's 32
 * (8 bits); each pair step is a vpmaddwd into 8 lanes and a vpaddd. */
#define HALF_ROWS 4 /* rows of x per pass (16 ymm registers: the sums of 4 rows, their scaled sums, 4 steps) */

/* rows r .. r + R - 1 of x times rows 8 h .. 8 h + 7 of tile t; x as int16 */
ALWAYS_INLINE void half_block(int R, int bits, const uint8_t *qt, const uint16_t *dt, const uint16_t *mt,
                              const Quantized *qx, float *y, long N, long K, long G, long r, long t, int h) {
    const __m256i low = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    __m256 f[HALF_ROWS];
    for (int i = 0; i < R; i++) f[i] = _mm256_setzero_ps();
    for (long g = 0; g < G; g++) {
        if (h == 0) prefetch_group(qt + (bits == 4 ? 256 : 512) * g, bits == 4 ? 256 : 512); /* both halves' lines */
        __m256i a[HALF_ROWS];
        const int32_t *xp[HALF_ROWS];
        for (int i = 0; i < R; i++) {
            a[i] = _mm256_setzero_si256();
            xp[i] = (const int32_t *)(qx->xq + (r + i) * K + 32 * g);
        }
        if (bits == 4) {
            const uint8_t *tg = qt + 256 * g + 32 * h;
            for (int c = 0; c < 4; c++) {
                const __m256i b = _mm256_loadu_si256((const __m256i *)(tg + 64 * c));
                const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
                const __m256i w[4] = {_mm256_unpacklo_epi8(lo, zero), _mm256_unpackhi_epi8(lo, zero),
                                      _mm256_unpacklo_epi8(hi, zero), _mm256_unpackhi_epi8(hi, zero)};
                for (int k = 0; k < 4; k++)
                    for (int i = 0; i < R; i++)
                        a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(w[k], _mm256_set1_epi32(xp[i][4 * c + k])));
            }
        } else {
            const int8_t *tg = (const int8_t *)qt + 512 * g + 16 * h;
            for (int p = 0; p < 16; p++) {
                const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(tg + 32 * p)));
                for (int i = 0; i < R; i++) a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(w, _mm256_set1_epi32(xp[i][p])));
            }
        }
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + TILE * g + 8 * h)));
        const __m256 mv = bits == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mt + TILE * g + 8 * h))) : dv;
        for (int i = 0; i < R; i++) {
            const long at = (r + i) * G + g;
            f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[i]), _mm256_mul_ps(dv, _mm256_set1_ps(qx->s[at])), f[i]);
            if (bits == 4) f[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(qx->xs[at]), f[i]);
        }
    }
    for (int i = 0; i < R; i++) _mm256_storeu_ps(y + (r + i) * N + TILE * t + 8 * h, f[i]);
}

void tiles_part_avx2(int bits, const void *q, const uint16_t *d, const uint16_t *m, const Quantized *qx,
                            float *y, long M, long N, long K, long t0, long t1) {
    const long G = K / 32, tile_bytes = (bits == 4 ? 256 : 512) * G;
    for (long r = 0; r < M; r += HALF_ROWS) {
        const long R = M - r < HALF_ROWS ? M - r : HALF_ROWS;
        for (long t = t0; t < t1; t++) {
            const uint8_t *qt = (const uint8_t *)q + t * tile_bytes;
            const uint16_t *dt = d + t * TILE * G, *mt = m == NULL ? NULL : m + t * TILE * G;
            for (int h = 0; h < 2; h++) {
#define HALF_BLOCKS(BITS)                                                                            \
                switch (R) {                                                                         \
                case 4: half_block(4, BITS, qt, dt, mt, qx, y, N, K, G, r, t, h); break;              \
                case 3: half_block(3, BITS, qt, dt, mt, qx, y, N, K, G, r, t, h); break;              \
                case 2: half_block(2, BITS, qt, dt, mt, qx, y, N, K, G, r, t, h); break;              \
                default: half_block(1, BITS, qt, dt, mt, qx, y, N, K, G, r, t, h); break;             \
                }
                if (bits == 4) {
                    HALF_BLOCKS(4)
                } else {
                    HALF_BLOCKS(8)
                }
#undef HALF_BLOCKS
            }
        }
    }
}
