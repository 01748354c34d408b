// The decode kernel's per-thread arithmetic (hack_frag.cuh) compiled for the host, so the CPU
// tests can run it against the Python model (hack_ops/cuda/fragment.py) and the reference
// quantizer: staging a page the way the cp.async ring does, each lane's MMA fragments of the K
// and V codes, the pairs of K's side tables, and which pages a split reads. Host code only: no
// kernel, no CUDA runtime call, so it loads on a machine without a GPU.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "hack_frag.cuh"
#include "hack_params.h"
#include "hack_store_params.h"

using namespace hack;

namespace {

template <int D, int ORDER>
void stage(const uint8_t* kc, const uint8_t* km, const uint8_t* ks, const uint8_t* vc, const uint8_t* vm,
           const uint8_t* vs, uint8_t* st) {
  using G = Geo<D>;
  using S = Stage<D, ORDER>;
  std::memset(st, 0, G::STAGE);
  for (int lane = 0; lane < 32; ++lane) {
    for (int j = 0; j < G::CP_CODES; ++j) {
      const int c = 32 * j + lane, dst = S::code_copy_dst(j, lane);
      std::memcpy(st + G::OFF_KC + dst, kc + 16 * c, 16);
      std::memcpy(st + G::OFF_VC + dst, vc + 16 * c, 16);
    }
    int which, cc;
    for (int j = 0; j < G::CP_KTAB; ++j)
      if (S::table_chunk(j, lane, G::TAB / 16, which, cc))
        std::memcpy(st + (which ? G::OFF_KM : G::OFF_KS) + S::ktab_dst(cc), (which ? km : ks) + 16 * cc, 16);
    for (int j = 0; j < G::CP_VTAB; ++j)
      if (S::table_chunk(j, lane, G::VTAB / 16, which, cc))
        std::memcpy(st + (which ? G::OFF_VM : G::OFF_VS) + 16 * cc, (which ? vm : vs) + 16 * cc, 16);
  }
}

// out[((mt * MD) + kk) * 4 + r]: register r of the A fragment of Sᵀ's m-tile mt at k-tile kk.
template <int D, int ORDER>
void k_frags(const uint8_t* st, int lane, uint32_t* out) {
  using G = Geo<D>;
  for (int mt = 0; mt < 4; ++mt) {
    uint32_t kw[2][G::KWORDS];
    load_k_words<D, ORDER>(st + G::OFF_KC, lane, mt, kw);
    for (int kk = 0; kk < G::MD; ++kk) {
      uint32_t a[4];
      k_frag(kw, kk, a);
      for (int r = 0; r < 4; ++r) out[(mt * G::MD + kk) * 4 + r] = a[r];
    }
  }
}

// out[((kt * MD) + md) * 4 + r]: register r of the A fragment of Oᵀ's m-tile md at k-tile kt.
template <int D, int ORDER>
void v_frags(const uint8_t* st, int lane, uint32_t* out) {
  using G = Geo<D>;
  for (int kt = 0; kt < 4; ++kt)
    for (int grp = 0; grp < G::NG; ++grp) {
      uint32_t x[2];
      load_v_words<D, ORDER>(st + G::OFF_VC, lane, kt, grp, x);
      for (int j = 0; j < 4; ++j) {
        uint32_t a[4];
        v_frag(x, j, a);
        for (int r = 0; r < 4; ++r) out[(kt * G::MD + 4 * grp + j) * 4 + r] = a[r];
      }
    }
}

// out[P]: pair P of the lane's slice of K's scale (which 0) or minimum (which 1).
template <int D, int ORDER>
void table_pairs(const uint8_t* st, int lane, int which, uint32_t* out) {
  using G = Geo<D>;
  uint32_t w[G::NQ];
  load_words<G::NQ>(st + (which ? G::OFF_KM : G::OFF_KS) + Stage<D, ORDER>::ktab_slice(lane), w);
  for (int P = 0; P < G::NQ; ++P) out[P] = slice_pair(w, P);
}

template <int D>
void geometry(int64_t* out) {
  using G = Geo<D>;
  const int64_t v[] = {G::STAGE, G::OFF_KC, G::OFF_KS, G::OFF_KM, G::OFF_VC, G::OFF_VS, G::OFF_VM, G::SMEM,
                       G::CODES, G::TAB, G::TABP, G::VTAB};
  for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); ++i) out[i] = v[i];
}

template <template <int, int> class F, typename... A>
int dispatch(int d, int order, A... args) {
  switch (d * 2 + order) {
    case 128: F<64, 0>::run(args...); return 0;
    case 129: F<64, 1>::run(args...); return 0;
    case 256: F<128, 0>::run(args...); return 0;
    case 257: F<128, 1>::run(args...); return 0;
    case 512: F<256, 0>::run(args...); return 0;
    case 513: F<256, 1>::run(args...); return 0;
    default: return -1;
  }
}

template <int D, int O> struct StageF { static void run(const uint8_t* a, const uint8_t* b, const uint8_t* c, const uint8_t* d, const uint8_t* e, const uint8_t* f, uint8_t* st) { stage<D, O>(a, b, c, d, e, f, st); } };
template <int D, int O> struct KF { static void run(const uint8_t* st, int lane, uint32_t* out) { k_frags<D, O>(st, lane, out); } };
template <int D, int O> struct VF { static void run(const uint8_t* st, int lane, uint32_t* out) { v_frags<D, O>(st, lane, out); } };
template <int D, int O> struct TF { static void run(const uint8_t* st, int lane, int which, uint32_t* out) { table_pairs<D, O>(st, lane, which, out); } };
template <int D, int O> struct GF { static void run(int64_t* out) { geometry<D>(out); } };

}  // namespace

extern "C" {

uint32_t hfh_code_pair(uint32_t word, int i) { return code_pair(word, i); }
uint32_t hfh_join_halves(uint32_t a, uint32_t b, int high) { return join_halves(a, b, high); }

// Stage one head's page sections (K codes, K min, K scale, V codes, V min, V scale) as the ring does.
int hfh_stage(int d, int order, const uint8_t* kc, const uint8_t* km, const uint8_t* ks, const uint8_t* vc,
              const uint8_t* vm, const uint8_t* vs, uint8_t* st) {
  return dispatch<StageF>(d, order, kc, km, ks, vc, vm, vs, st);
}
int hfh_k_frags(int d, int order, const uint8_t* st, int lane, uint32_t* out) { return dispatch<KF>(d, order, st, lane, out); }
int hfh_v_frags(int d, int order, const uint8_t* st, int lane, uint32_t* out) { return dispatch<VF>(d, order, st, lane, out); }
int hfh_table_pairs(int d, int order, const uint8_t* st, int lane, int which, uint32_t* out) {
  return dispatch<TF>(d, order, st, lane, which, out);
}
// STAGE, OFF_KC, OFF_KS, OFF_KM, OFF_VC, OFF_VS, OFF_VM, SMEM, CODES, TAB, TABP, VTAB.
int hfh_geometry(int d, int64_t* out) { return dispatch<GF>(d, 0, out); }

// lo, pg_from, first, last, closed_end, n_closed, open_len, has_open, has_sinks, then the closed
// pages of warps 0..3.
void hfh_page_range(int L, int window, int S, int split, int pages_per_split, int32_t* out) {
  const PageRange x = page_range(L, window, S, split, pages_per_split);
  const int32_t v[] = {x.lo, x.pg_from, x.first, x.last, x.closed_end, x.n_closed, x.open_len, x.has_open, x.has_sinks};
  for (int i = 0; i < 9; ++i) out[i] = v[i];
  for (int w = 0; w < WARPS; ++w) out[9 + w] = warp_pages(x, w);
}

// sizeof(DecodeParams), then the offset of each field in declaration order.
int hfh_param_layout(int64_t* out) {
  int n = 0;
  out[n++] = sizeof(DecodeParams);
#define HACK_OFFSET(f) out[n++] = offsetof(DecodeParams, f);
  HACK_PARAM_FIELDS(HACK_OFFSET)
#undef HACK_OFFSET
  return n;
}

// sizeof(StoreParams), then the offset of each field in declaration order.
int hfh_store_param_layout(int64_t* out) {
  int n = 0;
  out[n++] = sizeof(hack::StoreParams);
#define HACK_OFFSET(f) out[n++] = offsetof(hack::StoreParams, f);
  HACK_STORE_FIELDS(HACK_OFFSET)
#undef HACK_OFFSET
  return n;
}

}  // extern "C"
