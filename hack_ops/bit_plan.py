"""A bit plan: which layers' K codes and which layers' V codes a model keeps at 4 bits.

`hack calibrate MODEL` (hack_eval.calibrate) measures where a model's 2-bit error and its
retrieval sit and writes a plan under a byte budget; a server with `--hack-bits auto` (the
default) loads the plan of the model it serves. A plan belongs to one model's weights: it is
keyed by the model's hash (model_hash: config.json and the weight files) and lives beside the
model folder (`hack-bits-<hash>.json`), or ships in this package (hack_ops/plans/) for the
project's own models. The plan says which tensors are raised, and which rotation
(hack_ops.rotation) the codes are taken under where the calibration measured one to pay; the
rest of the format (partition size, orientation, sinks) is the server's HackConfig, and
HackConfig's four_bit_k_layers / four_bit_v_layers / rotation carry the plan to every path that
lays out pages.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import HackConfig
from .rotation import Rotation, rotation as _rotation

PLAN_VERSION = 1
PLAN_PREFIX = "hack-bits-"
HASH_CHARS = 16  # of the sha256 hex digest, in file names and logs
SHIPPED_DIR = Path(__file__).resolve().parent / "plans"
MANIFEST = "hack-manifest.json"  # written by hack_eval.models.prepare: file name -> sha256

# What identifies a model's numbers: its config and its weights (not the tokenizer's files).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _identity_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file()
                  and (p.name == "config.json" or p.name.endswith(_WEIGHT_SUFFIXES)))


def model_hash(folder: str | Path) -> str:
    """sha256 over (name, sha256) of the folder's config.json and weight files. A folder that
    `hack model prepare` wrote takes the files' digests from its manifest (no re-hashing)."""
    folder = Path(folder)
    names = _identity_files(folder)
    if "config.json" not in names:
        raise FileNotFoundError(f"{folder} has no config.json: a bit plan is keyed by a model folder")
    known: dict[str, str] = {}
    man = folder / MANIFEST
    if man.is_file():
        try:
            known = dict(json.loads(man.read_text())["files"])
        except (ValueError, KeyError, TypeError):
            known = {}
    pairs = [(n, known.get(n) or _sha256(folder / n)) for n in names]
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()


def plan_file_name(hash_hex: str) -> str:
    return f"{PLAN_PREFIX}{hash_hex[:HASH_CHARS]}.json"


@dataclass(frozen=True)
class BitPlan:
    """k_layers / v_layers: 0-based layers whose K (V) codes are 4-bit; every other code keeps
    the server's --hack-kv-bits (2). bytes_ratio: bytes per token vs BF16 at budget_context
    (hack_ops.layout.model_bytes_per_token, tails and sinks included). calibration: how it was
    measured (text, items, context, seconds, date, command); measurements: the scores it was
    chosen from, per layer and tensor, and the per-head analysis (hack_eval.calibrate).
    rotation: the Rotation value the codes are taken under ('none' in plans written before the
    calibration measured rotations, and wherever none paid)."""

    model_hash: str
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    k_layers: tuple[int, ...]
    v_layers: tuple[int, ...]
    budget_fraction: float
    budget_context: int
    bytes_ratio: float
    plain_bytes_ratio: float
    calibration: dict = field(default_factory=dict)
    measurements: dict = field(default_factory=dict)
    version: int = PLAN_VERSION
    rotation: str = Rotation.NONE.value

    def __post_init__(self) -> None:
        for name in ("k_layers", "v_layers"):
            layers = tuple(sorted({int(i) for i in getattr(self, name)}))
            if any(not 0 <= i < self.num_layers for i in layers):
                raise ValueError(f"{name} {list(layers)} are outside the plan's {self.num_layers} layers")
            object.__setattr__(self, name, layers)  # frozen: coerced once, here
        object.__setattr__(self, "rotation", _rotation(self.rotation).value)  # ValueError names the values
        if self.version != PLAN_VERSION:
            raise ValueError(f"bit plan version {self.version} is not {PLAN_VERSION}: run `hack calibrate` again")

    @property
    def short_hash(self) -> str:
        return self.model_hash[:HASH_CHARS]

    def apply(self, config: HackConfig, rotation: bool = True) -> HackConfig:
        """`config` with the plan's K and V layers at 4 bits and (unless not `rotation`: a server
        given --hack-rotation keeps its own) the plan's rotation; its other fields unchanged."""
        extra = {"rotation": Rotation(self.rotation)} if rotation else {}
        return config.replace(four_bit_k_layers=self.k_layers, four_bit_v_layers=self.v_layers, **extra)

    def summary(self) -> str:
        """One line for the server log."""
        show = lambda xs: ",".join(map(str, xs)) or "none"  # noqa: E731
        rot = "" if self.rotation == Rotation.NONE.value else f"; codes under the {self.rotation} rotation"
        return (f"K at 4 bits in layers {show(self.k_layers)}; V at 4 bits in layers {show(self.v_layers)}{rot} "
                f"({100 * self.bytes_ratio:.1f}% of BF16's bytes at {self.budget_context} tokens, budget "
                f"{100 * self.budget_fraction:.0f}%; plain 2-bit {100 * self.plain_bytes_ratio:.1f}%)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BitPlan":
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("a bit plan is a JSON object")
        return cls(**raw)

    def write(self, folder: str | Path) -> Path:
        """Write the plan into `folder` under its hash's file name; returns the path."""
        path = Path(folder) / plan_file_name(self.model_hash)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json() + "\n")
        tmp.replace(path)
        return path


def load_plan(path: str | Path) -> BitPlan:
    """The plan in `path` (ValueError naming the file when it is not one)."""
    try:
        return BitPlan.from_json(Path(path).read_text())
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path} is not a bit plan ({exc}); run `hack calibrate` again") from None


def find_plan(model_folder: str | Path, shipped_dir: Path = SHIPPED_DIR) -> tuple[BitPlan, Path] | None:
    """The plan for the model in `model_folder`: the one beside it (a user's own calibration)
    first, then the one shipped in `shipped_dir`; None when neither holds one for its hash."""
    folder = Path(model_folder)
    if not (folder / "config.json").is_file():
        return None
    digest = model_hash(folder)
    name = plan_file_name(digest)
    for path in (folder / name, shipped_dir / name):
        if path.is_file():
            plan = load_plan(path)
            if plan.model_hash != digest:
                raise ValueError(f"{path} names model hash {plan.short_hash}, not this model's {digest[:HASH_CHARS]}")
            return plan, path
    return None


def plan_for_check(plan: BitPlan, num_layers: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why `plan` cannot serve a model of this geometry (None: it can)."""
    have = (plan.num_layers, plan.num_kv_heads, plan.head_dim)
    if have != (num_layers, num_kv_heads, head_dim):
        return (f"the bit plan for model {plan.short_hash} was measured on {have[0]} layers of {have[1]} KV heads "
                f"x {have[2]}, and this model has {num_layers} x {num_kv_heads} x {head_dim}")
    return None


def describe(plan: Any) -> dict:
    """The plan's JSON-able summary (for /server_info and reports)."""
    return {"model_hash": plan.model_hash[:HASH_CHARS], "k_layers": list(plan.k_layers),
            "v_layers": list(plan.v_layers), "rotation": plan.rotation, "bytes_ratio": plan.bytes_ratio,
            "budget_context": plan.budget_context}
