"""EngineSettings: what the `--hack-*` server options decided, shared by every SGLang process.

The CLI options are parsed in the launching process, but the KV pool and the attention backend
are built in scheduler processes started with the spawn method. The settings therefore travel
as JSON in an environment variable that children inherit. Format knobs live in
hack_ops.HackConfig (its defaults are the project's defaults); this adds the serving modes.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

from hack_ops import HackConfig
from hack_ops.modes import SERVING_MODES, AttentionMode, PrefillMode, attention_mode, prefill_mode
from hack_ops.sparse import SparseConfig
from hack_ops.static_keep import StaticKeep

ENV_VAR = "SGLANG_HACK_ENGINE"
KV_CACHE_DTYPE = "hack"
BACKEND_NAME = "hack"


@dataclass(frozen=True)
class EngineSettings:
    """config: the KV format. prefill (PrefillMode, `--hack-prefill`): how extend attention
    treats the chunk's own tokens ('homomorphic' reads them through the same quantized path as
    decode would; 'exact' uses their full-precision K/V, cached prefix pages still go through
    the homomorphic path; 'dense' also reads a cached prefix dequantized, by SDPA; 'auto', the
    default, is resolved by the attention backend at startup, engine.prefill_choice).
    attention (AttentionMode, `--hack-attention`): 'hack' (homomorphic, no dequantization) or
    'dequant' (the paper's strawman: the same pages dequantized before float attention; for
    comparisons only). Strings are accepted and stored as the enums.
    kv_budget_mb: fixed KV pool byte budget instead of profiling free memory (any KV dtype;
    used to compare capacities under the same budget).
    enabled: the server's KV cache is HACK (`--kv-cache-dtype hack`); False when only the
    budget was given for another KV dtype.
    sparse: sparse decode (`--hack-sparse-*`, hack_ops.sparse.SparseConfig; off by default):
    each decode step reads the pages selected from the side tables, up to a token budget.
    static: look-once static eviction (`--hack-static-*`, hack_ops.static_keep.StaticKeep; off
    by default): decode reads the prompt pages its last queries voted for."""

    enabled: bool = True
    config: HackConfig = field(default_factory=HackConfig)
    prefill: PrefillMode = PrefillMode.AUTO
    attention: AttentionMode = AttentionMode.HACK
    kv_budget_mb: float | None = None
    sparse: SparseConfig = field(default_factory=SparseConfig)
    static: StaticKeep = field(default_factory=StaticKeep)

    def __post_init__(self) -> None:
        if not isinstance(self.config, HackConfig):
            raise ValueError(f"config must be a HackConfig, got {type(self.config).__name__}")
        if not isinstance(self.sparse, SparseConfig):
            raise ValueError(f"sparse must be a SparseConfig, got {type(self.sparse).__name__}")
        if not isinstance(self.static, StaticKeep):
            raise ValueError(f"static must be a StaticKeep, got {type(self.static).__name__}")
        object.__setattr__(self, "prefill", prefill_mode(self.prefill))  # frozen: set once, here
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")
        object.__setattr__(self, "attention", attention_mode(self.attention, SERVING_MODES, "attention"))
        b = self.kv_budget_mb
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0):
            raise ValueError(f"kv_budget_mb must be a positive number, got {b!r}")

    @property
    def page_size(self) -> int:
        return self.config.partition_size

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "EngineSettings":
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError(f"{ENV_VAR} must hold a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{ENV_VAR} has unknown keys {sorted(unknown)}")
        cfg = HackConfig(**raw.pop("config", {}))
        sparse = SparseConfig(**raw.pop("sparse", {}))
        static = StaticKeep(**raw.pop("static", {}))
        return cls(config=cfg, sparse=sparse, static=static, **raw)


def publish(settings: EngineSettings) -> None:
    """Make the settings visible to this process and every child it starts."""
    os.environ[ENV_VAR] = settings.to_json()


def published() -> EngineSettings | None:
    text = os.environ.get(ENV_VAR)
    return EngineSettings.from_json(text) if text else None


def active() -> EngineSettings | None:
    """The settings when this server's KV cache is HACK, else None."""
    s = published()
    return s if s is not None and s.enabled else None


def budget_bytes() -> int | None:
    """The fixed KV budget in bytes, if one was published (applies to any KV dtype)."""
    s = published()
    if s is None or s.kv_budget_mb is None:
        return None
    return int(s.kv_budget_mb * (1 << 20))
