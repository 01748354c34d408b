"""The HACK metrics format and what reads it: no SGLang, no engine.

A run directory (`rundir`: run.json + one Arrow IPC stream per server process) is written by
the servers (engine.metrics: the sink, the live HTTP routes, Prometheus) and read here:

- `schema`   the record schema (version 3), its phases, roles and checks
- `rundir`   the runs root, run directories and run.json
- `reader`   one stream file, read whole or tailed while it grows
- `runload`  every stream of a run directory -> `RunData` (frames + warnings)
- `http_client`  the same from a live server or router (`GET /hack/streams`, `/hack/events`)
- `join`     prefill and decode records of one request joined (by bootstrap room)
- `analysis` the exclusive breakdown, percentiles, throughput, memory and wire ratios
- `run_view` all of the above for one run, as the dashboard shows it

Dependencies point down: dashboard -> hack_metrics <- engine (the writer side imports the
schema from here); nothing here imports `engine` or `sglang` (tests/test_metrics_layers.py).
"""
