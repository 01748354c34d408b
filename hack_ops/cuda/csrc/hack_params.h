// The decode kernel's arguments, one struct passed by value (Python fills a ctypes copy of it:
// hack_ops/cuda/launch.py; a test compares every field's offset with offsetof here).
#pragma once

#include <cstddef>
#include <cstdint>

namespace hack {

struct DecodeParams {
  const void* q;                 // [B, Hq, D] bf16 or fp16
  int64_t q_sb, q_sh;            // strides in elements
  const uint8_t* k_buf;          // [pages, k_page_bytes]
  const uint8_t* v_buf;          // [pages, v_page_bytes]
  int64_t k_page, v_page;        // page strides in bytes
  int64_t kc_off, km_off, ks_off;  // section offsets in a K page: codes, minimum, scale
  int64_t vc_off, vm_off, vs_off;  // ... in a V page
  const void* tail_k;            // fp16 [rows, Π, H, D]
  const void* tail_v;
  int64_t t_row, t_tok, t_head;  // strides in elements
  const void* sink_k;            // fp16 [slots, S, H, D] (any fp16 tensor when S = 0)
  const void* sink_v;
  int64_t s_slot, s_tok, s_head;
  const int32_t* kv_indptr;      // [B + 1]
  const int32_t* kv_indices;     // page ids in sequence order
  const int32_t* seq_lens;       // [B], the new token included
  const int32_t* tail_rows;      // [B]
  const int32_t* sink_slots;     // [B]
  void* out;                     // [B, Hq, D], q's dtype
  int64_t o_sb, o_sh;
  float* o_part;                 // [B, Hq, splits, D] (splits > 1)
  float* m_part;                 // [B, Hq, splits], log2 units
  float* l_part;
  float sm_scale;
  float logit_cap;               // 0: none
  int32_t window;                // -1: none
  int32_t rep;                   // query heads per KV head (<= 8)
  int32_t sinks;                 // sink tokens of the format
  int32_t pages_per_split;
  int32_t num_splits;
  int32_t batch;
  int32_t kv_heads;
  int32_t head_tables;           // 1: kv_indices holds a page list per KV head (sparse decode): request b's
                                 // head h reads kv_indices[kv_indptr[b] * kv_heads + h * n_b ..], n_b its pages
};

#define HACK_PARAM_FIELDS(X)                                                                                   \
  X(q) X(q_sb) X(q_sh) X(k_buf) X(v_buf) X(k_page) X(v_page) X(kc_off) X(km_off) X(ks_off) X(vc_off) X(vm_off) \
  X(vs_off) X(tail_k) X(tail_v) X(t_row) X(t_tok) X(t_head) X(sink_k) X(sink_v) X(s_slot) X(s_tok) X(s_head)   \
  X(kv_indptr) X(kv_indices) X(seq_lens) X(tail_rows) X(sink_slots) X(out) X(o_sb) X(o_sh) X(o_part) X(m_part) \
  X(l_part) X(sm_scale) X(logit_cap) X(window) X(rep) X(sinks) X(pages_per_split) X(num_splits) X(batch)       \
  X(kv_heads) X(head_tables)

}  // namespace hack
