/* group_avx512_vnni.c: kernel 2 of the group products (group_matmul.c's layouts), for CPUs with
 * AVX-512 F, BW, VL and VNNI: a tile of 16 rows of W per 512-bit register, vpdpwssd. Compiled with
 * the library's AVX2 flags; its functions carry their own target, so it builds on every x86-64
 * compiler the library supports and runs only where tiles_supported() says so. */
#include "group_matmul.h"

#define TILE_ROWS 8 /* rows of x per pass over the weights */
#define VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"
#define VNNI_INLINE static inline __attribute__((always_inline, target(VNNI_TARGET)))

/* the 4 pair steps of one 64-byte chunk of a 4-bit tile, as int16 */
VNNI_INLINE void widen4_tile(const uint8_t *chunk, __m512i w[4]) {
    const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    const __m512i b = _mm512_loadu_si512((const void *)chunk);
    const __m512i lo = _mm512_and_si512(b, low), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
    w[0] = _mm512_unpacklo_epi8(lo, zero);
    w[1] = _mm512_unpackhi_epi8(lo, zero);
    w[2] = _mm512_unpacklo_epi8(hi, zero);
    w[3] = _mm512_unpackhi_epi8(hi, zero);
}

/* rows r .. r + R - 1 of x times the 16 rows of tile t: y[r + i][16 t .. 16 t + 15]; x as int16 */
VNNI_INLINE void tile_block(int R, int bits, const uint8_t *qt, const uint16_t *dt, const uint16_t *mt,
                            const Quantized *qx, float *y, long N, long K, long G, long r, long t) {
    __m512 f[TILE_ROWS];
    for (int i = 0; i < R; i++) f[i] = _mm512_setzero_ps();
    for (long g = 0; g < G; g++) {
        prefetch_group(qt + (bits == 4 ? 256 : 512) * g, bits == 4 ? 256 : 512);
        __m512i a[TILE_ROWS];
        const int32_t *xp[TILE_ROWS]; /* the rows' int16 pairs of group g */
        for (int i = 0; i < R; i++) {
            a[i] = _mm512_setzero_si512();
            xp[i] = (const int32_t *)(qx->xq + (r + i) * K + 32 * g);
        }
        if (bits == 4) {
            const uint8_t *tg = qt + 256 * g;
            for (int c = 0; c < 4; c++) {
                __m512i w[4];
                widen4_tile(tg + 64 * c, w);
                for (int k = 0; k < 4; k++)
                    for (int i = 0; i < R; i++) a[i] = _mm512_dpwssd_epi32(a[i], w[k], _mm512_set1_epi32(xp[i][4 * c + k]));
            }
        } else {
            const int8_t *tg = (const int8_t *)qt + 512 * g;
            for (int p = 0; p < 16; p++) {
                const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(tg + 32 * p)));
                for (int i = 0; i < R; i++) a[i] = _mm512_dpwssd_epi32(a[i], w, _mm512_set1_epi32(xp[i][p]));
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + TILE * g)));
        const __m512 mv = bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + TILE * g))) : dv;
        for (int i = 0; i < R; i++) {
            const long at = (r + i) * G + g;
            f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i]), _mm512_mul_ps(dv, _mm512_set1_ps(qx->s[at])), f[i]);
            if (bits == 4) f[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(qx->xs[at]), f[i]);
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(y + (r + i) * N + TILE * t, f[i]);
}

/* tiles t0 .. t1 - 1 against every row of x, in passes of up to TILE_ROWS rows */
__attribute__((target(VNNI_TARGET))) void tiles_part(int bits, const void *q, const uint16_t *d,
                                                          const uint16_t *m, const Quantized *qx, float *y, long M,
                                                          long N, long K, long t0, long t1) {
    const long G = K / 32, tile_bytes = (bits == 4 ? 256 : 512) * G;
    for (long r = 0; r < M; r += TILE_ROWS) {
        const long R = M - r < TILE_ROWS ? M - r : TILE_ROWS;
        for (long t = t0; t < t1; t++) {
            const uint8_t *qt = (const uint8_t *)q + t * tile_bytes;
            const uint16_t *dt = d + t * TILE * G, *mt = m == NULL ? NULL : m + t * TILE * G;
#define TILE_BLOCKS(BITS)                                                                           \
            switch (R) { /* a constant R per call: the row loop unrolled, the sums in registers */  \
            case 8: tile_block(8, BITS, qt, dt, mt, qx, y, N, K, G, r, t); break;                   \
            case 7: tile_block(7, BITS, qt, dt, mt, qx, y, N, K, G, r, t); break;                   \
            case 6: tile_block(6, BITS, qt, dt, mt, qx, y, N, K, G, r, t); break;                   \
            case 5: tile_block(5, BITS, qt, dt, mt, qx, y, N, K, G, r, t); break;                   \
            case 4: tile_block(4, BITS, qt, dt, mt, qx, y, N, K, G, r, t); break;                   \
            case 3: tile_block(3, BITS, qt, dt, mt, qx, y, N, K, G, r, t); break;                   \
            case 2: tile_block(2, BITS, qt, dt, mt, qx, y, N, K, G, r, t); break;                   \
            default: tile_block(1, BITS, qt, dt, mt, qx, y, N, K, G, r, t); break;                  \
            }
            if (bits == 4) {
                TILE_BLOCKS(4)
            } else {
                TILE_BLOCKS(8)
            }
#undef TILE_BLOCKS
        }
    }
}
