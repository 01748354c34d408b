// The store kernel's arguments, one struct passed by value (Python fills a ctypes copy of it:
// hack_ops/cuda/store.py; a test compares every field's offset with offsetof here).
#pragma once

#include <cstddef>
#include <cstdint>

namespace hack {

struct StoreParams {
  const void* k;                 // [new tokens, H, D] bf16 or fp16 (the model's activations)
  const void* v;
  int64_t k_tok, k_head;         // strides in elements
  int64_t v_tok, v_head;
  const int32_t* qo_indptr;      // [B + 1]: request b's new tokens are rows qo_indptr[b]..
  const int32_t* prefix_lens;    // [B]: tokens stored before this call
  const int32_t* kv_indptr;      // [B + 1]
  const int32_t* kv_indices;     // page ids in sequence order
  const int32_t* tail_rows;      // [B]
  const int32_t* sink_slots;     // [B]
  uint8_t* k_buf;                // [pages, k_page bytes]
  uint8_t* v_buf;
  int64_t k_page, v_page;        // page strides in bytes
  int64_t kc_off, km_off, ks_off, ksum_off;  // section offsets in a K page: codes, minimum, scale, sums
  int64_t vc_off, vm_off, vs_off;            // ... in a V page (no sums: layout v2)
  const void* tail_k;            // fp16 [rows, Π, H, D]: the open page's tokens stored before this call
  const void* tail_v;
  int64_t t_row, t_tok, t_head;  // strides in elements
  void* sink_k;                  // fp16 [slots, S, H, D] (any fp16 tensor when S = 0)
  void* sink_v;
  int64_t s_slot, s_tok, s_head;
  int32_t batch;
  int32_t heads;                 // KV heads
  int32_t max_touched;           // most pages a request's new tokens touch (the grid's x)
  int32_t k_bits, v_bits;        // 2 or 4
  int32_t sinks;                 // sink tokens of the format
  int32_t meta_bytes;            // 2: fp16 side tables, 4: fp32
  int32_t sum_bytes;             // K code sums: 1 (uint8), 2 (int16) or 4 (int32)
  int32_t range_search;          // 1: each group's range is the least-squared-error clipped candidate
  int32_t sum_width;             // lanes of torch's CPU vectors in the reference's V error sums: 8 or 16
};

#define HACK_STORE_FIELDS(X)                                                                                    \
  X(k) X(v) X(k_tok) X(k_head) X(v_tok) X(v_head) X(qo_indptr) X(prefix_lens) X(kv_indptr) X(kv_indices)        \
  X(tail_rows) X(sink_slots) X(k_buf) X(v_buf) X(k_page) X(v_page) X(kc_off) X(km_off) X(ks_off) X(ksum_off)    \
  X(vc_off) X(vm_off) X(vs_off) X(tail_k) X(tail_v) X(t_row) X(t_tok) X(t_head) X(sink_k) X(sink_v) X(s_slot)   \
  X(s_tok) X(s_head) X(batch) X(heads) X(max_touched) X(k_bits) X(v_bits) X(sinks) X(meta_bytes) X(sum_bytes)   \
  X(range_search) X(sum_width)

}  // namespace hack
