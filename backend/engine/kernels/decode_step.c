/* decode_step.c: a whole decode step of a Llama-family model in one call (decode_layers). */
#include "group_matmul.h"

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
