"""Prefill/decode disaggregation with HACK pages: what travels besides the pages
(pd_state), digests (checksum), bytes on the wire (wire_meter), the local cluster launcher
(cluster, server_cmd, netns, procs), workloads and the benchmark (workload, replay, bench)."""
