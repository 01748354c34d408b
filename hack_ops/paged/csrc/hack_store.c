/* The HACK page store: one call stores one layer's new K/V of a whole forward batch.
 *
 * It does what hack_ops/paged/write.py (the PyTorch reference) does for orientation
 * 'channel_k', nearest rounding and requantization elimination, and leaves the same bytes:
 *   - sink positions (< sink_tokens): FP16 K and V into the sequence's sink slot;
 *   - a page whose last offset arrives is quantized once, whole: K per channel over the page's
 *     non-sink tokens (FP16 values: the row's tail overlaid with the new tokens), its per-token
 *     code sums per head_dim group, and V per token when V has a tail;
 *   - without a V tail, V is quantized per token as it is written, from the input precision;
 *   - new tokens of a page that stays open go to the row's FP16 tail(s).
 * Bit-identity with hack_ops.quant.quantize: the same float32 operations in the same order
 * (no FMA contraction: built with -ffp-contract=off), the IEEE quotient's rounding (a reciprocal
 * multiply checked against half-integers, see rint_quotients), round-half-even (rintf),
 * fp16 metadata rounded toward -inf (minimum) / +inf (scale) by stepping the fp16 bits as
 * quant._step_toward does, and the range search's squared-error sums added in the order of
 * torch's CPU sum kernel for the layout the reference reduces (see err_reduce below).
 * Threads: OpenMP over (page, KV head) work items; the tails are written after every page has
 * been read, because a closing page reads the tail row that the same write refills. */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
/* full-width vectors for the elementwise loops (gcc prefers 256 bits on some AVX-512 CPUs) */
#pragma GCC target("prefer-vector-width=512")
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#define ST_MAX_D 256
#define ST_MAX_P 256

enum { IN_F32 = 0, IN_F16 = 1, IN_BF16 = 2 };
enum { SUM_ROWS = 0, SUM_INNER = 1 }; /* the two reduction orders, see err_reduce */

typedef struct {
    int64_t batch, heads, head_dim, page_size, k_bits, v_bits, group, sink_tokens; /* K and V codes may differ */
    int64_t meta_fp32, v_tail, range_search, in_dtype, inner_width, max_pages, nthreads;
    int64_t k_page_bytes, k_codes_off, k_min_off, k_scale_off, k_sums_off, k_sums_bytes;
    int64_t v_page_bytes, v_codes_off, v_min_off, v_scale_off;
    const int64_t *qo_indptr;   /* [B+1] new tokens of request b: [qo[b], qo[b+1]) */
    const int64_t *prefix_lens; /* [B] tokens cached before this forward */
    const int64_t *rows;        /* [B] tail row of each request */
    const int64_t *page_table;  /* [B, max_pages] page ids */
    const int64_t *sink_slots;  /* [B] sink slot (-1: none) */
    const void *k, *v;          /* [N, H, D] contiguous, in_dtype */
    uint8_t *k_pages, *v_pages; /* [num_pages, *_page_bytes] */
    _Float16 *tail_k, *tail_v;  /* [rows, P, H, D]; tail_v NULL without a V tail */
    _Float16 *sink_k, *sink_v;  /* [slots, S, H, D] */
} hack_store_args;

static const float CLIP[5] = {0.0f, 0.05f, 0.1f, 0.2f, 0.3f}; /* hack_ops.quant.CLIP_GRID */

static inline float load_in(const void *p, int64_t i, int dt) {
    if (dt == IN_F32) return ((const float *)p)[i];
    if (dt == IN_F16) return (float)((const _Float16 *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* n input values from element i on as floats, rounded through FP16 when `via_f16` (what the
 * page holds); the dtype switch is outside the loops so that each one vectorizes. */
static void load_row(const void *p, int64_t i, int dt, int via_f16, float *out, int64_t n) {
    if (dt == IN_F32) {
        const float *x = (const float *)p + i;
        if (via_f16) for (int64_t j = 0; j < n; j++) out[j] = (float)(_Float16)x[j];
        else for (int64_t j = 0; j < n; j++) out[j] = x[j];
    } else if (dt == IN_F16) {
        const _Float16 *x = (const _Float16 *)p + i;
        for (int64_t j = 0; j < n; j++) out[j] = (float)x[j];
    } else {
        const uint16_t *x = (const uint16_t *)p + i;
        int64_t j = 0;
#if defined(__AVX512F__)
        /* gcc keeps the FP16 round trip scalar: 16 at a time here (vcvtps2ph rounds to nearest even,
         * as the C conversion does) */
        for (; j + 16 <= n; j += 16) {
            const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + j))), 16);
            __m512 f = _mm512_castsi512_ps(u);
            if (via_f16) f = _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm512_storeu_ps(out + j, f);
        }
#endif
        for (; j < n; j++) {
            const uint32_t u = (uint32_t)x[j] << 16;
            float f;
            memcpy(&f, &u, 4);
            out[j] = via_f16 ? (float)(_Float16)f : f;
        }
    }
}

typedef union { _Float16 h; uint16_t u; } half_bits;

/* quant._step_toward for fp16 metadata over n values: the largest fp16 <= x[i] (down) or the
 * smallest fp16 >= x[i] (up), as floats; float32 metadata is x itself. Written branch-free
 * over arrays so that it vectorizes (vcvtps2ph / vcvtph2ps). */
static inline __attribute__((always_inline)) void step_meta(const float *x, float *out, int64_t n, int down, int fp32) {
    if (fp32) {
        for (int64_t i = 0; i < n; i++) out[i] = x[i];
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        half_bits y = {.h = (_Float16)x[i]};
        const float yf = (float)y.h;
        const int wrong = down ? yf > x[i] : yf < x[i];
        /* one fp16 step toward -inf (down) or +inf (up); from a zero, the smallest subnormal */
        const uint16_t away = (uint16_t)(y.u + 1), toward = (uint16_t)(y.u - 1);
        const uint16_t step = yf == 0.0f ? (down ? 0x8001u : 0x0001u) : ((yf < 0.0f) == down ? away : toward);
        half_bits z = {.u = wrong ? step : y.u};
        out[i] = (float)z.h;
    }
}

/* Sum of e[i * cols + c] over i < n for every column c, in the order of torch's CPU sum
 * (aten/src/ATen/native/cpu/SumKernel.cpp), which the reference's err.sum(-1) uses:
 *  SUM_ROWS  the reduced dim is not the contiguous one (K per channel: the page's tokens):
 *            vectorized across columns, each column a multi_row_sum (blocks of 16 rows summed
 *            in sequence, block sums accumulated on 4 levels);
 *  SUM_INNER the reduced dim is contiguous (V per token: a head_dim group): vectors of `w`
 *            lanes, row_sum over them with 4 interleaved partial sums, then the scalar
 *            remainder, then the lanes in order.
 * hack_store_sum_check() lets the Python side confirm both against this torch build. */
static void multi_row_sum(const float *e, int64_t n, int64_t row_step, int64_t cols, float *out, float *scratch) {
    /* scratch: 4 * cols floats (the four levels); rows i = 0..n-1 at e + i * row_step * cols */
    float *acc0 = scratch, *acc1 = scratch + cols, *acc2 = scratch + 2 * cols, *acc3 = scratch + 3 * cols;
    float *acc[4] = {acc0, acc1, acc2, acc3};
    for (int64_t c = 0; c < 4 * cols; c++) scratch[c] = 0.0f;
    const int64_t level_power = 4, level_step = 16, level_mask = 15; /* n <= 2^16 */
    int64_t i = 0;
    while (i + level_step <= n) {
        for (int64_t j = 0; j < level_step; j++, i++) {
            const float *row = e + i * row_step * cols;
            for (int64_t c = 0; c < cols; c++) acc0[c] += row[c];
        }
        for (int lv = 1; lv < 4; lv++) {
            for (int64_t c = 0; c < cols; c++) {
                acc[lv][c] += acc[lv - 1][c];
                acc[lv - 1][c] = 0.0f;
            }
            if ((i & (level_mask << (lv * level_power))) != 0) break;
        }
    }
    for (; i < n; i++) {
        const float *row = e + i * row_step * cols;
        for (int64_t c = 0; c < cols; c++) acc0[c] += row[c];
    }
    for (int lv = 1; lv < 4; lv++)
        for (int64_t c = 0; c < cols; c++) acc0[c] += acc[lv][c];
    for (int64_t c = 0; c < cols; c++) out[c] = acc0[c];
}

/* e: [n][cols]; out[cols]; scratch: >= (4 + 4 * w + w) * cols floats */
static inline __attribute__((always_inline)) void err_reduce(const float *e, int64_t n, int64_t cols, int order, int64_t w, float *out, float *scratch) {
    if (order == SUM_ROWS) {
        if (n > 256) {
            multi_row_sum(e, n, 1, cols, out, scratch);
            return;
        }
        /* n <= 256: multi_row_sum is blocks of 16 rows, each summed in sequence, the block sums
         * added in sequence, a last partial block added to that (e >= +0, so 0 + x = x) */
        float *acc0 = scratch, *acc1 = scratch + cols;
        int64_t i = 0;
        for (int64_t c = 0; c < cols; c++) acc1[c] = 0.0f;
        for (; i + 16 <= n; i += 16) {
            for (int64_t c = 0; c < cols; c++) acc0[c] = e[i * cols + c];
            for (int64_t j = 1; j < 16; j++)
                for (int64_t c = 0; c < cols; c++) acc0[c] += e[(i + j) * cols + c];
            for (int64_t c = 0; c < cols; c++) acc1[c] += acc0[c];
        }
        if (i < n) {
            for (int64_t c = 0; c < cols; c++) acc0[c] = e[i * cols + c];
            for (int64_t j = i + 1; j < n; j++)
                for (int64_t c = 0; c < cols; c++) acc0[c] += e[j * cols + c];
            for (int64_t c = 0; c < cols; c++) out[c] = acc0[c] + acc1[c];
        } else {
            for (int64_t c = 0; c < cols; c++) out[c] = acc1[c];
        }
        return;
    }
    /* SUM_INNER: element i = vector r = i / w, lane l = i % w. row_sum splits the vectors into
     * 4 interleaved partial sums (vector r goes to partial r % 4), each a multi_row_sum over
     * nilp vectors; vectors beyond 4 * nilp are added to partial 0; then the partials are added
     * lane-wise, and the lanes after the scalar remainder. */
    const int64_t nvec = n / w, nilp = nvec / 4;
    float *part = scratch + 4 * cols; /* [4 * w][cols]: partial (r % 4), lane l at row (r % 4) * w + l */
    float *tmp = part + 4 * w * cols;  /* [cols] */
    if (nilp <= 16) { /* a multi_row_sum of <= 16 items is their sum in sequence */
        for (int64_t c = 0; c < 4 * w * cols; c++) part[c] = 0.0f;
        for (int64_t i = 0; i < nilp * 4 * w; i++) {
            float *pr = part + (i % (4 * w)) * cols;
            for (int64_t c = 0; c < cols; c++) pr[c] += e[i * cols + c];
        }
    } else {
        for (int k = 0; k < 4; k++)
            for (int64_t l = 0; l < w; l++)
                multi_row_sum(e + ((int64_t)k * w + l) * cols, nilp, 4 * w, cols, part + ((int64_t)k * w + l) * cols,
                              scratch);
    }
    for (int64_t r = nilp * 4; r < nvec; r++)
        for (int64_t l = 0; l < w; l++)
            for (int64_t c = 0; c < cols; c++) part[l * cols + c] += e[(r * w + l) * cols + c];
    for (int k = 1; k < 4; k++)
        for (int64_t l = 0; l < w; l++)
            for (int64_t c = 0; c < cols; c++) part[l * cols + c] += part[((int64_t)k * w + l) * cols + c];
    for (int64_t c = 0; c < cols; c++) tmp[c] = 0.0f;
    for (int64_t i = nvec * w; i < n; i++)
        for (int64_t c = 0; c < cols; c++) tmp[c] += e[i * cols + c];
    for (int64_t l = 0; l < w; l++)
        for (int64_t c = 0; c < cols; c++) tmp[c] += part[l * cols + c];
    for (int64_t c = 0; c < cols; c++) out[c] = tmp[c];
}

typedef struct {
    float *x;             /* [n][cols] the groups being quantized (group c = column c) */
    float *xc;            /* [n][CW] one chunk of them */
    float *e;             /* [n][CW] squared errors of one range candidate */
    float *red;           /* err_reduce's accumulators */
    float *page;          /* [P][D] one head's FP16 page content or new V tokens, as floats */
    float *out_min, *out_scale; /* [cols] what quantize_cols leaves */
    uint8_t *codes;       /* [n][cols] */
    uint8_t *tok_codes;   /* [P][D] codes of one head's tokens, before packing */
} scratch_t;

#define ST_COLS (ST_MAX_D > ST_MAX_P ? ST_MAX_D : ST_MAX_P)
#define ST_VECS 2 /* out_min, out_scale */

static int scratch_alloc(scratch_t *s, int64_t w) {
    const int64_t nc = (int64_t)ST_MAX_P * ST_MAX_D;
    float *f = (float *)malloc(sizeof(float) * (4 * nc + (4 + 5 * w) * ST_COLS + ST_VECS * ST_COLS));
    uint8_t *c = (uint8_t *)malloc(2 * nc);
    if (!f || !c) { free(f); free(c); return -1; }
    s->x = f;
    s->e = f + nc;
    s->page = f + 2 * nc;
    s->xc = f + 3 * nc;
    s->red = f + 4 * nc;
    float *m = s->red + (4 + 5 * w) * ST_COLS;
    float **vecs[ST_VECS] = {&s->out_min, &s->out_scale};
    for (int i = 0; i < ST_VECS; i++) *vecs[i] = m + i * ST_COLS;
    s->codes = c;
    s->tok_codes = c + nc;
    return 0;
}

static void scratch_free(scratch_t *s) { free(s->x); free(s->codes); }

/* q[c] = rintf((x[c] - lo[c]) / sc[c]) for the CW groups of one row, without a division per
 * element (divisions were most of the range search's time): r = (x - lo) * inv, inv = 1/sc
 * rounded, lies within 2^-22 (relative) of the exact quotient, so within 2^-16 of the correctly
 * rounded one wherever |quotient| <= 32, and rint(r) equals rint(quotient) unless r is within
 * 2^-16 of a half-integer; beyond 32 both clamp to the same code (levels <= 15). A row with such
 * an element (a few percent: FP16 values often divide to exact halves) or a non-finite r is
 * redone with the division, so the codes are the reference's bit for bit
 * (tests/test_cpu_store.py builds rows of exact ties to check it). */
#define CW 16 /* groups per chunk: one AVX-512 vector of floats */
#define QUOT_TOL (1.0f / 65536.0f)
static inline void rint_quotients(const float *x, const float *lo, const float *sc, const float *inv, float *q) {
    int near_half = 0;
    for (int c = 0; c < CW; c++) {
        const float r = (x[c] - lo[c]) * inv[c];
        const float qr = rintf(r);
        near_half |= !(fabsf(fabsf(r - qr) - 0.5f) > QUOT_TOL);
        q[c] = qr;
    }
    if (near_half)
        for (int c = 0; c < CW; c++) q[c] = rintf((x[c] - lo[c]) / sc[c]);
}

#if defined(__AVX512F__)
/* rint_quotients on one vector (AVX-512 builds; the plain C above is the portable build's) */
static inline __m512 rint_quotients16(__m512 x, __m512 lo, __m512 sc, __m512 inv) {
    const __m512 d = _mm512_sub_ps(x, lo), r = _mm512_mul_ps(d, inv);
    const __m512 q = _mm512_roundscale_ps(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* |r - rint(r)| <= 0.5 always: r is near a half-integer iff that distance is near 0.5 (a NaN fails too) */
    const __m512 f = _mm512_abs_ps(_mm512_sub_ps(r, q));
    if (_mm512_cmp_ps_mask(f, _mm512_set1_ps(0.5f - QUOT_TOL), _CMP_LT_OQ) == 0xFFFF) return q;
    return _mm512_roundscale_ps(_mm512_div_ps(d, sc), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* The C's clamp q < 0 ? 0 : (q > lv ? lv : q) as min/max, which differ from it only in
 * turning a -0 into +0: the error then adds +-0 to a minimum that is never -0, and the code is
 * 0 either way, so nothing stored changes. */
static inline __m512 clamp16(__m512 q, __m512 lv) {
    return _mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), lv);
}

/* One range candidate's squared error of row i, the quantize_chunk loop's formula; a mask
 * factor of 1 is skipped (x * 1 = x exactly), a 0 is applied as the C does. */
static inline __m512 cand_err16(const float *row, __m512 loq, __m512 sc, __m512 inv, __m512 cmf, int cm_ones,
                                float rowf, __m512 lv) {
    const __m512 x = _mm512_loadu_ps(row);
    const __m512 q = clamp16(rint_quotients16(x, loq, sc, inv), lv);
    __m512 t = _mm512_mul_ps(q, sc);
    t = _mm512_add_ps(t, loq);
    t = _mm512_sub_ps(t, x);
    t = _mm512_mul_ps(t, t);
    if (!cm_ones) t = _mm512_mul_ps(t, cmf);
    return rowf == 1.0f ? t : _mm512_mul_ps(t, _mm512_set1_ps(rowf));
}
#endif

/* quant.quantize of CW groups of n values each (group c = x[i * CW + c]); an element is valid
 * iff rmask[i] (NULL: all) and cm[c]. Codes ([n][CW]) go to codes, the stored minimum / scale
 * per group (floats equal to the stored meta values) to out_min / out_scale. Every operation is
 * per group, so chunking the groups by CW changes no result; the fixed width lets the compiler
 * keep a row of a chunk in one vector. */
static void quantize_chunk(scratch_t *s, const float *x, int64_t n, const uint8_t *rmask, const uint8_t *cm,
                           int levels, int meta_fp32, int range_search, int order, int64_t w, uint8_t *codes,
                           float *out_min, float *out_scale) {
    float mn[CW], mx[CW], lo[CW], hi[CW], loq[CW], sc[CW], inv[CW], err[CW], best_err[CW], best_lo[CW],
        best_hi[CW], rng[CW], cmf[CW], qv[CW];
    const float lv = (float)levels;
    for (int c = 0; c < CW; c++) { mn[c] = INFINITY; mx[c] = -INFINITY; }
    for (int64_t i = 0; i < n; i++) {
        if (rmask && !rmask[i]) continue;
        const float *row = x + i * CW;
        for (int c = 0; c < CW; c++) {
            mn[c] = row[c] < mn[c] ? row[c] : mn[c];
            mx[c] = row[c] > mx[c] ? row[c] : mx[c];
        }
    }
    for (int c = 0; c < CW; c++) {
        if (mn[c] > mx[c] || !cm[c]) { mn[c] = 0.0f; mx[c] = 0.0f; } /* an empty group */
        mn[c] = mn[c] + 0.0f; /* a zero minimum is +0 (quant.quantize) */
    }
    if (range_search) {
        for (int c = 0; c < CW; c++) cmf[c] = cm[c] ? 1.0f : 0.0f;
        for (int c = 0; c < CW; c++) { rng[c] = mx[c] - mn[c]; best_lo[c] = mn[c]; best_hi[c] = mx[c]; }
        for (int cand = 0; cand < 25; cand++) {
            const float a = CLIP[cand / 5], b = CLIP[cand % 5];
            if (cand % 5 == 0) { /* lo and its stored value depend on a only */
                for (int c = 0; c < CW; c++) {
                    const float ar = a * rng[c];
                    lo[c] = mn[c] + ar;
                }
                step_meta(lo, loq, CW, 1, meta_fp32);
            }
            for (int c = 0; c < CW; c++) {
                const float br = b * rng[c];
                hi[c] = mx[c] - br;
                sc[c] = (hi[c] - loq[c]) / lv;
            }
            step_meta(sc, sc, CW, 0, meta_fp32);
            for (int c = 0; c < CW; c++) sc[c] = sc[c] <= 0.0f ? 1.0f : sc[c];
            for (int c = 0; c < CW; c++) inv[c] = 1.0f / sc[c];
#if defined(__AVX512F__)
            const __m512 loqv = _mm512_loadu_ps(loq), scv = _mm512_loadu_ps(sc), invv = _mm512_loadu_ps(inv),
                         cmv = _mm512_loadu_ps(cmf), lvv = _mm512_set1_ps(lv);
            const int cm_ones = _mm512_cmp_ps_mask(cmv, _mm512_set1_ps(1.0f), _CMP_EQ_OQ) == 0xFFFF;
#define ROWF(i) ((!rmask || rmask[i]) ? 1.0f : 0.0f)
            if (order == SUM_ROWS && n <= 256) {
                /* err_reduce's SUM_ROWS order for n <= 256, summed as the errors are made */
                __m512 acc1 = _mm512_setzero_ps(), acc0;
                int64_t i = 0;
                for (; i + 16 <= n; i += 16) {
                    acc0 = cand_err16(x + i * CW, loqv, scv, invv, cmv, cm_ones, ROWF(i), lvv);
                    for (int64_t j = i + 1; j < i + 16; j++)
                        acc0 = _mm512_add_ps(acc0, cand_err16(x + j * CW, loqv, scv, invv, cmv, cm_ones, ROWF(j), lvv));
                    acc1 = _mm512_add_ps(acc1, acc0);
                }
                if (i < n) {
                    acc0 = cand_err16(x + i * CW, loqv, scv, invv, cmv, cm_ones, ROWF(i), lvv);
                    for (int64_t j = i + 1; j < n; j++)
                        acc0 = _mm512_add_ps(acc0, cand_err16(x + j * CW, loqv, scv, invv, cmv, cm_ones, ROWF(j), lvv));
                    acc1 = _mm512_add_ps(acc0, acc1);
                }
                _mm512_storeu_ps(err, acc1);
            } else if (order == SUM_INNER && (n / w) / 4 <= 16) {
                /* err_reduce's SUM_INNER order (nilp <= 16), summed as the errors are made */
                const int64_t nvec = n / w, w4 = 4 * w, head = (nvec / 4) * w4;
                __m512 part[4 * 64], tmp = _mm512_setzero_ps();
                for (int64_t k = 0; k < w4; k++) part[k] = _mm512_setzero_ps();
                int64_t i = 0;
                for (int64_t k = 0; i < head; i++, k = k + 1 == w4 ? 0 : k + 1)
                    part[k] = _mm512_add_ps(part[k], cand_err16(x + i * CW, loqv, scv, invv, cmv, cm_ones, ROWF(i), lvv));
                for (int64_t l = 0; i < nvec * w; i++, l = l + 1 == w ? 0 : l + 1)
                    part[l] = _mm512_add_ps(part[l], cand_err16(x + i * CW, loqv, scv, invv, cmv, cm_ones, ROWF(i), lvv));
                for (int64_t k = 1; k < 4; k++)
                    for (int64_t l = 0; l < w; l++) part[l] = _mm512_add_ps(part[l], part[k * w + l]);
                for (; i < n; i++) tmp = _mm512_add_ps(tmp, cand_err16(x + i * CW, loqv, scv, invv, cmv, cm_ones, ROWF(i), lvv));
                for (int64_t l = 0; l < w; l++) tmp = _mm512_add_ps(tmp, part[l]);
                _mm512_storeu_ps(err, tmp);
            } else {
                for (int64_t i = 0; i < n; i++)
                    _mm512_storeu_ps(s->e + i * CW, cand_err16(x + i * CW, loqv, scv, invv, cmv, cm_ones, ROWF(i), lvv));
                err_reduce(s->e, n, CW, order, w, err, s->red);
            }
#undef ROWF
#else
            for (int64_t i = 0; i < n; i++) {
                const float *row = x + i * CW;
                float *er = s->e + i * CW;
                const float rowf = (!rmask || rmask[i]) ? 1.0f : 0.0f;
                rint_quotients(row, loq, sc, inv, qv);
                for (int c = 0; c < CW; c++) {
                    float q = qv[c];
                    q = q < 0.0f ? 0.0f : (q > lv ? lv : q);
                    float t = q * sc[c]; /* (c * s + lo_q - g) ** 2, one rounding per op */
                    t = t + loq[c];
                    t = t - row[c];
                    t = t * t;
                    er[c] = t * cmf[c] * rowf; /* masked: the reference's e * m, x * 0 = +0 */
                }
            }
            err_reduce(s->e, n, CW, order, w, err, s->red);
#endif
            for (int c = 0; c < CW; c++) {
                if (cand == 0) best_err[c] = err[c];
                else if (err[c] < best_err[c]) { /* ties keep the earlier candidate */
                    best_err[c] = err[c];
                    best_lo[c] = lo[c];
                    best_hi[c] = hi[c];
                }
            }
        }
        for (int c = 0; c < CW; c++) { mn[c] = best_lo[c]; mx[c] = best_hi[c]; }
    }
    step_meta(mn, out_min, CW, 1, meta_fp32);
    for (int c = 0; c < CW; c++) out_scale[c] = (mx[c] - out_min[c]) / lv;
    step_meta(out_scale, out_scale, CW, 0, meta_fp32);
    for (int c = 0; c < CW; c++) /* a zero range gets scale 1 */
        out_scale[c] = (out_scale[c] <= 0.0f || mx[c] <= mn[c]) ? 1.0f : out_scale[c];
    for (int c = 0; c < CW; c++) inv[c] = 1.0f / out_scale[c];
    for (int64_t i = 0; i < n; i++) {
        const float *row = x + i * CW;
        uint8_t *cr = codes + i * CW;
        const int rv = !rmask || rmask[i];
#if defined(__AVX512F__)
        _mm512_storeu_ps(qv, rint_quotients16(_mm512_loadu_ps(row), _mm512_loadu_ps(out_min),
                                              _mm512_loadu_ps(out_scale), _mm512_loadu_ps(inv)));
#else
        rint_quotients(row, out_min, out_scale, inv, qv);
#endif
        for (int c = 0; c < CW; c++) {
            float q = qv[c];
            q = q < 0.0f ? 0.0f : (q > lv ? lv : q);
            cr[c] = (rv && cm[c]) ? (uint8_t)q : 0;
        }
    }
}

/* quant.quantize of `cols` groups of n values each (group c = s->x[i * cols + c], i < n);
 * an element is valid iff rmask[i] (NULL: all) and cmask[c] (NULL: all). Leaves the codes
 * ([n][cols]) in s->codes and the stored minimum / scale per group (floats equal to the
 * stored meta values) in s->out_min / s->out_scale. Runs CW groups at a time (zero-padded). */
static void quantize_cols(scratch_t *s, int64_t n, int64_t cols, const uint8_t *rmask, const uint8_t *cmask,
                          int levels, int meta_fp32, int range_search, int order, int64_t w) {
    for (int64_t c0 = 0; c0 < cols; c0 += CW) {
        const int64_t nc = cols - c0 < CW ? cols - c0 : CW;
        uint8_t cm[CW], chunk_codes[ST_MAX_P * CW];
        float mins[CW], scales[CW];
        for (int c = 0; c < CW; c++) cm[c] = c < nc && (!cmask || cmask[c0 + c]);
        for (int64_t i = 0; i < n; i++)
            for (int c = 0; c < CW; c++) s->xc[i * CW + c] = c < nc ? s->x[i * cols + c0 + c] : 0.0f;
        quantize_chunk(s, s->xc, n, rmask, cm, levels, meta_fp32, range_search, order, w, chunk_codes, mins, scales);
        for (int64_t c = 0; c < nc; c++) { s->out_min[c0 + c] = mins[c]; s->out_scale[c0 + c] = scales[c]; }
        for (int64_t i = 0; i < n; i++)
            for (int64_t c = 0; c < nc; c++) s->codes[i * cols + c0 + c] = chunk_codes[i * CW + c];
    }
}

static inline void put_meta(uint8_t *base, int64_t idx, float v, int fp32) {
    if (fp32) memcpy(base + 4 * idx, &v, 4);
    else { _Float16 h = (_Float16)v; memcpy(base + 2 * idx, &h, 2); }
}

/* Pack one token's D codes (little-endian within a byte, hack_ops.packing). */
static inline void pack_row(const uint8_t *codes, int64_t d, int bits, uint8_t *out) {
    const int per = 8 / bits;
    for (int64_t b = 0; b < d / per; b++) {
        unsigned v = 0;
        for (int i = 0; i < per; i++) v |= (unsigned)codes[b * per + i] << (i * bits);
        out[b] = (uint8_t)v;
    }
}

/* V per token of head h, offsets j0 .. j0+nj-1 of `page`, values s->page[jj][D]: groups of gd
 * channels; sinks (position < S) get code 0, min 0, scale 0. */
static void store_v_tokens(const hack_store_args *a, scratch_t *s, int64_t page, int64_t p0, int64_t h, int64_t j0,
                           int64_t nj) {
    const int64_t P = a->page_size, D = a->head_dim, gd = a->group, ng = D / gd;
    const int bits = (int)a->v_bits, fp32 = (int)a->meta_fp32;
    const int64_t rowb = D * bits / 8;
    uint8_t cm[ST_MAX_P];
    for (int64_t jj = 0; jj < nj; jj++) cm[jj] = !(p0 + j0 + jj < a->sink_tokens);
    uint8_t *vb = a->v_pages + page * a->v_page_bytes;
    for (int64_t g = 0; g < ng; g++) {
        for (int64_t t = 0; t < gd; t++) /* transpose: the group's channels become the rows */
            for (int64_t jj = 0; jj < nj; jj++) s->x[t * nj + jj] = s->page[jj * D + g * gd + t];
        /* the reference reduces along the contiguous head_dim group: torch's inner-sum order */
        quantize_cols(s, gd, nj, NULL, cm, (1 << bits) - 1, fp32, (int)a->range_search, SUM_INNER, a->inner_width);
        for (int64_t jj = 0; jj < nj; jj++) {
            const int64_t idx = h * P * ng + (j0 + jj) * ng + g;
            put_meta(vb + a->v_min_off, idx, s->out_min[jj], fp32);
            put_meta(vb + a->v_scale_off, idx, cm[jj] ? s->out_scale[jj] : 0.0f, fp32);
            for (int64_t t = 0; t < gd; t++) s->tok_codes[jj * D + g * gd + t] = s->codes[t * nj + jj];
        }
    }
    uint8_t *vc = vb + a->v_codes_off + (h * P + j0) * rowb;
    for (int64_t jj = 0; jj < nj; jj++) pack_row(s->tok_codes + jj * D, D, bits, vc + jj * rowb);
}

/* One work item: page `pg` (index in the request's page table) of request b, KV head h.
 * A page whose last offset arrives now is quantized whole (K, and V when it has a tail);
 * without a V tail, this page's new tokens' V is quantized per token. */
static void store_item(const hack_store_args *a, scratch_t *s, int64_t b, int64_t pg, int64_t h) {
    const int64_t P = a->page_size, H = a->heads, D = a->head_dim, S = a->sink_tokens;
    const int64_t gd = a->group, ng = D / gd, HD = H * D;
    const int bits = (int)a->k_bits, levels = (1 << bits) - 1, fp32 = (int)a->meta_fp32, dt = (int)a->in_dtype;
    const int64_t pre = a->prefix_lens[b], q0 = a->qo_indptr[b], seq = pre + a->qo_indptr[b + 1] - q0;
    const int64_t row = a->rows[b], page = a->page_table[b * a->max_pages + pg], p0 = pg * P;
    const int64_t lo_pos = pre > p0 ? pre : p0, hi_pos = seq < p0 + P ? seq : p0 + P;
    const int64_t first_new = lo_pos - p0, rowb = D * bits / 8;
    /* source element of channel d of head h of new token at page offset j */
#define SRC(j) ((q0 + (p0 + (j) - pre)) * HD + h * D)
    if (hi_pos == p0 + P) {
        /* K: the page's FP16 content, the tail below the first new offset, then the new tokens */
        uint8_t rmask[ST_MAX_P];
        for (int64_t j = 0; j < P; j++) {
            rmask[j] = !(p0 + j < S); /* sinks take no part in the page's ranges */
            float *xr = s->x + j * D;
            if (j < first_new) {
                const _Float16 *t = a->tail_k + ((row * P + j) * H + h) * D;
                for (int64_t d = 0; d < D; d++) xr[d] = (float)t[d];
            } else {
                load_row(a->k, SRC(j), dt, 1, xr, D);
            }
        }
        /* per channel over the page's tokens: the reference reduces a strided dim (row order) */
        quantize_cols(s, P, D, rmask, NULL, levels, fp32, (int)a->range_search, SUM_ROWS, a->inner_width);
        uint8_t *kb = a->k_pages + page * a->k_page_bytes;
        for (int64_t d = 0; d < D; d++) {
            put_meta(kb + a->k_min_off, h * D + d, s->out_min[d], fp32);
            put_meta(kb + a->k_scale_off, h * D + d, s->out_scale[d], fp32);
        }
        uint8_t *kc = kb + a->k_codes_off + h * P * rowb, *sp = kb + a->k_sums_off;
        for (int64_t j = 0; j < P; j++) {
            const uint8_t *cr = s->codes + j * D;
            pack_row(cr, D, bits, kc + j * rowb);
            for (int64_t g = 0; g < ng; g++) { /* per-token code sums (summation elimination) */
                int32_t sum = 0;
                for (int64_t t = 0; t < gd; t++) sum += cr[g * gd + t];
                const int64_t idx = h * P * ng + j * ng + g;
                if (a->k_sums_bytes == 1) sp[idx] = (uint8_t)sum;
                else if (a->k_sums_bytes == 2) { const int16_t v16 = (int16_t)sum; memcpy(sp + 2 * idx, &v16, 2); }
                else memcpy(sp + 4 * idx, &sum, 4);
            }
        }
        if (a->v_tail) {
            for (int64_t j = 0; j < P; j++) {
                float *vr = s->page + j * D;
                if (j < first_new) {
                    const _Float16 *t = a->tail_v + ((row * P + j) * H + h) * D;
                    for (int64_t d = 0; d < D; d++) vr[d] = (float)t[d];
                } else {
                    load_row(a->v, SRC(j), dt, 1, vr, D);
                }
            }
            store_v_tokens(a, s, page, p0, h, 0, P);
        }
    }
    if (!a->v_tail) { /* V read quantized as soon as written: from the input precision */
        const int64_t nj = hi_pos - lo_pos;
        for (int64_t jj = 0; jj < nj; jj++)
            load_row(a->v, SRC(first_new + jj), dt, 0, s->page + jj * D, D);
        store_v_tokens(a, s, page, p0, h, first_new, nj);
    }
#undef SRC
}

int hack_store(const hack_store_args *a) {
    const int64_t B = a->batch, P = a->page_size, H = a->heads, D = a->head_dim, S = a->sink_tokens;
    if (P <= 0 || P > ST_MAX_P || D <= 0 || D > ST_MAX_D || a->group <= 0 || D % a->group ||
        (a->k_bits != 2 && a->k_bits != 4) || (a->v_bits != 2 && a->v_bits != 4) || (D * a->k_bits) % 8 ||
        (D * a->v_bits) % 8 || a->inner_width <= 0 || a->inner_width > 64)
        return 1;
    /* work items: (request, page) pairs to quantize, times heads */
    int64_t n_items = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t pre = a->prefix_lens[b], seq = pre + a->qo_indptr[b + 1] - a->qo_indptr[b];
        if (seq <= pre) continue;
        const int64_t first = pre / P, last = (seq - 1) / P;
        for (int64_t pg = first; pg <= last; pg++)
            if (!a->v_tail || (pg + 1) * P <= seq) n_items++;
    }
    int64_t *items = NULL;
    if (n_items) {
        items = (int64_t *)malloc(sizeof(int64_t) * 2 * n_items);
        if (!items) return 2;
        int64_t i = 0;
        for (int64_t b = 0; b < B; b++) {
            const int64_t pre = a->prefix_lens[b], seq = pre + a->qo_indptr[b + 1] - a->qo_indptr[b];
            if (seq <= pre) continue;
            for (int64_t pg = pre / P; pg <= (seq - 1) / P; pg++)
                if (!a->v_tail || (pg + 1) * P <= seq) { items[2 * i] = b; items[2 * i + 1] = pg; i++; }
        }
    }
    int failed = 0;
    const int64_t total = n_items * H;
    if (total) {
        int nth = (int)(a->nthreads > 0 ? a->nthreads : 1);
        if (nth > total) nth = (int)total;
#pragma omp parallel num_threads(nth) if (nth > 1)
        {
            scratch_t s;
            int ok = scratch_alloc(&s, a->inner_width) == 0;
            if (!ok) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < total; it++)
                if (ok) store_item(a, &s, items[2 * (it / H)], items[2 * (it / H) + 1], it % H);
            if (ok) scratch_free(&s);
        }
    }
    free(items);
    if (failed) return 2;
    /* tails and sinks, after every closing page has read its tail row */
    const int64_t HD = H * D;
    for (int64_t b = 0; b < B; b++) {
        const int64_t pre = a->prefix_lens[b], q0 = a->qo_indptr[b], seq = pre + a->qo_indptr[b + 1] - q0;
        const int64_t row = a->rows[b], open_from = (seq / P) * P; /* tokens of a page that stays open */
        for (int64_t pos = pre; pos < seq; pos++) {
            const int64_t src = (q0 + pos - pre) * HD;
            if (pos >= open_from) {
                _Float16 *tk = a->tail_k + (row * P + pos % P) * HD;
                for (int64_t i = 0; i < HD; i++) tk[i] = (_Float16)load_in(a->k, src + i, (int)a->in_dtype);
                if (a->tail_v) {
                    _Float16 *tv = a->tail_v + (row * P + pos % P) * HD;
                    for (int64_t i = 0; i < HD; i++) tv[i] = (_Float16)load_in(a->v, src + i, (int)a->in_dtype);
                }
            }
            if (pos < S && a->sink_slots[b] >= 0) {
                _Float16 *sk = a->sink_k + (a->sink_slots[b] * S + pos) * HD;
                _Float16 *sv = a->sink_v + (a->sink_slots[b] * S + pos) * HD;
                for (int64_t i = 0; i < HD; i++) {
                    sk[i] = (_Float16)load_in(a->k, src + i, (int)a->in_dtype);
                    sv[i] = (_Float16)load_in(a->v, src + i, (int)a->in_dtype);
                }
            }
        }
    }
    return 0;
}

/* Test hooks for the summation orders: sums[c] of e [n][cols] in the given order. */
int hack_store_sum(const float *e, int64_t n, int64_t cols, int64_t order, int64_t w, float *out) {
    if (w <= 0 || w > 64 || cols > ST_COLS) return 1;
    float *scratch = (float *)malloc(sizeof(float) * (4 + 5 * w) * cols);
    if (!scratch) return 2;
    err_reduce(e, n, cols, (int)order, w, out, scratch);
    free(scratch);
    return 0;
}

/* The store step of a forward that only appends to the FP16 tails (no page closes, no token is a
 * sink: HackKVStore.write's appends_only case, most decode steps): token t's K and V, hd = heads
 * x head_dim contiguous values each in dtype dt (IN_F32, IN_F16, IN_BF16), token t's starting at
 * element t * k_stride of k (t * v_stride of v: the model's V is often a view into a fused QKV
 * output), into slot offs[t] of tail row rows[t] (tails [rows, p, hd] fp16), rounded to nearest
 * as torch's .to(float16) does. Nothing is written unless every value is finite: -3 when K holds
 * a NaN or inf, -4 when V does; -1 for bad arguments. One call instead of a dozen torch calls,
 * each costing microseconds from the cold caches a served layer starts from. */
int hack_append_tails(const void *k, const void *v, int64_t dt, int64_t n, int64_t hd, int64_t p,
                      const int64_t *rows, const int64_t *offs, uint16_t *tail_k, uint16_t *tail_v,
                      int64_t k_stride, int64_t v_stride) {
    if (dt < IN_F32 || dt > IN_BF16 || n < 0 || hd < 1 || p < 1 || k_stride < hd || v_stride < hd) return -1;
    for (int64_t t = 0; t < n; t++)
        if (rows[t] < 0 || offs[t] < 0 || offs[t] >= p) return -1;
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = 0; c < hd; c++)
            if (!isfinite(load_in(k, t * k_stride + c, (int)dt))) return -3;
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = 0; c < hd; c++)
            if (!isfinite(load_in(v, t * v_stride + c, (int)dt))) return -4;
    for (int64_t t = 0; t < n; t++) {
        _Float16 *dk = (_Float16 *)tail_k + (rows[t] * p + offs[t]) * hd;
        _Float16 *dv = (_Float16 *)tail_v + (rows[t] * p + offs[t]) * hd;
        for (int64_t c = 0; c < hd; c++) {
            dk[c] = (_Float16)load_in(k, t * k_stride + c, (int)dt);
            dv[c] = (_Float16)load_in(v, t * v_stride + c, (int)dt);
        }
    }
    return 0;
}
