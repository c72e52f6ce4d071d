/* group_matmul: y = x W^T for W held in groups of 32 along K, in tiles of 16 rows of W (the output
 * rows split between the calling thread and threads - 1 helpers). Built and loaded by
 * backend/engine/group_matmul.py.
 *
 * The activations are quantized per row and group of 32 to int16 with the scale max|x| / 32767
 * (their relative error about 1.5e-5 of the group's largest value, below float16's rounding),
 * so each group's sum of products is an exact int32 sum of integer products (pairs of int16
 * products summed into int32: vpdpwssd or vpmaddwd), scaled once in float32.
 *
 * int4_matmul: 4-bit groups, each value d * q + m (q in 0..15; d, m float16: a GGUF Q4_1 block).
 *   y[r][n] = sum_g d[n][g] * s[r][g] * (sum_j q[n][g][j] * xq[r][g][j]) + m[n][g] * xs[r][g]
 *   (s: the activations' group scales, xs: their float32 group sums).
 * int8_matmul: 8-bit groups, each value d * q (q in -127..127, d float16; a GGUF Q8_0 block).
 * x: [M][K] float32; y: [M][N] float32; N a multiple of 16.
 *
 * A tile's lanes: each lane of a register sums one of the tile's rows, so a group's products for
 * 16 outputs are 16 pair steps (pair p: the activations 2p, 2p + 1 broadcast to every lane, times
 * each row's weights 2p, 2p + 1), and the float32 scaling is done once per group for the tile's
 * rows at once, in the lanes where the results are stored. Layouts (made by group_matmul.py):
 *   4 bits: for tile t and group g, 256 bytes: 4 chunks of 64; chunk c's bytes widen (low nibbles,
 *     then high ones; bytes 0-7 of each 128-bit lane, then 8-15) to the pair steps 4c .. 4c + 3:
 *     int16 element e of step p = weight 2p + e % 2 of the tile's row e / 2.
 *   8 bits: for tile t and group g, 512 bytes: 16 steps of 32 bytes, byte e of step p = weight
 *     2p + e % 2 of the tile's row e / 2.
 *   d, m: [N / 16][G][16] float16 (as GGUF's blocks hold them), widened in registers (F16C).
 * Two kernels read them: AVX-512 VNNI (kernel 2: a tile per 512-bit register, vpdpwssd) and AVX2
 * (kernel 1: a tile as two halves of 8 rows, vpmaddwd and vpaddd).
 */
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

typedef struct {
    int16_t *xq; /* int16 activations */
    float *s, *xs;
} Quantized;

/* x as int16 per row and group of 32 */
static int quantize(const float *x, long M, long K, Quantized *out) {
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

static void release(Quantized *qx) {
    free(qx->xq);
    free(qx->s);
}

/* the weights PREFETCH_BYTES past group g's, asked for now (the next tile's, past a tile's end; a
 * prefetch past the weights' end is harmless): the hardware's prefetcher alone left the products
 * waiting on memory, at 8 rows as at 1 (measured on a Zen 4: with it, a decode step's products
 * 10-15% faster, bench group-kernels; at 2 KB ahead better than at 1 or 4) */
#define PREFETCH_BYTES 2048
ALWAYS_INLINE void prefetch_group(const uint8_t *group, long bytes) {
    for (long c = 0; c < bytes; c += 64) _mm_prefetch((const char *)group + PREFETCH_BYTES + c, _MM_HINT_T0);
}

/* ---------------------------------------------------------------- kernel 2: AVX-512 VNNI */
#define TILE 16
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
__attribute__((target(VNNI_TARGET))) static void tiles_part(int bits, const void *q, const uint16_t *d,
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

static void tiles_part_avx2(int bits, const void *q, const uint16_t *d, const uint16_t *m, const Quantized *qx,
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

/* 1 when this CPU runs kernel 2 (AVX-512 F, BW, VL and VNNI) */
int tiles_supported(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    }
    return known;
}

/* ---------------------------------------------------------------- a pool of helper threads
 * A job's units (a product's tiles, an attention's (sequence, head) pairs) are split into one part
 * per thread, the calling thread's and up to threads - 1 helpers'. Each thread takes units of its
 * own part from the front, a shrinking share at a time (a quarter of what is left), then units of
 * the other parts the same way: a thread the system preempts holds up only the units it holds, and
 * the other threads do the rest of its part. A helper spins on the job word for a while after
 * each job (the next product of a step follows within microseconds), then sleeps on a condition
 * variable until the next job. Jobs are posted by one thread at a time (an engine's step thread);
 * the caller's lock makes that so. */
#define MAX_HELPERS 15
#define SPIN_NS 200000L

typedef struct { /* one product: what each part needs */
    int bits, kernel;
    const void *q;
    const uint16_t *d, *m;
    const Quantized *qx;
    float *y;
    long M, N, K;
} Product;

/* a job for the pool: fn(ctx, u0, u1, thread) for units [u0, u1), run by thread 0 (the caller) to
 * threads - 1 */
typedef struct {
    void (*fn)(const void *ctx, long u0, long u1, long thread);
    const void *ctx;
} Job;

/* The job's word: (job number << PARTS_BITS) | parts (the threads it may use); a helper whose
 * index + 1 is below that takes units. Part p's cursor: CURSOR(tag, end, next), tag the job number
 * mod 2^19, units [next, end) of part p not taken yet. A thread takes units by advancing a cursor
 * (compare and swap) while its tag is the job's it saw and units are left; only after that does it
 * read `job`, which cannot change before the job completes, and the job cannot complete before
 * those units are done. A helper late to a job (preempted after it saw the word) finds another tag
 * or no unit left and takes nothing; units_done counts each unit of the current job exactly once. */
#define PARTS_BITS 5
#define UNIT_BITS 22 /* at most 4M units a job */
#define TAG(number) ((number) & 0x7FFFFL) /* 19 bits: a cursor (tag << 44) stays positive */
#define CURSOR(tag, end, next) ((tag) << (2 * UNIT_BITS) | (end) << UNIT_BITS | (next))
#define UNIT_MASK ((1L << UNIT_BITS) - 1)
typedef struct {
    _Alignas(64) atomic_long word; /* a cache line each: a part's owner takes from it alone until others steal */
} Cursor;
static Job job;
#ifndef FIRST_JOB /* tests only: the job number to start from (the tags' wrap) */
#define FIRST_JOB 0L
#endif
static atomic_long posted = FIRST_JOB << PARTS_BITS, units_done;
static Cursor cursors[MAX_HELPERS + 1];
static atomic_int sleeping;
static int helpers_started;
static long first_seen[MAX_HELPERS]; /* the word when helper i was started (before the job that needs it) */
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER, post_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

/* units [u0, u1) of the product: its tiles */
static void product_part(const void *ctx, long u0, long u1, long thread) {
    (void)thread;
    const Product *jb = ctx;
    if (jb->kernel == 2)
        tiles_part(jb->bits, jb->q, jb->d, jb->m, jb->qx, jb->y, jb->M, jb->N, jb->K, u0, u1);
    else
        tiles_part_avx2(jb->bits, jb->q, jb->d, jb->m, jb->qx, jb->y, jb->M, jb->N, jb->K, u0, u1);
}

/* takes units of part p of job `tag`: 1 and [*u0, *u1), or 0 when none is left */
static int take(long p, long tag, long *u0, long *u1) {
    long c = atomic_load(&cursors[p].word);
    for (;;) {
        const long next = c & UNIT_MASK, end = (c >> UNIT_BITS) & UNIT_MASK;
        if ((c >> (2 * UNIT_BITS)) != tag || next >= end) return 0;
        const long step = (end - next + 3) / 4;
        if (atomic_compare_exchange_weak(&cursors[p].word, &c, CURSOR(tag, end, next + step))) {
            *u0 = next, *u1 = next + step;
            return 1;
        }
    }
}

/* thread `me`'s share of job `tag` of `parts` parts: its own part, then whatever is left of the others */
static void take_units(long tag, long me, long parts) {
    long done = 0, u0, u1;
    for (long k = 0; k < parts; k++)
        while (take((me + k) % parts, tag, &u0, &u1)) {
            job.fn(job.ctx, u0, u1, me);
            done += u1 - u0;
        }
    if (done) atomic_fetch_add(&units_done, done);
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *helper(void *arg) {
    const long index = (long)arg; /* thread index + 1 of the jobs that use it */
    long seen = first_seen[index];
    for (;;) {
        long word, start = now_ns();
        while ((word = atomic_load_explicit(&posted, memory_order_acquire)) == seen) {
            if (now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&wake_lock);
                atomic_fetch_add(&sleeping, 1);
                while ((word = atomic_load(&posted)) == seen) pthread_cond_wait(&wake, &wake_lock);
                atomic_fetch_sub(&sleeping, 1);
                pthread_mutex_unlock(&wake_lock);
                break;
            }
            _mm_pause();
        }
        seen = word;
#ifdef HELPER_DELAY_NS /* tests only: widens the window a preempted helper opens here */
        nanosleep(&(struct timespec){0, HELPER_DELAY_NS}, NULL);
#endif
        const long parts = word & ((1L << PARTS_BITS) - 1);
        if (index + 1 < parts) take_units(TAG(word >> PARTS_BITS), index + 1, parts);
    }
    return NULL;
}

/* a forked child has none of its parent's helper threads */
static void forget_helpers(void) {
    helpers_started = 0;
    atomic_store(&sleeping, 0);
    pthread_mutex_init(&wake_lock, NULL);
    pthread_mutex_init(&post_lock, NULL);
    pthread_cond_init(&wake, NULL);
}

/* start helpers up to count (once each); how many there are */
static int ensure_helpers(int count) {
    static int registered;
    if (!registered) registered = pthread_atfork(NULL, NULL, forget_helpers) == 0;
    while (helpers_started < count && helpers_started < MAX_HELPERS) {
        pthread_t t;
        first_seen[helpers_started] = atomic_load(&posted);
        if (pthread_create(&t, NULL, helper, (void *)(long)helpers_started) != 0) break;
        pthread_detach(t);
        helpers_started++;
    }
    return helpers_started;
}

/* fn over units [0, units), split between the caller and up to threads - 1 helpers */
static void run_job(void (*fn)(const void *, long, long, long), const void *ctx, long threads, long units) {
    if (threads <= 1 || units <= 1) {
        fn(ctx, 0, units, 0);
        return;
    }
    pthread_mutex_lock(&post_lock);
    long parts = 1 + ensure_helpers((int)threads - 1);
    if (parts > threads) parts = threads;
    if (parts > units) parts = units;
    job = (Job){fn, ctx};
    atomic_store(&units_done, 0);
    const long number = (atomic_load_explicit(&posted, memory_order_relaxed) >> PARTS_BITS) + 1;
    for (long p = 0; p < parts; p++)
        atomic_store(&cursors[p].word, CURSOR(TAG(number), units * (p + 1) / parts, units * p / parts));
    atomic_store_explicit(&posted, number << PARTS_BITS | parts, memory_order_seq_cst);
    if (atomic_load(&sleeping)) {
        pthread_mutex_lock(&wake_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&wake_lock);
    }
    take_units(TAG(number), 0, parts);
    for (long spins = 0; atomic_load_explicit(&units_done, memory_order_acquire) < units; spins++)
        if (spins < 20000)
            _mm_pause();
        else
            sched_yield(); /* a helper holding units was preempted: let it have this core */
    pthread_mutex_unlock(&post_lock);
}

ALWAYS_INLINE int matmul(int bits, int kernel, const void *q, const uint16_t *d, const uint16_t *m, const float *x,
                         float *y, long M, long N, long K, long threads) {
    Quantized qx;
    if (N % TILE || (kernel != 1 && kernel != 2) || (kernel == 2 && !tiles_supported())) return -2;
    if (quantize(x, M, K, &qx)) return -1;
    const Product product = {bits, kernel, q, d, m, &qx, y, M, N, K};
    run_job(product_part, &product, N >= 64 * threads ? threads : 1, N / TILE);
    release(&qx);
    return 0;
}

/* kernel: 1 (AVX2) or 2 (AVX-512 VNNI).
 * 0: done; -1: out of memory; -2: N not a multiple of 16, or a kernel this CPU does not run
 * (y untouched on an error) */
int int4_matmul(const uint8_t *q, const uint16_t *d, const uint16_t *m, const float *x, float *y, long M, long N, long K,
                long threads, long kernel) {
    return matmul(4, (int)kernel, q, d, m, x, y, M, N, K, threads);
}

int int8_matmul(const int8_t *q, const uint16_t *d, const float *x, float *y, long M, long N, long K, long threads,
                long kernel) {
    return matmul(8, (int)kernel, q, d, NULL, x, y, M, N, K, threads);
}

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
__attribute__((target(F32_TARGET))) static void rows512_f32(const void *w, const float *x, float *y, long M, long N,
                                                           long K, long n0, long n1) {
    f32_rows512(0, w, x, y, M, N, K, n0, n1);
}
__attribute__((target(F32_TARGET))) static void rows512_f16(const void *w, const float *x, float *y, long M, long N,
                                                           long K, long n0, long n1) {
    f32_rows512(1, w, x, y, M, N, K, n0, n1);
}
static void rows256_f32(const void *w, const float *x, float *y, long M, long N, long K, long n0, long n1) {
    f32_rows256(0, w, x, y, M, N, K, n0, n1);
}
static void rows256_f16(const void *w, const float *x, float *y, long M, long N, long K, long n0, long n1) {
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
    if (p->kernel == 2)
        (p->half ? rows512_f16 : rows512_f32)(p->w, p->x, p->y, p->M, p->N, p->K, n0, n1);
    else
        (p->half ? rows256_f16 : rows256_f32)(p->w, p->x, p->y, p->M, p->N, p->K, n0, n1);
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

/* ---------------------------------------------------------------- a whole decode step
 * decode_layers: every decoder layer of a Llama-family model for B <= 16 sequences of one token each,
 * in one call: RMS norm, the fused q/k/v product, the rotary embedding of q and k, the K/V write into
 * the paged HND pool, attention over each sequence's pages, the output product and residual add, RMS
 * norm, the fused gate/up product, SiLU(gate) * up, the down product and residual add; then, given
 * final_norm (else NULL), the model's RMS norm after the last layer. The products'
 * weights: 4-bit groups (Dims.weights 4: int4_matmul's q, d, m), float32 (32: f32_matmul's W in
 * the q pointers, d and m unused) or float16 (16: f16_matmul's, likewise). float32 activations; the
 * pool float32 or float16 (Dims.kv_bits: K/V rounded to nearest even as written, as torch's
 * conversion, and widened as read). What it computes is the lean layer loop's
 * (backend/engine/lean_decoder.py) without a dispatch per op.
 */
typedef struct {
    const float *norm1, *norm2;
    const uint8_t *qkv_q, *o_q, *gu_q, *down_q;
    const uint16_t *qkv_d, *qkv_m, *o_d, *o_m, *gu_d, *gu_m, *down_d, *down_m; /* float16 */
} Layer;

typedef struct {
    long hidden, heads, kv_heads, head_dim, inter;
    float eps, scaling;
    long num_pages, page_size, max_pages;
    long kernel;  /* the products' kernel (int4_matmul's and f32_matmul's numbering) */
    long weights; /* 4: the products' weights in 4-bit groups; 32: float32; 16: float16 */
    long kv_bits; /* the KV pool's elements: 32 (float32) or 16 (float16, converted as they are read) */
} Dims;

/* one of a layer's products: y = x W^T, W as Dims.weights says */
static int layer_product(const Dims *dm, const uint8_t *q, const uint16_t *d, const uint16_t *m, const float *x,
                         float *y, long M, long N, long K, long threads) {
    if (dm->weights == 32) return f32_matmul((const float *)q, x, y, M, N, K, threads, dm->kernel);
    if (dm->weights == 16) return f16_matmul((const uint16_t *)q, x, y, M, N, K, threads, dm->kernel);
    return int4_matmul(q, d, m, x, y, M, N, K, threads, dm->kernel);
}

static void rms_norm(const float *x, const float *w, float *out, long n, float eps) {
    __m256 ss8 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        ss8 = _mm256_fmadd_ps(v, v, ss8);
    }
    double ss = hsum(ss8);
    for (; i < n; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / n) + eps);
    const __m256 r8 = _mm256_set1_ps(r);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), r8)));
    for (; i < n; i++) out[i] = w[i] * (x[i] * r);
}

static inline float dot(const float *a, const float *b, long n) {
    __m256 s = _mm256_setzero_ps();
    for (long i = 0; i < n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    return hsum(s);
}

/* e^x for 8 floats (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by its degree-7 polynomial,
 * 2^n in the exponent bits; within 2 ulp of expf over [-87.3, 88.3], x clamped to that range:
 * e^-87.3 is 1.2e-38, never a denormal or an inf) */
ALWAYS_INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* out[i] = e^(x[i] - shift) for i < n; their sum */
static float exp_shifted(const float *x, float *out, long n, float shift) {
    const __m256 s = _mm256_set1_ps(shift);
    __m256 sum = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
        _mm256_storeu_ps(out + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum(sum);
    for (; i < n; i++) total += (out[i] = expf(x[i] - shift));
    return total;
}

/* act[i] = SiLU(gate[i]) * up[i] = gate / (1 + e^-gate) * up for i < n */
static void silu_mul(const float *gate, const float *up, float *act, long n) {
    long i = 0;
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_xor_ps(g, sign));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) act[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
}

typedef struct { /* one layer's attention for the step's B sequences: what each part needs */
    const Dims *dm;
    const float *qkv;
    float *att;
    const void *lpool; /* float or uint16_t (float16), as Dims.kv_bits says */
    const long *tables, *lengths;
    long B;
    float *scores; /* longest floats per thread */
    long longest;
} Attention;

/* 8 sums of 8 lanes each: lane i of the result is the sum of a[i]'s lanes */
ALWAYS_INLINE __m256 hsum8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0: lanes 0-3 the low halves' sums of a[0..3], 4-7 their high halves'; u1 likewise for a[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 8 of the pool's elements from element i of p (float32, or float16 widened) */
ALWAYS_INLINE __m256 kv8(const void *p, long i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

/* element i of the pool from p, in bytes */
ALWAYS_INLINE const void *kv_at(const void *p, long i, int half) {
    return (const char *)p + i * (half ? 2 : 4);
}

/* the next page's keys or values of a KV head (`elements` of them from p), asked for now: a
 * sequence's pages lie anywhere in the pool, so the hardware's prefetcher does not run ahead */
ALWAYS_INLINE void prefetch_page(const void *p, long elements, int half) {
    const long bytes = elements * (half ? 2 : 4);
    for (long b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* scores[t] = q . k_t * scaling for t < len (k_t: token t's key in the sequence's pages), page by
 * page, 8 tokens at a time (their 8 dot products summed across lanes together); the largest score */
ALWAYS_INLINE float key_scores(const float *q, const void *kbase, const long *table, long len, long S, long D,
                               long page_floats, float scaling, float *scores, int half) {
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    const __m256 sc = _mm256_set1_ps(scaling);
    float top = -INFINITY;
    for (long pg = 0, t0 = 0; t0 < len; pg++, t0 += S) {
        const void *kp = kv_at(kbase, table[pg] * page_floats, half);
        const long n = len - t0 < S ? len - t0 : S;
        if (t0 + S < len) prefetch_page(kv_at(kbase, table[pg + 1] * page_floats, half), S * D, half);
        long i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 acc[8];
            for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
            for (long j = 0; j < D; j += 8) {
                const __m256 qv = _mm256_loadu_ps(q + j);
                for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qv, kv8(kp, (i + u) * D + j, half), acc[u]);
            }
            const __m256 s8 = _mm256_mul_ps(hsum8(acc), sc);
            _mm256_storeu_ps(scores + t0 + i, s8);
            top8 = _mm256_max_ps(top8, s8);
        }
        for (; i < n; i++) {
            __m256 acc = _mm256_setzero_ps();
            for (long j = 0; j < D; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), kv8(kp, i * D + j, half), acc);
            const float v = hsum(acc) * scaling;
            scores[t0 + i] = v;
            top = v > top ? v : top;
        }
    }
    const float top_blocks = hmax(top8);
    return top_blocks > top ? top_blocks : top;
}

/* out = inv * sum_t w[t] v_t (v_t: token t's value in the sequence's pages), page by page */
ALWAYS_INLINE void value_sum(long D, const float *w, const void *vbase, const long *table, long len, long S,
                             long page_floats, float inv, float *out, int half) {
    __m256 o[64];
    for (long j = 0; j < D / 8; j++) o[j] = _mm256_setzero_ps();
    for (long pg = 0, t0 = 0; t0 < len; pg++, t0 += S) {
        const void *vp = kv_at(vbase, table[pg] * page_floats, half);
        const long n = len - t0 < S ? len - t0 : S;
        if (t0 + S < len) prefetch_page(kv_at(vbase, table[pg + 1] * page_floats, half), S * D, half);
        for (long i = 0; i < n; i++) {
            const __m256 wt = _mm256_set1_ps(w[t0 + i]);
            for (long j = 0; j < D / 8; j++) o[j] = _mm256_fmadd_ps(wt, kv8(vp, i * D + 8 * j, half), o[j]);
        }
    }
    const __m256 iv = _mm256_set1_ps(inv);
    for (long j = 0; j < D / 8; j++) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(o[j], iv));
}

/* the (sequence, query head) pairs [u0, u1) (pair b H + h): softmax(q K^T * scaling) V, over a
 * pool of float16 (half) or float32 elements */
ALWAYS_INLINE void attention_pairs(const Attention *a, long u0, long u1, float *scores, int half) {
    const Dims *dm = a->dm;
    const long H = dm->heads, Hkv = dm->kv_heads, D = dm->head_dim, S = dm->page_size, group = H / Hkv;
    const long qkv_n = (H + 2 * Hkv) * D, page_floats = 2 * Hkv * S * D;
    for (long p = u0; p < u1; p++) {
        const long b = p / H, hq = p % H, len = a->lengths[b], kh = hq / group;
        const long *table = a->tables + b * dm->max_pages;
        const float *q = a->qkv + b * qkv_n + hq * D;
        const void *kbase = kv_at(a->lpool, kh * S * D, half);
        const float top = key_scores(q, kbase, table, len, S, D, page_floats, dm->scaling, scores, half);
        const float inv = 1.f / exp_shifted(scores, scores, len, top);
        const void *vbase = kv_at(a->lpool, (Hkv + kh) * S * D, half);
        float *out = a->att + b * H * D + hq * D;
        switch (D) { /* a constant head size: the sums stay in registers */
        case 64: value_sum(64, scores, vbase, table, len, S, page_floats, inv, out, half); break;
        case 128: value_sum(128, scores, vbase, table, len, S, page_floats, inv, out, half); break;
        default: value_sum(D, scores, vbase, table, len, S, page_floats, inv, out, half); break;
        }
    }
}

static void attention_part(const void *ctx, long u0, long u1, long thread) {
    const Attention *a = ctx;
    float *scores = a->scores + thread * a->longest;
    if (a->dm->kv_bits == 16)
        attention_pairs(a, u0, u1, scores, 1);
    else
        attention_pairs(a, u0, u1, scores, 0);
}

/* 0: done; -1: out of memory; -2: as int4_matmul's or f32_matmul's */
int decode_layers(const Layer *layers, long num_layers, const Dims *dm, float *h, long B, const float *cos,
                  const float *sin, void *pool, const long *tables, const long *lengths, const long *write_page,
                  const long *write_offset, const float *final_norm, long threads) {
    const long hd = dm->hidden, H = dm->heads, Hkv = dm->kv_heads, D = dm->head_dim, I = dm->inter, S = dm->page_size;
    const long qkv_n = (H + 2 * Hkv) * D, half = D / 2;
    const long page_floats = 2 * Hkv * S * D, layer_floats = dm->num_pages * page_floats;
    const int kv16 = dm->kv_bits == 16;
    if (dm->kv_bits != 16 && dm->kv_bits != 32) return -2;
    long longest = 1;
    for (long b = 0; b < B; b++) longest = lengths[b] > longest ? lengths[b] : longest;
    float *x = malloc(sizeof(float) * (size_t)(B * (hd + qkv_n + H * D + hd + 2 * I + I) + (MAX_HELPERS + 1) * longest));
    if (x == NULL) return -1;
    float *qkv = x + B * hd, *att = qkv + B * qkv_n, *tmp = att + B * H * D, *gu = tmp + B * hd, *act = gu + B * 2 * I;
    float *scores = act + B * I;
    int rc = 0;
    for (long l = 0; l < num_layers && rc == 0; l++) {
        const Layer *ly = &layers[l];
        char *lpool = (char *)kv_at(pool, l * layer_floats, kv16);
        for (long b = 0; b < B; b++) rms_norm(h + b * hd, ly->norm1, x + b * hd, hd, dm->eps);
        if ((rc = layer_product(dm, ly->qkv_q, ly->qkv_d, ly->qkv_m, x, qkv, B, qkv_n, hd, threads))) break;
        for (long b = 0; b < B; b++) {
            float *row = qkv + b * qkv_n;
            const float *c = cos + b * D, *s = sin + b * D;
            for (long hh = 0; hh < H + Hkv; hh++) { /* q and k rotated: x * cos + roll(x, half) * sin */
                float *v = row + hh * D, r[512];
                for (long j = 0; j < half; j++) r[j] = v[j + half], r[j + half] = v[j];
                for (long j = 0; j < D; j++) v[j] = v[j] * c[j] + r[j] * s[j];
            }
            const long page = write_page[b] * page_floats;
            for (long kh = 0; kh < Hkv; kh++) {
                const long kdst = page + (kh * S + write_offset[b]) * D, vdst = page + ((Hkv + kh) * S + write_offset[b]) * D;
                const float *ksrc = row + (H + kh) * D, *vsrc = row + (H + Hkv + kh) * D;
                if (kv16) { /* rounded to nearest even, as torch converts */
                    uint16_t *k16 = (uint16_t *)lpool + kdst, *v16 = (uint16_t *)lpool + vdst;
                    for (long j = 0; j < D; j += 8) {
                        _mm_storeu_si128((__m128i *)(k16 + j), _mm256_cvtps_ph(_mm256_loadu_ps(ksrc + j), _MM_FROUND_TO_NEAREST_INT));
                        _mm_storeu_si128((__m128i *)(v16 + j), _mm256_cvtps_ph(_mm256_loadu_ps(vsrc + j), _MM_FROUND_TO_NEAREST_INT));
                    }
                } else {
                    float *k32 = (float *)lpool + kdst, *v32 = (float *)lpool + vdst;
                    for (long j = 0; j < D; j++) k32[j] = ksrc[j], v32[j] = vsrc[j];
                }
            }
        }
        const Attention attention = {dm, qkv, att, lpool, tables, lengths, B, scores, longest};
        run_job(attention_part, &attention, B * H >= 2 * threads ? threads : 1, B * H);
        if ((rc = layer_product(dm, ly->o_q, ly->o_d, ly->o_m, att, tmp, B, hd, H * D, threads))) break;
        for (long i = 0; i < B * hd; i++) h[i] += tmp[i];
        for (long b = 0; b < B; b++) rms_norm(h + b * hd, ly->norm2, x + b * hd, hd, dm->eps);
        if ((rc = layer_product(dm, ly->gu_q, ly->gu_d, ly->gu_m, x, gu, B, 2 * I, hd, threads))) break;
        for (long b = 0; b < B; b++) silu_mul(gu + b * 2 * I, gu + b * 2 * I + I, act + b * I, I);
        if ((rc = layer_product(dm, ly->down_q, ly->down_d, ly->down_m, act, tmp, B, hd, I, threads))) break;
        for (long i = 0; i < B * hd; i++) h[i] += tmp[i];
    }
    if (rc == 0 && final_norm != NULL) /* the model's norm after the last layer, in place */
        for (long b = 0; b < B; b++) rms_norm(h + b * hd, final_norm, h + b * hd, hd, dm->eps);
    free(x);
    return rc;
}
