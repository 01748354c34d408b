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
 * Sliding window (window >= 0): the query at t sees keys t-window..t. Items start at the page
 * holding key t-window, so pages wholly before the window are never read; on that boundary
 * page (and among the sinks) earlier keys get a zero softmax numerator. logit_cap > 0
 * soft-caps the scaled scores (cap * tanh(s / cap)) before the softmax.
 *
 * Per-head page tables (head_tables = 1, sparse decode): each KV head of a request reads its own
 * list of pages, page_table[(row * heads + h) * max_pages + p]; the lists are as long for every
 * head (seq_lens and n_closed are per request), which is all a shorter sequence needs.
 *
 * Work split (flash-decoding): one item = (request, KV head, run of up to CHUNK_PAGES pages),
 * all query heads of the GQA group together; each item keeps its own softmax max, the items
 * of a head are merged at the end in a fixed order, so results do not depend on the thread
 * count. Nothing is dequantized or gathered into a copy of the cache: codes are unpacked in
 * registers (AVX-512 VNNI when compiled for it, plain C otherwise).
 */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "hack_kernel.h"

int hack_decode_simd(void) { return HACK_SIMD; }

/* Scores against n FP16 keys (token stride `stride` elements) for the group's query heads. */
static void fp16_scores(const uint16_t *x, int n, int64_t stride, int d, int rep, const float *q, float *s, int64_t ld) {
    for (int j = 0; j < n; j++) {
        const uint16_t *xj = x + j * stride;
#if HACK_SIMD
        __m512 xf[MAX_D / 16];
        for (int blk = 0; blk < d / 16; blk++) xf[blk] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(xj + blk * 16)));
        for (int r = 0; r < rep; r++) {
            __m512 acc = _mm512_setzero_ps();
            for (int blk = 0; blk < d / 16; blk++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * d + blk * 16), xf[blk], acc);
            s[r * ld + j] = _mm512_reduce_add_ps(acc);
        }
#else
        float xf[MAX_D];
        for (int c = 0; c < d; c++) xf[c] = h2f(xj[c]);
        for (int r = 0; r < rep; r++) {
            float acc = 0.0f;
            for (int c = 0; c < d; c++) acc += q[r * d + c] * xf[c];
            s[r * ld + j] = acc;
        }
#endif
    }
}

/* o[r] += sum_j pr[r * ld + j] * x_j over n FP16 values. */
static void fp16_pv(const uint16_t *x, int n, int64_t stride, int d, int rep, const float *pr, int64_t ld, float *o) {
#if HACK_SIMD
    for (int blk = 0; blk < d / 16; blk++)
        for (int r0 = 0; r0 < rep; r0 += 4) { /* 4 query heads' accumulators in registers */
            const int nr = rep - r0 < 4 ? rep - r0 : 4;
            const float *p0 = pr + r0 * ld, *p1 = p0 + (nr > 1) * ld, *p2 = p0 + (nr > 2) * 2 * ld, *p3 = p0 + (nr > 3) * 3 * ld;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int j = 0; j < n; j++) {
                __m512 xf = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + j * stride + blk * 16)));
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(p0[j]), xf, a0);
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(p1[j]), xf, a1);
                a2 = _mm512_fmadd_ps(_mm512_set1_ps(p2[j]), xf, a2);
                a3 = _mm512_fmadd_ps(_mm512_set1_ps(p3[j]), xf, a3);
            }
            __m512 res[4] = {a0, a1, a2, a3};
            for (int k = 0; k < nr; k++) {
                float *dst = o + (r0 + k) * d + blk * 16;
                _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), res[k]));
            }
        }
#else
    for (int j = 0; j < n; j++) {
        float xf[MAX_D];
        for (int c = 0; c < d; c++) xf[c] = h2f(x[j * stride + c]);
        for (int r = 0; r < rep; r++) {
            float p = pr[r * ld + j];
            for (int c = 0; c < d; c++) o[r * d + c] += p * xf[c];
        }
    }
#endif
}

/* The first key a query of a sequence of length L sees (0 without a window). */
static inline int64_t first_key(const hack_decode_args *a, int64_t L) {
    return a->window >= 0 && L - 1 - a->window > 0 ? L - 1 - a->window : 0;
}

/* One item: scores, local max, numerators, P.V for pages [p0, p1) of (b, h). */
static void run_item(const item_t *it, float *m_out, float *l_out, float *o_out, float *s, float *ws) {
    const hack_decode_args *a = it->a;
    const int d = (int)a->head_dim, rep = (int)a->rep, P = (int)a->page_size;
    const int64_t H = a->heads, L = it->seq_len, nc = it->n_closed;
    const int64_t tok0 = it->p0 * P, tok1 = it->p1 * P < L ? it->p1 * P : L, nt = tok1 - tok0;
    const int64_t sinks = a->sink_tokens < L ? a->sink_tokens : L;
    const int64_t hd = H * d;
    const int64_t trow = (a->head_tables ? a->table_rows[it->b] * H + it->h : a->table_rows[it->b]) * a->max_pages;
    const int64_t first = first_key(a, L), vis0 = first > tok0 ? first - tok0 : 0; /* window */
    const float *q = a->q + (it->b * H * rep + it->h * rep) * d;
    /* scores */
    for (int64_t p = it->p0; p < it->p1; p++) {
        int64_t page_id = a->page_table[trow + p];
        int n = (int)((p + 1) * P <= L ? P : L - p * P);
        float *sp = s + (p * P - tok0);
        if (p < nc || a->k_open_quantized)
            page_scores_quant(it, page_id, n, q, sp, nt, ws);
        else
            fp16_scores(a->k_open + a->k_open_off[it->b] + (p - nc) * P * hd + it->h * d, n, hd, d, rep, q, sp, nt);
    }
    if (it->p0 == 0 && sinks)
        fp16_scores(a->sink_k + a->sink_slots[it->b] * a->sink_tokens * hd + it->h * d, (int)sinks, hd, d, rep, q, s, nt);
    if (a->logit_cap > 0.0) {
        const float cap = (float)a->logit_cap;
        for (int64_t j = 0; j < rep * nt; j++) s[j] = cap * tanhf(s[j] / cap);
    }
    /* local softmax numerators; keys before the window (j < vis0) get 0 */
    for (int r = 0; r < rep; r++) {
        float *sr = s + r * nt, m = sr[vis0], l = 0.0f;
        for (int64_t j = vis0 + 1; j < nt; j++) m = sr[j] > m ? sr[j] : m;
        for (int64_t j = 0; j < vis0; j++) sr[j] = 0.0f;
        for (int64_t j = vis0; j < nt; j++) { sr[j] = hack_exp_neg(sr[j] - m); l += sr[j]; }
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
            page_pv_quant(it, page_id, n, skip, prp, nt, o_out, ws);
        } else {
            const uint16_t *t = a->v_open + a->v_open_off[it->b] + (p - nc) * P * hd + it->h * d;
            fp16_pv(t + skip * hd, n - skip, hd, d, rep, prp + skip, nt, o_out);
        }
    }
    if (it->p0 == 0 && sinks)
        fp16_pv(a->sink_v + a->sink_slots[it->b] * a->sink_tokens * hd + it->h * d, (int)sinks, hd, d, rep, s, nt, o_out);
}

static int decode_f32(const hack_decode_args *a);

/* a's queries, scaled, as float32 in a converted copy (free it); NULL on a failed allocation
 * (*bad set on a q_dtype it does not know). Each value is float(q) * float(q_scale), what
 * torch's q.float() * scale computes. */
static float *scaled_q(const hack_decode_args *a, int *bad) {
    const int64_t n = a->batch * a->heads * a->rep * a->head_dim;
    *bad = a->q_dtype < 0 || a->q_dtype > 2;
    if (*bad) return NULL;
    float *f = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!f) return NULL;
    const float s = a->q_scale == 0.0 ? 1.0f : (float)a->q_scale;
    const uint16_t *h = (const uint16_t *)a->q;
    for (int64_t i = 0; i < n; i++) {
        float v;
        if (a->q_dtype == 0) {
            v = a->q[i];
        } else if (a->q_dtype == 1) {
            const uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(&v, &bits, sizeof(v));
        } else {
            v = h2f(h[i]);
        }
        f[i] = v * s;
    }
    return f;
}

/* float -> bfloat16, rounded to nearest even; NaN -> 0x7fc0 (c10::BFloat16's conversion) */
static inline uint16_t f2bf(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof(x));
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

int hack_decode(const hack_decode_args *a) {
    const int plain_q = a->q_dtype == 0 && (a->q_scale == 0.0 || a->q_scale == 1.0);
    if (plain_q && a->out_dtype == 0) return decode_f32(a);
    if (a->batch < 0 || a->heads < 0 || a->rep < 0 || a->head_dim < 0 || a->out_dtype < 0 || a->out_dtype > 1)
        return -1;
    const int64_t n = a->batch * a->heads * a->rep * a->head_dim;
    hack_decode_args s = *a;
    float *qf = NULL, *of = NULL;
    if (!plain_q) {
        int bad;
        if (!(qf = scaled_q(a, &bad))) return bad ? -1 : -2;
        s.q = qf;
        s.q_dtype = 0;
        s.q_scale = 0.0;
    }
    if (a->out_dtype == 1) {
        if (!(of = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1)))) { free(qf); return -2; }
        s.out = of;
        s.out_dtype = 0;
    }
    const int rc = decode_f32(&s);
    if (rc == 0 && of) {
        uint16_t *o16 = (uint16_t *)a->out;
        for (int64_t i = 0; i < n; i++) o16[i] = f2bf(of[i]);
    }
    free(qf);
    free(of);
    return rc;
}

static int decode_f32(const hack_decode_args *a) {
    const int64_t B = a->batch, H = a->heads, rep = a->rep, d = a->head_dim, P = a->page_size;
    if (d > MAX_D || d % 64 || rep > MAX_REP || d / a->group > MAX_G || P > 256) return -1;
    if (a->head_tables && a->window >= 0) return -1; /* a per-head table shortens the sequence: no window then */
    int64_t n_items = 0;
    for (int64_t b = 0; b < B; b++) {
        if (a->seq_lens[b] < 1) return -1; /* a query sees at least itself: no empty key range */
        int64_t np = (a->seq_lens[b] + P - 1) / P - first_key(a, a->seq_lens[b]) / P; /* pages read */
        n_items += H * ((np + CHUNK_PAGES - 1) / CHUNK_PAGES);
    }
    if (n_items == 0) return -1;
    item_t *items = (item_t *)malloc(sizeof(item_t) * n_items);
    float *mls = (float *)malloc(sizeof(float) * n_items * rep * (d + 2));
    if (!items || !mls) { free(items); free(mls); return -2; }
    int64_t k = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t L = a->seq_lens[b], np = (L + P - 1) / P, fp = first_key(a, L) / P;
        for (int64_t h = 0; h < H; h++)
            for (int64_t p0 = fp; p0 < np; p0 += CHUNK_PAGES) {
                item_t it = {a, b, h, p0, p0 + CHUNK_PAGES < np ? p0 + CHUNK_PAGES : np, L, a->n_closed[b]};
                items[k++] = it;
            }
    }
    /* per-thread scratch: an item's scores, and the page functions' work space */
    const int64_t s_len = rep * CHUNK_PAGES * P, ws_len = (rep + 2) * (d / a->group) * P;
    const int nth = a->nthreads > 0 ? (int)a->nthreads : 1;
    float *scratch = (float *)malloc(sizeof(float) * nth * (s_len + ws_len));
    if (!scratch) { free(items); free(mls); return -2; }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nth)
    for (int64_t i = 0; i < n_items; i++) {
#ifdef _OPENMP
        float *mine = scratch + omp_get_thread_num() * (s_len + ws_len);
#else
        float *mine = scratch;
#endif
        float *base = mls + i * rep * (d + 2);
        run_item(&items[i], base, base + rep, base + 2 * rep, mine, mine + s_len);
    }
    free(scratch);
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
