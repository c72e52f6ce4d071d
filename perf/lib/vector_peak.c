/* vector_peak: the most multiply-adds per second one core does with each instruction the group
 * kernel's products are made of (backend/engine/kernels/group_matmul.c), in a loop of 12
 * independent sums (more than each instruction's latency times its throughput), nothing else in
 * it (the sums in registers: the loops unrolled); and how fast a core reads memory (read_pass).
 * Built and run by perf/lib/vector_peak.py; what bench group-kernels compares its products to.
 * Each PEAK function runs `iters` rounds and returns the seconds they took; a round is 12 instructions. */
#include <immintrin.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define PEAK(NAME, TARGET, TYPE, INIT, STEP, REDUCE)                       \
    __attribute__((target(TARGET))) double NAME(long iters, long *sink) {  \
        TYPE a[12], w = INIT, x = INIT;                                    \
        _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) { /* opaque: not one sum 12 times */ \
            a[i] = INIT;                                                   \
            __asm__ volatile("" : "+x"(a[i]));                             \
        }                                                                  \
        const double t = now();                                            \
        for (long k = 0; k < iters; k++) {                                 \
            _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = STEP; \
            __asm__ volatile("" : "+x"(w)); /* a new w each round: no folding */ \
        }                                                                  \
        const double took = now() - t;                                     \
        long s = 0;                                                        \
        for (int i = 0; i < 12; i++) s += REDUCE;                          \
        *sink = s;                                                         \
        return took;                                                       \
    }

/* AVX-512 VNNI: 16 lanes x 2 int16 products (vpdpwssd) */
PEAK(vpdpwssd_zmm, "avx512f,avx512bw,avx512vnni", __m512i, _mm512_set1_epi16(3), _mm512_dpwssd_epi32(a[i], w, x),
     _mm_cvtsi128_si32(_mm512_castsi512_si128(a[i])))
/* AVX2: 8 lanes x 2 int16 products (vpmaddwd) summed into int32 (vpaddd) */
PEAK(vpmaddwd_ymm, "avx2", __m256i, _mm256_set1_epi16(3), _mm256_add_epi32(a[i], _mm256_madd_epi16(w, x)),
     _mm_cvtsi128_si32(_mm256_castsi256_si128(a[i])))

/* the seconds one read of `bytes` (a multiple of 256) from p takes: 256 bytes a round in four 64-byte
 * loads (AVX2: every x86-64 CPU the kernels run on), folded into sums the caller gets in *sink */
__attribute__((target("avx2"))) double read_pass(const char *p, long bytes, long *sink) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    const double t = now();
    for (long o = 0; o < bytes; o += 256) {
        a = _mm256_xor_si256(a, _mm256_load_si256((const __m256i *)(p + o)));
        b = _mm256_xor_si256(b, _mm256_load_si256((const __m256i *)(p + o + 64)));
        c = _mm256_xor_si256(c, _mm256_load_si256((const __m256i *)(p + o + 128)));
        d = _mm256_xor_si256(d, _mm256_load_si256((const __m256i *)(p + o + 192)));
    }
    const double took = now() - t;
    *sink = _mm_cvtsi128_si32(_mm256_castsi256_si128(_mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d))));
    return took;
}
