// Per-thread arithmetic of the CUDA decode kernel, compiled for the device and for the host (the
// CPU tests call it through hack_frag_host.cu): where a lane's codes sit in a page staged in shared
// memory, how they are widened to the fp16 MMA operands, and which pages a split reads.
//
// Format: HACK layout v2 pages, Π = 64, 2-bit K and V codes, fp16 side tables, K per channel over
// the page, V per token in head_dim groups of 64 (Gd = min(Π, D) = 64). Codes are packed along
// head_dim, four per byte, code j of a 32-bit word at bits 2j (hack_ops.packing).
//
// MMA: mma.m16n8k16 f16 x f16 -> f32. Q·Kᵀ is computed transposed, Sᵀ[token, query head]: the A
// operand is K's codes (M = 16 tokens, K = 16 channels), B is Q' = Q ⊙ s_K (N = 8 query heads of a
// GQA group). P·V likewise, Oᵀ[channel, query head]: A is V's codes transposed (M = 16 channels,
// K = 16 tokens), B is P' = P ⊙ s_V. The contraction index of a dot product may be permuted freely
// as long as both operands agree, so each lane takes whole packed words:
//   K: lane (g, t) = (lane / 4, lane % 4) reads channels [t·D/4, (t+1)·D/4) of tokens g and g + 8;
//      word w of that slice holds channels 16w + i and 16w + i + 8 in its low and high 16 bits, which
//      are exactly the (k, k+1) pair an fp16 fragment register holds: pair P = 8w + i goes to k-tile
//      P / 2, slot P % 2 (a0a1/a2a3 or a4a5/a6a7; b0b1 or b2b3 for Q'). Q' and K's min/scale use
//      the same pairs.
//   V: lane (g, t) holds tokens 2t, 2t+1 (+8) of a 16-token k-tile and channels 64·grp + 8g + i
//      (i = 0..7) of every group; a register pairs the same channel of two tokens, so the two tokens'
//      16-bit pieces are joined (byte permute) into one word whose pair i = (code i of token A,
//      code i of token B). Channel 8g + 2j (+1) of group grp is row g (g + 8) of m-tile 4·grp + j,
//      so every m-tile lies in one group (P' differs per group).
// Widening: (word & 3<<2k in both halves) | 0x6400 0x6400 is the fp16 pair 1024 + 4^k·c, exactly;
// one HFMA2 by 4^-k, -1024·4^-k gives the codes. No shared-memory traffic per code.
#pragma once

#include <cstdint>
#include <cuda_fp16.h>
#include <vector_types.h>

#if defined(__CUDACC__)
#define HACK_HD __host__ __device__ __forceinline__
#else
#define HACK_HD inline
#endif

namespace hack {

constexpr int PAGE = 64;      // tokens per page (Π)
constexpr int WARPS = 4;      // warps per block; each warp walks its own pages
#ifndef HACK_STAGES
#define HACK_STAGES 2
#endif
// Pages in flight per warp (cp.async ring). 2 by default; a build may take 3 (HACK_STAGES), 1.5x the
// bytes in flight at 63 KB of shared memory per block: still 3 blocks per SM on sm90, fewer elsewhere.
constexpr int STAGES = HACK_STAGES;
static_assert(STAGES >= 2 && STAGES <= 4, "2-4 pages in flight per warp");
constexpr int MAX_REP = 8;    // query heads per KV head: the MMA's N = 8
constexpr uint32_t MAGIC = 0x64006400u;  // fp16 1024.0 in both halves

enum CodeOrder : int { ORDER_TOKEN = 0, ORDER_FRAGMENT = 1 };

template <int D>
struct Geo {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  static constexpr int NG = D / 64;            // head_dim groups (V's per-token min/scale)
  static constexpr int ROW = D / 4;            // code bytes of one token
  static constexpr int CHUNKS = ROW / 16;      // 16-byte chunks of a row (cp.async unit)
  static constexpr int SWS = CHUNKS == 4 ? 1 : 2;  // swizzle shift (rows 2t of a k-tile hit distinct banks)
  static constexpr int KSLICE = D / 16;        // bytes of a lane's K slice of one token (D/4 codes)
  static constexpr int KWORDS = D / 64;        // 32-bit words of that slice
  static constexpr int NQ = D / 8;             // fp16 pairs of a lane's D/4 channels (Q', s_K, m_K)
  static constexpr int MD = D / 16;            // channel tiles (PV's M) = k-tiles of QKᵀ
  static constexpr int CODES = PAGE * ROW;     // code bytes of one head's page (K or V)
  static constexpr int TAB = 2 * D;            // bytes of K's min (or scale) of one head
  static constexpr int TABP = D >= 128 ? TAB + 64 : TAB;  // padded: the 4 lanes' slices on distinct banks
  static constexpr int VTAB = 2 * PAGE * NG;   // bytes of V's min (or scale) of one head
  static constexpr int OFF_KC = 0;
  static constexpr int OFF_KS = OFF_KC + CODES;
  static constexpr int OFF_KM = OFF_KS + TABP;
  static constexpr int OFF_VC = OFF_KM + TABP;
  static constexpr int OFF_VS = OFF_VC + CODES;
  static constexpr int OFF_VM = OFF_VS + VTAB;
  static constexpr int STAGE = OFF_VM + VTAB;  // bytes of one staged page
  static constexpr int PIPE = WARPS * STAGES * STAGE;
  static constexpr int COMBINE = WARPS * MAX_REP * (D + 2) * 4;  // the warps' partial results
  static constexpr int SMEM = PIPE > COMBINE ? PIPE : COMBINE;   // dynamic shared memory per block
  static constexpr int CP_CODES = CODES / 16 / 32;               // cp.async per lane per code section
  static constexpr int CP_KTAB = (2 * TAB / 16 + 31) / 32;       // ... for K's min + scale
  static constexpr int CP_VTAB = (2 * VTAB / 16 + 31) / 32;      // ... for V's min + scale
};

HACK_HD int lane_g(int lane) { return lane >> 2; }
HACK_HD int lane_t(int lane) { return lane & 3; }

// ---- bit manipulation, identical on host and device -------------------------------------------------

HACK_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t x = (uint64_t(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((x >> (8 * ((sel >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
#endif
}

// Low halves (sel 0x5410) or high halves (0x7632) of a and b, as (a's, b's).
HACK_HD uint32_t join_halves(uint32_t a, uint32_t b, int high) { return byte_perm(a, b, high ? 0x7632u : 0x5410u); }

// fp16 pair 1024 + 4^(i%4)·c of pair i (0..7) of a word: codes i and i + 8.
HACK_HD uint32_t magic_pair(uint32_t word, int i) {
  const uint32_t x = i < 4 ? word : word >> 8;
  const uint32_t mask = 0x00030003u << (2 * (i & 3));
#if defined(__CUDA_ARCH__)
  // One LOP3 ((a & b) | c, LUT 0xea); written in C the compiler splits it into an AND and an OR.
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(x), "r"(mask), "r"(MAGIC));
  return r;
#else
  return (x & mask) | MAGIC;
#endif
}

#if !defined(__CUDA_ARCH__)
inline float half_bits_to_float(uint32_t h) {
  __half_raw r;
  r.x = static_cast<unsigned short>(h & 0xffffu);
  return __half2float(__half(r));
}
inline uint32_t float_to_half_bits(float f) { return static_cast<__half_raw>(__float2half_rn(f)).x; }
#endif

// Exact fp16 codes of pair i: HFMA2 (1024 + 4^k c)·4^-k - 1024·4^-k = c, k = i % 4.
HACK_HD uint32_t code_pair(uint32_t word, int i) {
  const uint32_t h = magic_pair(word, i);
  const int k = i & 3;
  // 4^-k and -1024·4^-k as fp16 bits: 1, 1/4, 1/16, 1/64 and -1024, -256, -64, -16.
  const uint32_t scale = 0x3c00u - 0x0800u * k, bias = 0xe400u - 0x0800u * k;
#if defined(__CUDA_ARCH__)
  const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&h), __half2(__ushort_as_half(scale), __ushort_as_half(scale)),
                            __half2(__ushort_as_half(bias), __ushort_as_half(bias)));
  return *reinterpret_cast<const uint32_t*>(&r);
#else
  const float s = half_bits_to_float(scale), b = half_bits_to_float(bias);
  return float_to_half_bits(half_bits_to_float(h & 0xffffu) * s + b) |
         (float_to_half_bits(half_bits_to_float(h >> 16) * s + b) << 16);
#endif
}

// Pair P (= 8w + i) of a lane's slice of D/4 fp16 values (K's min or scale, a tail token's K),
// given as words of two adjacent channels: (channel 16w + i, channel 16w + i + 8).
template <int NQ>
HACK_HD uint32_t slice_pair(const uint32_t (&words)[NQ], int P) {
  const int w = P >> 3, i = P & 7;
  return join_halves(words[8 * w + (i >> 1)], words[8 * w + 4 + (i >> 1)], i & 1);
}

// ---- where a lane's data sits in a staged page (shared memory, or a host copy of it) ---------------

template <int D, int ORDER>
struct Stage {
  using G = Geo<D>;

  // Row swizzle of the token order: chunk c of row r is stored at chunk c ^ sw(r), so the rows
  // 2t (t = 0..3) that a V load touches fall on distinct banks.
  HACK_HD static int sw(int row) { return G::CHUNKS > 1 ? (row >> G::SWS) & (G::CHUNKS - 1) : 0; }

  // Byte offset in the stage's code section of code chunk c (16 bytes) of the page in memory.
  HACK_HD static int code_dst(int c) {
    if (ORDER == ORDER_FRAGMENT) return 16 * c;
    const int row = c / G::CHUNKS, ch = c % G::CHUNKS;
    return row * G::ROW + 16 * (ch ^ sw(row));
  }

  // Where cp.async j of a lane puts its code chunk (32j + lane): 32 chunks span whole periods of
  // the row swizzle (8 rows), so it lands 512j bytes after chunk `lane`.
  HACK_HD static int code_copy_dst(int j, int lane) { return 512 * j + code_dst(lane); }

  // Offset of chunk c of K's min or scale (padded by 16 bytes after each lane slice of D/2 bytes).
  HACK_HD static int ktab_dst(int c) { return D >= 128 ? 16 * c + 16 * (c / (D / 32)) : 16 * c; }

  // cp.async j of a lane for a pair of tables (scale, then minimum) of n chunks each: false when
  // the lane has none; else which (0: scale, 1: minimum) and the chunk cc within that table.
  HACK_HD static bool table_chunk(int j, int lane, int n, int& which, int& cc) {
    const int c = 32 * j + lane;
    which = c < n ? 0 : 1;
    cc = c - which * n;
    return c < 2 * n;
  }

  // Lane's K slice (KSLICE bytes) of row r (0: token 16mt + g, 1: token 16mt + g + 8) of m-tile mt.
  // The swizzle repeats every 8 rows, so the lane's part is the same in every m-tile (and is
  // computed once, outside the page loop).
  HACK_HD static int k_slice(int mt, int lane, int r) {
    if (ORDER == ORDER_FRAGMENT) return (mt * 32 + lane) * 2 * G::KSLICE + r * G::KSLICE;
    return 16 * mt * G::ROW + k_lane(lane, r);
  }
  HACK_HD static int k_lane(int lane, int r) {
    const int row = lane_g(lane) + 8 * r, byte = lane_t(lane) * G::KSLICE;
    return row * G::ROW + 16 * ((byte >> 4) ^ sw(row)) + (byte & 15);
  }

  // Token order: the word of token (16kt + 2t + 8tp + which) holding the lane's 16-bit piece of
  // group grp (its half g & 1). Fragment order: the joined word itself (which = 0).
  HACK_HD static int v_word(int kt, int lane, int tp, int grp, int which) {
    if (ORDER == ORDER_FRAGMENT) return (kt * 32 + lane) * 8 * G::NG + (tp * G::NG + grp) * 4;
    return (16 * kt + 8 * tp) * G::ROW + v_lane(lane, grp, which);
  }
  HACK_HD static int v_lane(int lane, int grp, int which) {
    const int row = 2 * lane_t(lane) + which;
    return row * G::ROW + 16 * (grp ^ sw(row)) + 4 * (lane_g(lane) >> 1);
  }

  // Offset of the lane's K min/scale slice (channels t·D/4 .. (t+1)·D/4) in a table section.
  HACK_HD static int ktab_slice(int lane) { return ktab_dst(lane_t(lane) * (D / 32)); }
};

template <int N>
HACK_HD void load_words(const uint8_t* p, uint32_t* out) {
  if constexpr (N % 4 == 0) {
    for (int i = 0; i < N / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
    }
  } else if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    out[0] = v.x; out[1] = v.y;
  } else {
    for (int i = 0; i < N; ++i) out[i] = reinterpret_cast<const uint32_t*>(p)[i];
  }
}

// K's code words of a lane for m-tile mt: [row g, row g + 8][KWORDS].
template <int D, int ORDER>
HACK_HD void load_k_words(const uint8_t* codes, int lane, int mt, uint32_t (&kw)[2][Geo<D>::KWORDS]) {
  load_words<Geo<D>::KWORDS>(codes + Stage<D, ORDER>::k_slice(mt, lane, 0), kw[0]);
  load_words<Geo<D>::KWORDS>(codes + Stage<D, ORDER>::k_slice(mt, lane, 1), kw[1]);
}

// The A fragment of Sᵀ's m-tile at k-tile kk from K's code words of that m-tile.
template <int KWORDS>
HACK_HD void k_frag(const uint32_t (&kw)[2][KWORDS], int kk, uint32_t (&a)[4]) {
  const int w = kk >> 2, i = 2 * (kk & 3);
  a[0] = code_pair(kw[0][w], i);
  a[1] = code_pair(kw[1][w], i);
  a[2] = code_pair(kw[0][w], i + 1);
  a[3] = code_pair(kw[1][w], i + 1);
}

// V's joined words of a lane for k-tile kt and group grp: x[tp] pairs tokens 16kt + 2t + 8tp and +1.
template <int D, int ORDER>
HACK_HD void load_v_words(const uint8_t* codes, int lane, int kt, int grp, uint32_t (&x)[2]) {
  using S = Stage<D, ORDER>;
  for (int tp = 0; tp < 2; ++tp) {
    if (ORDER == ORDER_FRAGMENT) {
      x[tp] = *reinterpret_cast<const uint32_t*>(codes + S::v_word(kt, lane, tp, grp, 0));
    } else {
      const uint32_t a = *reinterpret_cast<const uint32_t*>(codes + S::v_word(kt, lane, tp, grp, 0));
      const uint32_t b = *reinterpret_cast<const uint32_t*>(codes + S::v_word(kt, lane, tp, grp, 1));
      x[tp] = join_halves(a, b, lane_g(lane) & 1);
    }
  }
}

// The A fragment of Oᵀ's m-tile 4·grp + j (channels 64grp + 8g + 2j, +1) at that k-tile.
HACK_HD void v_frag(const uint32_t (&x)[2], int j, uint32_t (&a)[4]) {
  a[0] = code_pair(x[0], 2 * j);
  a[1] = code_pair(x[0], 2 * j + 1);
  a[2] = code_pair(x[1], 2 * j);
  a[3] = code_pair(x[1], 2 * j + 1);
}

// ---- which pages a split reads ----------------------------------------------------------------------

struct PageRange {
  int lo;          // first visible key (the sliding window's start, 0 without one)
  int pg_from;     // first key the pages and the open partition attend to (the sinks have their own tile)
  int first;       // the split's first page (logical index in the request's page table)
  int last;        // one past its last page
  int closed_end;  // one past its last closed (quantized) page
  int n_closed;    // closed pages of the request
  int open_len;    // tokens in the request's open partition (its FP16 tail)
  int has_open;    // this split holds the open partition
  int has_sinks;   // this split attends to the sinks (split 0, some sink visible)
};

HACK_HD int imin(int a, int b) { return a < b ? a : b; }
HACK_HD int imax(int a, int b) { return a > b ? a : b; }

// Request of L tokens (the new one included), window -1 or keys L-1-window..L-1, S sinks,
// pages_per_split pages per split starting at the window's first page.
HACK_HD PageRange page_range(int L, int window, int S, int split, int pages_per_split) {
  PageRange x;
  x.n_closed = L / PAGE;
  x.open_len = L % PAGE;
  const int n_pages = (L + PAGE - 1) / PAGE;
  x.lo = window >= 0 ? imax(L - 1 - window, 0) : 0;
  x.pg_from = imax(x.lo, S);
  x.first = x.lo / PAGE + split * pages_per_split;
  x.last = imin(x.first + pages_per_split, n_pages);
  x.closed_end = imin(x.last, x.n_closed);
  x.has_open = x.open_len > 0 && x.n_closed >= x.first && x.n_closed < x.last;
  x.has_sinks = split == 0 && S > 0 && x.lo < imin(S, L);
  return x;
}

// Closed pages of a split that warp w walks (pages first + w + WARPS·i).
HACK_HD int warp_pages(const PageRange& x, int w) {
  const int n = x.closed_end - x.first;
  return n > w ? (n - w + WARPS - 1) / WARPS : 0;
}

}  // namespace hack
