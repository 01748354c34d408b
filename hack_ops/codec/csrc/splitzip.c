/* SplitZip codec, compiled CPU implementation (format: hack_ops/codec/format.py).
 *
 * Two passes over chunks, each parallel with OpenMP: count escapes (sizes, directory, then a
 * serial prefix sum gives every chunk's offset), then write the planes. BF16 has an AVX-512
 * VBMI path (64 elements per step: exponent bytes by vpermt2b, the 256-entry exponent->code
 * table as four vpermt2b lookups, the 16-entry code->exponent table by vpshufb); FP16 and the
 * portable variant use plain loops. The decoder validates every length and position before
 * writing, so a damaged stream returns an error and never writes outside `out`.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define SZ_SIMD 1
#else
#define SZ_SIMD 0
#endif

#define HDR 16
#define RAW_FLAG 0x80000000u
#define ESC_NIB 15
enum { FMT_BF16 = 1, FMT_FP16 = 2 };
enum { E_CAP = -1, E_ARG = -2, E_HDR = -3, E_CB = -4, E_TRUNC = -5, E_ESC = -6, E_TRAIL = -7, E_MEM = -8 };

int sz_simd(void) { return SZ_SIMD; }

static inline int64_t coded_bytes(int fmt, int64_t n, int64_t k) {
    return (n + 1) / 2 + n + (fmt == FMT_FP16 ? 3 * ((n + 7) / 8) : 0) + 3 * k;
}

static inline uint8_t exp_of(uint16_t w, int fmt) {
    return fmt == FMT_BF16 ? (uint8_t)((w >> 7) & 0xFF) : (uint8_t)((w >> 10) & 0x1F);
}

static void put32(uint8_t *p, uint32_t v) { p[0] = v; p[1] = v >> 8; p[2] = v >> 16; p[3] = v >> 24; }
static uint32_t get32(const uint8_t *p) { return p[0] | (p[1] << 8) | (p[2] << 16) | ((uint32_t)p[3] << 24); }

#if SZ_SIMD
static inline __m512i bf16_exps(const uint16_t *p) {
    const __m512i idx = _mm512_set_epi8(126, 124, 122, 120, 118, 116, 114, 112, 110, 108, 106, 104, 102, 100, 98, 96,
                                        94, 92, 90, 88, 86, 84, 82, 80, 78, 76, 74, 72, 70, 68, 66, 64,
                                        62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                        30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    __m512i a = _mm512_srli_epi16(_mm512_loadu_si512(p), 7);
    __m512i b = _mm512_srli_epi16(_mm512_loadu_si512(p + 32), 7);
    return _mm512_permutex2var_epi8(a, idx, b);
}
static inline __m512i lut256(const __m512i *L, __m512i e) {
    __m512i lo = _mm512_permutex2var_epi8(L[0], e, L[1]);
    __m512i hi = _mm512_permutex2var_epi8(L[2], e, L[3]);
    return _mm512_mask_blend_epi8(_mm512_movepi8_mask(e), lo, hi);
}
#endif

/* Escapes of one chunk (pass 1). */
static int64_t count_escapes(const uint16_t *w, int64_t m, int fmt, const uint8_t *lut) {
    int64_t k = 0, i = 0;
#if SZ_SIMD
    if (fmt == FMT_BF16) {
        __m512i L[4];
        for (int j = 0; j < 4; j++) L[j] = _mm512_loadu_si512(lut + 64 * j);
        const __m512i ff = _mm512_set1_epi8((char)0xFF);
        for (; i + 64 <= m; i += 64)
            k += __builtin_popcountll(_mm512_cmpeq_epi8_mask(lut256(L, bf16_exps(w + i)), ff));
    }
#endif
    for (; i < m; i++) k += lut[exp_of(w[i], fmt)] == 0xFF;
    return k;
}

static void encode_chunk(const uint16_t *w, int64_t m, int fmt, const uint8_t *lut, uint8_t *p, int64_t k) {
    const int64_t nb = (m + 1) / 2;
    uint8_t *nib = p, *lo = p + nb, *hi = lo + m;
    uint8_t *esc = hi + (fmt == FMT_FP16 ? 3 * ((m + 7) / 8) : 0);
    uint8_t *eval = esc + 2 * k;
    int64_t ke = 0, i = 0;
#if SZ_SIMD
    if (fmt == FMT_BF16) {
        __m512i L[4];
        for (int j = 0; j < 4; j++) L[j] = _mm512_loadu_si512(lut + 64 * j);
        const __m512i ff = _mm512_set1_epi8((char)0xFF), m7f = _mm512_set1_epi8(0x7F);
        const __m512i even = _mm512_set_epi8(126, 124, 122, 120, 118, 116, 114, 112, 110, 108, 106, 104, 102, 100, 98, 96,
                                             94, 92, 90, 88, 86, 84, 82, 80, 78, 76, 74, 72, 70, 68, 66, 64,
                                             62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                             30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i odd = _mm512_add_epi8(even, _mm512_set1_epi8(1));
        for (; i + 64 <= m; i += 64) {
            __m512i a = _mm512_loadu_si512(w + i), b = _mm512_loadu_si512(w + i + 32);
            __m512i e = bf16_exps(w + i);
            __m512i code = lut256(L, e);
            __mmask64 em = _mm512_cmpeq_epi8_mask(code, ff);
            /* two codes per byte: low nibble = even element */
            __m512i c16 = _mm512_or_si512(_mm512_and_si512(code, _mm512_set1_epi16(0x0F)),
                                          _mm512_and_si512(_mm512_srli_epi16(code, 4), _mm512_set1_epi16(0xF0)));
            _mm256_storeu_si256((__m256i *)(nib + i / 2), _mm512_cvtepi16_epi8(c16));
            __m512i lb = _mm512_permutex2var_epi8(a, even, b), hb = _mm512_permutex2var_epi8(a, odd, b);
            _mm512_storeu_si512(lo + i, _mm512_or_si512(_mm512_and_si512(lb, m7f), _mm512_andnot_si512(m7f, hb)));
            if (em) {
                uint8_t eb[64];
                _mm512_storeu_si512(eb, e);
                while (em) {
                    int j = __builtin_ctzll(em);
                    esc[2 * ke] = (uint8_t)(i + j); esc[2 * ke + 1] = (uint8_t)((i + j) >> 8);
                    eval[ke++] = eb[j];
                    em &= em - 1;
                }
            }
        }
    }
#endif
    for (; i < m; i++) {
        uint16_t x = w[i];
        uint8_t e = exp_of(x, fmt), c = lut[e];
        if (c == 0xFF) {
            c = ESC_NIB;
            esc[2 * ke] = (uint8_t)i; esc[2 * ke + 1] = (uint8_t)(i >> 8);
            eval[ke++] = e;
        }
        if (i & 1) nib[i / 2] |= (uint8_t)(c << 4); else nib[i / 2] = c;
        lo[i] = fmt == FMT_BF16 ? (uint8_t)(((x >> 8) & 0x80) | (x & 0x7F)) : (uint8_t)(x & 0xFF);
    }
    if (fmt == FMT_FP16) {
        for (int64_t g = 0; g < (m + 7) / 8; g++) {
            uint32_t v = 0;
            for (int j = 0; j < 8; j++) {
                int64_t t = 8 * g + j;
                if (t < m) v |= (uint32_t)((((w[t] >> 15) << 2) | ((w[t] >> 8) & 3)) & 7) << (3 * j);
            }
            hi[3 * g] = v; hi[3 * g + 1] = v >> 8; hi[3 * g + 2] = v >> 16;
        }
    }
}

int64_t sz_encode(const uint16_t *in, int64_t n, int fmt, const uint8_t *cb, uint32_t cb_id, int64_t chunk,
                  uint8_t *out, int64_t cap, int nthreads) {
    if (n < 0 || n > 0xFFFFFFFFLL || chunk <= 0 || chunk % 8 || chunk > 65536 || (fmt != FMT_BF16 && fmt != FMT_FP16))
        return E_ARG;
    int64_t nc = (n + chunk - 1) / chunk;
    if (cap < HDR + 4 * nc) return E_CAP;
    uint8_t lut[256];
    memset(lut, 0xFF, sizeof lut);
    for (int i = 0; i < 16; i++) lut[cb[i]] = (uint8_t)i;
    int64_t *off = malloc(sizeof(int64_t) * (nc + 1));
    uint32_t *dir = malloc(sizeof(uint32_t) * (nc ? nc : 1));
    if (!off || !dir) { free(off); free(dir); return E_MEM; }
    if (nthreads < 1) nthreads = 1;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < nc; c++) {
        int64_t m = (c + 1) * chunk <= n ? chunk : n - c * chunk;
        int64_t k = count_escapes(in + c * chunk, m, fmt, lut);
        int64_t sz = coded_bytes(fmt, m, k);
        if (sz >= 2 * m) { dir[c] = RAW_FLAG; off[c + 1] = 2 * m; }
        else { dir[c] = (uint32_t)k; off[c + 1] = sz; }
    }
    off[0] = HDR + 4 * nc;
    for (int64_t c = 0; c < nc; c++) off[c + 1] += off[c];
    int64_t total = off[nc];
    if (total > cap) { free(off); free(dir); return E_CAP; }
    out[0] = 'S'; out[1] = 'Z'; out[2] = 1; out[3] = (uint8_t)fmt;
    put32(out + 4, (uint32_t)n); put32(out + 8, (uint32_t)chunk); put32(out + 12, cb_id);
    for (int64_t c = 0; c < nc; c++) put32(out + HDR + 4 * c, dir[c]);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < nc; c++) {
        int64_t m = (c + 1) * chunk <= n ? chunk : n - c * chunk;
        if (dir[c] & RAW_FLAG) memcpy(out + off[c], in + c * chunk, 2 * m);  /* little-endian host */
        else encode_chunk(in + c * chunk, m, fmt, lut, out + off[c], dir[c]);
    }
    free(off); free(dir);
    return total;
}

static int decode_chunk(const uint8_t *p, int64_t m, int fmt, const uint8_t *cb, int64_t k, uint16_t *w) {
    const int64_t nb = (m + 1) / 2;
    const uint8_t *nib = p, *lo = p + nb, *hi = lo + m;
    const uint8_t *esc = hi + (fmt == FMT_FP16 ? 3 * ((m + 7) / 8) : 0), *eval = esc + 2 * k;
    int64_t i = 0;
#if SZ_SIMD
    if (fmt == FMT_BF16) {
        const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)cb));
        const __m512i m7f = _mm512_set1_epi8(0x7F), m80 = _mm512_set1_epi8((char)0x80);
        __m512i ia, ib;  /* interleave L (low bytes) and H (high bytes) into 64 words */
        {
            uint8_t xa[64], xb[64];
            for (int j = 0; j < 32; j++) { xa[2 * j] = j; xa[2 * j + 1] = 64 + j; xb[2 * j] = 32 + j; xb[2 * j + 1] = 96 + j; }
            ia = _mm512_loadu_si512(xa); ib = _mm512_loadu_si512(xb);
        }
        for (; i + 64 <= m; i += 64) {
            __m512i nb16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(nib + i / 2)));
            __m512i codes = _mm512_or_si512(_mm512_and_si512(nb16, _mm512_set1_epi16(0x0F)),
                                            _mm512_slli_epi16(_mm512_and_si512(nb16, _mm512_set1_epi16(0xF0)), 4));
            __m512i e = _mm512_shuffle_epi8(tab, codes);
            __m512i r = _mm512_loadu_si512(lo + i);
            __m512i L = _mm512_or_si512(_mm512_and_si512(r, m7f), _mm512_and_si512(_mm512_slli_epi16(e, 7), m80));
            __m512i H = _mm512_or_si512(_mm512_and_si512(r, m80), _mm512_and_si512(_mm512_srli_epi16(e, 1), m7f));
            _mm512_storeu_si512(w + i, _mm512_permutex2var_epi8(L, ia, H));
            _mm512_storeu_si512(w + i + 32, _mm512_permutex2var_epi8(L, ib, H));
        }
    }
#endif
    for (; i < m; i++) {
        uint8_t c = (nib[i / 2] >> (4 * (i & 1))) & 0xF;
        uint16_t e = cb[c], r = lo[i];
        if (fmt == FMT_BF16) w[i] = (uint16_t)(((r & 0x80) << 8) | (e << 7) | (r & 0x7F));
        else {
            uint32_t g = hi[3 * (i / 8)] | (hi[3 * (i / 8) + 1] << 8) | (hi[3 * (i / 8) + 2] << 16);
            uint16_t h = (g >> (3 * (i % 8))) & 7;
            w[i] = (uint16_t)(((h >> 2) << 15) | (e << 10) | ((h & 3) << 8) | r);
        }
    }
    const int shift = fmt == FMT_BF16 ? 7 : 10;
    const uint16_t emask = (uint16_t)((fmt == FMT_BF16 ? 0xFF : 0x1F) << shift);
    const int emax = fmt == FMT_BF16 ? 255 : 31;
    for (int64_t j = 0; j < k; j++) {
        int64_t pos = esc[2 * j] | (esc[2 * j + 1] << 8);
        if (pos >= m || eval[j] > emax) return E_ESC;
        w[pos] = (uint16_t)((w[pos] & ~emask) | ((uint16_t)eval[j] << shift));
    }
    return 0;
}

int64_t sz_decode(const uint8_t *in, int64_t len, int fmt, const uint8_t *cb, uint32_t cb_id,
                  uint16_t *out, int64_t n, int nthreads) {
    if (len < HDR) return E_TRUNC;
    if (in[0] != 'S' || in[1] != 'Z' || in[2] != 1 || in[3] != fmt) return E_HDR;
    int64_t sn = get32(in + 4), chunk = get32(in + 8);
    if (sn != n || chunk <= 0 || chunk % 8 || chunk > 65536) return E_HDR;
    if (get32(in + 12) != cb_id) return E_CB;
    int64_t nc = (n + chunk - 1) / chunk;
    if (len < HDR + 4 * nc) return E_TRUNC;
    int64_t *off = malloc(sizeof(int64_t) * (nc + 1));
    if (!off) return E_MEM;
    off[0] = HDR + 4 * nc;
    for (int64_t c = 0; c < nc; c++) {
        int64_t m = (c + 1) * chunk <= n ? chunk : n - c * chunk;
        uint32_t d = get32(in + HDR + 4 * c);
        if (!(d & RAW_FLAG) && d > (uint32_t)m) { free(off); return E_ESC; }
        off[c + 1] = off[c] + ((d & RAW_FLAG) ? 2 * m : coded_bytes(fmt, m, d));
    }
    if (off[nc] > len) { free(off); return E_TRUNC; }
    if (off[nc] < len) { free(off); return E_TRAIL; }
    int err = 0;
    if (nthreads < 1) nthreads = 1;
    #pragma omp parallel for num_threads(nthreads) schedule(static) reduction(min:err)
    for (int64_t c = 0; c < nc; c++) {
        int64_t m = (c + 1) * chunk <= n ? chunk : n - c * chunk;
        uint32_t d = get32(in + HDR + 4 * c);
        if (d & RAW_FLAG) memcpy(out + c * chunk, in + off[c], 2 * m);
        else { int r = decode_chunk(in + off[c], m, fmt, cb, d, out + c * chunk); if (r < err) err = r; }
    }
    free(off);
    return err;
}
