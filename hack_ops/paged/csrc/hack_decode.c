/* HACK decode attention on the CPU, reading the paged store in place.
 *
 * Orientation 'channel_k': K quantized per channel over each page (Q' = Q * s_K(page) is
 * quantized to INT8 per head_dim group, scores = sum_g sq*(Qq.Kq) + mq*sum(Kq) + Q.m_K with K's
 * stored per-token code sums); V quantized per token (P' = P * s_V(token) quantized to INT8
 * per (page, group) with a zero minimum, O = sum_p sp*(Pq.Vq) + sum_j P_j m_V(j)). FP16 for
 * sinks and for the open page of a tensor with a tail. Same arithmetic as hack_ops.attention,
 * other summation order.
 *
 * A "request" here is one query: decode passes one per sequence, extend one per new token
 * (position t: seq_len t+1), each with its own count of closed pages and a pointer to the FP16
 * tokens of its open region (the tail row in decode, a window of the new tokens in extend).
 *
 * Work split (flash-decoding): one item = (request, KV head, run of up to CHUNK_PAGES pages),
 * all query heads of the GQA group together; each item keeps its own softmax max, the items
 * of a head are merged at the end in a fixed order, so results do not depend on the thread
 * count. Nothing is dequantized or gathered into a copy of the cache: codes are unpacked in
 * registers (AVX-512 VNNI when compiled for it, plain C otherwise).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HACK_SIMD 1
#else
#define HACK_SIMD 0
#endif

#define CHUNK_PAGES 16
#define MAX_D 256
#define MAX_REP 16
#define MAX_G 16

typedef struct {
    int64_t batch, heads, rep, head_dim, page_size, bits, group, sink_tokens;
    int64_t k_open_quantized; /* 1: the open K page is read from its (re-quantized) codes */
    int64_t v_open_quantized; /* 1: the open page's V is read from its per-token codes */
    int64_t meta_fp32, max_pages;
    int64_t k_page_bytes, k_codes_off, k_min_off, k_scale_off, k_sums_off, k_sums_bytes;
    int64_t v_page_bytes, v_codes_off, v_min_off, v_scale_off;
    int64_t nthreads;
    const int64_t *seq_lens, *n_closed, *page_table, *table_rows, *sink_slots;
    const int64_t *k_open_off, *v_open_off; /* element offset of each query's open region */
    const uint8_t *k_pages, *v_pages;
    const uint16_t *k_open, *v_open, *sink_k, *sink_v; /* fp16, [.., H, D] per token */
    const float *q;                                    /* [B, H*rep, D], already scaled */
    float *out;                                        /* [B, H*rep, D] */
} hack_decode_args;

int hack_decode_simd(void) { return HACK_SIMD; }

#ifdef __F16C__
#include <immintrin.h>
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float h2f(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        if (m == 0) {
            bits = s;
        } else { /* subnormal: normalize */
            e = 113;
            while (!(m & 0x400)) { m <<= 1; e--; }
            bits = s | (e << 23) | ((m & 0x3ff) << 13);
        }
    } else if (e == 31) {
        bits = s | 0x7f800000 | (m << 13);
    } else {
        bits = s | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

static inline float meta_at(const uint8_t *base, int64_t i, int fp32) {
    if (fp32) { float f; memcpy(&f, base + 4 * i, 4); return f; }
    uint16_t h; memcpy(&h, base + 2 * i, 2); return h2f(h);
}

/* exp for x <= 0 (softmax numerators), about 1 ulp; branch-free so loops vectorize. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, 4);
    return p * two_n;
}

/* INT8 min/max quantization of x[0..n) (float32 side values, as hack_ops.quant does with
 * meta_dtype float32): codes = clamp(rint((x - mn) / s), 0, 255), s = (mx - mn) / 255 or 1. */
static void q8(const float *x, int n, int zero_min, uint8_t *codes, float *scale, float *minimum) {
    float mn = x[0], mx = x[0];
    for (int i = 1; i < n; i++) { mn = x[i] < mn ? x[i] : mn; mx = x[i] > mx ? x[i] : mx; }
    if (zero_min) mn = 0.0f;
    float s = (mx - mn) / 255.0f;
    if (!(s > 0.0f)) s = 1.0f;
    for (int i = 0; i < n; i++) {
        float v = nearbyintf((x[i] - mn) / s);
        v = v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v);
        codes[i] = (uint8_t)v;
    }
    *scale = s;
    *minimum = mn;
}

static inline void unpack_row(const uint8_t *row, int d, int bits, uint8_t *out) {
    int per = 8 / bits, mask = (1 << bits) - 1;
    for (int c = 0; c < d; c++) out[c] = (row[c / per] >> (bits * (c % per))) & mask;
}

typedef struct {
    const hack_decode_args *a;
    int64_t b, h, p0, p1, seq_len, n_closed;
} item_t;

/* Scores of one page's tokens [j0, j1) (page-relative) for all query heads of the group. */
static void page_scores_quant(const item_t *it, int64_t page_id, int nt, const float *q, float *s, int64_t ld) {
    const hack_decode_args *a = it->a;
    const int d = (int)a->head_dim, rep = (int)a->rep, bits = (int)a->bits, gd = (int)a->group;
    const int ng = d / gd, P = (int)a->page_size, row = d * bits / 8, fp32 = (int)a->meta_fp32;
    const uint8_t *page = a->k_pages + page_id * a->k_page_bytes;
    const uint8_t *codes = page + a->k_codes_off + it->h * P * row;
    const uint8_t *mnb = page + a->k_min_off, *scb = page + a->k_scale_off;
    const uint8_t *sums = page + a->k_sums_off + (it->h * P * ng) * a->k_sums_bytes;
    float sk[MAX_D], mk[MAX_D], qm[MAX_REP], sq[MAX_REP][MAX_G], mq[MAX_REP][MAX_G];
    uint8_t qc[MAX_REP][MAX_D] __attribute__((aligned(64)));
    for (int c = 0; c < d; c++) {
        sk[c] = meta_at(scb, it->h * d + c, fp32);
        mk[c] = meta_at(mnb, it->h * d + c, fp32);
    }
    for (int r = 0; r < rep; r++) {
        float qf[MAX_D];
        const float *qr = q + r * d;
        float acc = 0.0f;
        for (int c = 0; c < d; c++) { qf[c] = qr[c] * sk[c]; acc += qr[c] * mk[c]; }
        qm[r] = acc;
        for (int g = 0; g < ng; g++) q8(qf + g * gd, gd, 0, qc[r] + g * gd, &sq[r][g], &mq[r][g]);
    }
#if HACK_SIMD
    /* Codes of one token: 64 channels per 512-bit register; byte position (lane L, byte i)
     * holds channel 4i+L (2-bit: a 16-byte chunk broadcast to 4 lanes, lane L shifted by 2L)
     * or 2i+L (4-bit: a 32-byte chunk in 2 halves, half L shifted by 4L). Q's codes are laid
     * out the same way once per page, so one VNNI dot per 64 channels. */
    const int nchunk = d / 64;
    __m512i qp[MAX_REP][MAX_D / 64];
    __mmask16 gmask[MAX_D / 64][4];
    int gidx[MAX_D / 64][4], ngc[MAX_D / 64];
    for (int ch = 0; ch < nchunk; ch++) {
        uint8_t tmp[64];
        for (int r = 0; r < rep; r++) {
            for (int pos = 0; pos < 64; pos++) {
                int c = bits == 2 ? 4 * (pos & 15) + (pos >> 4) : 2 * (pos & 31) + (pos >> 5);
                tmp[pos] = qc[r][ch * 64 + c];
            }
            qp[r][ch] = _mm512_loadu_si512(tmp);
        }
        ngc[ch] = 0;
        for (int dw = 0; dw < 16; dw++) { /* dword -> head_dim group */
            int lo = bits == 2 ? 16 * (dw & 3) : 8 * (dw & 7);
            int g = (ch * 64 + lo) / gd, k;
            for (k = 0; k < ngc[ch] && gidx[ch][k] != g; k++) {}
            if (k == ngc[ch]) { gidx[ch][k] = g; gmask[ch][k] = 0; ngc[ch]++; }
            gmask[ch][k] |= (__mmask16)(1u << dw);
        }
    }
    const __m512i shift = bits == 2 ? _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0)
                                    : _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i cmask = _mm512_set1_epi8((char)((1 << bits) - 1));
    for (int j = 0; j < nt; j++) {
        const uint8_t *rowp = codes + j * row;
        int32_t dot[MAX_REP][MAX_G];
        memset(dot, 0, sizeof(dot));
        for (int ch = 0; ch < nchunk; ch++) {
            __m512i x = bits == 2 ? _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(rowp + ch * 16)))
                                  : _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(rowp + ch * 32)));
            x = _mm512_and_si512(_mm512_srlv_epi32(x, shift), cmask);
            for (int r = 0; r < rep; r++) {
                __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qp[r][ch], x);
                for (int k = 0; k < ngc[ch]; k++) dot[r][gidx[ch][k]] += _mm512_mask_reduce_add_epi32(gmask[ch][k], acc);
            }
        }
#else
    for (int j = 0; j < nt; j++) {
        uint8_t kc[MAX_D];
        int32_t dot[MAX_REP][MAX_G];
        unpack_row(codes + j * row, d, bits, kc);
        for (int r = 0; r < rep; r++)
            for (int g = 0; g < ng; g++) {
                int32_t acc = 0;
                for (int c = g * gd; c < (g + 1) * gd; c++) acc += (int32_t)qc[r][c] * kc[c];
                dot[r][g] = acc;
            }
#endif
        for (int r = 0; r < rep; r++) {
            float acc = 0.0f;
            for (int g = 0; g < ng; g++) {
                int64_t si = j * ng + g;
                float ks = a->k_sums_bytes == 1 ? (float)sums[si] : (float)((const int16_t *)sums)[si];
                acc += sq[r][g] * (float)dot[r][g] + mq[r][g] * ks;
            }
            s[r * ld + j] = acc + qm[r];
        }
    }
}

static void fp16_scores(const uint16_t *x, int n, int64_t stride, int d, int rep, const float *q, float *s, int64_t ld) {
    for (int j = 0; j < n; j++) {
        float xf[MAX_D];
        for (int c = 0; c < d; c++) xf[c] = h2f(x[j * stride + c]);
        for (int r = 0; r < rep; r++) {
            float acc = 0.0f;
            for (int c = 0; c < d; c++) acc += q[r * d + c] * xf[c];
            s[r * ld + j] = acc;
        }
    }
}

/* P.V over one page's per-token V codes for tokens [0, nt) with numerators pr (stride ld). */
static void page_pv_quant(const item_t *it, int64_t page_id, int nt, int skip, const float *pr, int64_t ld, float *o) {
    const hack_decode_args *a = it->a;
    const int d = (int)a->head_dim, rep = (int)a->rep, bits = (int)a->bits, gd = (int)a->group;
    const int ng = d / gd, P = (int)a->page_size, row = d * bits / 8, fp32 = (int)a->meta_fp32;
    const uint8_t *page = a->v_pages + page_id * a->v_page_bytes;
    const uint8_t *codes = page + a->v_codes_off + it->h * P * row;
    const uint8_t *mnb = page + a->v_min_off, *scb = page + a->v_scale_off;
    const int64_t mbase = it->h * P * ng;
    float sv[P * ng], mv[P * ng], pf[P], sp[MAX_REP][MAX_G], mterm[MAX_REP][MAX_G], dummy;
    uint8_t pc[MAX_REP][MAX_G][256];
    for (int i = 0; i < nt * ng; i++) {
        sv[i] = meta_at(scb, mbase + i, fp32);
        mv[i] = meta_at(mnb, mbase + i, fp32);
    }
    for (int r = 0; r < rep; r++)
        for (int g = 0; g < ng; g++) {
            float mt = 0.0f;
            for (int j = 0; j < nt; j++) {
                float p = j < skip ? 0.0f : pr[r * ld + j]; /* sinks are not quantized keys */
                pf[j] = p * sv[j * ng + g];
                mt += p * mv[j * ng + g];
            }
            mterm[r][g] = mt;
            for (int j = nt; j < P; j++) pf[j] = 0.0f; /* unfilled slots: P = 0 */
            q8(pf, P, 1, pc[r][g], &sp[r][g], &dummy);
        }
    float acc[MAX_REP][MAX_D] __attribute__((aligned(64)));
    memset(acc, 0, sizeof(acc));
    for (int j = 0; j < nt; j++) {
        const uint8_t *rowp = codes + j * row;
#if HACK_SIMD
        /* 16 channels per register, natural order: each byte duplicated 4x (2-bit) or 2x
         * (4-bit) and shifted per lane. */
        const __m128i dup = bits == 2 ? _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                      : _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        const __m512i shv = bits == 2 ? _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6)
                                      : _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        const __m512i cm = _mm512_set1_epi32((1 << bits) - 1);
        const int bpb = 16 * bits / 8; /* bytes per 16 channels */
        for (int blk = 0; blk < d / 16; blk++) {
            __m128i raw = _mm_maskz_loadu_epi8((__mmask16)((1u << bpb) - 1), rowp + blk * bpb);
            __m512i w = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(raw, dup));
            __m512 cf = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, shv), cm));
            int g = blk * 16 / gd;
            for (int r = 0; r < rep; r++) {
                __m512 av = _mm512_load_ps(acc[r] + blk * 16);
                av = _mm512_fmadd_ps(_mm512_set1_ps((float)pc[r][g][j]), cf, av);
                _mm512_store_ps(acc[r] + blk * 16, av);
            }
        }
#else
        uint8_t vc[MAX_D];
        unpack_row(rowp, d, bits, vc);
        for (int r = 0; r < rep; r++)
            for (int c = 0; c < d; c++) acc[r][c] += (float)pc[r][c / gd][j] * (float)vc[c];
#endif
    }
    for (int r = 0; r < rep; r++)
        for (int c = 0; c < d; c++) o[r * d + c] += sp[r][c / gd] * acc[r][c] + mterm[r][c / gd];
}

static void fp16_pv(const uint16_t *x, int n, int64_t stride, int d, int rep, const float *pr, int64_t ld, float *o) {
    for (int j = 0; j < n; j++) {
        float xf[MAX_D];
        for (int c = 0; c < d; c++) xf[c] = h2f(x[j * stride + c]);
        for (int r = 0; r < rep; r++) {
            float p = pr[r * ld + j];
            for (int c = 0; c < d; c++) o[r * d + c] += p * xf[c];
        }
    }
}

/* One item: scores, local max, numerators, P.V for pages [p0, p1) of (b, h). */
static void run_item(const item_t *it, float *m_out, float *l_out, float *o_out) {
    const hack_decode_args *a = it->a;
    const int d = (int)a->head_dim, rep = (int)a->rep, P = (int)a->page_size;
    const int64_t H = a->heads, L = it->seq_len, nc = it->n_closed;
    const int64_t tok0 = it->p0 * P, tok1 = it->p1 * P < L ? it->p1 * P : L, nt = tok1 - tok0;
    const int64_t sinks = a->sink_tokens < L ? a->sink_tokens : L;
    const int64_t hd = H * d, trow = a->table_rows[it->b] * a->max_pages;
    const float *q = a->q + (it->b * H * rep + it->h * rep) * d;
    float *s = (float *)malloc(sizeof(float) * rep * nt);
    /* scores */
    for (int64_t p = it->p0; p < it->p1; p++) {
        int64_t page_id = a->page_table[trow + p];
        int n = (int)((p + 1) * P <= L ? P : L - p * P);
        float *sp = s + (p * P - tok0);
        if (p < nc || a->k_open_quantized)
            page_scores_quant(it, page_id, n, q, sp, nt);
        else
            fp16_scores(a->k_open + a->k_open_off[it->b] + (p - nc) * P * hd + it->h * d, n, hd, d, rep, q, sp, nt);
    }
    if (it->p0 == 0 && sinks)
        fp16_scores(a->sink_k + a->sink_slots[it->b] * a->sink_tokens * hd + it->h * d, (int)sinks, hd, d, rep, q, s, nt);
    /* local softmax numerators */
    for (int r = 0; r < rep; r++) {
        float *sr = s + r * nt, m = sr[0], l = 0.0f;
        for (int64_t j = 1; j < nt; j++) m = sr[j] > m ? sr[j] : m;
        for (int64_t j = 0; j < nt; j++) { sr[j] = exp_neg(sr[j] - m); l += sr[j]; }
        m_out[r] = m;
        l_out[r] = l;
    }
    memset(o_out, 0, sizeof(float) * rep * d);
    for (int64_t p = it->p0; p < it->p1; p++) {
        int64_t page_id = a->page_table[trow + p];
        int n = (int)((p + 1) * P <= L ? P : L - p * P);
        int skip = p == 0 ? (int)sinks : 0;
        const float *prp = s + (p * P - tok0);
        if (p < nc || a->v_open_quantized) {
            page_pv_quant(it, page_id, n, skip, prp, nt, o_out);
        } else {
            const uint16_t *t = a->v_open + a->v_open_off[it->b] + (p - nc) * P * hd + it->h * d;
            fp16_pv(t + skip * hd, n - skip, hd, d, rep, prp + skip, nt, o_out);
        }
    }
    if (it->p0 == 0 && sinks)
        fp16_pv(a->sink_v + a->sink_slots[it->b] * a->sink_tokens * hd + it->h * d, (int)sinks, hd, d, rep, s, nt, o_out);
    free(s);
}

int hack_decode(const hack_decode_args *a) {
    const int64_t B = a->batch, H = a->heads, rep = a->rep, d = a->head_dim, P = a->page_size;
    if (d > MAX_D || d % 64 || rep > MAX_REP || d / a->group > MAX_G || P > 256) return -1;
    int64_t n_items = 0;
    for (int64_t b = 0; b < B; b++) n_items += H * ((((a->seq_lens[b] + P - 1) / P) + CHUNK_PAGES - 1) / CHUNK_PAGES);
    item_t *items = (item_t *)malloc(sizeof(item_t) * n_items);
    float *mls = (float *)malloc(sizeof(float) * n_items * rep * (d + 2));
    int64_t k = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t L = a->seq_lens[b], np = (L + P - 1) / P;
        for (int64_t h = 0; h < H; h++)
            for (int64_t p0 = 0; p0 < np; p0 += CHUNK_PAGES) {
                item_t it = {a, b, h, p0, p0 + CHUNK_PAGES < np ? p0 + CHUNK_PAGES : np, L, a->n_closed[b]};
                items[k++] = it;
            }
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads((int)a->nthreads)
    for (int64_t i = 0; i < n_items; i++) {
        float *base = mls + i * rep * (d + 2);
        run_item(&items[i], base, base + rep, base + 2 * rep);
    }
    /* merge the items of each (b, h) in order */
    for (int64_t i = 0; i < n_items;) {
        int64_t j = i;
        while (j < n_items && items[j].b == items[i].b && items[j].h == items[i].h) j++;
        for (int64_t r = 0; r < rep; r++) {
            float m = -INFINITY, l = 0.0f, o[MAX_D] = {0};
            for (int64_t t = i; t < j; t++) { float mt = mls[t * rep * (d + 2) + r]; m = mt > m ? mt : m; }
            for (int64_t t = i; t < j; t++) {
                float *base = mls + t * rep * (d + 2);
                float w = expf(base[r] - m);
                l += w * base[rep + r];
                for (int64_t c = 0; c < d; c++) o[c] += w * base[2 * rep + r * d + c];
            }
            float *dst = a->out + ((items[i].b * H + items[i].h) * rep + r) * d;
            for (int64_t c = 0; c < d; c++) dst[c] = o[c] / l;
        }
        i = j;
    }
    free(items);
    free(mls);
    return 0;
}
