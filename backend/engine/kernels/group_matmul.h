/* group_matmul.h: what the kernel library's files share (the .c files of backend/engine/kernels, compiled by
 * backend/engine/group_matmul.py into one library). The library computes y = x W^T for W held
 * in groups of 32 along K (group_matmul.c: the group products and the dispatch table; quantize.c:
 * the activations as int16; group_avx512_vnni.c and group_avx2.c: one kernel per ISA), products
 * with float32 or float16 weights (float_products.c), and a whole decode step (decode_step.c), the
 * work split between the calling thread and helper threads (threads.c).
 */
#ifndef GROUP_MATMUL_H
#define GROUP_MATMUL_H

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ALWAYS_INLINE float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---------------------------------------------------------------- the activations (quantize.c) */
typedef struct {
    int16_t *xq; /* int16 activations */
    float *s, *xs;
} Quantized;

/* x as int16 per row and group of 32 into *out (0; -1: out of memory); release frees them */
int quantize(const float *x, long M, long K, Quantized *out);
void release(Quantized *qx);

/* the weights PREFETCH_BYTES past group g's, asked for now (the next tile's, past a tile's end; a
 * prefetch past the weights' end is harmless): the hardware's prefetcher alone left the products
 * waiting on memory, at 8 rows as at 1 (measured on a Zen 4: with it, a decode step's products
 * 10-15% faster, bench group-kernels; at 2 KB ahead better than at 1 or 4) */
#define PREFETCH_BYTES 2048
ALWAYS_INLINE void prefetch_group(const uint8_t *group, long bytes) {
    for (long c = 0; c < bytes; c += 64) _mm_prefetch((const char *)group + PREFETCH_BYTES + c, _MM_HINT_T0);
}

/* ---------------------------------------------------------------- the group kernels, one per ISA */
#define TILE 16

/* tiles t0 .. t1 - 1 of W (4- or 8-bit groups) against every row of x (group_avx512_vnni.c, group_avx2.c) */
typedef void TilesFn(int bits, const void *q, const uint16_t *d, const uint16_t *m, const Quantized *qx, float *y,
                     long M, long N, long K, long t0, long t1);
TilesFn tiles_part, tiles_part_avx2;

/* rows n0 .. n1 - 1 of W (float32 or float16) against every row of x (float_products.c) */
typedef void RowsFn(const void *w, const float *x, float *y, long M, long N, long K, long n0, long n1);
RowsFn rows512_f32, rows512_f16, rows256_f32, rows256_f16;

/* The dispatch table: per kernel number (1: AVX2, 2: AVX-512 (VNNI)), its version of each
 * product, chosen once per process by group_matmul.py's kernel() and passed with every call. */
typedef struct {
    TilesFn *tiles;
    RowsFn *rows_f32, *rows_f16;
} Kernels;
extern const Kernels KERNELS[3];
int tiles_supported(void);

/* ---------------------------------------------------------------- the thread pool (threads.c) */
#define MAX_HELPERS 15
/* fn over units [0, units), split between the caller and up to threads - 1 helpers */
void run_job(void (*fn)(const void *, long, long, long), const void *ctx, long threads, long units);

/* ---------------------------------------------------------------- the products the decode step calls */
int int4_matmul(const uint8_t *q, const uint16_t *d, const uint16_t *m, const float *x, float *y, long M, long N, long K,
                long threads, long kernel);
int f32_matmul(const float *w, const float *x, float *y, long M, long N, long K, long threads, long kernel);
int f16_matmul(const uint16_t *w, const float *x, float *y, long M, long N, long K, long threads, long kernel);

#endif
