"""sglang-hack's SGLang plugin: the `--kv-cache-dtype hack` server option, the compressed paged
KV pool, the `hack` attention backend and the CPU platform, loaded through SGLang's entry points
(`sglang.srt.plugins` through disagg.plugin, `sglang.srt.platforms`). Every upstream symbol
the project touches is a row of the hook table in engine.hooks (packages above the engine add
their rows with engine.hooks.register_extension; the engine imports none of them).

Importing this package is cheap on purpose: SGLang loads the entry points in every process.
"""
