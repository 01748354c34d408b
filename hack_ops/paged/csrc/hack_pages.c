/* Homomorphic products on one page, read in place: Q.K^T against per-channel K codes and
 * P.V against per-token V codes. Codes are unpacked in registers; nothing is dequantized. */
#include <math.h>

#include "hack_kernel.h"

/* INT8 min/max quantization of x[0..n) with float32 side values (as hack_ops.quant with
 * meta_dtype float32): codes = clamp(rint((x - mn) / s), 0, 255), s = (mx - mn) / 255 or 1.
 * Codes go to codes8 (bytes) or codesf (floats), whichever is given. */
static void q8(const float *x, int n, int zero_min, uint8_t *codes8, float *codesf, float *scale, float *minimum) {
    int i = 0;
    float mn = x[0], mx = x[0];
#if HACK_SIMD
    if (n % 16 == 0) {
        __m512 vmn = _mm512_loadu_ps(x), vmx = vmn;
        for (i = 16; i < n; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            vmn = _mm512_min_ps(vmn, v);
            vmx = _mm512_max_ps(vmx, v);
        }
        mn = _mm512_reduce_min_ps(vmn);
        mx = _mm512_reduce_max_ps(vmx);
    } else
#endif
        for (i = 1; i < n; i++) { mn = x[i] < mn ? x[i] : mn; mx = x[i] > mx ? x[i] : mx; }
    if (zero_min) mn = 0.0f;
    float s = (mx - mn) / 255.0f;
    if (!(s > 0.0f)) s = 1.0f;
    i = 0;
#if HACK_SIMD
    const __m512 vm = _mm512_set1_ps(mn), vs = _mm512_set1_ps(s), top = _mm512_set1_ps(255.0f);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm), vs);
        v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), top);
        if (codesf) _mm512_storeu_ps(codesf + i, v);
        if (codes8) _mm_storeu_si128((__m128i *)(codes8 + i), _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(v)));
    }
#endif
    for (; i < n; i++) {
        float v = nearbyintf((x[i] - mn) / s);
        v = v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v);
        if (codesf) codesf[i] = v;
        if (codes8) codes8[i] = (uint8_t)v;
    }
    *scale = s;
    *minimum = mn;
}

/* n side values (fp16 or fp32) starting at element idx -> float. */
static void load_meta(const uint8_t *base, int64_t idx, int n, int fp32, float *out) {
    if (fp32) {
        memcpy(out, base + 4 * idx, 4 * (size_t)n);
        return;
    }
    const uint16_t *h = (const uint16_t *)(base + 2 * idx);
    int i = 0;
#if HACK_SIMD
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = h2f(h[i]);
}

static inline void unpack_row(const uint8_t *row, int d, int bits, uint8_t *out) {
    /* one packed byte -> its 2 or 4 codes, one per byte, in a word: no per-code shifts, and the
     * loop vectorizes in the plain-C build (AVX2 hosts) */
    if (bits == 2) {
        for (int i = 0; i < d / 4; i++) {
            uint32_t x = row[i];
            x = (x | (x << 6) | (x << 12) | (x << 18)) & 0x03030303u;
            memcpy(out + 4 * i, &x, 4);
        }
    } else if (bits == 4) {
        for (int i = 0; i < d / 2; i++) {
            uint16_t x = row[i];
            x = (uint16_t)((x | (x << 4)) & 0x0F0Fu);
            memcpy(out + 2 * i, &x, 2);
        }
    } else {
        const int per = 8 / bits, mask = (1 << bits) - 1;
        for (int c = 0; c < d; c++) out[c] = (row[c / per] >> (bits * (c % per))) & mask;
    }
}

#if HACK_SIMD
/* Byte position (lane L, byte i) of an unpacked 64-channel register holds channel 4i+L for
 * 2-bit codes (a 16-byte chunk broadcast to 4 lanes, lane L shifted by 2L) or 2i+L for 4-bit
 * codes (a 32-byte chunk in 2 halves, half L shifted by 4L). */
static inline int chan_at(int pos, int bits) { return bits == 2 ? 4 * (pos & 15) + (pos >> 4) : 2 * (pos & 31) + (pos >> 5); }

static inline __m512i unpack64(const uint8_t *rowp, int ch, int bits) {
    const __m512i shift = bits == 2 ? _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0)
                                    : _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i x = bits == 2 ? _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(rowp + ch * 16)))
                          : _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(rowp + ch * 32)));
    return _mm512_and_si512(_mm512_srlv_epi32(x, shift), _mm512_set1_epi8((char)((1 << bits) - 1)));
}

/* Horizontal sums of 16 registers of 16 int32 -> one register, token t in dword t. */
static inline __m512i reduce16(const __m512i *v) {
    __m512i r[4];
    for (int k = 0; k < 4; k++) {
        __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(v[4 * k], v[4 * k + 1]), _mm512_unpackhi_epi32(v[4 * k], v[4 * k + 1]));
        __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(v[4 * k + 2], v[4 * k + 3]), _mm512_unpackhi_epi32(v[4 * k + 2], v[4 * k + 3]));
        r[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    }
    __m512i x = _mm512_add_epi32(_mm512_shuffle_i32x4(r[0], r[1], 0x88), _mm512_shuffle_i32x4(r[0], r[1], 0xDD));
    __m512i y = _mm512_add_epi32(_mm512_shuffle_i32x4(r[2], r[3], 0x88), _mm512_shuffle_i32x4(r[2], r[3], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x, y, 0x88), _mm512_shuffle_i32x4(x, y, 0xDD));
}
#endif

void page_scores_quant(const item_t *it, int64_t page_id, int nt, const float *q, float *s, int64_t ld, float *ws) {
    const hack_decode_args *a = it->a;
    const int d = (int)a->head_dim, rep = (int)a->rep, bits = (int)a->k_bits, gd = (int)a->group;
    const int ng = d / gd, P = (int)a->page_size, row = d * bits / 8, fp32 = (int)a->meta_fp32;
    const uint8_t *page = a->k_pages + page_id * a->k_page_bytes;
    const uint8_t *codes = page + a->k_codes_off + it->h * P * row;
    const uint8_t *sums = page + a->k_sums_off + (it->h * P * ng) * a->k_sums_bytes;
    float sk[MAX_D], mk[MAX_D], qf[MAX_D], qm[MAX_REP], sq[MAX_REP][MAX_G], mq[MAX_REP][MAX_G];
    uint8_t qc[MAX_REP][MAX_D] __attribute__((aligned(64)));
    float *ks = ws; /* K's stored code sums as floats, [ng][P] */
    load_meta(page + a->k_scale_off, it->h * d, d, fp32, sk);
    load_meta(page + a->k_min_off, it->h * d, d, fp32, mk);
    for (int r = 0; r < rep; r++) { /* K's per-channel scale folded into Q, then INT8 per group */
        const float *qr = q + r * d;
        float acc = 0.0f;
        for (int c = 0; c < d; c++) { qf[c] = qr[c] * sk[c]; acc += qr[c] * mk[c]; }
        qm[r] = acc; /* Q . min, exact */
        for (int g = 0; g < ng; g++) q8(qf + g * gd, gd, 0, qc[r] + g * gd, NULL, &sq[r][g], &mq[r][g]);
    }
    if (a->k_sums_bytes == 1) {
        for (int j = 0; j < nt; j++)
            for (int g = 0; g < ng; g++) ks[g * P + j] = (float)sums[j * ng + g];
    } else {
        const int16_t *s16 = (const int16_t *)sums;
        for (int j = 0; j < nt; j++)
            for (int g = 0; g < ng; g++) ks[g * P + j] = (float)s16[j * ng + g];
    }
    int j0 = 0;
#if HACK_SIMD
    const int nchunk = d / 64;
    __m512i qp[MAX_REP][MAX_D / 64];
#ifdef __AVX512VBMI__
    uint8_t perm[64];
    for (int pos = 0; pos < 64; pos++) perm[pos] = (uint8_t)chan_at(pos, bits);
    const __m512i pidx = _mm512_loadu_si512(perm);
    for (int r = 0; r < rep; r++)
        for (int ch = 0; ch < nchunk; ch++) qp[r][ch] = _mm512_permutexvar_epi8(pidx, _mm512_loadu_si512(qc[r] + ch * 64));
#else
    for (int r = 0; r < rep; r++)
        for (int ch = 0; ch < nchunk; ch++) {
            uint8_t tmp[64];
            for (int pos = 0; pos < 64; pos++) tmp[pos] = qc[r][ch * 64 + chan_at(pos, bits)];
            qp[r][ch] = _mm512_loadu_si512(tmp);
        }
#endif
    if (gd % 64 == 0) { /* each 64-channel chunk lies in one group: 16 tokens per reduction */
        const int cpg = gd / 64;
        for (; j0 + 16 <= nt; j0 += 16) {
            __m512i xs[16][MAX_D / 64], v[16];
            for (int t = 0; t < 16; t++)
                for (int ch = 0; ch < nchunk; ch++) xs[t][ch] = unpack64(codes + (j0 + t) * row, ch, bits);
            for (int r = 0; r < rep; r++) {
                __m512 acc = _mm512_setzero_ps();
                for (int g = 0; g < ng; g++) {
                    for (int t = 0; t < 16; t++) {
                        v[t] = _mm512_setzero_si512();
                        for (int ch = g * cpg; ch < (g + 1) * cpg; ch++) v[t] = _mm512_dpbusd_epi32(v[t], qp[r][ch], xs[t][ch]);
                    }
                    __m512 dot = _mm512_cvtepi32_ps(reduce16(v));
                    __m512 term = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(sq[r][g]), dot),
                                                _mm512_mul_ps(_mm512_set1_ps(mq[r][g]), _mm512_loadu_ps(ks + g * P + j0)));
                    acc = _mm512_add_ps(acc, term);
                }
                _mm512_storeu_ps(s + r * ld + j0, _mm512_add_ps(acc, _mm512_set1_ps(qm[r])));
            }
        }
    }
    /* the remaining tokens (and groups narrower than 64 channels): one token at a time */
    __mmask16 gmask[MAX_D / 64][4];
    int gidx[MAX_D / 64][4], ngc[MAX_D / 64];
    for (int ch = 0; ch < nchunk && j0 < nt; ch++) {
        ngc[ch] = 0;
        for (int dw = 0; dw < 16; dw++) { /* dword -> head_dim group */
            int g = (ch * 64 + (bits == 2 ? 16 * (dw & 3) : 8 * (dw & 7))) / gd, k;
            for (k = 0; k < ngc[ch] && gidx[ch][k] != g; k++) {}
            if (k == ngc[ch]) { gidx[ch][k] = g; gmask[ch][k] = 0; ngc[ch]++; }
            gmask[ch][k] |= (__mmask16)(1u << dw);
        }
    }
    for (int j = j0; j < nt; j++) {
        int32_t dot[MAX_REP][MAX_G];
        for (int r = 0; r < rep; r++)
            for (int g = 0; g < ng; g++) dot[r][g] = 0;
        for (int ch = 0; ch < nchunk; ch++) {
            __m512i x = unpack64(codes + j * row, ch, bits);
            for (int r = 0; r < rep; r++) {
                __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qp[r][ch], x);
                for (int k = 0; k < ngc[ch]; k++) dot[r][gidx[ch][k]] += _mm512_mask_reduce_add_epi32(gmask[ch][k], acc);
            }
        }
#else
    for (int j = j0; j < nt; j++) {
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
            for (int g = 0; g < ng; g++) acc += sq[r][g] * (float)dot[r][g] + mq[r][g] * ks[g * P + j];
            s[r * ld + j] = acc + qm[r];
        }
    }
}

void page_pv_quant(const item_t *it, int64_t page_id, int nt, int skip, const float *pr, int64_t ld, float *o, float *ws) {
    const hack_decode_args *a = it->a;
    const int d = (int)a->head_dim, rep = (int)a->rep, bits = (int)a->v_bits, gd = (int)a->group;
    const int ng = d / gd, P = (int)a->page_size, row = d * bits / 8, fp32 = (int)a->meta_fp32;
    const uint8_t *page = a->v_pages + page_id * a->v_page_bytes;
    const uint8_t *codes = page + a->v_codes_off + it->h * P * row;
    const int64_t mbase = it->h * P * ng;
    float *sv = ws, *mv = ws + ng * P, *pcf = ws + 2 * ng * P; /* sv, mv: [ng][P]; pcf: [rep][ng][P] */
    uint8_t *pc8 = (uint8_t *)pcf; /* the same P codes as bytes, for the integer path */
#if HACK_SIMD && defined(__AVX512VBMI__)
    const int int_pv = gd % (16 * (8 / bits)) == 0; /* a 16-byte block of codes lies in one group */
#else
    const int int_pv = 0;
#endif
    float tmp[MAX_G * MAX_P], pf[MAX_P], sp[MAX_REP][MAX_G], mterm[MAX_REP][MAX_G], dummy;
    load_meta(page + a->v_scale_off, mbase, nt * ng, fp32, tmp); /* [token][group] -> [group][token] */
    for (int j = 0; j < nt; j++)
        for (int g = 0; g < ng; g++) sv[g * P + j] = tmp[j * ng + g];
    load_meta(page + a->v_min_off, mbase, nt * ng, fp32, tmp);
    for (int j = 0; j < nt; j++)
        for (int g = 0; g < ng; g++) mv[g * P + j] = tmp[j * ng + g];
    for (int r = 0; r < rep; r++)
        for (int g = 0; g < ng; g++) { /* V's per-token scale folded into P, INT8 with a zero minimum */
            float mt = 0.0f;
            for (int j = 0; j < nt; j++) {
                float p = j < skip ? 0.0f : pr[r * ld + j]; /* sinks are not quantized keys */
                pf[j] = p * sv[g * P + j];
                mt += p * mv[g * P + j];
            }
            for (int j = nt; j < P; j++) pf[j] = 0.0f; /* unfilled slots: P = 0 */
            mterm[r][g] = mt;
            q8(pf, P, 1, int_pv ? pc8 + (r * ng + g) * P : NULL, int_pv ? NULL : pcf + (r * ng + g) * P, &sp[r][g], &dummy);
        }
    float acc[MAX_REP][MAX_D] __attribute__((aligned(64)));
#if HACK_SIMD && defined(__AVX512VBMI__)
    if (int_pv) {
        /* Integer P.V with VNNI: 4 tokens at a time. Their 16-byte blocks of packed codes are
         * interleaved so that dword i holds the 4 tokens' byte i; shifting by bits*k and masking
         * gives, in dword i, the 4 tokens' codes of channel (16*blk + i)*per + k; one vpdpbusd
         * with the 4 tokens' P codes (u8) broadcast adds their products to that channel. */
        const int per = 8 / bits, cpb = 16 * per, nt4 = (nt + 3) & ~3;
        uint8_t ib[64];
        for (int i = 0; i < 16; i++)
            for (int t = 0; t < 4; t++) ib[4 * i + t] = (uint8_t)(16 * t + i);
        const __m512i idx = _mm512_loadu_si512(ib), m8 = _mm512_set1_epi8((char)((1 << bits) - 1));
        for (int j = nt; j < nt4; j++) /* padding tokens: P code 0 */
            for (int r = 0; r < rep; r++)
                for (int g = 0; g < ng; g++) pc8[(r * ng + g) * P + j] = 0;
        for (int blk = 0; blk < row / 16; blk++) {
            const int g = blk * cpb / gd;
            for (int r0 = 0; r0 < rep; r0 += 4) {
                const int nr = rep - r0 < 4 ? rep - r0 : 4;
                __m512i ac[4][4];
                for (int rr = 0; rr < 4; rr++)
                    for (int k = 0; k < 4; k++) ac[rr][k] = _mm512_setzero_si512();
                for (int j = 0; j < nt4; j += 4) {
                    const uint8_t *b0 = codes + j * row + blk * 16;
                    __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)b0));
                    raw = _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i *)(b0 + row)), 1);
                    raw = _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i *)(b0 + 2 * row)), 2);
                    raw = _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i *)(b0 + 3 * row)), 3);
                    const __m512i z = _mm512_permutexvar_epi8(idx, raw);
                    __m512i x[4];
                    for (int k = 0; k < per; k++) x[k] = _mm512_and_si512(_mm512_srli_epi32(z, bits * k), m8);
                    for (int rr = 0; rr < nr; rr++) {
                        int32_t quad;
                        memcpy(&quad, pc8 + ((r0 + rr) * ng + g) * P + j, 4);
                        const __m512i pq = _mm512_set1_epi32(quad);
                        for (int k = 0; k < per; k++) ac[rr][k] = _mm512_dpbusd_epi32(ac[rr][k], pq, x[k]);
                    }
                }
                for (int rr = 0; rr < nr; rr++)
                    for (int k = 0; k < per; k++) {
                        int32_t t32[16];
                        _mm512_storeu_si512(t32, ac[rr][k]);
                        for (int i = 0; i < 16; i++) acc[r0 + rr][blk * cpb + i * per + k] = (float)t32[i];
                    }
            }
        }
    } else {
#endif
#if HACK_SIMD
    /* 16 channels at a time, all tokens, accumulators of 4 query heads in registers. A
     * channel block's codes: each byte repeated 4x (2-bit) or 2x (4-bit), shifted per lane. */
    const __m128i dup = bits == 2 ? _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                  : _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i shv = bits == 2 ? _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6)
                                  : _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    const __m512i cm = _mm512_set1_epi32((1 << bits) - 1);
    const int bpb = 16 * bits / 8; /* bytes per 16 channels */
    const __mmask16 lm = (__mmask16)((1u << bpb) - 1);
    for (int blk = 0; blk < d / 16; blk++) {
        const float *pcg = pcf + (blk * 16 / gd) * P;
        for (int r0 = 0; r0 < rep; r0 += 4) {
            const int nr = rep - r0 < 4 ? rep - r0 : 4;
            const float *p0 = pcg + r0 * ng * P, *p1 = p0 + (nr > 1) * ng * P;
            const float *p2 = p0 + (nr > 2) * 2 * ng * P, *p3 = p0 + (nr > 3) * 3 * ng * P;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int j = 0; j < nt; j++) {
                __m128i raw = _mm_maskz_loadu_epi8(lm, codes + j * row + blk * bpb);
                __m512i w = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(raw, dup));
                __m512 cf = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, shv), cm));
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(p0[j]), cf, a0);
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(p1[j]), cf, a1);
                a2 = _mm512_fmadd_ps(_mm512_set1_ps(p2[j]), cf, a2);
                a3 = _mm512_fmadd_ps(_mm512_set1_ps(p3[j]), cf, a3);
            }
            __m512 res[4] = {a0, a1, a2, a3};
            for (int k = 0; k < nr; k++) _mm512_store_ps(acc[r0 + k] + blk * 16, res[k]);
        }
    }
#else
    for (int r = 0; r < rep; r++) memset(acc[r], 0, sizeof(float) * d);
    for (int j = 0; j < nt; j++) {
        uint8_t vc[MAX_D];
        float vf[MAX_D];
        unpack_row(codes + j * row, d, bits, vc);
        for (int c = 0; c < d; c++) vf[c] = (float)vc[c];
        for (int r = 0; r < rep; r++)
            for (int g = 0; g < ng; g++) { /* one P code per group: channels contiguous, the loop vectorizes */
                const float p = pcf[(r * ng + g) * P + j];
                for (int c = g * gd; c < (g + 1) * gd; c++) acc[r][c] += p * vf[c];
            }
    }
#endif
#if HACK_SIMD && defined(__AVX512VBMI__)
    }
#endif
    for (int r = 0; r < rep; r++)
        for (int g = 0; g < ng; g++)
            for (int c = g * gd; c < (g + 1) * gd; c++) o[r * d + c] += sp[r][g] * acc[r][c] + mterm[r][g];
}
