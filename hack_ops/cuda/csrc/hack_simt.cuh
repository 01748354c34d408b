// The warp-level operations the decode kernel uses, for the GPU (PTX, intrinsics) or, built with
// HACK_SIMT_HOST by a host compiler, for the CPU: there every thread of a block is a fiber, and a
// collective (mma, movmatrix, a shuffle, a barrier) completes once every lane of its warp (or every
// thread of its block) has reached it. The host build runs the kernel's own source in the CPU tests
// (hack_simt_host.cpp, tests/test_cuda_simt.py): a test harness, slow, not a serving path.
#pragma once

#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if defined(HACK_SIMT_HOST)
#define HACK_DEV inline
#define HACK_GLOBAL
#define HACK_BOUNDS(n)
#else
#define HACK_DEV __device__ __forceinline__
#define HACK_GLOBAL __global__
#define HACK_BOUNDS(n) __launch_bounds__(n)
#endif

namespace hack {
namespace simt {

#if defined(HACK_SIMT_HOST)

// ---- host: fibers --------------------------------------------------------------------------------
struct Dim3 {
  int x, y, z;
};
struct Exchange {  // one warp's (or the block's) collective in progress
  uint32_t in[32][6];
  float fin[32][4];
  uint32_t out[32];
  float fout[32][4];
  int arrived;
  uint64_t gen;
};
struct BlockState {
  Dim3 block;
  int threads;
  uint8_t* smem;
  Exchange warp[32];
  int block_arrived;
  uint64_t block_gen;
};
BlockState& block_state();
int current_thread();
void yield();

inline int thread_x() { return current_thread(); }
inline int block_x() { return block_state().block.x; }
inline int block_y() { return block_state().block.y; }
inline int block_z() { return block_state().block.z; }
inline uint8_t* shared_memory() { return block_state().smem; }

// Deposit, wait for the warp's other lanes, and let the last arrival compute everyone's result.
template <class Compute>
inline void warp_collective(Compute&& compute) {
  Exchange& x = block_state().warp[current_thread() / 32];
  const uint64_t gen = x.gen;
  if (++x.arrived == 32) {
    compute(x);
    x.arrived = 0;
    ++x.gen;
  } else {
    while (x.gen == gen) yield();
  }
}

inline void sync_warp() { warp_collective([](Exchange&) {}); }

inline void sync_block() {
  BlockState& b = block_state();
  const uint64_t gen = b.block_gen;
  if (++b.block_arrived == b.threads) {
    b.block_arrived = 0;
    ++b.block_gen;
  } else {
    while (b.block_gen == gen) yield();
  }
}

inline float shfl_xor(float v, int off) {
  const int lane = current_thread() % 32;
  Exchange& x = block_state().warp[current_thread() / 32];
  x.fin[lane][0] = v;
  warp_collective([off](Exchange& e) {
    for (int l = 0; l < 32; ++l) e.fout[l][0] = e.fin[l ^ off][0];
  });
  return x.fout[lane][0];
}

inline int shfl_idx(int v, int src) {
  const int lane = current_thread() % 32;
  Exchange& x = block_state().warp[current_thread() / 32];
  x.in[lane][0] = static_cast<uint32_t>(v);
  x.in[lane][1] = static_cast<uint32_t>(src);
  warp_collective([](Exchange& e) {
    for (int l = 0; l < 32; ++l) e.out[l] = e.in[e.in[l][1] & 31][0];
  });
  return static_cast<int>(x.out[lane]);
}

inline float half_bits(uint32_t h) {
  __half_raw r;
  r.x = static_cast<unsigned short>(h & 0xffffu);
  return __half2float(__half(r));
}

// d += a·b, m16n8k16 (the PTX fragment layouts), accumulated in float.
inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const int lane = current_thread() % 32;
  Exchange& x = block_state().warp[current_thread() / 32];
  for (int r = 0; r < 4; ++r) x.in[lane][r] = a[r];
  x.in[lane][4] = b0;
  x.in[lane][5] = b1;
  for (int e = 0; e < 4; ++e) x.fin[lane][e] = d[e];
  warp_collective([](Exchange& e) {
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      for (int r = 0; r < 4; ++r)
        for (int h = 0; h < 2; ++h) A[g + 8 * (r % 2)][2 * t + h + 8 * (r / 2)] = half_bits(e.in[l][r] >> (16 * h));
      for (int r = 0; r < 2; ++r)
        for (int h = 0; h < 2; ++h) B[2 * t + h + 8 * r][g] = half_bits(e.in[l][4 + r] >> (16 * h));
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      for (int c = 0; c < 4; ++c) {
        const int row = g + 8 * (c / 2), col = 2 * t + c % 2;
        float acc = e.fin[l][c];
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
        e.fout[l][c] = acc;
      }
    }
  });
  for (int e = 0; e < 4; ++e) d[e] = x.fout[lane][e];
}

// movmatrix.m8n8.trans.b16.
inline uint32_t trans8x8(uint32_t v) {
  const int lane = current_thread() % 32;
  Exchange& x = block_state().warp[current_thread() / 32];
  x.in[lane][0] = v;
  warp_collective([](Exchange& e) {
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      uint32_t out = 0;
      for (int h = 0; h < 2; ++h) {  // element (g, 2t + h) of the transpose = (2t + h, g)
        const int src = 4 * (2 * t + h) + g / 2;
        out |= ((e.in[src][0] >> (16 * (g % 2))) & 0xffffu) << (16 * h);
      }
      e.out[l] = out;
    }
  });
  return x.out[lane];
}

// 16 bytes from global memory to shared memory at slot + offset.
inline void cp_async16(uint8_t* slot, int offset, const void* src) {
  const auto* s = static_cast<const uint8_t*>(src);
  for (int i = 0; i < 16; ++i) slot[offset + i] = s[i];
}
inline void cp_commit() {}
template <int N>
inline void cp_wait() {}

inline float ex2(float x) { return std::exp2(x); }
inline float rcp(float x) { return 1.f / x; }

inline uint32_t hmul2(uint32_t a, uint32_t b) {
  const __half2 r = __floats2half2_rn(half_bits(a) * half_bits(b), half_bits(a >> 16) * half_bits(b >> 16));
  return *reinterpret_cast<const uint32_t*>(&r);
}

#else

// ---- device ------------------------------------------------------------------------------------
__device__ __forceinline__ int thread_x() { return threadIdx.x; }
__device__ __forceinline__ int block_x() { return blockIdx.x; }
__device__ __forceinline__ int block_y() { return blockIdx.y; }
__device__ __forceinline__ int block_z() { return blockIdx.z; }
__device__ __forceinline__ uint8_t* shared_memory() {
  extern __shared__ __align__(16) uint8_t smem[];
  return smem;
}
__device__ __forceinline__ void sync_warp() { __syncwarp(); }
__device__ __forceinline__ void sync_block() { __syncthreads(); }
__device__ __forceinline__ float shfl_xor(float v, int off) { return __shfl_xor_sync(0xffffffffu, v, off); }
__device__ __forceinline__ int shfl_idx(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }

// d += a·b, m16n8k16, fp16 operands, fp32 accumulators.
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 8x8 fp16 transpose across the warp.
__device__ __forceinline__ uint32_t trans8x8(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// 16 bytes from global memory to shared memory at slot + offset (the slot's shared address is
// computed once per page and shared by every copy).
__device__ __forceinline__ void cp_async16(uint8_t* slot, int offset, const void* src) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(slot)) + offset;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

#endif

// ---- both --------------------------------------------------------------------------------------
HACK_DEV uint32_t pack_f16(float lo, float hi) {
  const __half2 r = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&r);
}
HACK_DEV uint32_t halves(__half lo, __half hi) {
  const __half2 r = __halves2half2(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&r);
}
HACK_DEV float low_float(uint32_t w) { return __low2float(*reinterpret_cast<const __half2*>(&w)); }
// The low (high = 0) or high half of w in both halves.
HACK_DEV uint32_t broadcast(uint32_t w, int high) {
  const __half2 h = *reinterpret_cast<const __half2*>(&w);
  const __half2 r = high ? __high2half2(h) : __low2half2(h);
  return *reinterpret_cast<const uint32_t*>(&r);
}
HACK_DEV float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
HACK_DEV float to_float(__half x) { return __half2float(x); }
template <typename T>
HACK_DEV T from_float(float x);
template <>
HACK_DEV __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <>
HACK_DEV __half from_float(float x) { return __float2half_rn(x); }

}  // namespace simt
}  // namespace hack
