"""hack_ops.paged: the paged HACK KV store and attention on it (CPU / portable PyTorch).

FlashInfer-style use, per forward pass:
    store = HackKVStore(cfg, num_layers, kv_heads, head_dim, num_pages, num_rows)
    plan = store.plan(req_to_token, rows, seq_lens, ext_lens)   # once per forward
    o = decode(store, layer, plan, q, k, v)                      # per layer (stores k, v first)
    o = extend(store, layer, plan, q, k, v, mode=AttentionMode.HACK,
               prefill=PrefillMode.HOMOMORPHIC)                # per layer, prefill/extend
    store.write(layer, plan, k, v)                                # store only
    store.free_sinks(page_ids)                                    # when the pool frees pages
See docs/kernels.md ("CPU path") for the semantics and the layout of every buffer.
"""
from .attention import decode, extend, extend_strawman
from .plan import ForwardPlan, build_plan
from .store import HackKVStore

__all__ = ["HackKVStore", "ForwardPlan", "build_plan", "decode", "extend", "extend_strawman"]
