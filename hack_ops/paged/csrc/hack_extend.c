/* HACK extend (prefill) attention on the CPU, tiled: a block of query rows x one page at a time.
 *
 * Semantics: those of hack_ops.attention mode 'hack' (decode-time visibility): the query at
 * position t reads pages p < nc(t) = (t+1)/P from their 2-bit/4-bit codes, the rest of its
 * keys (its open partition, up to t) in FP16 from a window of FP16 tokens, and the first S
 * tokens (sinks) in FP16. 'exact' extend is the same with nc = prefix/P for every query.
 * The last query of a page therefore reads its own page quantized.
 *
 * Work item: (request, KV head, block of query positions inside one page). Its rows are
 * (position, GQA query head) pairs, 16 per "lane group" (one AVX-512 register of rows). For
 * each page p of the item, codes are unpacked once (K: bytes per token, 4 channels per dword;
 * V: 4 tokens per channel per dword) and every lane group runs:
 *   Q' = Q * s_K(p) quantized to INT8 per (row, head_dim group) (min/max, unsigned codes),
 *   S  = sum_g sq*(Qq.Kq) + mq*sum(Kq) + Q.m_K          (vpdpbusd: Q codes u8 x K codes)
 *   online softmax (running max and sum per row),
 *   P' = P * s_V(token) quantized to INT8 per (row, page, group) with a zero minimum,
 *   O  = O*alpha + sum_g sp*(Pq.Vq) + sum_j P_j m_V(j)   (vpdpbusd: P codes u8 x V codes)
 * with FP16 keys/values (fp32 arithmetic) where a row's visibility says so. Rows sit in the
 * lanes of a register, so every quantity that is per row (Q/P quantization ranges, softmax
 * state) is a plain vertical vector operation: no horizontal reductions in the inner loops.
 *
 * Sliding window (window >= 0): the query at t sees keys t-window..t. An item starts its page
 * loop at the page holding key t0-window of its first position t0, so pages wholly before every
 * row's window are never read (nor the sinks, once page 0 is out); on the pages it reads, a
 * lane group skips a page none of its rows can see, and keys before a row's window get a zero
 * numerator, whatever kind they are (2-bit, FP16 open partition, FP16 sink), as in the
 * reference. logit_cap > 0 soft-caps the scaled scores (cap * tanh(s / cap)) before the online
 * softmax; tanh is computed from the kernel's exp, (1 - e^-2|x|) / (1 + e^-2|x|) with x's sign,
 * in both builds.
 *
 * Differences to the reference: summation order (so a Q'/P' value sitting on a rounding
 * boundary can flip one INT8 code); the P' range is taken against the running softmax max
 * (min/max INT8 quantization is scale invariant, up to float rounding). Codes are computed as
 * the reference does, (x - min) / s: a reciprocal multiply was tried and flipped Q' codes often
 * enough to move rows past the tolerance. Tests state the resulting tolerances.
 *
 * Builds: AVX-512 VNNI (HACK_SIMD, above); AVX2 without it (HACK_AVX2: the same tiles, 8 lanes a
 * register, the INT8 dot products as vpmaddubsw + vpmaddwd, every float step the plain-C build's
 * in the same order, so both give the same bits); plain C (lanes innermost, vectorized by the
 * compiler where it can).
 *
 * AMX-INT8 is not built: the machine this was written and tested on has no AMX, and a path
 * that cannot be run is not shipped.
 */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "hack_kernel.h"

#define LN 16 /* query rows per lane group */
#define NO_WINDOW ((int64_t)1 << 48) /* a window no position reaches past: t - it < 0 */

/* The instruction set of the INT8 dot products: 2 AVX-512 VNNI, 1 AVX2, 0 plain C. */
int hack_extend_isa(void) { return HACK_SIMD ? 2 : (HACK_AVX2 ? 1 : 0); }

/* The first page a query at position >= t0 can see: the one holding key t0-window (0 without
 * a window). Pages before it are not read. */
static inline int64_t window_first_page(const hack_extend_args *a, int64_t t0) {
    return a->window >= 0 && t0 - a->window > 0 ? (t0 - a->window) / a->page_size : 0;
}

typedef struct {
    int64_t b, h, t0, t1, cost;
} xitem_t;

typedef struct {
    float *qt;        /* [ngr][D][LN] the item's queries (scaled), transposed */
    float *m, *l;     /* [ngr][LN] running max and sum */
    float *o;         /* [ngr][D][LN] running output */
    int64_t *t, *nc;  /* [ngr*LN] position and closed pages of each row */
    int64_t *orow;    /* [ngr*LN] row of q/out (padding lanes repeat the last row) */
    float *s;         /* [P][LN] scores, then numerators */
    float *pz, *pf;   /* [P][LN] numerators for the quantized and the FP16 P.V */
    uint8_t *qq;      /* [D/4][LN][4] Q codes */
    float *qf;        /* [D][LN] Q codes as floats (plain-C build, instead of qq: lanes innermost) */
    float *pf8;       /* [ng][P][LN] P codes as floats (plain-C build, instead of pq) */
    float *sq, *mq;   /* [ng][LN] */
    float *qm;        /* [LN] Q . m_K */
    uint8_t *pq;      /* [ng][P/4][LN][4] P codes */
    float *sp, *mt;   /* [ng][LN] */
    uint8_t *kb;      /* [P][D] K codes, one byte each */
    uint8_t *vb;      /* [P][D] V codes, one byte each */
    uint8_t *vq;      /* [P/4][D][4] V codes, 4 tokens per channel */
    float *ks;        /* [P][ng] K code sums */
    float *sk, *mk;   /* [D] K scale and minimum of the page */
    float *sv, *mv;   /* [P][ng] V scale and minimum per token */
    float *kf, *vf;   /* [P][D] FP16 keys / values as floats */
    float *snk, *snv; /* [S][D] sink keys / values as floats */
} xscratch_t;

/* ---- small helpers ------------------------------------------------------------------------ */

#if HACK_SIMD
static inline __m512 xexp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))), _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

#if HACK_AVX2
/* acc (8 dwords) += the dot product of each dword's 4 unsigned bytes of u with s's 4 signed
 * bytes: vpmaddubsw pairs (no saturation here: u <= 255, s <= 15, a pair <= 7,650), vpmaddwd
 * with ones sums the pairs. Exact, as vpdpbusd. */
static inline __m256i dot4_acc(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* hack_exp_neg on 8 lanes: the same operations in the same order (no FMA), so the same
 * numerators as the plain-C build */
static inline __m256 xexp_neg8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))), _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* x rounded to the nearest integer, ties to even (nearbyintf's rounding): a code before its clamp */
static inline __m256 round_codes(__m256 x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* s > 0 ? s : 1 (a range of zero quantizes with scale 1, as the reference) */
static inline __m256 nonzero_scale(__m256 s) {
    return _mm256_blendv_ps(_mm256_set1_ps(1.0f), s, _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ));
}
#endif

/* s[i] = cap * tanh(s[i] / cap) for n scores: tanh through exp(-2|x|) <= 1, so the kernel's
 * exp for non-positive arguments serves (tanh(x) = sign(x) (1 - e) / (1 + e)). */
static void soft_cap(float *s, int64_t n, float cap) {
    int64_t i = 0;
#if HACK_SIMD
    const __m512 c = _mm512_set1_ps(cap), one = _mm512_set1_ps(1.0f), m2 = _mm512_set1_ps(-2.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_div_ps(_mm512_loadu_ps(s + i), c);
        const __m512 e = xexp_neg16(_mm512_mul_ps(m2, _mm512_abs_ps(x)));
        __m512 t = _mm512_mul_ps(c, _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e)));
        t = _mm512_mask_sub_ps(t, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), t);
        _mm512_storeu_ps(s + i, t);
    }
#endif
    for (; i < n; i++) {
        const float x = s[i] / cap, e = hack_exp_neg(-2.0f * fabsf(x)), t = cap * ((1.0f - e) / (1.0f + e));
        s[i] = x < 0.0f ? -t : t;
    }
}

/* n side values (fp16 or fp32) starting at element idx -> float. */
static void xload_meta(const uint8_t *base, int64_t idx, int n, int fp32, float *out) {
    if (fp32) {
        memcpy(out, base + 4 * idx, 4 * (size_t)n);
        return;
    }
    const uint16_t *hp = (const uint16_t *)(base + 2 * idx);
    for (int i = 0; i < n; i++) out[i] = h2f(hp[i]);
}

static void load_fp16(const uint16_t *src, int n, int64_t stride, int d, float *dst) {
    for (int j = 0; j < n; j++)
        for (int c = 0; c < d; c++) dst[j * d + c] = h2f(src[j * stride + c]);
}

/* One token's packed codes -> one byte per channel (channel order kept). */
static void unpack_codes(const uint8_t *row, int d, int bits, uint8_t *out) {
    int c = 0;
#if HACK_SIMD
    if (bits == 2)
        for (; c + 64 <= d; c += 64) { /* byte i -> dword i: its 4 codes, one per byte */
            __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c / 4)));
            x = _mm512_or_si512(_mm512_or_si512(x, _mm512_slli_epi32(x, 6)), _mm512_or_si512(_mm512_slli_epi32(x, 12), _mm512_slli_epi32(x, 18)));
            _mm512_storeu_si512(out + c, _mm512_and_si512(x, _mm512_set1_epi32(0x03030303)));
        }
    else if (bits == 4)
        for (; c + 32 <= d; c += 32) { /* byte i -> word i: its 2 codes, one per byte */
            __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + c / 2)));
            x = _mm256_and_si256(_mm256_or_si256(x, _mm256_slli_epi16(x, 4)), _mm256_set1_epi16(0x0F0F));
            _mm256_storeu_si256((__m256i *)(out + c), x);
        }
#endif
    /* the rest (all of it in the plain-C build): one packed byte -> its codes in one word */
    if (bits == 2)
        for (; c + 4 <= d; c += 4) {
            uint32_t x = row[c / 4];
            x = (x | (x << 6) | (x << 12) | (x << 18)) & 0x03030303u;
            memcpy(out + c, &x, 4);
        }
    else if (bits == 4)
        for (; c + 2 <= d; c += 2) {
            uint16_t x = row[c / 2];
            x = (uint16_t)((x | (x << 4)) & 0x0F0Fu);
            memcpy(out + c, &x, 2);
        }
    const int per = 8 / bits, mask = (1 << bits) - 1;
    for (; c < d; c++) out[c] = (row[c / per] >> (bits * (c % per))) & mask;
}

/* vb [P][D] bytes (rows >= nt zero) -> vq [P/4][D][4]: 4 consecutive tokens of a channel. */
static void interleave4(const uint8_t *vb, int P, int d, uint8_t *vq) {
    for (int j4 = 0; j4 < P / 4; j4++) {
        const uint8_t *r0 = vb + (4 * j4) * d;
        uint8_t *dst = vq + (int64_t)j4 * d * 4;
        int c = 0;
#if HACK_SIMD || HACK_AVX2
        for (; c + 16 <= d; c += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(r0 + c)), b = _mm_loadu_si128((const __m128i *)(r0 + d + c));
            __m128i e = _mm_loadu_si128((const __m128i *)(r0 + 2 * d + c)), f = _mm_loadu_si128((const __m128i *)(r0 + 3 * d + c));
            __m128i ab0 = _mm_unpacklo_epi8(a, b), ab1 = _mm_unpackhi_epi8(a, b);
            __m128i ef0 = _mm_unpacklo_epi8(e, f), ef1 = _mm_unpackhi_epi8(e, f);
            _mm_storeu_si128((__m128i *)(dst + 4 * c), _mm_unpacklo_epi16(ab0, ef0));
            _mm_storeu_si128((__m128i *)(dst + 4 * c + 16), _mm_unpackhi_epi16(ab0, ef0));
            _mm_storeu_si128((__m128i *)(dst + 4 * c + 32), _mm_unpacklo_epi16(ab1, ef1));
            _mm_storeu_si128((__m128i *)(dst + 4 * c + 48), _mm_unpackhi_epi16(ab1, ef1));
        }
#endif
        for (; c < d; c++)
            for (int k = 0; k < 4; k++) dst[4 * c + k] = r0[k * d + c];
    }
}

/* ---- per page: the codes and side tables of K and V, once per item -------------------- */

static void load_k_page(const hack_extend_args *a, int64_t h, int64_t page_id, xscratch_t *w) {
    const int d = (int)a->head_dim, P = (int)a->page_size, bits = (int)a->k_bits, ng = d / (int)a->group;
    const int row = d * bits / 8;
    const uint8_t *page = a->k_pages + page_id * a->k_page_bytes;
    const uint8_t *codes = page + a->k_codes_off + h * P * row;
    for (int j = 0; j < P; j++) unpack_codes(codes + j * row, d, bits, w->kb + j * d);
    xload_meta(page + a->k_scale_off, h * d, d, (int)a->meta_fp32, w->sk);
    xload_meta(page + a->k_min_off, h * d, d, (int)a->meta_fp32, w->mk);
    const uint8_t *sums = page + a->k_sums_off + (h * P * ng) * a->k_sums_bytes;
    for (int i = 0; i < P * ng; i++)
        w->ks[i] = a->k_sums_bytes == 1 ? (float)sums[i] : (float)((const int16_t *)sums)[i];
}

static void load_v_page(const hack_extend_args *a, int64_t h, int64_t page_id, int nt, xscratch_t *w) {
    const int d = (int)a->head_dim, P = (int)a->page_size, bits = (int)a->v_bits, ng = d / (int)a->group;
    const int row = d * bits / 8;
    const uint8_t *page = a->v_pages + page_id * a->v_page_bytes;
    const uint8_t *codes = page + a->v_codes_off + h * P * row;
    for (int j = 0; j < nt; j++) unpack_codes(codes + j * row, d, bits, w->vb + j * d);
    memset(w->vb + nt * d, 0, (size_t)(P - nt) * d); /* slots not written yet: code 0, P 0 */
    interleave4(w->vb, P, d, w->vq);
    xload_meta(page + a->v_scale_off, h * P * ng, nt * ng, (int)a->meta_fp32, w->sv);
    xload_meta(page + a->v_min_off, h * P * ng, nt * ng, (int)a->meta_fp32, w->mv);
    for (int i = nt * ng; i < P * ng; i++) w->sv[i] = w->mv[i] = 0.0f;
}

/* PrefillMode.INT8: page p of request b (p >= prefix/P) from the chunk's finer codes, laid out
 * as load_k_page / load_v_page leave the pool's. */
static void load_k_chunk(const hack_extend_args *a, int64_t b, int64_t h, int64_t p, xscratch_t *w) {
    const int64_t d = a->head_dim, P = a->page_size, ng = d / a->group, H = a->heads;
    const int64_t idx = (a->chunk_page0[b] + p - a->prefix_lens[b] / P) * H + h;
    memcpy(w->kb, a->ck_codes + idx * P * d, (size_t)(P * d));
    memcpy(w->sk, a->ck_scale + idx * d, sizeof(float) * (size_t)d);
    memcpy(w->mk, a->ck_min + idx * d, sizeof(float) * (size_t)d);
    memcpy(w->ks, a->ck_sums + idx * P * ng, sizeof(float) * (size_t)(P * ng));
}

static void load_v_chunk(const hack_extend_args *a, int64_t b, int64_t h, int64_t p, int nt, xscratch_t *w) {
    const int64_t d = a->head_dim, P = a->page_size, ng = d / a->group, H = a->heads;
    const int64_t idx = (a->chunk_page0[b] + p - a->prefix_lens[b] / P) * H + h;
    memcpy(w->vb, a->cv_codes + idx * P * d, (size_t)(nt * d));
    memset(w->vb + nt * d, 0, (size_t)((P - nt) * d));
    interleave4(w->vb, (int)P, (int)d, w->vq);
    memcpy(w->sv, a->cv_scale + idx * P * ng, sizeof(float) * (size_t)(nt * ng));
    memcpy(w->mv, a->cv_min + idx * P * ng, sizeof(float) * (size_t)(nt * ng));
    for (int64_t i = nt * ng; i < P * ng; i++) w->sv[i] = w->mv[i] = 0.0f;
}

/* ---- per lane group ------------------------------------------------------------------- */

/* Q' = Q * s_K quantized per (row, group): codes into w->qq (quad layout), sq, mq, qm. */
static void quantize_q(const hack_extend_args *a, const float *qt, xscratch_t *w) {
    const int d = (int)a->head_dim, gd = (int)a->group, ng = d / gd;
#if HACK_SIMD
    __m512 qm = _mm512_setzero_ps();
    for (int c = 0; c < d; c++) qm = _mm512_add_ps(qm, _mm512_mul_ps(_mm512_loadu_ps(qt + c * LN), _mm512_set1_ps(w->mk[c])));
    _mm512_storeu_ps(w->qm, qm);
    for (int g = 0; g < ng; g++) {
        __m512 mn = _mm512_set1_ps(INFINITY), mx = _mm512_set1_ps(-INFINITY);
        for (int c = g * gd; c < (g + 1) * gd; c++) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qt + c * LN), _mm512_set1_ps(w->sk[c]));
            mn = _mm512_min_ps(mn, x);
            mx = _mm512_max_ps(mx, x);
        }
        __m512 s = _mm512_div_ps(_mm512_sub_ps(mx, mn), _mm512_set1_ps(255.0f));
        s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.0f), s);
        const __m512 top = _mm512_set1_ps(255.0f);
        _mm512_storeu_ps(w->sq + g * LN, s);
        _mm512_storeu_ps(w->mq + g * LN, mn);
        for (int c4 = g * gd / 4; c4 < (g + 1) * gd / 4; c4++) {
            __m512i quad = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                const int c = 4 * c4 + k;
                __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qt + c * LN), _mm512_set1_ps(w->sk[c]));
                __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(x, mn), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), top);
                quad = _mm512_or_si512(quad, _mm512_slli_epi32(_mm512_cvtps_epi32(v), 8 * k));
            }
            _mm512_storeu_si512(w->qq + c4 * LN * 4, quad);
        }
    }
#elif HACK_AVX2
    /* the plain-C arithmetic below, 8 lanes a register (same operations, same order: the same
     * codes), into the quad layout the INT8 dot products read */
    for (int h = 0; h < 2; h++) {
        const float *qh = qt + 8 * h;
        __m256 qm = _mm256_setzero_ps();
        for (int c = 0; c < d; c++) qm = _mm256_add_ps(qm, _mm256_mul_ps(_mm256_loadu_ps(qh + c * LN), _mm256_set1_ps(w->mk[c])));
        _mm256_storeu_ps(w->qm + 8 * h, qm);
        for (int g = 0; g < ng; g++) {
            __m256 mn = _mm256_set1_ps(INFINITY), mx = _mm256_set1_ps(-INFINITY);
            for (int c = g * gd; c < (g + 1) * gd; c++) {
                const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(qh + c * LN), _mm256_set1_ps(w->sk[c]));
                mn = _mm256_min_ps(mn, x);
                mx = _mm256_max_ps(mx, x);
            }
            const __m256 s = nonzero_scale(_mm256_div_ps(_mm256_sub_ps(mx, mn), _mm256_set1_ps(255.0f)));
            _mm256_storeu_ps(w->sq + g * LN + 8 * h, s);
            _mm256_storeu_ps(w->mq + g * LN + 8 * h, mn);
            for (int c4 = g * gd / 4; c4 < (g + 1) * gd / 4; c4++) {
                __m256i quad = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) {
                    const int c = 4 * c4 + k;
                    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(qh + c * LN), _mm256_set1_ps(w->sk[c]));
                    __m256 v = round_codes(_mm256_div_ps(_mm256_sub_ps(x, mn), s));
                    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), _mm256_set1_ps(255.0f));
                    quad = _mm256_or_si256(quad, _mm256_slli_epi32(_mm256_cvtps_epi32(v), 8 * k));
                }
                _mm256_storeu_si256((__m256i *)(w->qq + c4 * LN * 4 + 32 * h), quad);
            }
        }
    }
#else
    /* lanes innermost (contiguous in qt), so the compiler vectorizes over the 16 rows; the
     * arithmetic per element is the SIMD build's, so the codes are the same */
    float acc[LN] = {0}, mn[LN], mx[LN], sl[LN];
    for (int c = 0; c < d; c++)
        for (int l = 0; l < LN; l++) acc[l] += qt[c * LN + l] * w->mk[c];
    memcpy(w->qm, acc, sizeof(acc));
    for (int g = 0; g < ng; g++) {
        for (int l = 0; l < LN; l++) mn[l] = INFINITY, mx[l] = -INFINITY;
        for (int c = g * gd; c < (g + 1) * gd; c++)
            for (int l = 0; l < LN; l++) {
                const float x = qt[c * LN + l] * w->sk[c];
                mn[l] = x < mn[l] ? x : mn[l];
                mx[l] = x > mx[l] ? x : mx[l];
            }
        for (int l = 0; l < LN; l++) {
            const float sc = (mx[l] - mn[l]) / 255.0f;
            sl[l] = sc > 0.0f ? sc : 1.0f;
            w->sq[g * LN + l] = sl[l];
            w->mq[g * LN + l] = mn[l];
        }
        for (int c = g * gd; c < (g + 1) * gd; c++) {
            float *qf = w->qf + c * LN;
            for (int l = 0; l < LN; l++) {
                float v = nearbyintf((qt[c * LN + l] * w->sk[c] - mn[l]) / sl[l]);
                qf[l] = v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v);
            }
        }
    }
#endif
}

/* s[j][lane] = scores of the page's P tokens from the K codes. */
static void scores_quant(const hack_extend_args *a, xscratch_t *w) {
    const int d = (int)a->head_dim, gd = (int)a->group, ng = d / gd, P = (int)a->page_size, dq = d / 4;
#if HACK_SIMD
    const int32_t *kq = (const int32_t *)w->kb; /* [P][D/4] quads */
    for (int j0 = 0; j0 < P; j0 += 16) {
        for (int t = 0; t < 16; t++) _mm512_storeu_ps(w->s + (j0 + t) * LN, _mm512_loadu_ps(w->qm));
        for (int g = 0; g < ng; g++) {
            __m512i acc[16];
            for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_si512();
            for (int c4 = g * gd / 4; c4 < (g + 1) * gd / 4; c4++) {
                const __m512i qv = _mm512_loadu_si512(w->qq + c4 * LN * 4);
                const int32_t *kc = kq + j0 * dq + c4;
                for (int t = 0; t < 16; t++) acc[t] = _mm512_dpbusd_epi32(acc[t], qv, _mm512_set1_epi32(kc[t * dq]));
            }
            const __m512 sq = _mm512_loadu_ps(w->sq + g * LN), mq = _mm512_loadu_ps(w->mq + g * LN);
            for (int t = 0; t < 16; t++) {
                float *st = w->s + (j0 + t) * LN;
                __m512 v = _mm512_add_ps(_mm512_mul_ps(sq, _mm512_cvtepi32_ps(acc[t])), _mm512_mul_ps(mq, _mm512_set1_ps(w->ks[(j0 + t) * ng + g])));
                _mm512_storeu_ps(st, _mm512_add_ps(_mm512_loadu_ps(st), v));
            }
        }
    }
#elif HACK_AVX2
    /* 4 tokens x 16 rows (two registers) at a time; the float epilogue is the plain-C one (the
     * running scores stay in w->s: held in registers across groups they pushed the integer
     * accumulators out to the stack) */
    const int32_t *kq = (const int32_t *)w->kb; /* [P][D/4] quads */
    for (int j0 = 0; j0 < P; j0 += 4) {
        for (int t = 0; t < 4; t++) memcpy(w->s + (j0 + t) * LN, w->qm, sizeof(float) * LN);
        for (int g = 0; g < ng; g++) {
            __m256i acc[4][2];
            for (int t = 0; t < 4; t++) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
            for (int c4 = g * gd / 4; c4 < (g + 1) * gd / 4; c4++) {
                const __m256i q0 = _mm256_loadu_si256((const __m256i *)(w->qq + c4 * LN * 4));
                const __m256i q1 = _mm256_loadu_si256((const __m256i *)(w->qq + c4 * LN * 4 + 32));
                const int32_t *kc = kq + j0 * dq + c4;
                for (int t = 0; t < 4; t++) {
                    const __m256i kv = _mm256_set1_epi32(kc[t * dq]);
                    acc[t][0] = dot4_acc(acc[t][0], q0, kv);
                    acc[t][1] = dot4_acc(acc[t][1], q1, kv);
                }
            }
            for (int h = 0; h < 2; h++) {
                const __m256 sq = _mm256_loadu_ps(w->sq + g * LN + 8 * h), mq = _mm256_loadu_ps(w->mq + g * LN + 8 * h);
                for (int t = 0; t < 4; t++) {
                    float *st = w->s + (j0 + t) * LN + 8 * h;
                    const __m256 v = _mm256_add_ps(_mm256_mul_ps(sq, _mm256_cvtepi32_ps(acc[t][h])),
                                                   _mm256_mul_ps(mq, _mm256_set1_ps(w->ks[(j0 + t) * ng + g])));
                    _mm256_storeu_ps(st, _mm256_add_ps(_mm256_loadu_ps(st), v));
                }
            }
        }
    }
#else
    /* integer dot products in float: codes are small integers (Q < 256, K < 16, a group at most
     * 256 channels), so every partial sum is an integer below 2^24 and exact, as in vpdpbusd */
    for (int j = 0; j < P; j++) {
        const uint8_t *kc = w->kb + j * d;
        float acc[LN];
        memcpy(acc, w->qm, sizeof(acc));
        for (int g = 0; g < ng; g++) {
            float dot[LN] = {0};
            for (int c = g * gd; c < (g + 1) * gd; c++) {
                const float kv = (float)kc[c], *qc = w->qf + c * LN;
                for (int l = 0; l < LN; l++) dot[l] += qc[l] * kv;
            }
            const float ksum = w->ks[j * ng + g];
            for (int l = 0; l < LN; l++) acc[l] += w->sq[g * LN + l] * dot[l] + w->mq[g * LN + l] * ksum;
        }
        memcpy(w->s + j * LN, acc, sizeof(acc));
    }
#endif
}

/* dst[j][lane] = q . x_j for n FP16 keys already converted to floats (x [n][D]). */
static void scores_fp(const float *qt, const float *x, int n, int d, float *dst) {
    int j = 0;
#if HACK_SIMD
    for (; j + 8 <= n; j += 8) { /* 8 independent chains: FMA latency, not throughput, binds one */
        __m512 acc[8];
        for (int t = 0; t < 8; t++) acc[t] = _mm512_setzero_ps();
        for (int c = 0; c < d; c++) {
            const __m512 qv = _mm512_loadu_ps(qt + c * LN);
            for (int t = 0; t < 8; t++) acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(qv, _mm512_set1_ps(x[(j + t) * d + c])));
        }
        for (int t = 0; t < 8; t++) _mm512_storeu_ps(dst + (j + t) * LN, acc[t]);
    }
#elif HACK_AVX2
    for (; j + 4 <= n; j += 4) { /* the loop below, 4 keys x 16 rows in registers */
        __m256 acc[4][2];
        for (int t = 0; t < 4; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int c = 0; c < d; c++) {
            const __m256 q0 = _mm256_loadu_ps(qt + c * LN), q1 = _mm256_loadu_ps(qt + c * LN + 8);
            for (int t = 0; t < 4; t++) {
                const __m256 xv = _mm256_set1_ps(x[(j + t) * d + c]);
                acc[t][0] = _mm256_add_ps(acc[t][0], _mm256_mul_ps(q0, xv));
                acc[t][1] = _mm256_add_ps(acc[t][1], _mm256_mul_ps(q1, xv));
            }
        }
        for (int t = 0; t < 4; t++) {
            _mm256_storeu_ps(dst + (j + t) * LN, acc[t][0]);
            _mm256_storeu_ps(dst + (j + t) * LN + 8, acc[t][1]);
        }
    }
#endif
    for (; j < n; j++) {
        float acc[LN] = {0};
        for (int c = 0; c < d; c++) {
            const float xv = x[j * d + c];
            for (int l = 0; l < LN; l++) acc[l] += qt[c * LN + l] * xv;
        }
        memcpy(dst + j * LN, acc, sizeof(acc));
    }
}

/* P' = pz * s_V quantized per (row, group) with a zero minimum; mt = sum_j pz_j m_V(j). */
static void quantize_p(const hack_extend_args *a, int nt, xscratch_t *w) {
    const int d = (int)a->head_dim, gd = (int)a->group, ng = d / gd, P = (int)a->page_size;
    const int nt4 = (nt + 3) & ~3;
    for (int g = 0; g < ng; g++) {
        uint8_t *pq = w->pq + (int64_t)g * (P / 4) * LN * 4;
#if HACK_SIMD
        __m512 mx = _mm512_setzero_ps(), mt = _mm512_setzero_ps();
        for (int j = 0; j < nt; j++) {
            const __m512 p = _mm512_loadu_ps(w->pz + j * LN);
            mx = _mm512_max_ps(mx, _mm512_mul_ps(p, _mm512_set1_ps(w->sv[j * ng + g])));
            mt = _mm512_fmadd_ps(p, _mm512_set1_ps(w->mv[j * ng + g]), mt);
        }
        __m512 s = _mm512_div_ps(mx, _mm512_set1_ps(255.0f));
        s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.0f), s);
        const __m512 top = _mm512_set1_ps(255.0f);
        _mm512_storeu_ps(w->sp + g * LN, s);
        _mm512_storeu_ps(w->mt + g * LN, mt);
        for (int j4 = 0; j4 < nt4 / 4; j4++) {
            __m512i quad = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                const int j = 4 * j4 + k;
                if (j >= nt) break;
                __m512 v = _mm512_div_ps(_mm512_mul_ps(_mm512_loadu_ps(w->pz + j * LN), _mm512_set1_ps(w->sv[j * ng + g])), s);
                v = _mm512_min_ps(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), top);
                quad = _mm512_or_si512(quad, _mm512_slli_epi32(_mm512_cvtps_epi32(v), 8 * k));
            }
            _mm512_storeu_si512(pq + j4 * LN * 4, quad);
        }
#elif HACK_AVX2
        /* the plain-C arithmetic below, 8 lanes a register, into the quad layout */
        for (int h = 0; h < 2; h++) {
            __m256 mx = _mm256_setzero_ps(), mt = _mm256_setzero_ps();
            for (int j = 0; j < nt; j++) {
                const __m256 p = _mm256_loadu_ps(w->pz + j * LN + 8 * h);
                mx = _mm256_max_ps(mx, _mm256_mul_ps(p, _mm256_set1_ps(w->sv[j * ng + g])));
                mt = _mm256_add_ps(mt, _mm256_mul_ps(p, _mm256_set1_ps(w->mv[j * ng + g])));
            }
            const __m256 s = nonzero_scale(_mm256_div_ps(mx, _mm256_set1_ps(255.0f)));
            _mm256_storeu_ps(w->sp + g * LN + 8 * h, s);
            _mm256_storeu_ps(w->mt + g * LN + 8 * h, mt);
            for (int j4 = 0; j4 < nt4 / 4; j4++) {
                __m256i quad = _mm256_setzero_si256();
                for (int k = 0; k < 4 && 4 * j4 + k < nt; k++) {
                    const int j = 4 * j4 + k;
                    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(w->pz + j * LN + 8 * h), _mm256_set1_ps(w->sv[j * ng + g]));
                    v = _mm256_min_ps(round_codes(_mm256_div_ps(v, s)), _mm256_set1_ps(255.0f));
                    quad = _mm256_or_si256(quad, _mm256_slli_epi32(_mm256_cvtps_epi32(v), 8 * k));
                }
                _mm256_storeu_si256((__m256i *)(pq + j4 * LN * 4 + 32 * h), quad);
            }
        }
#else
        float mx[LN] = {0}, mt[LN] = {0}, sl[LN];
        for (int j = 0; j < nt; j++) {
            const float sv = w->sv[j * ng + g], mv = w->mv[j * ng + g];
            for (int l = 0; l < LN; l++) {
                const float p = w->pz[j * LN + l], x = p * sv;
                mx[l] = x > mx[l] ? x : mx[l];
                mt[l] += p * mv;
            }
        }
        for (int l = 0; l < LN; l++) {
            const float sc = mx[l] / 255.0f;
            sl[l] = sc > 0.0f ? sc : 1.0f;
            w->sp[g * LN + l] = sl[l];
            w->mt[g * LN + l] = mt[l];
        }
        float *pf8 = w->pf8 + (int64_t)g * P * LN; /* the byte codes (pq) serve the SIMD build only */
        (void)pq;
        for (int j = 0; j < nt4; j++) {
            const float sv = j < nt ? w->sv[j * ng + g] : 0.0f;
            for (int l = 0; l < LN; l++) {
                float v = j < nt ? nearbyintf(w->pz[j * LN + l] * sv / sl[l]) : 0.0f;
                pf8[j * LN + l] = v > 255.0f ? 255.0f : v;
            }
        }
#endif
    }
}

/* o[c][lane] += sum_g sp * (Pq . Vq) + mt over the page's first nt tokens. */
static void pv_quant(const hack_extend_args *a, int nt, xscratch_t *w, float *o) {
    const int d = (int)a->head_dim, gd = (int)a->group, P = (int)a->page_size;
    const int n4 = (nt + 3) / 4;
#if HACK_SIMD
    const int32_t *vq = (const int32_t *)w->vq; /* [P/4][D] quads */
    for (int c0 = 0; c0 < d; c0 += 16) {
        const int g = c0 / gd;
        const uint8_t *pq = w->pq + (int64_t)g * (P / 4) * LN * 4;
        __m512i acc[16];
        for (int cc = 0; cc < 16; cc++) acc[cc] = _mm512_setzero_si512();
        for (int j4 = 0; j4 < n4; j4++) {
            const __m512i pv = _mm512_loadu_si512(pq + j4 * LN * 4);
            const int32_t *vc = vq + j4 * d + c0;
            for (int cc = 0; cc < 16; cc++) acc[cc] = _mm512_dpbusd_epi32(acc[cc], pv, _mm512_set1_epi32(vc[cc]));
        }
        const __m512 sp = _mm512_loadu_ps(w->sp + g * LN), mt = _mm512_loadu_ps(w->mt + g * LN);
        for (int cc = 0; cc < 16; cc++) {
            float *oc = o + (c0 + cc) * LN;
            _mm512_storeu_ps(oc, _mm512_add_ps(_mm512_fmadd_ps(sp, _mm512_cvtepi32_ps(acc[cc]), _mm512_loadu_ps(oc)), mt));
        }
    }
#elif HACK_AVX2
    /* 4 channels x 16 rows at a time; the float epilogue is the plain-C one */
    const int32_t *vq = (const int32_t *)w->vq; /* [P/4][D] quads */
    for (int c0 = 0; c0 < d; c0 += 4) {
        const int g = c0 / gd; /* a group spans a multiple of 16 channels */
        const uint8_t *pq = w->pq + (int64_t)g * (P / 4) * LN * 4;
        __m256i acc[4][2];
        for (int cc = 0; cc < 4; cc++) acc[cc][0] = acc[cc][1] = _mm256_setzero_si256();
        for (int j4 = 0; j4 < n4; j4++) {
            const __m256i p0 = _mm256_loadu_si256((const __m256i *)(pq + j4 * LN * 4));
            const __m256i p1 = _mm256_loadu_si256((const __m256i *)(pq + j4 * LN * 4 + 32));
            const int32_t *vc = vq + j4 * d + c0;
            for (int cc = 0; cc < 4; cc++) {
                const __m256i vv = _mm256_set1_epi32(vc[cc]);
                acc[cc][0] = dot4_acc(acc[cc][0], p0, vv);
                acc[cc][1] = dot4_acc(acc[cc][1], p1, vv);
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 sp = _mm256_loadu_ps(w->sp + g * LN + 8 * h), mt = _mm256_loadu_ps(w->mt + g * LN + 8 * h);
            for (int cc = 0; cc < 4; cc++) {
                float *oc = o + (c0 + cc) * LN + 8 * h;
                const __m256 v = _mm256_add_ps(_mm256_mul_ps(sp, _mm256_cvtepi32_ps(acc[cc][h])), mt);
                _mm256_storeu_ps(oc, _mm256_add_ps(_mm256_loadu_ps(oc), v));
            }
        }
    }
#else
    /* exact integer sums in float, as in scores_quant; V codes from the unpacked page w->vb
     * (slots at or past nt hold code 0, their P codes are 0 too) */
    for (int c = 0; c < d; c++) {
        const int g = c / gd;
        const float *pf8 = w->pf8 + (int64_t)g * P * LN;
        float dot[LN] = {0};
        for (int j = 0; j < 4 * n4; j++) {
            const float vv = (float)w->vb[j * d + c], *pj = pf8 + j * LN;
            for (int l = 0; l < LN; l++) dot[l] += pj[l] * vv;
        }
        for (int l = 0; l < LN; l++) o[c * LN + l] += w->sp[g * LN + l] * dot[l] + w->mt[g * LN + l];
    }
    (void)P;
#endif
}

/* o[c][lane] += sum_j p[j][lane] * x[j][c] for n FP16 values already converted to floats. */
static void pv_fp(const float *p, const float *x, int n, int d, float *o) {
    int c = 0;
#if HACK_SIMD
    for (; c + 8 <= d; c += 8) { /* 8 channels' accumulators in registers, tokens streamed */
        __m512 acc[8];
        for (int k = 0; k < 8; k++) acc[k] = _mm512_loadu_ps(o + (c + k) * LN);
        for (int j = 0; j < n; j++) {
            const __m512 pj = _mm512_loadu_ps(p + j * LN);
            for (int k = 0; k < 8; k++) acc[k] = _mm512_fmadd_ps(pj, _mm512_set1_ps(x[j * d + c + k]), acc[k]);
        }
        for (int k = 0; k < 8; k++) _mm512_storeu_ps(o + (c + k) * LN, acc[k]);
    }
#elif HACK_AVX2
    for (; c + 4 <= d; c += 4) { /* the loop below, 4 channels x 16 rows in registers */
        __m256 acc[4][2];
        for (int k = 0; k < 4; k++) acc[k][0] = _mm256_loadu_ps(o + (c + k) * LN), acc[k][1] = _mm256_loadu_ps(o + (c + k) * LN + 8);
        for (int j = 0; j < n; j++) {
            const __m256 p0 = _mm256_loadu_ps(p + j * LN), p1 = _mm256_loadu_ps(p + j * LN + 8);
            for (int k = 0; k < 4; k++) {
                const __m256 xv = _mm256_set1_ps(x[j * d + c + k]);
                acc[k][0] = _mm256_add_ps(acc[k][0], _mm256_mul_ps(p0, xv));
                acc[k][1] = _mm256_add_ps(acc[k][1], _mm256_mul_ps(p1, xv));
            }
        }
        for (int k = 0; k < 4; k++) {
            _mm256_storeu_ps(o + (c + k) * LN, acc[k][0]);
            _mm256_storeu_ps(o + (c + k) * LN + 8, acc[k][1]);
        }
    }
#endif
    for (; c < d; c++) {
        float acc[LN];
        memcpy(acc, o + c * LN, sizeof(acc));
        for (int j = 0; j < n; j++) {
            const float xv = x[j * d + c];
            for (int l = 0; l < LN; l++) acc[l] += p[j * LN + l] * xv;
        }
        memcpy(o + c * LN, acc, sizeof(acc));
    }
}

/* One page for one lane group: scores, online softmax update, P.V. */
static void group_page(const hack_extend_args *a, xscratch_t *w, int gr, int64_t p, int nt_v,
                       int n_f, int n_sink) {
    const int d = (int)a->head_dim, P = (int)a->page_size;
    const int64_t *tl = w->t + gr * LN, *ncl = w->nc + gr * LN;
    const float *qt = w->qt + (int64_t)gr * d * LN;
    float *o = w->o + (int64_t)gr * d * LN, *m = w->m + gr * LN, *lsum = w->l + gr * LN;
    /* lanes are position-major, so lane 0 holds the group's earliest query: when even its
     * window starts after this page, no row sees the page */
    if (a->window >= 0 && (p + 1) * P - 1 < tl[0] - a->window) return;
    int quant[LN], any_q = 0, any_f = 0;
    for (int l = 0; l < LN; l++) {
        quant[l] = p < ncl[l];
        any_q |= quant[l];
        any_f |= !quant[l];
    }
    /* scores: codes for the rows that see the page closed, FP16 for the others */
    if (any_q) { /* the caller loaded the page's codes: p < nc of some row */
        quantize_q(a, qt, w);
        scores_quant(a, w);
    }
    if (any_f) {
        float *sf = w->pf; /* scratch: FP16 scores */
        scores_fp(qt, w->kf, n_f, d, sf);
        for (int j = 0; j < n_f; j++)
            for (int l = 0; l < LN; l++)
                if (!quant[l]) w->s[j * LN + l] = sf[j * LN + l];
    }
    if (n_sink) { /* sinks: FP16 keys from the sink store, for every row */
        float *sf = w->pf;
        scores_fp(qt, w->snk, n_sink, d, sf);
        memcpy(w->s, sf, sizeof(float) * n_sink * LN);
    }
    const int ns = any_q ? P : n_f; /* tokens with a score */
    if (a->logit_cap > 0.0) soft_cap(w->s, (int64_t)ns * LN, (float)a->logit_cap);
    /* visibility (causal, and inside the row's window) and online softmax */
    const int64_t win = a->window; /* < 0: no window, every key up to t */
    float alpha[LN];
#if HACK_SIMD
    {
        __mmask16 qmask = 0;
        for (int l = 0; l < LN; l++) qmask |= (__mmask16)(quant[l] << l);
        const __m512i t_lo = _mm512_loadu_si512(tl), t_hi = _mm512_loadu_si512(tl + 8);
        const __m512i w_lo = _mm512_sub_epi64(t_lo, _mm512_set1_epi64(win < 0 ? NO_WINDOW : win));
        const __m512i w_hi = _mm512_sub_epi64(t_hi, _mm512_set1_epi64(win < 0 ? NO_WINDOW : win));
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        __m512 mloc = ninf;
        for (int j = 0; j < ns; j++) {
            const __m512i pos = _mm512_set1_epi64(p * P + j);
            __mmask16 vis = (__mmask16)(_mm512_cmple_epi64_mask(pos, t_lo) | (_mm512_cmple_epi64_mask(pos, t_hi) << 8));
            vis &= (__mmask16)(_mm512_cmpge_epi64_mask(pos, w_lo) | (_mm512_cmpge_epi64_mask(pos, w_hi) << 8));
            if (j >= n_f) vis &= qmask;
            const __m512 x = _mm512_mask_mov_ps(ninf, vis, _mm512_loadu_ps(w->s + j * LN));
            _mm512_storeu_ps(w->s + j * LN, x);
            mloc = _mm512_max_ps(mloc, x);
        }
        const __m512 mold = _mm512_loadu_ps(m), mnew = _mm512_max_ps(mloc, mold);
        /* a row that has seen no key yet (window) keeps max -inf: alpha 1, not exp(NaN) */
        const __m512 al = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mnew, ninf, _CMP_EQ_OQ),
                                               xexp_neg16(_mm512_sub_ps(mold, mnew)), _mm512_set1_ps(1.0f));
        _mm512_storeu_ps(alpha, al);
        _mm512_storeu_ps(m, mnew);
        __m512 add = _mm512_setzero_ps();
        for (int j = 0; j < ns; j++) {
            float *sj = w->s + j * LN;
            const __m512 x = _mm512_loadu_ps(sj);
            const __mmask16 fin = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
            const __m512 e = _mm512_maskz_mov_ps(fin, xexp_neg16(_mm512_sub_ps(x, mnew)));
            _mm512_storeu_ps(sj, e);
            add = _mm512_add_ps(add, e);
        }
        _mm512_storeu_ps(lsum, _mm512_fmadd_ps(_mm512_loadu_ps(lsum), al, add));
        for (int c = 0; c < d; c++) _mm512_storeu_ps(o + c * LN, _mm512_mul_ps(_mm512_loadu_ps(o + c * LN), al));
    }
#else
    {
        float mloc[LN], add[LN];
        for (int l = 0; l < LN; l++) mloc[l] = -INFINITY;
        for (int j = 0; j < ns; j++) {
            const int64_t pos = p * P + j;
            for (int l = 0; l < LN; l++) {
                const int vis = pos <= tl[l] && (win < 0 || pos >= tl[l] - win) && (quant[l] || j < n_f);
                float *sj = w->s + j * LN + l;
                if (!vis) *sj = -INFINITY;
                mloc[l] = *sj > mloc[l] ? *sj : mloc[l];
            }
        }
        for (int l = 0; l < LN; l++) {
            const float mn = mloc[l] > m[l] ? mloc[l] : m[l];
            alpha[l] = mn == -INFINITY ? 1.0f : hack_exp_neg(m[l] - mn); /* no key seen yet: see above */
            m[l] = mn;
            add[l] = 0.0f;
        }
#if HACK_AVX2
        /* the loop below with the exp in registers (gcc leaves hack_exp_neg scalar there) */
        for (int h = 0; h < 2; h++) {
            const __m256 mh = _mm256_loadu_ps(m + 8 * h), ninf = _mm256_set1_ps(-INFINITY);
            __m256 sum = _mm256_setzero_ps();
            for (int j = 0; j < ns; j++) {
                float *sj = w->s + j * LN + 8 * h;
                const __m256 x = _mm256_loadu_ps(sj);
                const __m256 e = _mm256_and_ps(xexp_neg8(_mm256_sub_ps(x, mh)), _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
                _mm256_storeu_ps(sj, e);
                sum = _mm256_add_ps(sum, e);
            }
            _mm256_storeu_ps(add + 8 * h, sum);
        }
#else
        for (int j = 0; j < ns; j++) {
            float *sj = w->s + j * LN;
            for (int l = 0; l < LN; l++) {
                sj[l] = sj[l] == -INFINITY ? 0.0f : hack_exp_neg(sj[l] - m[l]);
                add[l] += sj[l];
            }
        }
#endif
        for (int l = 0; l < LN; l++) lsum[l] = lsum[l] * alpha[l] + add[l];
        for (int c = 0; c < d; c++)
            for (int l = 0; l < LN; l++) o[c * LN + l] *= alpha[l];
    }
#endif
    /* P.V: codes where the row reads V quantized (sinks excluded), FP16 elsewhere */
    const int vcodes_f = (int)a->v_open_quantized;
    if (any_q || (any_f && vcodes_f)) {
        float keep[LN];
        for (int l = 0; l < LN; l++) keep[l] = (quant[l] || vcodes_f) ? 1.0f : 0.0f;
        for (int j = 0; j < nt_v; j++) {
            const int use = j >= n_sink && j < ns;
            for (int l = 0; l < LN; l++) w->pz[j * LN + l] = use ? w->s[j * LN + l] * keep[l] : 0.0f;
        }
        quantize_p(a, nt_v, w);
        pv_quant(a, nt_v, w, o);
    }
    if (any_f && !vcodes_f) {
        float keep[LN];
        for (int l = 0; l < LN; l++) keep[l] = quant[l] ? 0.0f : 1.0f;
        for (int j = 0; j < n_f; j++)
            for (int l = 0; l < LN; l++) w->pf[j * LN + l] = j >= n_sink ? w->s[j * LN + l] * keep[l] : 0.0f;
        pv_fp(w->pf, w->vf, n_f, d, o);
    }
    if (n_sink) pv_fp(w->s, w->snv, n_sink, d, o);
}

static void run_xitem(const hack_extend_args *a, const xitem_t *it, xscratch_t *w) {
    const int64_t H = a->heads, rep = a->rep, d = a->head_dim, P = a->page_size, hd = H * d;
    const int64_t b = it->b, h = it->h, pre = a->prefix_lens[b], seq = a->seq_lens[b];
    const int64_t rows = (it->t1 - it->t0) * rep, ngr = (rows + LN - 1) / LN;
    const int64_t wstart = (pre / P) * P;
    /* rows: (position, query head of the GQA group), position-major */
    for (int64_t r = 0; r < ngr * LN; r++) {
        const int64_t rr = r < rows ? r : rows - 1, tk = rr / rep, k = rr % rep, t = it->t0 + tk;
        w->t[r] = t;
        w->nc[r] = a->exact ? pre / P : (t + 1) / P;
        w->orow[r] = (a->q_start[b] + (t - pre)) * H * rep + h * rep + k;
        const float *qr = a->q + w->orow[r] * d;
        float *qt = w->qt + (r / LN) * d * LN + (r % LN);
        for (int64_t c = 0; c < d; c++) qt[c * LN] = qr[c];
    }
    for (int64_t i = 0; i < ngr * LN; i++) w->m[i] = -INFINITY;
    memset(w->l, 0, sizeof(float) * ngr * LN);
    memset(w->o, 0, sizeof(float) * ngr * d * LN);
    const int64_t nc_min = w->nc[0], nc_max = w->nc[rows - 1], tmax = it->t1 - 1;
    const int64_t last_page = tmax / P;
    const int64_t *table = a->page_table + b * a->max_pages;
    /* the first page any row's window reaches: earlier pages (and their sinks) are not read */
    const int64_t first_page = window_first_page(a, it->t0);
    const int n_sink_all = first_page ? 0 : (int)(a->sink_tokens < seq ? a->sink_tokens : seq);
    if (n_sink_all) {
        const int64_t sbase = a->sink_slots[b] * a->sink_tokens * hd + h * d;
        load_fp16(a->sink_k + sbase, n_sink_all, hd, (int)d, w->snk);
        load_fp16(a->sink_v + sbase, n_sink_all, hd, (int)d, w->snv);
    }
    for (int64_t p = first_page; p <= last_page; p++) {
        const int64_t page_id = table[p];
        const int have_q = p < nc_max; /* some row reads this page from its codes */
        const int have_f = p >= nc_min; /* some row reads it in FP16 */
        int nt_v = (int)(seq - p * P < P ? seq - p * P : P);
        const int chunk = a->chunk_page0 != NULL && p >= pre / P; /* PrefillMode.INT8's own pages */
        if (have_q) {
            if (chunk) load_k_chunk(a, b, h, p, w);
            else load_k_page(a, h, page_id, w);
        }
        if (have_q || (have_f && a->v_open_quantized)) {
            if (chunk) load_v_chunk(a, b, h, p, nt_v, w);
            else load_v_page(a, h, page_id, nt_v, w);
        }
        int n_f = 0;
        if (have_f) {
            n_f = (int)(tmax - p * P + 1 < P ? tmax - p * P + 1 : P);
            const int64_t off = a->win_off[b] + (p * P - wstart) * hd + h * d;
            load_fp16(a->k_win + off, n_f, hd, (int)d, w->kf);
            if (!a->v_open_quantized) load_fp16(a->v_win + off, n_f, hd, (int)d, w->vf);
        }
        /* sinks past the item's last position are visible to none of its rows */
        const int n_sink = p == 0 ? (int)(n_sink_all < tmax + 1 ? n_sink_all : tmax + 1) : 0;
        for (int64_t gr = 0; gr < ngr; gr++) group_page(a, w, (int)gr, p, nt_v, n_f, n_sink);
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *o = w->o + (r / LN) * d * LN + (r % LN);
        const float inv = 1.0f / w->l[r];
        float *dst = a->out + w->orow[r] * d;
        for (int64_t c = 0; c < d; c++) dst[c] = o[c * LN] * inv;
    }
}

static int cmp_cost(const void *x, const void *y) {
    const xitem_t *a = (const xitem_t *)x, *b = (const xitem_t *)y;
    return a->cost < b->cost ? 1 : (a->cost > b->cost ? -1 : 0);
}

static void *xalloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? (bytes + 63) & ~(size_t)63 : 64)) return NULL;
    return p;
}

int hack_extend(const hack_extend_args *a) {
    const int64_t B = a->batch, H = a->heads, rep = a->rep, d = a->head_dim, P = a->page_size;
    const int64_t ng = d / a->group, S = a->sink_tokens;
    if (d > MAX_D || d % 64 || rep < 1 || rep > MAX_REP || ng > MAX_G || P > MAX_P || P % 16 || a->group % 16)
        return -1;
    int64_t bt = a->block_tokens > 0 ? a->block_tokens : 256 / rep; /* about 256 rows per item */
    bt = bt < 1 ? 1 : (bt > P ? P : bt);
    int64_t n_items = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t pre = a->prefix_lens[b], seq = a->seq_lens[b];
        if (pre < 0 || seq <= pre) return -1; /* every request adds a token after its prefix */
        for (int64_t pg = pre / P; pg * P < seq; pg++) {
            const int64_t lo = pg * P > pre ? pg * P : pre, hi = (pg + 1) * P < seq ? (pg + 1) * P : seq;
            n_items += H * ((hi - lo + bt - 1) / bt);
        }
    }
    xitem_t *items = (xitem_t *)malloc(sizeof(xitem_t) * (n_items ? n_items : 1));
    if (!items) return -2;
    int64_t k = 0, max_rows = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t pre = a->prefix_lens[b], seq = a->seq_lens[b];
        for (int64_t pg = pre / P; pg * P < seq; pg++) {
            const int64_t lo = pg * P > pre ? pg * P : pre, hi = (pg + 1) * P < seq ? (pg + 1) * P : seq;
            for (int64_t t0 = lo; t0 < hi; t0 += bt) {
                const int64_t t1 = t0 + bt < hi ? t0 + bt : hi;
                max_rows = (t1 - t0) * rep > max_rows ? (t1 - t0) * rep : max_rows;
                const int64_t pages = pg + 1 - window_first_page(a, t0); /* pages the item reads */
                for (int64_t h = 0; h < H; h++) items[k++] = (xitem_t){b, h, t0, t1, pages * (t1 - t0)};
            }
        }
    }
    qsort(items, (size_t)n_items, sizeof(xitem_t), cmp_cost); /* dearest first: better balance */
    const int64_t ngr = (max_rows + LN - 1) / LN;
    const int nth = a->nthreads > 0 ? (int)a->nthreads : 1;
    int failed = 0;
#pragma omp parallel num_threads(nth) reduction(| : failed)
    {
        xscratch_t w;
        const int64_t S1 = S > 0 ? S : 1;
        w.qt = xalloc(sizeof(float) * ngr * d * LN);
        w.m = xalloc(sizeof(float) * ngr * LN);
        w.l = xalloc(sizeof(float) * ngr * LN);
        w.o = xalloc(sizeof(float) * ngr * d * LN);
        w.t = xalloc(sizeof(int64_t) * ngr * LN);
        w.nc = xalloc(sizeof(int64_t) * ngr * LN);
        w.orow = xalloc(sizeof(int64_t) * ngr * LN);
        w.s = xalloc(sizeof(float) * P * LN);
        w.pz = xalloc(sizeof(float) * P * LN);
        w.pf = xalloc(sizeof(float) * P * LN);
        w.qq = xalloc((size_t)d * LN);
        w.qf = xalloc(sizeof(float) * d * LN);
        w.pf8 = xalloc(sizeof(float) * ng * P * LN);
        w.sq = xalloc(sizeof(float) * ng * LN);
        w.mq = xalloc(sizeof(float) * ng * LN);
        w.qm = xalloc(sizeof(float) * LN);
        w.pq = xalloc((size_t)ng * P * LN);
        w.sp = xalloc(sizeof(float) * ng * LN);
        w.mt = xalloc(sizeof(float) * ng * LN);
        w.kb = xalloc((size_t)P * d);
        w.vb = xalloc((size_t)P * d);
        w.vq = xalloc((size_t)P * d);
        w.ks = xalloc(sizeof(float) * P * ng);
        w.sk = xalloc(sizeof(float) * d);
        w.mk = xalloc(sizeof(float) * d);
        w.sv = xalloc(sizeof(float) * P * ng);
        w.mv = xalloc(sizeof(float) * P * ng);
        w.kf = xalloc(sizeof(float) * P * d);
        w.vf = xalloc(sizeof(float) * P * d);
        w.snk = xalloc(sizeof(float) * S1 * d);
        w.snv = xalloc(sizeof(float) * S1 * d);
        void *all[] = {w.qt, w.m, w.l, w.o, w.t, w.nc, w.orow, w.s, w.pz, w.pf, w.qq, w.qf, w.pf8, w.sq, w.mq, w.qm, w.pq,
                       w.sp, w.mt, w.kb, w.vb, w.vq, w.ks, w.sk, w.mk, w.sv, w.mv, w.kf, w.vf, w.snk, w.snv};
        const int n_all = (int)(sizeof(all) / sizeof(all[0]));
        for (int i = 0; i < n_all; i++) failed |= all[i] == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++)
            if (!failed) run_xitem(a, &items[i], &w);
        for (int i = 0; i < n_all; i++) free(all[i]);
    }
    free(items);
    return failed ? -2 : 0;
}

/* ---- PrefillMode.INT8: the chunk's codes (the reference: hack_ops/paged/chunk_codes.py) ---- */

/* The reference's float operations in its order. chunk_scale: a range min..max (any: whether a
 * valid value set it; none: 0..0) -> its scale (max - min) / L, 1 for a flat or empty range, and
 * *mn made +0 where it was -0. chunk_code: round-half-even((x - min) / scale) clamped to 0..L. */
static inline float chunk_scale(float *mn, float mx, int any, float levels) {
    if (!any) *mn = mx = 0.0f;
    *mn += 0.0f; /* -0 -> +0, as the reference */
    const float s = (mx - *mn) / levels;
    return s > 0.0f ? s : 1.0f;
}

static inline uint8_t chunk_code(float x, float mn, float s, float levels) {
    float c = nearbyintf((x - mn) / s);
    c = c < 0.0f ? 0.0f : (c > levels ? levels : c);
    return (uint8_t)c;
}

int hack_chunk_codes(const hack_chunk_args *c) {
    const int64_t H = c->heads, d = c->head_dim, P = c->page_size, gd = c->group, ng = d / gd, hd = H * d;
    if (d > MAX_D || P > MAX_P || gd <= 0 || d % gd) return -1;
    int64_t total = 0;
    for (int64_t b = 0; b < c->batch; b++) total += (c->seq_lens[b] - c->win_start[b] + P - 1) / P;
    int64_t *req = (int64_t *)malloc(sizeof(int64_t) * (total ? total : 1)); /* each page's request */
    if (!req) return -2;
    for (int64_t b = 0, k = 0; b < c->batch; b++)
        for (int64_t pg = 0; pg < (c->seq_lens[b] - c->win_start[b] + P - 1) / P; pg++) req[k++] = b;
    const float levels = (float)c->levels;
    int failed = 0;
#pragma omp parallel num_threads(c->nthreads > 0 ? (int)c->nthreads : 1) reduction(| : failed)
    {
    float *xk = xalloc(sizeof(float) * P * d), *xv = xalloc(sizeof(float) * P * d); /* one page of one head */
    failed |= xk == NULL || xv == NULL;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < total * H; i++) {
        if (failed) continue;
        const int64_t page = i / H, h = i % H, b = req[page];
        const int64_t pg = page - c->page0[b], t0 = c->win_start[b] + pg * P;
        uint8_t valid[MAX_P];
        for (int64_t j = 0; j < P; j++) {
            const int64_t t = t0 + j;
            valid[j] = t < c->seq_lens[b] && t >= c->sink_tokens;
            const int64_t off = c->win_off[b] + (pg * P + j) * hd + h * d;
            for (int64_t e = 0; e < d; e++) {
                xk[j * d + e] = t < c->seq_lens[b] ? h2f(c->k_win[off + e]) : 0.0f;
                xv[j * d + e] = t < c->seq_lens[b] ? h2f(c->v_win[off + e]) : 0.0f;
            }
        }
        const int64_t row = page * H + h; /* [pages, H, ...] */
        uint8_t *kc = c->k_codes + row * P * d, *vc = c->v_codes + row * P * d;
        float *ks = c->k_scale + row * d, *km = c->k_min + row * d;
        /* K: per channel over the page's valid tokens; channels innermost, so the loops vectorize */
        float kmx[MAX_D];
        int any = 0;
        for (int64_t e = 0; e < d; e++) km[e] = INFINITY, kmx[e] = -INFINITY;
        for (int64_t j = 0; j < P; j++) {
            if (!valid[j]) continue;
            any = 1;
            for (int64_t e = 0; e < d; e++) {
                const float x = xk[j * d + e];
                km[e] = x < km[e] ? x : km[e];
                kmx[e] = x > kmx[e] ? x : kmx[e];
            }
        }
        for (int64_t e = 0; e < d; e++) ks[e] = chunk_scale(km + e, kmx[e], any, levels);
        for (int64_t j = 0; j < P; j++) {
            if (!valid[j]) {
                memset(kc + j * d, 0, (size_t)d);
                continue;
            }
            for (int64_t e = 0; e < d; e++) kc[j * d + e] = chunk_code(xk[j * d + e], km[e], ks[e], levels);
        }
        /* V: per token and group of gd channels; K's code sums per token and group */
        for (int64_t j = 0; j < P; j++)
            for (int64_t g = 0; g < ng; g++) {
                const int64_t at = (row * P + j) * ng + g;
                const float *x = xv + j * d + g * gd;
                uint8_t *dst = vc + j * d + g * gd;
                float mn = INFINITY, mx = -INFINITY;
                if (valid[j])
                    for (int64_t e = 0; e < gd; e++) {
                        mn = x[e] < mn ? x[e] : mn;
                        mx = x[e] > mx ? x[e] : mx;
                    }
                const float sv = chunk_scale(&mn, mx, valid[j], levels);
                if (valid[j])
                    for (int64_t e = 0; e < gd; e++) dst[e] = chunk_code(x[e], mn, sv, levels);
                else
                    memset(dst, 0, (size_t)gd);
                c->v_scale[at] = sv;
                c->v_min[at] = mn;
                int32_t sum = 0;
                for (int64_t e = 0; e < gd; e++) sum += kc[j * d + g * gd + e];
                c->k_sums[at] = (float)sum;
            }
    }
    free(xk);
    free(xv);
    }
    free(req);
    return failed ? -2 : 0;
}
