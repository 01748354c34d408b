"""sglang-hack's SGLang plugin: the `--kv-cache-dtype hack` server option, the compressed paged
KV pool, the `hack` attention backend and the CPU platform, loaded through SGLang's entry points
(`sglang.srt.plugins`, `sglang.srt.platforms`). Every upstream symbol the plugin touches is
listed in engine.hooks.

Importing this package is cheap on purpose: SGLang loads the entry points in every process.
"""
