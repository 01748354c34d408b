// The decode and store kernels' own sources (hack_decode.cu, hack_store.cu) run on the CPU: every thread of a block is a
// fiber (ucontext), switched at each warp collective and barrier (hack_simt.cuh); blocks run one
// after another, then the split-combining kernel. A test harness for the CPU tests
// (tests/test_cuda_simt.py): it checks the kernel's control flow, indexing and arithmetic against
// the reference where no GPU exists. It does not model timing, memory ordering or the tensor
// cores' exact accumulation order.
#define HACK_SIMT_HOST 1

#include <ucontext.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <vector>

#include "hack_decode.cu"
#include "hack_store.cu"

namespace hack {
namespace simt {
namespace {

constexpr size_t STACK = 256 * 1024;

struct Runtime {
  BlockState block;
  std::vector<ucontext_t> fibers;
  std::vector<char> done;
  std::vector<char> stacks;
  ucontext_t main;
  int current = 0;
  std::function<void()> body;
};

Runtime& rt() {
  static Runtime r;
  return r;
}

void trampoline() {
  Runtime& r = rt();
  r.body();
  r.done[r.current] = 1;
}  // returns to r.main through uc_link

// Everything a round of the scheduler can change: a round that changes none of it is a deadlock.
uint64_t signature(const Runtime& r) {
  uint64_t n = r.block.block_gen * 1000003u + r.block.block_arrived;
  for (const auto& w : r.block.warp) n = n * 31u + w.gen * 1009u + w.arrived;
  for (char d : r.done) n = n * 3u + d;
  return n;
}

// Run `body` as a block of `threads` threads; false on a deadlock (a collective some lanes never
// reach: divergent code calling a warp-wide operation, which a GPU would not survive either).
bool run_block(Dim3 block, int threads, uint8_t* smem, const std::function<void()>& body) {
  Runtime& r = rt();
  r.block = BlockState{};
  r.block.block = block;
  r.block.threads = threads;
  r.block.smem = smem;
  r.body = body;
  r.fibers.assign(threads, ucontext_t{});
  r.done.assign(threads, 0);
  if (r.stacks.size() < threads * STACK) r.stacks.resize(threads * STACK);
  for (int i = 0; i < threads; ++i) {
    getcontext(&r.fibers[i]);
    r.fibers[i].uc_stack.ss_sp = r.stacks.data() + i * STACK;
    r.fibers[i].uc_stack.ss_size = STACK;
    r.fibers[i].uc_link = &r.main;
    makecontext(&r.fibers[i], trampoline, 0);
  }
  for (;;) {
    bool any = false;
    const uint64_t before = signature(r);
    for (int i = 0; i < threads; ++i) {
      if (r.done[i]) continue;
      any = true;
      r.current = i;
      swapcontext(&r.main, &r.fibers[i]);
    }
    if (!any) return true;
    if (signature(r) == before) return false;
  }
}

}  // namespace

BlockState& block_state() { return rt().block; }
int current_thread() { return rt().current; }
void yield() {
  Runtime& r = rt();
  swapcontext(&r.fibers[r.current], &r.main);
}

}  // namespace simt
}  // namespace hack

// Run the decode (and, with p->num_splits > 1, the combine) kernel on host memory. 0: done;
// 1: a collective deadlocked; 2: bad arguments.
extern "C" int hack_simt_decode(const hack::DecodeParams* p) {
  using G = hack::Geo<HACK_D>;
  if (p->rep < 1 || p->rep > hack::MAX_REP || p->num_splits < 1) return 2;
  std::vector<uint8_t> smem(G::SMEM + 16);
  auto* aligned = smem.data() + ((16 - reinterpret_cast<uintptr_t>(smem.data()) % 16) % 16);
  for (int b = 0; b < p->batch; ++b)
    for (int h = 0; h < p->kv_heads; ++h)
      for (int s = 0; s < p->num_splits; ++s)
        if (!hack::simt::run_block({s, h, b}, hack::WARPS * 32, aligned,
                                   [&] { hack::hack_decode_kernel<HACK_D, HACK_ORDER, HACK_CAP != 0>(*p); }))
          return 1;
  if (p->num_splits > 1) {
    for (int b = 0; b < p->batch; ++b)
      for (int qh = 0; qh < p->kv_heads * p->rep; ++qh)
        if (!hack::simt::run_block({qh, b, 0}, HACK_D, nullptr, [&] { hack::hack_decode_combine<HACK_D>(*p); }))
          return 1;
  }
  return 0;
}

// Run the store kernel on host memory, blocks one after another. 0: done; 1: a barrier
// deadlocked; 2: bad arguments.
extern "C" int hack_simt_store(const hack::StoreParams* p) {
  if (p->k_bits < 1 || p->v_bits < 1 || p->batch < 0 || p->heads < 0) return 2;
  std::vector<uint8_t> smem(hack::store::P * HACK_D);
  for (int b = 0; b < p->batch; ++b)
    for (int h = 0; h < p->heads; ++h)
      for (int x = 0; x < p->max_touched; ++x)
        if (!hack::simt::run_block({x, b, h}, HACK_D, smem.data(), [&] { hack::store::hack_store_kernel<HACK_D>(*p); }))
          return 1;
  return 0;
}
