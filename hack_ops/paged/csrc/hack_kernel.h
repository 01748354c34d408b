/* Shared definitions of the HACK CPU kernel (hack_decode.c, hack_pages.c, hack_extend.c). */
#ifndef HACK_KERNEL_H
#define HACK_KERNEL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HACK_SIMD 1
#else
#define HACK_SIMD 0
#endif
/* AVX2 without AVX-512 VNNI (AMD Zen 2/3, Intel Haswell..Comet Lake): the extend kernel's
 * INT8 dot products run as vpmaddubsw + vpmaddwd on 8 lanes (exact integer sums, as vpdpbusd). */
#if !HACK_SIMD && defined(__AVX2__)
#define HACK_AVX2 1
#else
#define HACK_AVX2 0
#endif
#if HACK_SIMD || HACK_AVX2 || defined(__F16C__)
#include <immintrin.h>
#endif

#define CHUNK_PAGES 16 /* pages per work item */
#define MAX_D 256
#define MAX_REP 16
#define MAX_G 16
#define MAX_P 256

/* exp for x <= 0 (softmax numerators), about 1 ulp; branch-free so loops vectorize. Shared by
 * the decode and extend kernels so both round the same way. */
static inline float hack_exp_neg(float x) {
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

typedef struct {
    int64_t batch, heads, rep, head_dim, page_size, k_bits, v_bits, group, sink_tokens; /* K, V codes may differ */
    int64_t k_open_quantized; /* 1: the open K page is read from its (re-quantized) codes */
    int64_t v_open_quantized; /* 1: the open page's V is read from its per-token codes */
    int64_t meta_fp32, max_pages;
    int64_t k_page_bytes, k_codes_off, k_min_off, k_scale_off, k_sums_off, k_sums_bytes;
    int64_t v_page_bytes, v_codes_off, v_min_off, v_scale_off;
    int64_t nthreads;
    int64_t window;   /* sliding window (query at t sees keys t-window..t); -1: none */
    int64_t head_tables; /* 1: page_table is [rows, heads, max_pages], each KV head its own pages (sparse decode) */
    double logit_cap; /* > 0: scores soft-capped to cap * tanh(s / cap); 0: none */
    const int64_t *seq_lens, *n_closed, *page_table, *table_rows, *sink_slots;
    const int64_t *k_open_off, *v_open_off; /* element offset of each query's open region */
    const uint8_t *k_pages, *v_pages;
    const uint16_t *k_open, *v_open, *sink_k, *sink_v; /* fp16, [.., H, D] per token */
    const float *q;                                    /* [N, H*rep, D], in q_dtype */
    float *out;                                        /* [N, H*rep, D] */
    /* q's element type (0 float32, 1 bfloat16, 2 float16) and the factor hack_decode applies to
     * it on entry (the softmax scale; 0 or 1: none): the model's queries are converted here once
     * per call instead of by torch calls around it. 0 with no factor: q is read as it is. */
    int64_t q_dtype;
    double q_scale;
    /* out's element type: 0 float32, 1 bfloat16 (rounded to nearest even, as torch converts),
     * so a bfloat16 model's output needs no conversion after the call */
    int64_t out_dtype;
} hack_decode_args;

typedef struct {
    const hack_decode_args *a;
    int64_t b, h, p0, p1, seq_len, n_closed;
} item_t;

#ifdef __F16C__
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

/* Scores of tokens [0, nt) of one K page (quantized per channel) for the group's query heads:
 * s[r * ld + j]. ws: scratch of ng * P floats. */
void page_scores_quant(const item_t *it, int64_t page_id, int nt, const float *q, float *s, int64_t ld, float *ws);

/* o[r * D + c] += P.V over tokens [0, nt) of one V page (quantized per token); tokens < skip
 * (sinks) are left out; pr: softmax numerators (stride ld). ws: (rep + 2) * ng * P floats. */
void page_pv_quant(const item_t *it, int64_t page_id, int nt, int skip, const float *pr, int64_t ld, float *o, float *ws);

/* Tiled extend (hack_extend.c): one call for all new tokens of a batch of requests. */
typedef struct {
    int64_t batch, heads, rep, head_dim, page_size, k_bits, v_bits, group, sink_tokens; /* K, V codes may differ */
    int64_t v_open_quantized; /* 1: V of the open partition is read from its per-token codes */
    int64_t exact;            /* 1: 'exact' extend: every query sees only pages < prefix/P closed */
    int64_t meta_fp32, max_pages;
    int64_t k_page_bytes, k_codes_off, k_min_off, k_scale_off, k_sums_off, k_sums_bytes;
    int64_t v_page_bytes, v_codes_off, v_min_off, v_scale_off;
    int64_t nthreads, block_tokens; /* block_tokens <= 0: chosen by the kernel */
    int64_t window;   /* sliding window (query at t sees keys t-window..t); -1: none */
    double logit_cap; /* > 0: scores soft-capped to cap * tanh(s / cap); 0: none */
    const int64_t *prefix_lens, *seq_lens, *q_start, *page_table, *sink_slots;
    const int64_t *win_off;          /* element offset of each request's FP16 window (starts at a page) */
    const uint8_t *k_pages, *v_pages;
    const uint16_t *k_win, *v_win, *sink_k, *sink_v; /* fp16, [.., H, D] per token */
    const float *q;                                  /* [N, H*rep, D], already scaled */
    float *out;                                      /* [N, H*rep, D] */
    /* PrefillMode.INT8: the pages from (prefix/P) on (the prefix's open page and the chunk's own)
     * are read from these finer codes of the FP16 window instead of the pool's (NULL: off).
     * chunk_page0[b]: request b's first such page in them. Codes one byte each, <= 63 so that
     * they are the signed operand of every build's dot products; side tables float. */
    const int64_t *chunk_page0;
    const uint8_t *ck_codes, *cv_codes;   /* [pages, H, P, D] */
    const float *ck_scale, *ck_min;       /* [pages, H, D] */
    const float *ck_sums;                 /* [pages, H, P, D/group] */
    const float *cv_scale, *cv_min;       /* [pages, H, P, D/group] */
} hack_extend_args;

int hack_extend(const hack_extend_args *a);

/* PrefillMode.INT8's codes of each request's FP16 window, as hack_ops/paged/chunk_codes.py
 * makes them (the reference): request b's window starts at position win_start[b] (a page
 * boundary), element offset win_off[b] of k_win / v_win, and ends at seq_lens[b]; its pages are
 * rows page0[b].. of the outputs (layouts in hack_extend_args). */
typedef struct {
    int64_t batch, heads, head_dim, page_size, group, sink_tokens, levels, nthreads;
    const int64_t *win_start, *seq_lens, *win_off, *page0;
    const uint16_t *k_win, *v_win;
    uint8_t *k_codes, *v_codes;
    float *k_scale, *k_min, *k_sums, *v_scale, *v_min;
} hack_chunk_args;

int hack_chunk_codes(const hack_chunk_args *c);
int hack_extend_isa(void);

#endif
