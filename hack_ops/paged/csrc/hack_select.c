/* Page scores for sparse decode (hack_ops.sparse.page_scores, the reference), read in place.
 *
 * For request b, KV head h and each of its n_closed[b] closed pages: the max over the group's
 * rep query heads of q.min + L * relu(q).scale (score 0, the upper bound of q.k over the page)
 * or q.min + alpha * L * q.scale (score 1, MPCache's linear stand-in), from the page's K
 * per-channel minimum and scale (fp16 or fp32), where they sit inside the page. Pages past
 * n_closed[b] get -inf. Nothing is gathered: a page costs two short dot products per query head.
 * Work items: (request, KV head, run of SEL_PAGES pages), spread over the threads.
 */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "hack_kernel.h"

#define SEL_PAGES 64
#define SEL_COPY_AHEAD 16384 /* bytes of a copy fetched ahead of the page being scored */
#define SEL_MAX_QD 16384 /* query heads x head_dim of one request (Llama-3-70B: 64 x 128 = 8,192) */

typedef struct {
    int64_t batch, heads, rep, head_dim, max_pages, width; /* width: the scores' last dim */
    int64_t k_page_bytes, k_min_off, k_scale_off, meta_fp32, score, nthreads;
    double levels, alpha;
    const int64_t *n_closed, *page_table; /* page_table [batch, max_pages] */
    const uint8_t *k_pages;
    const float *q; /* [batch, heads * rep, head_dim], in q_dtype (below) */
    float *out;     /* [batch, heads, width] */
    /* copies (or NULL): request b's closed pages' side tables copied in page order beside the
     * pool (hack_ops.paged.side_copies), copy_bytes apart from copies[b]: every head's minimum,
     * then every head's scale (copies[b] == 0: request b's are read in its pages). The scoring
     * then streams one buffer instead of gathering 2 x heads x head_dim values from each
     * scattered page. */
    int64_t copy_bytes;
    const int64_t *copies;
    /* q's element type: 0 float32, 1 bfloat16, 2 float16 (converted once per call here: the
     * model's own dtype needs no torch conversion around the call) */
    int64_t q_dtype;
    /* copied (with copies): request b's first copied[b] closed pages are in copies[b], the rest
     * read in their pages (a request sharing another's copy of a cached prefix) */
    const int64_t *copied;
} hack_select_args;

static inline void load_meta(const uint8_t *p, int64_t off, int fp32, int d, float *dst) {
    if (fp32) {
        memcpy(dst, p + off, sizeof(float) * d);
        return;
    }
    const uint16_t *m = (const uint16_t *)(p + off);
#if HACK_SIMD
    for (int c = 0; c < d; c += 16) _mm512_storeu_ps(dst + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + c))));
#else
    for (int c = 0; c < d; c++) dst[c] = h2f(m[c]);
#endif
}

#if HACK_SIMD
/* The four horizontal sums of v0..v3 in one vector (lane i: the sum of vi's 16 lanes): one
 * halving and three hadds shared by four sums instead of four separate reductions. */
static inline __m128 hsum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
#define HALF(v) _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(HALF(v0), HALF(v1)), _mm256_hadd_ps(HALF(v2), HALF(v3)));
#undef HALF
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static inline float max4(__m128 s) {
    __m128 m = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

/* One (page, KV head): max over the group's rep query heads of q.min + qp.scale, with qp the
 * query already scaled for the score (see hack_page_scores). The side tables are converted once
 * and held in registers while every query head of the group passes over them, four heads at a
 * time: a query head costs two FMAs a 16-channel block and a quarter of a 4-way reduction. */
#define HEAD_DOT(NV, r, out)                                                                        \
    do {                                                                                            \
        const float *qr_ = q + (r) * 16 * NV, *pr_ = qp + (r) * 16 * NV;                            \
        __m512 s0_ = _mm512_mul_ps(_mm512_loadu_ps(qr_), mn[0]);                                    \
        __m512 s1_ = _mm512_mul_ps(_mm512_loadu_ps(pr_), sc[0]);                                    \
        for (int i_ = 1; i_ < NV; i_++) {                                                           \
            s0_ = _mm512_fmadd_ps(_mm512_loadu_ps(qr_ + 16 * i_), mn[i_], s0_);                     \
            s1_ = _mm512_fmadd_ps(_mm512_loadu_ps(pr_ + 16 * i_), sc[i_], s1_);                     \
        }                                                                                           \
        out = _mm512_add_ps(s0_, s1_);                                                              \
    } while (0)
#define HEAD_BOUND(NV)                                                                              \
    static inline float head_bound_##NV(const uint16_t *m16, const uint16_t *s16, const float *q,   \
                                        const float *qp, int64_t rep) {                             \
        __m512 mn[NV], sc[NV];                                                                      \
        for (int i = 0; i < NV; i++) {                                                              \
            mn[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m16 + 16 * i)));           \
            sc[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s16 + 16 * i)));           \
        }                                                                                           \
        float best = -INFINITY;                                                                     \
        int64_t r = 0;                                                                              \
        for (; r + 4 <= rep; r += 4) {                                                              \
            __m512 v0, v1, v2, v3;                                                                  \
            HEAD_DOT(NV, r, v0);                                                                    \
            HEAD_DOT(NV, r + 1, v1);                                                                \
            HEAD_DOT(NV, r + 2, v2);                                                                \
            HEAD_DOT(NV, r + 3, v3);                                                                \
            float v = max4(hsum4(v0, v1, v2, v3));                                                  \
            best = v > best ? v : best;                                                             \
        }                                                                                           \
        if (r < rep) { /* the last 1-3 heads share one 4-way reduction (SmolLM2: 3 a group) */   \
            const __m512 z = _mm512_setzero_ps();                                                   \
            __m512 v0, v1 = z, v2 = z;                                                              \
            HEAD_DOT(NV, r, v0);                                                                    \
            if (r + 1 < rep) HEAD_DOT(NV, r + 1, v1);                                               \
            if (r + 2 < rep) HEAD_DOT(NV, r + 2, v2);                                               \
            const __m128 s = _mm_mask_mov_ps(_mm_set1_ps(-INFINITY), (__mmask8)((1u << (rep - r)) - 1u), \
                                             hsum4(v0, v1, v2, z));                                 \
            float v = max4(s);                                                                      \
            best = v > best ? v : best;                                                             \
        }                                                                                           \
        return best;                                                                                \
    }
HEAD_BOUND(4)
HEAD_BOUND(8)
#undef HEAD_BOUND
#undef HEAD_DOT
#endif

/* The same for any width and for fp32 side tables, from the side tables already in float. */
static inline float head_bound_any(const float *mn, const float *sc, const float *q, const float *qp, int64_t rep,
                                   int64_t d) {
    float best = -INFINITY;
    for (int64_t r = 0; r < rep; r++) {
        const float *qr = q + r * d, *pr = qp + r * d;
#if HACK_SIMD
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; c += 16) {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + c), _mm512_loadu_ps(mn + c), s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(pr + c), _mm512_loadu_ps(sc + c), s1);
        }
        float v = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#else
        float s0 = 0.0f, s1 = 0.0f;
        for (int64_t c = 0; c < d; c++) { s0 += qr[c] * mn[c]; s1 += pr[c] * sc[c]; }
        float v = s0 + s1;
#endif
        best = v > best ? v : best;
    }
    return best;
}

/* The query as the score weighs a page's scale: L relu(q) for the bound, alpha L q for the
 * linear score (n floats). */
static inline void scaled_query(const hack_select_args *a, const float *q, int64_t n, float *qp) {
    const float mul = a->score == 0 ? (float)a->levels : (float)(a->alpha * a->levels);
    for (int64_t j = 0; j < n; j++) qp[j] = mul * (a->score == 0 ? (q[j] > 0.0f ? q[j] : 0.0f) : q[j]);
}

static int page_scores_f32(const hack_select_args *a) {
    const int64_t B = a->batch, H = a->heads, rep = a->rep, d = a->head_dim, W = a->width;
    if (d > MAX_D || d % 16 || rep < 1 || rep > MAX_REP || H < 1 || H * rep * d > SEL_MAX_QD || W < 1) return -1;
    for (int64_t b = 0; b < B; b++)
        if (a->n_closed[b] < 0 || a->n_closed[b] > W || a->n_closed[b] > a->max_pages) return -1;
    /* items: (request, run of pages), every KV head of a page in turn, so each page's side
     * tables (all heads' minimums, then all heads' scales, each contiguous) are read once */
    const int64_t runs = (W + SEL_PAGES - 1) / SEL_PAGES, n_items = B * runs;
    const int nth = a->nthreads > 0 ? (int)a->nthreads : 1;
    const int64_t meta_bytes = a->meta_fp32 ? 4 : 2;
    if (a->copies && a->copy_bytes < 2 * H * d * meta_bytes) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nth)
    for (int64_t it = 0; it < n_items; it++) {
        const int64_t b = it / runs, p0 = (it % runs) * SEL_PAGES;
        const int64_t p1 = p0 + SEL_PAGES < W ? p0 + SEL_PAGES : W, nc = a->n_closed[b];
        /* where page p of request b keeps its side tables: in its copy (each head's minimum, then
         * each head's scale), or inside the page */
        const uint8_t *copy = a->copies ? (const uint8_t *)(intptr_t)a->copies[b] : NULL;
        const int64_t in_copy = copy ? (a->copied ? a->copied[b] : nc) : 0;
        const float *q = a->q + b * H * rep * d;
        float qp[SEL_MAX_QD]; /* [H * rep * d] */
        scaled_query(a, q, H * rep * d, qp);
        float mn[MAX_D], sc[MAX_D];
        for (int64_t p = p0; p < p1; p++) {
            float *out = a->out + b * H * W + p;
            if (p >= nc) {
                for (int64_t h = 0; h < H; h++) out[h * W] = -INFINITY;
                continue;
            }
            const int from_copy = p < in_copy;
            const uint8_t *page = from_copy ? copy + p * a->copy_bytes
                                            : a->k_pages + a->page_table[b * a->max_pages + p] * a->k_page_bytes;
            const int64_t min_off = from_copy ? 0 : a->k_min_off;
            const int64_t scale_off = from_copy ? H * d * meta_bytes : a->k_scale_off;
            if (from_copy) { /* the copy is streamed: its lines SEL_COPY_AHEAD bytes on are fetched while
                              * this page is scored (a cold copy came in x1.2 faster) */
                const int64_t at = (p + 1) * a->copy_bytes + SEL_COPY_AHEAD, end = in_copy * a->copy_bytes;
                for (int64_t off = at - a->copy_bytes; off < at && off < end; off += 64) __builtin_prefetch(copy + off);
            }
            if (p + 1 >= in_copy && p + 1 < nc) { /* the next page's side tables while this one is scored
                                                   * (1 to 8 pages ahead measured alike warm; a copy is
                                                   * streamed) */
                const uint8_t *next = a->k_pages + a->page_table[b * a->max_pages + p + 1] * a->k_page_bytes;
                for (int64_t off = 0; off < H * d * meta_bytes; off += 64) {
                    __builtin_prefetch(next + a->k_min_off + off);
                    __builtin_prefetch(next + a->k_scale_off + off);
                }
            }
            for (int64_t h = 0; h < H; h++) {
                const float *qh = q + h * rep * d, *ph = qp + h * rep * d;
#if HACK_SIMD
                if (!a->meta_fp32 && (d == 64 || d == 128)) { /* side tables held in registers */
                    const uint16_t *m16 = (const uint16_t *)(page + min_off) + h * d;
                    const uint16_t *s16 = (const uint16_t *)(page + scale_off) + h * d;
                    out[h * W] = d == 64 ? head_bound_4(m16, s16, qh, ph, rep) : head_bound_8(m16, s16, qh, ph, rep);
                    continue;
                }
#endif
                load_meta(page, min_off + h * d * meta_bytes, (int)a->meta_fp32, (int)d, mn);
                load_meta(page, scale_off + h * d * meta_bytes, (int)a->meta_fp32, (int)d, sc);
                out[h * W] = head_bound_any(mn, sc, qh, ph, rep, d);
            }
        }
    }
    return 0;
}

/* One (closed page, KV head)'s score from the side tables inside the page (what
 * hack_page_scores computes for it). mn, sc: MAX_D floats of scratch. */
static inline float page_bound(const hack_select_args *a, const uint8_t *page, int64_t h, const float *qh,
                               const float *ph, float *mn, float *sc) {
    const int64_t d = a->head_dim, meta_bytes = a->meta_fp32 ? 4 : 2;
#if HACK_SIMD
    if (!a->meta_fp32 && (d == 64 || d == 128)) {
        const uint16_t *m16 = (const uint16_t *)(page + a->k_min_off) + h * d;
        const uint16_t *s16 = (const uint16_t *)(page + a->k_scale_off) + h * d;
        return d == 64 ? head_bound_4(m16, s16, qh, ph, a->rep) : head_bound_8(m16, s16, qh, ph, a->rep);
    }
#endif
    load_meta(page, a->k_min_off + h * d * meta_bytes, (int)a->meta_fp32, (int)d, mn);
    load_meta(page, a->k_scale_off + h * d * meta_bytes, (int)a->meta_fp32, (int)d, sc);
    return head_bound_any(mn, sc, qh, ph, a->rep, d);
}

/* The whole one-level selection in one call (hack_ops.sparse.select_pages on page_scores, the
 * reference): for each (request, KV head) the scores of its closed pages, then the first page
 * and the pages from recent_from[b] on kept, the best-scored rest up to budget (a min-heap), the
 * chosen positions sorted, then the open page's position; written as the per-head page table
 * the decode kernel takes (positions and page ids [batch, heads, width], width = min(max
 * n_closed, budget) + 1, padding 0). count[b] = min(n_closed[b], budget). Ties between equal
 * scores may resolve to another page than torch.topk's. With refine > 1 the heap holds refine x
 * the free slots and the slots go to the candidates the decode kernel's own scores rank first
 * (hack_ops.sparse.refine_scores, whose reference scores the dequantized keys in float). */
typedef struct {
    hack_select_args s;   /* the scoring part; s.out: [batch, heads, s.width] scratch scores */
    int64_t budget, out_width;
    const int64_t *recent_from, *num_pages;
    int64_t *positions, *table, *count; /* [batch, heads, out_width] x2, [batch] */
    /* refine > 1: the bound keeps refine x the free slots' pages as candidates, and the free
     * slots go to the candidates whose best score over their own keys (the decode kernel's INT8
     * scores of the page, max over the group's query heads) is highest. 1: the bound alone. */
    int64_t refine, page_size, k_bits, group, k_codes_off, k_sums_off, k_sums_bytes;
    /* two levels (sel_group > 0 pages a group): group boxes[b] points at request b's cached boxes,
     * float [heads, box_cap[b], 2, head_dim] (the group's minimum, then its scale, as
     * hack_ops.sparse.group_boxes makes them), holding at least its middle groups (those before
     * the recent pages' first group); the best keep_groups groups (the first and the recent
     * ones among them) are kept, and only their pages are scored (and refined, with refine > 1).
     * 0: one level. */
    int64_t sel_group, keep_groups;
    const int64_t *boxes, *box_cap;
    /* seq_lens (or NULL): written [batch], each request's shortened length, count[b] * page_size
     * + open_tokens[b] (the open page's tokens): one tensor fewer to compute around the call */
    const int64_t *open_tokens;
    int64_t *seq_lens;
    /* read_total (or NULL): written, the sum of count[b] (the closed pages each KV head reads,
     * over the batch: what a server counts per layer, without reading count back) */
    int64_t *read_total;
} hack_choose_args;

/* The fields of a hack_choose_args that name one layer's K pages (hack_select_pages_at): fixed
 * for the pool's life, so a server builds one per layer once and a decode step's call per layer
 * passes it with the layer's queries instead of setting each field. */
typedef struct {
    int64_t k_page_bytes, k_min_off, k_scale_off, meta_fp32, k_bits, group, k_codes_off, k_sums_off, k_sums_bytes;
    double levels;
    const uint8_t *k_pages;
} hack_select_layer;

static void sift_down(float *hs, int64_t *hi, int64_t n, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && (hs[l] < hs[m] || (hs[l] == hs[m] && hi[l] > hi[m]))) m = l;
        if (r < n && (hs[r] < hs[m] || (hs[r] == hs[m] && hi[r] > hi[m]))) m = r;
        if (m == i) return;
        float ts = hs[i]; hs[i] = hs[m]; hs[m] = ts;
        int64_t ti = hi[i]; hi[i] = hi[m]; hi[m] = ti;
        i = m;
    }
}

/* Offers (v, p) to a min-heap of at most cap entries (the best cap scores seen; ties: the
 * earlier page), m its current size. */
static inline void heap_offer(float *hs, int64_t *hi, int64_t *m, int64_t cap, float v, int64_t p) {
    if (*m < cap) {
        hs[*m] = v; hi[*m] = p; (*m)++;
        if (*m == cap)
            for (int64_t i = *m / 2 - 1; i >= 0; i--) sift_down(hs, hi, *m, i);
    } else if (v > hs[0] || (v == hs[0] && p < hi[0])) {
        hs[0] = v; hi[0] = p;
        sift_down(hs, hi, *m, 0);
    }
}

static int cmp_i64(const void *x, const void *y) {
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

/* The best of m candidate pages by score (ties: the earlier page), the first k of them kept in
 * hi: a selection sort, m is a few dozen. */
static void keep_best(float *sc, int64_t *hi, int64_t m, int64_t k) {
    for (int64_t i = 0; i < k && i < m; i++) {
        int64_t best = i;
        for (int64_t j = i + 1; j < m; j++)
            if (sc[j] > sc[best] || (sc[j] == sc[best] && hi[j] < hi[best])) best = j;
        float ts = sc[i]; sc[i] = sc[best]; sc[best] = ts;
        int64_t ti = hi[i]; hi[i] = hi[best]; hi[best] = ti;
    }
}

/* A closed page's best score for (b, h): the max over its keys and the group's query heads of
 * the decode kernel's own scores (page_scores_quant), so the refinement ranks pages as the
 * attention that reads them will score them. s: rep * page_size floats, ws: the kernel's scratch. */
static float page_best(const hack_decode_args *dec, int64_t b, int64_t h, int64_t page_id, const float *q, float *s,
                       float *ws) {
    item_t it = {dec, b, h, 0, 0, 0, 0};
    const int P = (int)dec->page_size;
    page_scores_quant(&it, page_id, P, q, s, P, ws);
    float best = -INFINITY;
    for (int64_t j = 0; j < dec->rep * P; j++) best = s[j] > best ? s[j] : best;
    return best;
}

/* Refinement: of the m candidates (hs, hi), the k whose best scores over their own keys are
 * highest, in hi[0..k) (m > k). qh: the group's queries, row: the request's page table. */
static void refine_candidates(const hack_decode_args *dec, int64_t b, int64_t h, const int64_t *row,
                              const float *qh, float *hs, int64_t *hi, int64_t m, int64_t k) {
    float s[MAX_REP * MAX_P], ws[MAX_G * MAX_P];
    for (int64_t i = 0; i < m; i++) hs[i] = page_best(dec, b, h, row[hi[i]], qh, s, ws);
    keep_best(hs, hi, m, k);
}

/* Two levels for (request b, KV head h): the closed pages beside the first and the recent ones
 * (pos[0..*n) on entry) chosen up to k, only among the pages of the kept groups (see
 * hack_choose_args). Mirrors hack_ops.sparse.select with group_pages: the groups' own select
 * (the first group and the recent pages' groups kept, the best middle groups by their boxes'
 * bound up to keep_groups), then the best middle pages of the kept groups. Returns -2 where the
 * heap cannot be allocated. */
static int choose_two_level(const hack_choose_args *c, const hack_decode_args *dec, int64_t b, int64_t h, int64_t rf,
                            int64_t k, int64_t *pos, int64_t *n) {
    const hack_select_args *a = &c->s;
    const int64_t H = a->heads, rep = a->rep, d = a->head_dim, G = c->sel_group, nc = a->n_closed[b];
    const int64_t free_k = k - *n;
    if (free_k <= 0) return 0;
    const float *qh = a->q + (b * H + h) * rep * d;
    float qp[MAX_REP * MAX_D], mn[MAX_D], scr[MAX_D];
    scaled_query(a, qh, rep * d, qp);
    const int64_t ng = (nc + G - 1) / G, rg = (c->recent_from[b] > 0 ? c->recent_from[b] : 0) / G;
    const int64_t mid_end = rg < ng ? rg : ng; /* middle groups: [1, mid_end) */
    const int64_t forced = (ng > 0) + (ng > (rg > 1 ? rg : 1) ? ng - (rg > 1 ? rg : 1) : 0);
    const int64_t count_g = ng < c->keep_groups ? ng : c->keep_groups;
    int64_t free_g = count_g - forced;
    const int64_t cap_g = free_g > 0 ? free_g : 1, cand_k = c->refine * free_k; /* the bound's candidates */
    const int64_t heap = cap_g > cand_k ? cap_g : cand_k;
    float *hs = (float *)malloc(sizeof(float) * (size_t)heap);
    int64_t *hi = (int64_t *)malloc(sizeof(int64_t) * (size_t)heap);
    unsigned char *kept = (unsigned char *)calloc((size_t)(ng > 0 ? ng : 1), 1);
    if (!hs || !hi || !kept) { free(hs); free(hi); free(kept); return -2; }
    for (int64_t g = 0; g < ng; g++) kept[g] = g == 0 || g >= rg;
    int64_t m = 0;
    if (free_g > 0) {
        const float *box = (const float *)(intptr_t)c->boxes[b];
        const int64_t cap = c->box_cap[b];
        for (int64_t g = 1; g < mid_end; g++) {
            const float *gb = box + ((h * cap + g) * 2) * d;
            heap_offer(hs, hi, &m, free_g, head_bound_any(gb, gb + d, qh, qp, rep, d), g);
        }
        for (int64_t i = 0; i < m; i++) kept[hi[i]] = 1;
    }
    const uint8_t *k_pages = a->k_pages;
    const int64_t *row = a->page_table + b * a->max_pages;
    const int64_t meta = (a->meta_fp32 ? 4 : 2) * d, lines = (meta + 63) / 64;
    /* the candidates' side tables are one head's slice of pages far apart: fetched SEL_AHEAD
     * candidates ahead, or each page waits on memory (the one-level pass reads every head of a
     * page at once, in page order, and the hardware prefetches it) */
#define SEL_AHEAD 8
    int64_t cand[SEL_AHEAD], nq = 0, done = 0, next = 1; /* a ring: cand[done % SEL_AHEAD] is scored next */
    m = 0;
    for (;;) {
        while (nq < SEL_AHEAD && next < rf && next < nc) { /* queue the next candidates, fetching them */
            const int64_t p = next++;
            if (!kept[p / G]) continue;
            const uint8_t *pg = k_pages + row[p] * a->k_page_bytes;
            for (int64_t l = 0; l < lines; l++) {
                __builtin_prefetch(pg + a->k_min_off + h * meta + 64 * l);
                __builtin_prefetch(pg + a->k_scale_off + h * meta + 64 * l);
            }
            cand[(done + nq++) % SEL_AHEAD] = p;
        }
        if (nq == 0) break;
        const int64_t p = cand[done++ % SEL_AHEAD];
        nq--;
        heap_offer(hs, hi, &m, cand_k, page_bound(a, k_pages + row[p] * a->k_page_bytes, h, qh, qp, mn, scr), p);
    }
#undef SEL_AHEAD
    if (m > free_k) { /* refine: the candidates' best scores over their own keys choose */
        refine_candidates(dec, b, h, row, qh, hs, hi, m, free_k);
        m = free_k;
    }
    for (int64_t i = 0; i < m; i++) pos[(*n)++] = hi[i];
    /* fewer candidates than slots (never with group_keep >= 1 past the first levels): the
     * earliest pages of the dropped groups fill them, so every head still reads k pages */
    for (int64_t p = 1; p < rf && p < nc && *n < k; p++)
        if (!kept[p / G]) pos[(*n)++] = p;
    free(hs);
    free(hi);
    free(kept);
    return 0;
}

static int select_pages_f32(const hack_choose_args *c) {
    const hack_select_args *a = &c->s;
    const int64_t B = a->batch, H = a->heads, W = a->width, K = c->budget, OW = c->out_width;
    if (K < 1 || OW < 2) return -1;
    for (int64_t b = 0; b < B; b++) {
        int64_t nc = a->n_closed[b];
        if ((nc < K ? nc : K) + 1 > OW || c->num_pages[b] < 1 || c->num_pages[b] > a->max_pages) return -1;
    }
    const int64_t R = c->refine;
    if (R < 1 || (c->seq_lens && (!c->open_tokens || c->page_size < 1))) return -1;
    if (R > 1 && (a->head_dim % 64 || a->rep > MAX_REP || c->page_size < 1 || c->page_size > MAX_P ||
                  c->group < 1 || a->head_dim % c->group || a->head_dim / c->group > MAX_G))
        return -1;
    const int64_t G = c->sel_group;
    if (G < 0 || (G > 0 && (c->keep_groups < 1 || !c->boxes || !c->box_cap || a->head_dim > MAX_D ||
                            a->head_dim % 16 || a->rep > MAX_REP)))
        return -1;
    for (int64_t b = 0; G > 0 && b < B; b++) { /* the boxes must hold every middle group */
        const int64_t rg = (c->recent_from[b] > 0 ? c->recent_from[b] : 0) / G;
        if (a->n_closed[b] < 0 || a->n_closed[b] > a->max_pages || (rg > 1 && (!c->boxes[b] || c->box_cap[b] < rg)))
            return -1;
    }
    if (G == 0) { /* one level: every closed page scored first */
        int rc = page_scores_f32(a);
        if (rc) return rc;
    }
    hack_decode_args dec; /* what page_scores_quant reads of a decode call */
    memset(&dec, 0, sizeof(dec));
    dec.heads = H; dec.rep = a->rep; dec.head_dim = a->head_dim; dec.page_size = c->page_size;
    dec.k_bits = c->k_bits; dec.group = c->group; dec.meta_fp32 = a->meta_fp32; dec.k_pages = a->k_pages;
    dec.k_page_bytes = a->k_page_bytes; dec.k_codes_off = c->k_codes_off; dec.k_min_off = a->k_min_off;
    dec.k_scale_off = a->k_scale_off; dec.k_sums_off = c->k_sums_off; dec.k_sums_bytes = c->k_sums_bytes;
    const int nth = a->nthreads > 0 ? (int)a->nthreads : 1;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nth) reduction(| : failed)
    for (int64_t it = 0; it < B * H; it++) {
        const int64_t b = it / H, nc = a->n_closed[b], k = nc < K ? nc : K;
        const float *sc = a->out + it * W;
        int64_t *pos = c->positions + it * OW, *tab = c->table + it * OW;
        const int64_t rf = c->recent_from[b] > 1 ? c->recent_from[b] : 1;
        int64_t n = 0, free_k;
        if (nc > 0) pos[n++] = 0; /* the first page (sinks) */
        for (int64_t p = rf; p < nc && n < k; p++) pos[n++] = p; /* the recent pages */
        free_k = k - n;
        if (G > 0) {
            if (choose_two_level(c, &dec, b, it % H, rf, k, pos, &n)) { failed = 1; continue; }
        } else if (free_k > 0) { /* the best of the pages between them: a min-heap of the candidates */
            const int64_t cand = R * free_k;
            float *hs = (float *)malloc(sizeof(float) * cand);
            int64_t *hi = (int64_t *)malloc(sizeof(int64_t) * cand);
            if (!hs || !hi) { free(hs); free(hi); failed = 1; continue; }
            int64_t m = 0;
            for (int64_t p = 1; p < rf && p < nc; p++) heap_offer(hs, hi, &m, cand, sc[p], p);
            if (m > free_k) { /* refine: each candidate's best score over its own keys */
                refine_candidates(&dec, b, it % H, a->page_table + b * a->max_pages,
                                  a->q + (b * H + it % H) * a->rep * a->head_dim, hs, hi, m, free_k);
                m = free_k;
            }
            for (int64_t i = 0; i < m; i++) pos[n++] = hi[i];
            free(hs);
            free(hi);
        }
        qsort(pos, (size_t)n, sizeof(int64_t), cmp_i64);
        pos[n] = nc; /* the open page (read from the FP16 tail) */
        for (int64_t j = n + 1; j < OW; j++) pos[j] = 0;
        const int64_t *row = a->page_table + b * a->max_pages, last = c->num_pages[b] - 1;
        for (int64_t j = 0; j < OW; j++) tab[j] = row[pos[j] < last ? pos[j] : last];
        if (it % H == 0) {
            c->count[b] = n;
            if (c->seq_lens) c->seq_lens[b] = n * c->page_size + c->open_tokens[b];
        }
    }
    if (failed) return -2;
    if (c->read_total) {
        int64_t total = 0;
        for (int64_t b = 0; b < B; b++) total += c->count[b];
        *c->read_total = total;
    }
    return 0;
}

/* a's queries as float32: a->q itself, or a converted copy in *owned (free it); NULL on a bad
 * q_dtype or a failed allocation. */
static const float *q_float(const hack_select_args *a, float **owned) {
    *owned = NULL;
    if (a->q_dtype == 0) return a->q;
    if (a->q_dtype != 1 && a->q_dtype != 2) return NULL;
    const int64_t n = a->batch * a->heads * a->rep * a->head_dim;
    float *f = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!f) return NULL;
    const uint16_t *h = (const uint16_t *)a->q;
    if (a->q_dtype == 1) {
        for (int64_t i = 0; i < n; i++) {
            const uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(f + i, &bits, sizeof(bits));
        }
    } else {
        for (int64_t i = 0; i < n; i++) f[i] = h2f(h[i]);
    }
    *owned = f;
    return f;
}

int hack_page_scores(const hack_select_args *a) {
    float *owned;
    hack_select_args s = *a;
    if (!(s.q = q_float(a, &owned))) return a->q_dtype == 1 || a->q_dtype == 2 ? -2 : -1;
    s.q_dtype = 0;
    const int rc = page_scores_f32(&s);
    free(owned);
    return rc;
}

int hack_select_pages(const hack_choose_args *c) {
    float *owned;
    hack_choose_args cf = *c;
    if (!(cf.s.q = q_float(&c->s, &owned))) return c->s.q_dtype == 1 || c->s.q_dtype == 2 ? -2 : -1;
    cf.s.q_dtype = 0;
    const int rc = select_pages_f32(&cf);
    free(owned);
    return rc;
}

/* hack_select_pages with layer ly's K pages, queries q (in c's q_dtype) and the layer's copies
 * (copies/copied NULL: read in the pages) in place of c's: one step's arguments serve every
 * layer (c is not changed). */
int hack_select_pages_at(const hack_choose_args *c, const hack_select_layer *ly, const void *q,
                         const int64_t *copies, const int64_t *copied, int64_t copy_bytes) {
    hack_choose_args cf = *c;
    cf.s.k_page_bytes = ly->k_page_bytes; cf.s.k_min_off = ly->k_min_off; cf.s.k_scale_off = ly->k_scale_off;
    cf.s.meta_fp32 = ly->meta_fp32; cf.s.levels = ly->levels; cf.s.k_pages = ly->k_pages;
    cf.k_bits = ly->k_bits; cf.group = ly->group; cf.k_codes_off = ly->k_codes_off; cf.k_sums_off = ly->k_sums_off;
    cf.k_sums_bytes = ly->k_sums_bytes;
    cf.s.q = (const float *)q;
    cf.s.copies = copies; cf.s.copied = copied; cf.s.copy_bytes = copy_bytes;
    return hack_select_pages(&cf);
}
