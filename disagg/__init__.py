"""Prefill/decode disaggregation with HACK pages: the PD connector and its hook rows
(connector; what travels besides the pages: pd_state; the transfer codec; digests: checksum;
bytes on the wire: wire_meter; test-only faults), the plugin entry point that assembles the
engine's and the connector's hooks (plugin), the local cluster launcher (cluster, server_cmd,
netns, procs) and the replay benchmark (replay, bench). Depends on engine, hack_eval, hack_ops."""
