// HACK store for prefill on CUDA: the pages a batch of new tokens closes, quantized once each, and
// the sink tokens among them (the pages phase of hack_ops.triton.store; the open page's tokens
// go to the FP16 tails in Triton's tail phase). Layout v2, orientation channel_k, Π = 64,
// K and V 2- or 4-bit each, fp16 or fp32 side tables, K and V with FP16 tails (tail_tensors
// 'kv'), the range search on or off. The bytes are hack_ops.quant's: same operations in the
// same order (the library is built with -fmad=false), IEEE division, round-half-even codes,
// min rounded down and scale up to fp16. A candidate's squared error is summed in the order of
// torch's CPU sum, which the reference's err.sum(-1) is (hack_ops/paged/csrc/hack_store.c,
// err_reduce): K's 64 tokens (a strided dim) in blocks of 16 summed in sequence, the block sums
// in sequence; V's 64 channels (the contiguous dim) as vectors of `sum_width` lanes, 4 interleaved
// partials, then the lanes. Summed token by token instead, two candidates whose errors tie to the
// last bit resolved the other way on an H200 (1 page of ~800 at real shapes).
//
// Grid (touched page, request, KV head), HACK_D threads. Why this shape, and not the Triton
// kernel's tile per program: the range search tries 25 clipped ranges per group, and each group
// is one thread's (K: thread t owns channel t over the page's 64 tokens; V: thread t owns one
// token's group of 64 channels), so the search runs in registers with no reduction across
// threads; the Triton tile held a page per program at 254 registers, one block per SM. K's codes
// meet in shared memory once, to be packed along head_dim and summed per token.
//
// One instantiation per library: HACK_D (64, 128, 256), HACK_T (0: bf16, 1: fp16 new tokens).
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector_types.h>

#include "hack_simt.cuh"
#include "hack_store_params.h"

#ifndef HACK_D
#define HACK_D 128
#endif
#ifndef HACK_T
#define HACK_T 0
#endif

namespace hack {
namespace store {

constexpr int P = 64;   // tokens per page
constexpr int GD = 64;  // channels per group of a token (min(Π, D): D >= 64 here)
constexpr int CANDIDATES = 25;  // hack_ops.quant.CLIP_GRID squared
using In = std::conditional_t<HACK_T == 0, __nv_bfloat16, __half>;

HACK_DEV float div_rn(float a, float b) {
#if defined(HACK_SIMT_HOST)
  return a / b;
#else
  return __fdiv_rn(a, b);
#endif
}

// hack_ops.quant.CLIP_GRID[i], as float32 (what a Python float becomes against a float32 tensor).
HACK_DEV float clip_grid(int i) { return i == 1 ? 0.05f : i == 2 ? 0.1f : i == 3 ? 0.2f : i == 4 ? 0.3f : 0.f; }

HACK_DEV float f16_down(float x) { return __half2float(__float2half_rd(x)); }
HACK_DEV float f16_up(float x) { return __half2float(__float2half_ru(x)); }
HACK_DEV float fp16_of(float x) { return __half2float(__float2half_rn(x)); }

// A range [lo, hi] as stored: min rounded down and scale (hi - min) / levels up to the meta dtype;
// a scale <= 0 becomes 1 (hack_ops.quant).
HACK_DEV void rounded_range(float lo, float hi, float levels, bool f16, float& lo_q, float& s_q) {
  lo_q = f16 ? f16_down(lo) : lo;
  s_q = div_rn(hi - lo_q, levels);
  if (f16) s_q = f16_up(s_q);
  if (s_q <= 0.f) s_q = 1.f;
}

// The stored (min, scale) of a group's chosen range [mn, mx]; an empty range stores scale 1.
HACK_DEV void stored_meta(float mn, float mx, float levels, bool f16, float& mn_q, float& s_q) {
  rounded_range(mn, mx, levels, f16, mn_q, s_q);
  if (mx <= mn) s_q = 1.f;
}

// The code of x, clamp(rint((x - mn) / s), 0, levels) with an IEEE division, from one multiply by
// inv = 1 / s: the product is within 3 ulps of the quotient, so where it lies farther than 8e-6
// from a half-integer both round to the same integer (codes <= 15: |q| <= 16 where it matters;
// beyond, both clamp alike), and where it lies that close the division decides (ties, near-ties).
// (A division is ~8 instructions in SASS: MUFU.RCP, four FFMAs, FCHK and a slow-path branch.)
HACK_DEV float code_of(float x, float mn, float s, float inv, float levels) {
  const float a = x - mn;
  const float q = a * inv;
  float c = rintf(q);
  if (fabsf(q - c) >= 0.5f - 8e-6f) c = rintf(div_rn(a, s));
  return fminf(fmaxf(c, 0.f), levels);
}

// Σ err(i) over the P values of a group summed along a strided dim (K per channel): blocks of
// 16 in sequence, the block sums in sequence (err_reduce's SUM_ROWS for n <= 256).
template <class Err>
HACK_DEV float sum_rows(Err err) {
  float total = 0.f;
#pragma unroll
  for (int b = 0; b < P; b += 16) {
    float block = err(b);
#pragma unroll
    for (int j = b + 1; j < b + 16; ++j) block += err(j);
    total += block;
  }
  return total;
}

// ... along the contiguous dim (V per token and group) with torch's vectors of W lanes
// (err_reduce's SUM_INNER): element i belongs to vector i / W; vector r to partial r % 4 (lane
// by lane) while whole rounds of 4 vectors last, the rest to partial 0; the 4 partials are added
// lane by lane, then the W lanes in order.
template <int W, class Err>
HACK_DEV float sum_inner(Err err) {
  constexpr int NVEC = P / W, HEAD = NVEC / 4 * 4 * W;
  static_assert(P % W == 0, "whole vectors");
  float total = 0.f;
#pragma unroll
  for (int l = 0; l < W; ++l) {
    float lane = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float part = 0.f;
#pragma unroll
      for (int i = k * W + l; i < HEAD; i += 4 * W) part += err(i);
      if (k == 0) {
#pragma unroll
        for (int i = HEAD + l; i < NVEC * W; i += W) part += err(i);
      }
      lane = k == 0 ? part : lane + part;
    }
    total += lane;
  }
  return total;
}

enum class SumOrder { ROWS, INNER8, INNER16 };

// hack_ops.quant._search_range for one group of P values (bit i of `valid`: x[i] takes part):
// the clipped [mn + a·r, mx - b·r] whose codes give the least squared error; ties keep the earlier.
template <SumOrder ORDER>
HACK_DEV void search_range(const float (&x)[P], uint64_t valid, float& mn, float& mx, float levels, bool f16) {
  const float r = mx - mn;
  float best_err = 0.f, best_lo = mn, best_hi = mx;
#pragma unroll 1
  for (int c = 0; c < CANDIDATES; ++c) {
    const float lo = mn + clip_grid(c / 5) * r;
    const float hi = mx - clip_grid(c % 5) * r;
    float lo_q, sc;
    rounded_range(lo, hi, levels, f16, lo_q, sc);
    const float inv = div_rn(1.f, sc);
    auto sq = [&](int i) {
      const float d = code_of(x[i], lo_q, sc, inv, levels) * sc + lo_q - x[i];
      return ((valid >> i) & 1u) ? d * d : 0.f;
    };
    const float err = ORDER == SumOrder::ROWS     ? sum_rows(sq)
                      : ORDER == SumOrder::INNER8 ? sum_inner<8>(sq)
                                                  : sum_inner<16>(sq);
    if (c == 0) {
      best_err = err;
    } else if (err < best_err) {
      best_err = err;
      best_lo = lo;
      best_hi = hi;
    }
  }
  mn = best_lo;
  mx = best_hi;
}

HACK_DEV void put_meta(uint8_t* at, float x, int bytes) {
  if (bytes == 2) {
    *reinterpret_cast<__half*>(at) = __float2half_rn(x);  // exact: x is an fp16 value already
  } else {
    *reinterpret_cast<float*>(at) = x;
  }
}

HACK_DEV void put_sum(uint8_t* at, int s, int bytes) {
  if (bytes == 1) {
    *at = static_cast<uint8_t>(s);
  } else if (bytes == 2) {
    *reinterpret_cast<int16_t*>(at) = static_cast<int16_t>(s);
  } else {
    *reinterpret_cast<int32_t*>(at) = s;
  }
}

// 8 consecutive elements (16 bytes, 16-byte aligned) as floats.
template <typename T>
HACK_DEV void load8(const T* src, float* dst) {
  const uint4 w = *reinterpret_cast<const uint4*>(src);
  const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[i] = simt::to_float(e[i]);
}

// One token's group of V codes packed into GD * BITS / 32 words (code i at bits BITS * i of its
// word); a sink token's are all 0. Compile-time indices: x stays in registers.
template <int BITS>
HACK_DEV void pack_group(const float (&x)[GD], float mn_q, float s_q, bool sink, uint32_t* out) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr float LEVELS = static_cast<float>((1 << BITS) - 1);
  const float inv = div_rn(1.f, s_q);
#pragma unroll
  for (int w = 0; w < GD / PER_WORD; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < PER_WORD; ++i)
      word |= static_cast<uint32_t>(code_of(x[w * PER_WORD + i], mn_q, s_q, inv, LEVELS)) << (i * BITS);
    out[w] = sink ? 0u : word;
  }
}

template <int D>
HACK_GLOBAL HACK_BOUNDS(D) void hack_store_kernel(const StoreParams p) {
  static_assert(D % GD == 0 && D >= GD && D <= 256, "head_dim 64, 128 or 256");
  constexpr int NG = D / GD;
  const int t = simt::thread_x();
  const int b = simt::block_y(), h = simt::block_z();
  const int q0 = p.qo_indptr[b], n = p.qo_indptr[b + 1] - q0;
  const int L0 = p.prefix_lens[b], L = L0 + n;
  const int pg = L0 / P + simt::block_x();
  if (n <= 0 || pg * P >= L) return;  // the whole block: this request touches fewer pages
  const In* k = static_cast<const In*>(p.k);
  const In* v = static_cast<const In*>(p.v);

  // New tokens at positions < sinks go to the FP16 sink buffers (thread t: channel t).
  if (p.sinks > 0 && pg * P < p.sinks) {
    const int64_t slot = p.sink_slots[b];
    for (int j = 0; j < P && pg * P + j < p.sinks; ++j) {
      const int pos = pg * P + j;
      if (pos < L0 || pos >= L) continue;
      const int64_t src = q0 + pos - L0;
      const int64_t at = slot * p.s_slot + j * p.s_tok + h * p.s_head + t;
      static_cast<__half*>(p.sink_k)[at] = __float2half_rn(simt::to_float(k[src * p.k_tok + h * p.k_head + t]));
      static_cast<__half*>(p.sink_v)[at] = __float2half_rn(simt::to_float(v[src * p.v_tok + h * p.v_head + t]));
    }
  }
  if ((pg + 1) * P > L) return;  // the page stays open: its tokens go to the tails

  const int64_t page = p.kv_indices[p.kv_indptr[b] + pg];
  const int64_t trow = p.tail_rows[b];
  const bool f16 = p.meta_bytes == 2;
  const auto* tail_k = static_cast<const __half*>(p.tail_k);
  const auto* tail_v = static_cast<const __half*>(p.tail_v);
  uint8_t* kpage = p.k_buf + page * p.k_page;
  uint8_t* vpage = p.v_buf + page * p.v_page;
  uint8_t* codes = simt::shared_memory();  // [P][D] K codes, for packing along head_dim and sums

  // K per channel over the page's non-sink tokens: thread t owns channel t. Tokens stored
  // before this call come from the tail, new ones from the input rounded to FP16 (so the bytes
  // do not depend on how the tokens were batched).
  {
    const float levels = static_cast<float>((1 << p.k_bits) - 1);
    float x[P];
    uint64_t valid = 0;
    float mn = INFINITY, mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int pos = pg * P + j;
      x[j] = pos < L0 ? __half2float(tail_k[trow * p.t_row + j * p.t_tok + h * p.t_head + t])
                      : fp16_of(simt::to_float(k[(q0 + pos - L0) * p.k_tok + h * p.k_head + t]));
      if (pos >= p.sinks) {
        valid |= uint64_t{1} << j;
        mn = fminf(mn, x[j]);
        mx = fmaxf(mx, x[j]);
      }
    }
    if (mn > mx) mn = mx = 0.f;  // every token a sink: m = 0, s = 1
    mn = mn + 0.f;               // +0: which signed zero a min returns must not decide the bytes
    if (p.range_search) search_range<SumOrder::ROWS>(x, valid, mn, mx, levels, f16);
    float mn_q, s_q;
    stored_meta(mn, mx, levels, f16, mn_q, s_q);
    const float inv = div_rn(1.f, s_q);
#pragma unroll
    for (int j = 0; j < P; ++j)
      codes[j * D + t] = ((valid >> j) & 1u) ? static_cast<uint8_t>(code_of(x[j], mn_q, s_q, inv, levels)) : 0;
    put_meta(kpage + p.km_off + (static_cast<int64_t>(h) * D + t) * p.meta_bytes, mn_q, p.meta_bytes);
    put_meta(kpage + p.ks_off + (static_cast<int64_t>(h) * D + t) * p.meta_bytes, s_q, p.meta_bytes);
  }
  simt::sync_block();
  {
    const int per_word = 32 / p.k_bits, row_words = D / per_word;
    for (int w = t; w < P * row_words; w += D) {
      const int j = w / row_words, first = (w % row_words) * per_word;
      uint32_t word = 0;
      for (int i = 0; i < per_word; ++i) word |= static_cast<uint32_t>(codes[j * D + first + i]) << (i * p.k_bits);
      reinterpret_cast<uint32_t*>(kpage + p.kc_off)[static_cast<int64_t>(h) * P * row_words + w] = word;
    }
    for (int item = t; item < P * NG; item += D) {  // code sums per token and head_dim group
      const int j = item / NG, g = item % NG;
      int s = 0;
      for (int i = 0; i < GD; ++i) s += codes[j * D + g * GD + i];
      put_sum(kpage + p.ksum_off + (static_cast<int64_t>(h) * P * NG + item) * p.sum_bytes, s, p.sum_bytes);
    }
  }

  // V per token and group of GD channels: thread t owns token t / NG, group t % NG. Sink tokens
  // keep code 0, min 0, scale 0 (hack_ops.layout).
  {
    const float levels = static_cast<float>((1 << p.v_bits) - 1);
    const int per_word = 32 / p.v_bits, row_words = D / per_word;
    for (int item = t; item < P * NG; item += D) {
      const int j = item / NG, g = item % NG, pos = pg * P + j;
      const bool sink = pos < p.sinks;
      float x[GD];
      if (pos < L0) {
        const __half* src = tail_v + trow * p.t_row + j * p.t_tok + h * p.t_head + g * GD;
#pragma unroll
        for (int i = 0; i < GD; i += 8) load8(src + i, x + i);
      } else {
        const In* src = v + (q0 + pos - L0) * p.v_tok + h * p.v_head + g * GD;
#pragma unroll
        for (int i = 0; i < GD; i += 8) load8(src + i, x + i);
#pragma unroll
        for (int i = 0; i < GD; ++i) x[i] = fp16_of(x[i]);
      }
      float mn = x[0], mx = x[0];
#pragma unroll
      for (int i = 1; i < GD; ++i) {
        mn = fminf(mn, x[i]);
        mx = fmaxf(mx, x[i]);
      }
      mn = mn + 0.f;
      float mn_q = 0.f, s_q = 0.f;
      if (!sink) {
        if (p.range_search) {
          if (p.sum_width == 16) {
            search_range<SumOrder::INNER16>(x, ~uint64_t{0}, mn, mx, levels, f16);
          } else {
            search_range<SumOrder::INNER8>(x, ~uint64_t{0}, mn, mx, levels, f16);
          }
        }
        stored_meta(mn, mx, levels, f16, mn_q, s_q);
      }
      auto* out = reinterpret_cast<uint32_t*>(vpage + p.vc_off) + (static_cast<int64_t>(h) * P + j) * row_words +
                  g * (GD / per_word);
      if (p.v_bits == 2) {
        pack_group<2>(x, mn_q, s_q, sink, out);
      } else {
        pack_group<4>(x, mn_q, s_q, sink, out);
      }
      const int64_t meta = (static_cast<int64_t>(h) * P * NG + item) * p.meta_bytes;
      put_meta(vpage + p.vm_off + meta, mn_q, p.meta_bytes);
      put_meta(vpage + p.vs_off + meta, s_q, p.meta_bytes);
    }
  }
}

}  // namespace store
}  // namespace hack

#if !defined(HACK_SIMT_HOST)
#include <cuda_runtime.h>

namespace {
constexpr auto* STORE_KERNEL = hack::store::hack_store_kernel<HACK_D>;
constexpr int STORE_SMEM = hack::store::P * HACK_D;
}  // namespace

// Launch the store on `stream` of `device`; a cudaError_t (0: launched).
extern "C" int hack_cuda_store(const hack::StoreParams* p, int device, void* stream) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (p->batch == 0 || p->max_touched == 0 || p->heads == 0) return 0;
  STORE_KERNEL<<<dim3(p->max_touched, p->batch, p->heads), HACK_D, STORE_SMEM, static_cast<cudaStream_t>(stream)>>>(*p);
  return static_cast<int>(cudaGetLastError());
}

// What this library was built for: head_dim, input dtype (0 bf16, 1 fp16), sizeof(StoreParams).
extern "C" void hack_cuda_store_variant(int64_t* out) {
  out[0] = HACK_D;
  out[1] = HACK_T;
  out[2] = sizeof(hack::StoreParams);
}

// The driver's view on `device`: registers, local (spill) bytes per thread, static shared bytes,
// resident blocks per SM. cudaError_t.
extern "C" int hack_cuda_store_attributes(int device, int64_t* out) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  cudaFuncAttributes a;
  err = cudaFuncGetAttributes(&a, STORE_KERNEL);
  if (err != cudaSuccess) return static_cast<int>(err);
  int blocks = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, STORE_KERNEL, HACK_D, STORE_SMEM);
  out[0] = a.numRegs;
  out[1] = static_cast<int64_t>(a.localSizeBytes);
  out[2] = static_cast<int64_t>(a.sharedSizeBytes);
  out[3] = blocks;
  return static_cast<int>(err);
}

extern "C" const char* hack_cuda_store_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

#endif  // !HACK_SIMT_HOST
