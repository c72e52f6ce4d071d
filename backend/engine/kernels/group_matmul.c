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
#include "group_matmul.h"

/* The dispatch table (group_matmul.h): each kernel number's version of each product. */
const Kernels KERNELS[3] = {
    [1] = {tiles_part_avx2, rows256_f32, rows256_f16},
    [2] = {tiles_part, rows512_f32, rows512_f16},
};

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

typedef struct { /* one product: what each part needs */
    int bits, kernel;
    const void *q;
    const uint16_t *d, *m;
    const Quantized *qx;
    float *y;
    long M, N, K;
} Product;

/* units [u0, u1) of the product: its tiles */
static void product_part(const void *ctx, long u0, long u1, long thread) {
    (void)thread;
    const Product *jb = ctx;
    KERNELS[jb->kernel].tiles(jb->bits, jb->q, jb->d, jb->m, jb->qx, jb->y, jb->M, jb->N, jb->K, u0, u1);
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
