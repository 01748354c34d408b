// HACK decode attention on tensor cores, one query token per request over 2-bit pages (layout v2,
// Π = 64, fp16 side tables) plus the FP16 open partition and sinks. See hack_frag.cuh for the
// fragment mapping and docs/kernels.md ("CUDA decode kernel") for the design.
//
// Grid (split, KV head, request), 4 warps. Each warp walks every 4th closed page of its split with
// its own cp.async ring (STAGES pages in flight) and its own online softmax, so the page loop holds
// no block barrier; the warps meet once at the end, and a second kernel merges the splits.
// Arithmetic: scores in fp16 on the codes (Q' = Q ⊙ s_K(page) rounded to fp16, codes exact in
// fp16), Q·m_K added from an fp16 head + residual split of Q (~22 bits, like the fp32 reference),
// fp32 accumulation; values with P' = P ⊙ s_V(token) in fp16 and Σ_j P_j m_V(j) in fp32. The
// result equals hack_ops.attention's 'dequant' mode up to fp16 rounding (no INT8 Q' or P').
//
// One instantiation per library: HACK_D (64, 128, 256), HACK_T (0: bf16, 1: fp16 queries and
// output), HACK_ORDER (0: pages in token order, the pool's; 1: codes in fragment order), HACK_CAP
// (1: the layer soft-caps its logits; a separate build, so layers without a cap carry none of it).
#include <cstddef>
#include <type_traits>

#include "hack_frag.cuh"
#include "hack_params.h"
#include "hack_simt.cuh"

#ifndef HACK_D
#define HACK_D 128
#endif
#ifndef HACK_T
#define HACK_T 0
#endif
#ifndef HACK_ORDER
#define HACK_ORDER 0
#endif
#ifndef HACK_CAP
#define HACK_CAP 0
#endif

namespace hack {

using Act = std::conditional_t<HACK_T == 0, __nv_bfloat16, __half>;
constexpr float LOG2E = 1.4426950408889634f;
using simt::ex2;
using simt::mma;
using simt::pack_f16;
using simt::rcp;
using simt::trans8x8;

// Soft-capping in log2 units: c·tanh(s / c) with c = cap·log2(e); tanh from one exp (error ~1e-7·c).
HACK_DEV float soft_cap_l2(float s, float c) {
  const float x = s * rcp(c);
  const float e = ex2(-2.f * LOG2E * fabsf(x));
  const float th = (1.f - e) * rcp(1.f + e);
  return copysignf(c * th, x);
}

template <int D, bool CAP>
struct Warp {
  using G = Geo<D>;
  int lane, g, t;
  uint32_t qhi[G::NQ], qlo[G::NQ];  // fp16 pairs of q·scale·log2(e): head and residual
  float o[G::MD][4];                // Oᵀ accumulators (channel tiles x C fragment)
  float m_run[2];                   // running max of query heads 2t, 2t+1 (log2 units, warp-uniform per t)
  float l_part[2];                  // this lane's share of the softmax sums
  float mv[2][G::NG];               // ... of Σ_j P_j m_V(j) per head_dim group

  HACK_DEV void init(const DecodeParams& p, int b, int h, int ln) {
    lane = ln;
    g = lane_g(ln);
    t = lane_t(ln);
    float x[D / 4];
    const float scale = p.sm_scale * LOG2E;
    if (g < p.rep) {
      const Act* src = static_cast<const Act*>(p.q) + b * p.q_sb + (int64_t)(h * p.rep + g) * p.q_sh + t * (D / 4);
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(src)[i];
        const Act* e = reinterpret_cast<const Act*>(&v);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[8 * i + j] = simt::to_float(e[j]) * scale;
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 4; ++i) x[i] = 0.f;
    }
#pragma unroll
    for (int P = 0; P < G::NQ; ++P) {
      const int c0 = 16 * (P >> 3) + (P & 7), c1 = c0 + 8;
      const __half h0 = __float2half_rn(x[c0]), h1 = __float2half_rn(x[c1]);
      qhi[P] = simt::halves(h0, h1);
      qlo[P] = pack_f16(x[c0] - __half2float(h0), x[c1] - __half2float(h1));
    }
#pragma unroll
    for (int md = 0; md < G::MD; ++md) o[md][0] = o[md][1] = o[md][2] = o[md][3] = 0.f;
    m_run[0] = m_run[1] = -INFINITY;
    l_part[0] = l_part[1] = 0.f;
#pragma unroll
    for (int k = 0; k < G::NG; ++k) mv[0][k] = mv[1][k] = 0.f;
  }

  // Scores s (C fragments of Sᵀ: [m-tile][token g / g+8 x query heads 2t, 2t+1], log2 units) ->
  // unnormalized probabilities in place; the running state is rescaled. valid(token) masks.
  template <class Valid>
  HACK_DEV void softmax(float (&s)[4][4], float capl2, bool masked, Valid valid) {
    if (CAP) {
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][e] = soft_cap_l2(s[mt][e], capl2);
    }
    if (masked) {
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (!valid(16 * mt + g + 8 * (e >> 1))) s[mt][e] = -INFINITY;
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      mx[0] = fmaxf(mx[0], fmaxf(s[mt][0], s[mt][2]));
      mx[1] = fmaxf(mx[1], fmaxf(s[mt][1], s[mt][3]));
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) mx[c] = fmaxf(mx[c], simt::shfl_xor(mx[c], off));
    }
    float alpha[2], base[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float m_new = fmaxf(m_run[c], mx[c]);
      base[c] = m_new == -INFINITY ? 0.f : m_new;
      alpha[c] = ex2(m_run[c] - base[c]);
      m_run[c] = m_new;
      l_part[c] *= alpha[c];
#pragma unroll
      for (int k = 0; k < G::NG; ++k) mv[c][k] *= alpha[c];
    }
#pragma unroll
    for (int md = 0; md < G::MD; ++md) {
      o[md][0] *= alpha[0];
      o[md][1] *= alpha[1];
      o[md][2] *= alpha[0];
      o[md][3] *= alpha[1];
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][e] = ex2(s[mt][e] - base[e & 1]);
  }

  // One closed page staged in shared memory (Stage<D, ORDER> layout); keys before vfrom masked.
  template <int ORDER>
  HACK_DEV void page(const uint8_t* st, int vfrom, float capl2) {
    uint32_t sk[G::NQ], mk[G::NQ];
    load_words<G::NQ>(st + G::OFF_KS + Stage<D, ORDER>::ktab_slice(lane), sk);
    load_words<G::NQ>(st + G::OFF_KM + Stage<D, ORDER>::ktab_slice(lane), mk);
    // Q·m_K: an MMA whose A rows all hold m_K, so every token row of Sᵀ starts from it.
    float c_hi[4] = {0.f, 0.f, 0.f, 0.f}, c_lo[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < G::MD; ++kk) {
      const uint32_t m0 = slice_pair(mk, 2 * kk), m1 = slice_pair(mk, 2 * kk + 1);
      const uint32_t a[4] = {m0, m0, m1, m1};
      mma(c_hi, a, qhi[2 * kk], qhi[2 * kk + 1]);
      mma(c_lo, a, qlo[2 * kk], qlo[2 * kk + 1]);
    }
    float s[4][4];
    uint32_t kw[4][2][G::KWORDS];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      load_k_words<D, ORDER>(st + G::OFF_KC, lane, mt, kw[mt]);
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][e] = c_hi[e] + c_lo[e];
    }
#pragma unroll
    for (int kk = 0; kk < G::MD; ++kk) {
      const uint32_t q0 = simt::hmul2(qhi[2 * kk], slice_pair(sk, 2 * kk));
      const uint32_t q1 = simt::hmul2(qhi[2 * kk + 1], slice_pair(sk, 2 * kk + 1));
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        uint32_t a[4];
        k_frag(kw[mt], kk, a);
        mma(s[mt], a, q0, q1);
      }
    }
    softmax(s, capl2, vfrom > 0, [&](int tok) { return tok >= vfrom; });

#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      const uint32_t ph0 = pack_f16(s[kt][0], s[kt][1]), ph1 = pack_f16(s[kt][2], s[kt][3]);
      l_part[0] += s[kt][0] + s[kt][2];
      l_part[1] += s[kt][1] + s[kt][3];
      const int tok0 = 16 * kt + g, tok1 = tok0 + 8;
      uint32_t sc[2][G::NG], mn[2][G::NG];  // V's scale and minimum of the two tokens, per group (broadcast pairs)
      v_tables(st + G::OFF_VS, tok0, sc[0]);
      v_tables(st + G::OFF_VS, tok1, sc[1]);
      v_tables(st + G::OFF_VM, tok0, mn[0]);
      v_tables(st + G::OFF_VM, tok1, mn[1]);
#pragma unroll
      for (int grp = 0; grp < G::NG; ++grp) {
        const float mn0 = simt::low_float(mn[0][grp]), mn1 = simt::low_float(mn[1][grp]);
        mv[0][grp] += s[kt][0] * mn0 + s[kt][2] * mn1;
        mv[1][grp] += s[kt][1] * mn0 + s[kt][3] * mn1;
        const uint32_t b0 = trans8x8(simt::hmul2(ph0, sc[0][grp])), b1 = trans8x8(simt::hmul2(ph1, sc[1][grp]));
        uint32_t x[2];
        load_v_words<D, ORDER>(st + G::OFF_VC, lane, kt, grp, x);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t a[4];
          v_frag(x, j, a);
          mma(o[4 * grp + j], a, b0, b1);
        }
      }
    }
  }

  // V's min or scale of one token, each group's value broadcast to both halves. Whole 32-bit words
  // are read (NG = 1: the word two tokens share) rather than 16-bit shared loads.
  HACK_DEV void v_tables(const uint8_t* tab, int tok, uint32_t (&out)[G::NG]) const {
    if constexpr (G::NG == 1) {
      out[0] = simt::broadcast(*reinterpret_cast<const uint32_t*>(tab + 4 * (tok >> 1)), tok & 1);
    } else {
      uint32_t w[G::NG / 2];
      load_words<G::NG / 2>(tab + 2 * G::NG * tok, w);
#pragma unroll
      for (int k = 0; k < G::NG; ++k) out[k] = simt::broadcast(w[k / 2], k & 1);
    }
  }

  // Up to 64 FP16 tokens (the open partition's tail, or the sinks): token j's K at k0 + j·stride,
  // V likewise, this head's D values. Keys j < count at positions pos0 + j >= vis_from are visible.
  HACK_DEV void fp16_tile(const __half* k0, const __half* v0, int64_t stride, int count, int pos0, int vis_from,
                            float capl2) {
    float s[4][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      float s_lo[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][e] = 0.f;
      if (16 * mt < count) {
        uint32_t kh[2][G::NQ];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int tok = 16 * mt + g + 8 * r;
          if (tok < count) {
            load_words<G::NQ>(reinterpret_cast<const uint8_t*>(k0 + tok * stride + t * (D / 4)), kh[r]);
          } else {
#pragma unroll
            for (int i = 0; i < G::NQ; ++i) kh[r][i] = 0u;
          }
        }
#pragma unroll
        for (int kk = 0; kk < G::MD; ++kk) {
          const uint32_t a[4] = {slice_pair(kh[0], 2 * kk), slice_pair(kh[1], 2 * kk), slice_pair(kh[0], 2 * kk + 1),
                                 slice_pair(kh[1], 2 * kk + 1)};
          mma(s[mt], a, qhi[2 * kk], qhi[2 * kk + 1]);
          mma(s_lo, a, qlo[2 * kk], qlo[2 * kk + 1]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][e] += s_lo[e];
      }
    }
    softmax(s, capl2, true, [&](int tok) { return tok < count && pos0 + tok >= vis_from; });
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      l_part[0] += s[kt][0] + s[kt][2];
      l_part[1] += s[kt][1] + s[kt][3];
      if (16 * kt >= count) continue;
      const uint32_t b0 = trans8x8(pack_f16(s[kt][0], s[kt][1])), b1 = trans8x8(pack_f16(s[kt][2], s[kt][3]));
#pragma unroll
      for (int grp = 0; grp < G::NG; ++grp) {
        uint32_t w[2][2][4];  // [token pair][token A / B][channels 2j, 2j+1]
#pragma unroll
        for (int tp = 0; tp < 2; ++tp)
#pragma unroll
          for (int which = 0; which < 2; ++which) {
            const int tok = 16 * kt + 2 * t + 8 * tp + which;
            if (tok < count) {
              load_words<4>(reinterpret_cast<const uint8_t*>(v0 + tok * stride + 64 * grp + 8 * g), w[tp][which]);
            } else {
              w[tp][which][0] = w[tp][which][1] = w[tp][which][2] = w[tp][which][3] = 0u;
            }
          }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t a[4] = {join_halves(w[0][0][j], w[0][1][j], 0), join_halves(w[0][0][j], w[0][1][j], 1),
                                 join_halves(w[1][0][j], w[1][1][j], 0), join_halves(w[1][0][j], w[1][1][j], 1)};
          mma(o[4 * grp + j], a, b0, b1);
        }
      }
    }
  }

  // The lanes' partial sums reduced over the 8 lanes that share a query-head pair; the V minimum
  // term joins the accumulators.
  HACK_DEV void finish() {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        l_part[c] += simt::shfl_xor(l_part[c], off);
#pragma unroll
        for (int k = 0; k < G::NG; ++k) mv[c][k] += simt::shfl_xor(mv[c][k], off);
      }
    }
#pragma unroll
    for (int md = 0; md < G::MD; ++md) {
      const int grp = md / 4;
      o[md][0] += mv[0][grp];
      o[md][1] += mv[1][grp];
      o[md][2] += mv[0][grp];
      o[md][3] += mv[1][grp];
    }
  }
};

// Stage one closed page (this head's K and V codes and side tables) into a ring slot.
template <int D, int ORDER>
HACK_DEV void stage_page(const DecodeParams& p, int id, int h, int lane, uint8_t* slot) {
  using G = Geo<D>;
  using S = Stage<D, ORDER>;
  const uint8_t* kp = p.k_buf + (int64_t)id * p.k_page;
  const uint8_t* vp = p.v_buf + (int64_t)id * p.v_page;
  const uint8_t* kc = kp + p.kc_off + h * G::CODES;
  const uint8_t* vc = vp + p.vc_off + h * G::CODES;
#pragma unroll
  for (int j = 0; j < G::CP_CODES; ++j) {
    const int c = 32 * j + lane, dst = S::code_copy_dst(j, lane);
    simt::cp_async16(slot, G::OFF_KC + dst, kc + 16 * c);
    simt::cp_async16(slot, G::OFF_VC + dst, vc + 16 * c);
  }
  int which, cc;
#pragma unroll
  for (int j = 0; j < G::CP_KTAB; ++j) {
    if (S::table_chunk(j, lane, G::TAB / 16, which, cc)) {
      const uint8_t* src = kp + (which ? p.km_off : p.ks_off) + h * G::TAB + 16 * cc;
      simt::cp_async16(slot, (which ? G::OFF_KM : G::OFF_KS) + S::ktab_dst(cc), src);
    }
  }
#pragma unroll
  for (int j = 0; j < G::CP_VTAB; ++j) {
    if (S::table_chunk(j, lane, G::VTAB / 16, which, cc)) {
      const uint8_t* src = vp + (which ? p.vm_off : p.vs_off) + h * G::VTAB + 16 * cc;
      simt::cp_async16(slot, (which ? G::OFF_VM : G::OFF_VS) + 16 * cc, src);
    }
  }
}

template <int D, int ORDER, bool CAP>
HACK_GLOBAL void HACK_BOUNDS(WARPS * 32) hack_decode_kernel(const DecodeParams p) {
  using G = Geo<D>;
  uint8_t* smem = simt::shared_memory();
  const int split = simt::block_x(), h = simt::block_y(), b = simt::block_z();
  const int warp = simt::thread_x() >> 5, lane = simt::thread_x() & 31;
  const int L = p.seq_lens[b];
  const PageRange R = page_range(L, p.window, p.sinks, split, p.pages_per_split);
  const float capl2 = p.logit_cap * LOG2E;

  Warp<D, CAP> W;
  W.init(p, b, h, lane);

  // Closed pages first + warp + WARPS·i, i < n_my, through a ring of STAGES slots. Page ids are
  // read 32 at a time, one per lane, and passed around by shuffles.
  const int n_my = warp_pages(R, warp);
  uint8_t* ring = smem + warp * STAGES * G::STAGE;
  const int32_t* table = p.kv_indices + (p.head_tables ? static_cast<int64_t>(p.kv_indptr[b]) * p.kv_heads +
                                                             static_cast<int64_t>(h) * (p.kv_indptr[b + 1] - p.kv_indptr[b])
                                                       : p.kv_indptr[b]);
  int ids = 0, id_base = -32;
  auto issue = [&](int i) {
    if (i - id_base >= 32) {  // warp-uniform
      id_base = i;
      ids = i + lane < n_my ? table[R.first + warp + WARPS * (i + lane)] : 0;
    }
    const int id = simt::shfl_idx(ids, i - id_base);
    stage_page<D, ORDER>(p, id, h, lane, ring + (i % STAGES) * G::STAGE);
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < n_my) issue(i);
    simt::cp_commit();
  }
  for (int i = 0; i < n_my; ++i) {
    if (i + STAGES - 1 < n_my) issue(i + STAGES - 1);
    simt::cp_commit();
    simt::cp_wait<STAGES - 1>();
    simt::sync_warp();
    const int pg = R.first + warp + WARPS * i;
    W.template page<ORDER>(ring + (i % STAGES) * G::STAGE, R.pg_from - pg * PAGE, capl2);
    simt::sync_warp();  // the slot is refilled next
  }

  // The FP16 tiles go to the warps after the last closed page, round robin.
  const int n_closed_split = imax(R.closed_end - R.first, 0);
  if (R.has_open && warp == n_closed_split % WARPS) {
    const int64_t row = p.tail_rows[b];
    const __half* kt = static_cast<const __half*>(p.tail_k) + row * p.t_row + h * p.t_head;
    const __half* vt = static_cast<const __half*>(p.tail_v) + row * p.t_row + h * p.t_head;
    W.fp16_tile(kt, vt, p.t_tok, R.open_len, R.n_closed * PAGE, R.pg_from, capl2);
  }
  if (R.has_sinks && warp == (n_closed_split + 1) % WARPS) {
    const int64_t slot = p.sink_slots[b];
    const __half* ks = static_cast<const __half*>(p.sink_k) + slot * p.s_slot + h * p.s_head;
    const __half* vs = static_cast<const __half*>(p.sink_v) + slot * p.s_slot + h * p.s_head;
    W.fp16_tile(ks, vs, p.s_tok, imin(p.sinks, L), 0, R.lo, capl2);
  }
  W.finish();

  // The 4 warps' (max, sum, accumulators) merged through shared memory.
  simt::cp_wait<0>();
  simt::sync_block();  // every warp is done with its ring
  float* cm = reinterpret_cast<float*>(smem);
  float* cl = cm + WARPS * MAX_REP;
  float* co = cl + WARPS * MAX_REP;
  const int g = W.g, t = W.t;
  if (g == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      cm[warp * MAX_REP + 2 * t + c] = W.m_run[c];
      cl[warp * MAX_REP + 2 * t + c] = W.l_part[c];
    }
  }
#pragma unroll
  for (int md = 0; md < G::MD; ++md)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ch = 64 * (md / 4) + 8 * g + 2 * (md % 4) + (e >> 1), qh = 2 * t + (e & 1);
      co[(warp * MAX_REP + qh) * D + ch] = W.o[md][e];
    }
  simt::sync_block();
  const int hq = p.kv_heads * p.rep;
  for (int idx = simt::thread_x(); idx < p.rep * D; idx += WARPS * 32) {
    const int qh = idx / D, ch = idx % D;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m_all = fmaxf(m_all, cm[w * MAX_REP + qh]);
    float l = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float m = cm[w * MAX_REP + qh];
      const float f = m == -INFINITY ? 0.f : ex2(m - m_all);
      l += f * cl[w * MAX_REP + qh];
      acc += f * co[(w * MAX_REP + qh) * D + ch];
    }
    const int head = h * p.rep + qh;
    if (p.num_splits == 1) {
      static_cast<Act*>(p.out)[b * p.o_sb + head * p.o_sh + ch] = simt::from_float<Act>(acc / (l > 0.f ? l : 1.f));
    } else {
      const int64_t part = ((int64_t)b * hq + head) * p.num_splits + split;
      p.o_part[part * D + ch] = acc;
      if (ch == 0) {
        p.m_part[part] = m_all;
        p.l_part[part] = l;
      }
    }
  }
}

// Merge the splits of one (request, query head): each rescaled to the common max. Block: D threads.
template <int D>
HACK_GLOBAL void hack_decode_combine(const DecodeParams p) {
  const int qh = simt::block_x(), b = simt::block_y(), ch = simt::thread_x();
  const int hq = p.kv_heads * p.rep;
  const int64_t base = ((int64_t)b * hq + qh) * p.num_splits;
  float m_all = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) m_all = fmaxf(m_all, p.m_part[base + s]);
  float l = 0.f, acc = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float m = p.m_part[base + s];
    const float f = m == -INFINITY ? 0.f : ex2(m - m_all);
    l += f * p.l_part[base + s];
    acc += f * p.o_part[(base + s) * D + ch];
  }
  static_cast<Act*>(p.out)[b * p.o_sb + qh * p.o_sh + ch] = simt::from_float<Act>(acc / (l > 0.f ? l : 1.f));
}

}  // namespace hack

#if !defined(HACK_SIMT_HOST)
#include <cuda_runtime.h>

using hack::DecodeParams;

namespace {

constexpr auto* KERNEL = hack::hack_decode_kernel<HACK_D, HACK_ORDER, HACK_CAP != 0>;

// Select the device and let the kernel use its dynamic shared memory (above 48 KB a kernel must
// opt in, once per device).
cudaError_t prepare(int device) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  static int done_for = 0;  // device + 1
  if (hack::Geo<HACK_D>::SMEM > 48 * 1024 && done_for != device + 1) {
    err = cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, hack::Geo<HACK_D>::SMEM);
    if (err != cudaSuccess) return err;
    done_for = device + 1;
  }
  return cudaSuccess;
}

}  // namespace

// Launch the decode kernel (and the combine kernel when p.num_splits > 1) on `stream` of `device`.
// Returns a cudaError_t (0: launched).
extern "C" int hack_cuda_decode(const DecodeParams* p, int device, void* stream) {
  using G = hack::Geo<HACK_D>;
  auto* kernel = KERNEL;
  cudaError_t err = prepare(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  kernel<<<dim3(p->num_splits, p->kv_heads, p->batch), hack::WARPS * 32, G::SMEM, s>>>(*p);
  if (p->num_splits > 1) {
    hack::hack_decode_combine<HACK_D><<<dim3(p->kv_heads * p->rep, p->batch), HACK_D, 0, s>>>(*p);
  }
  return static_cast<int>(cudaGetLastError());
}

// What this library was built for: head_dim, activation dtype (0 bf16, 1 fp16), code order,
// soft-capping (0/1), dynamic shared memory per block, sizeof(DecodeParams).
extern "C" void hack_cuda_variant(int64_t* out) {
  out[0] = HACK_D;
  out[1] = HACK_T;
  out[2] = HACK_ORDER;
  out[3] = HACK_CAP;
  out[4] = hack::Geo<HACK_D>::SMEM;
  out[5] = sizeof(DecodeParams);
}

// What the driver says of the kernel on `device`: registers per thread, local (spill) bytes per
// thread, static shared bytes, resident blocks per SM at its dynamic shared memory. cudaError_t.
extern "C" int hack_cuda_kernel_attributes(int device, int64_t* out) {
  cudaError_t err = prepare(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  cudaFuncAttributes a;
  err = cudaFuncGetAttributes(&a, KERNEL);
  if (err != cudaSuccess) return static_cast<int>(err);
  int blocks = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, KERNEL, hack::WARPS * 32, hack::Geo<HACK_D>::SMEM);
  out[0] = a.numRegs;
  out[1] = static_cast<int64_t>(a.localSizeBytes);
  out[2] = static_cast<int64_t>(a.sharedSizeBytes);
  out[3] = blocks;
  return static_cast<int>(err);
}

extern "C" const char* hack_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

#endif  // !HACK_SIMT_HOST
