/* quantize.c: the activations of a group product as int16 per row and group of 32, the scale
 * max|x| / 32767 (their relative error about 1.5e-5 of the group's largest value, below float16's
 * rounding), with each group's float32 sum (group_matmul.c says what the kernels make of them). */
#include "group_matmul.h"

/* group g's 32 values of x rounded to integers of at most `largest` in magnitude (scale: the group's
 * largest magnitude over `largest`), as four registers of 8 int32; its scale */
ALWAYS_INLINE float round_group(const float *xg, float largest, __m256i i[4], __m256 *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 v0 = _mm256_loadu_ps(xg), v1 = _mm256_loadu_ps(xg + 8);
    const __m256 v2 = _mm256_loadu_ps(xg + 16), v3 = _mm256_loadu_ps(xg + 24);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    const float scale = hmax(a) / largest;
    const __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
    i[0] = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i[1] = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
    i[2] = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i[3] = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
    *sum = _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3));
    return scale;
}

/* one row of x -> xq (int16, per group of 32), s (the group scales), xs (the group sums) */
static void quantize_row(const float *x, int16_t *xq, float *s, float *xs, long G) {
    for (long g = 0; g < G; g++) {
        __m256i i[4];
        __m256 sum;
        s[g] = round_group(x + 32 * g, 32767.f, i, &sum);
        xs[g] = hsum(sum);
        /* packs works within 128-bit lanes (0-3 8-11 | 4-7 12-15): the permute puts them in order */
        _mm256_storeu_si256((__m256i *)(xq + 32 * g), _mm256_permute4x64_epi64(_mm256_packs_epi32(i[0], i[1]), 0xD8));
        _mm256_storeu_si256((__m256i *)(xq + 32 * g + 16),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2], i[3]), 0xD8));
    }
}

/* x as int16 per row and group of 32 */
int quantize(const float *x, long M, long K, Quantized *out) {
    const long G = K / 32;
    out->xq = aligned_alloc(32, (size_t)(M * K * 2 + 31) & ~(size_t)31);
    out->s = malloc((size_t)(2 * M * G) * sizeof(float));
    if (out->xq == NULL || out->s == NULL) {
        free(out->xq);
        free(out->s);
        return -1;
    }
    out->xs = out->s + M * G;
    for (long r = 0; r < M; r++) quantize_row(x + r * K, out->xq + r * K, out->s + r * G, out->xs + r * G, G);
    return 0;
}

void release(Quantized *qx) {
    free(qx->xq);
    free(qx->s);
}
