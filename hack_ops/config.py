"""HackConfig: every knob of the HACK KV format, validated once.

Defaults follow the project's accuracy study (docs/accuracy.md), not the paper's text: on the
models we can measure, per-channel K over the page with per-token V and a few FP16 sink tokens
is the most accurate 2-bit layout within the byte budget.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Literal

from .rotation import Rotation, rotation as _rotation

Orientation = Literal["channel_k", "token_k"]
Rounding = Literal["nearest", "stochastic"]
TailTensors = Literal["kv", "per_channel"]

ORIENTATIONS = ("channel_k", "token_k")
TAIL_TENSORS = ("kv", "per_channel")
ROUNDINGS = ("nearest", "stochastic")
META_DTYPES = ("float16", "float32")
MAX_K_OUTLIER_CHANNELS = 32  # a few per head; indices are stored as uint8 (head_dim <= 256)


class RaisedTensors(str, Enum):
    """Which tensors of a raised layer (four_bit_layers, edge_layer_bits) take the raised bits
    (HackConfig.raised_tensors)."""

    KV = "kv"  # K and V
    K = "k"  # K only; V keeps kv_bits (K carries most of the 2-bit error on the models studied)
    V = "v"  # V only; K keeps its bits (what a layer copies out of its keys is read from V)

    @property
    def raises_k(self) -> bool:
        return self != RaisedTensors.V

    @property
    def raises_v(self) -> bool:
        return self != RaisedTensors.K


def raised_tensors(value: "RaisedTensors | str") -> RaisedTensors:
    """The RaisedTensors named by `value` ('kv', 'k' or 'v'), or ValueError listing the choices."""
    try:
        return RaisedTensors(value)
    except ValueError:
        raise ValueError(f"raised_tensors must be one of {[m.value for m in RaisedTensors]}, got {value!r}") from None


class OpenMode(str, Enum):
    """How attention reads a tensor (K or V) in a query's open partition (HackConfig.open_mode)."""

    FP16 = "fp16"  # from the FP16 tail
    QUANT = "quant"  # per-token codes, written as tokens arrive
    REQUANT = "requant"  # per-channel codes re-quantized over the open partition at every write (RQE off)


@dataclass(frozen=True)
class HackConfig:
    """The HACK KV format.

    partition_size: tokens per partition Π = tokens per KV page (multiple of 16, 16..256).
    kv_bits: bits per K/V code (2, or 4 for accuracy-sensitive users).
    k_bits: bits per K code where K's differ from V's (0 = kv_bits for both; 2 or 4): a
        uniform config's K bits, which for_layer() sets on a raised layer whose
        raised_tensors is 'k' or 'v'. bits('k') / bits('v') are what every path reads.
    qp_bits: bits of the quantized Q and P operands (8).
    rounding: 'nearest' or 'stochastic' (the paper's; unbiased, seeded by a torch.Generator).
    summation_elimination: keep code sums next to min/scale instead of recomputing them
        (paper's SE; the result is identical, only the cost differs).
    requant_elimination: keep the open (still filling) partition in FP16 and quantize it once
        when it fills (paper's RQE). Off = requantize the open partition at every step.
    orientation: 'channel_k' = K quantized per channel over the partition's tokens and V per
        token (groups along head_dim); 'token_k' = the paper's layout, K per token (groups
        along head_dim) and V per channel over the partition. The per-channel tensor always
        needs an FP16 tail for its open partition (its ranges span the whole partition).
    tail_tensors: which tensors keep the open partition in FP16 until it fills: 'kv' = K and
        V (the page is quantized once, whole, when its last token arrives), 'per_channel' =
        only the per-channel tensor (the paper's scope; the per-token one is quantized as it is
        written). Keeping the most recent tokens' V exact matters a lot at 2 bits (the study).
    sink_tokens: the first tokens of every sequence kept in FP16 for K and V (attention sinks).
    meta_dtype: dtype of min/scale side tables.
    range_search: when a page is quantized, choose each group's range among a few clipped
        candidates by least squared error (quantize(..., range_search=True)); costs nothing
        in bytes or at attention time, and cut perplexity loss sharply in the study.
    rotation: an orthogonal Walsh-Hadamard rotation per head (hack_ops.rotation.Rotation) of Q
        and K and/or of V (the output rotated back), applied outside the kernels before the
        cache; exact attention is unchanged, only what the quantizer sees differs. Needs a
        head_dim that is a power of two. Costs no bytes.
    k_outlier_channels: dense-and-sparse K ('channel_k' only): in every closed page, the n
        channels of each head with the widest range over the page's tokens are kept apart in
        FP16 (their values and their channel indices, counted in hack_ops.layout) and take no
        part in the 2-bit codes (code 0, min 0, scale 0), so neither their error nor their scale
        in Q's INT8 range remains. 0 = none. Implemented in the reference only: the serving paths
        refuse it at startup.
    edge_layer_bits: bits per K/V code of the first and the last layer (the rest use kv_bits);
        0 = every layer uses kv_bits. A per-layer choice: for_layer() resolves it; the paged store
        lays each layer out with its own bits (HackKVStore.layout_for), so every serving path
        takes it.
    four_bit_layers: 0-based indices of the layers whose K/V codes use 4 bits (the rest use
        kv_bits, the first and last edge_layer_bits where set): the few layers where a model's
        2-bit error sits, found by `hack eval layers`. () = none. Per layer like
        edge_layer_bits, and served the same way.
    raised_tensors: which tensors a raised layer (four_bit_layers, edge_layer_bits) gives the
        raised bits: 'kv' (K and V), 'k' (K only, V keeps kv_bits: fewer bytes where K carries
        the error) or 'v' (V only, K keeps its bits).
    four_bit_k_layers, four_bit_v_layers: layers whose K codes (resp. V codes) use 4 bits,
        whatever raised_tensors says: a calibrated bit plan (hack_ops.bit_plan, `hack calibrate`)
        raises K and V of each layer apart, where they matter. Per layer like four_bit_layers.
    """

    partition_size: int = 64
    kv_bits: int = 2
    qp_bits: int = 8
    rounding: Rounding = "nearest"
    summation_elimination: bool = True
    requant_elimination: bool = True
    orientation: Orientation = "channel_k"
    tail_tensors: TailTensors = "kv"
    sink_tokens: int = 1
    meta_dtype: str = "float16"
    range_search: bool = True
    rotation: Rotation = Rotation.NONE
    k_outlier_channels: int = 0
    edge_layer_bits: int = 0
    four_bit_layers: tuple[int, ...] = ()
    k_bits: int = 0
    raised_tensors: RaisedTensors = RaisedTensors.KV
    four_bit_k_layers: tuple[int, ...] = ()
    four_bit_v_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        p = self.partition_size
        if not isinstance(p, int) or isinstance(p, bool) or p % 16 or not 16 <= p <= 256:
            raise ValueError(f"partition_size must be a multiple of 16 in 16..256, got {p!r}")
        if self.kv_bits not in (2, 4):
            raise ValueError(f"kv_bits must be 2 or 4, got {self.kv_bits!r}")
        if self.qp_bits != 8:
            raise ValueError(f"qp_bits must be 8 (INT8 Q and P), got {self.qp_bits!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.orientation not in ORIENTATIONS:
            raise ValueError(f"orientation must be one of {ORIENTATIONS}, got {self.orientation!r}")
        if self.tail_tensors not in TAIL_TENSORS:
            raise ValueError(f"tail_tensors must be one of {TAIL_TENSORS}, got {self.tail_tensors!r}")
        s = self.sink_tokens
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= p:
            raise ValueError(f"sink_tokens must be an integer in 0..partition_size ({p}), got {s!r}")
        if self.meta_dtype not in META_DTYPES:
            raise ValueError(f"meta_dtype must be one of {META_DTYPES}, got {self.meta_dtype!r}")
        n = self.k_outlier_channels
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_K_OUTLIER_CHANNELS:
            raise ValueError(f"k_outlier_channels must be an integer in 0..{MAX_K_OUTLIER_CHANNELS}, got {n!r}")
        if n and self.orientation != "channel_k":
            raise ValueError("k_outlier_channels needs orientation 'channel_k' (outlier channels are chosen "
                             f"over a page's tokens, which per-token K does not group), got {self.orientation!r}")
        if self.k_bits not in (0, 2, 4) or isinstance(self.k_bits, bool):
            raise ValueError(f"k_bits must be 0 (= kv_bits), 2 or 4, got {self.k_bits!r}")
        object.__setattr__(self, "raised_tensors", raised_tensors(self.raised_tensors))
        if self.k_bits == self.kv_bits:  # frozen: one spelling of "K as V", so equal configs compare equal
            object.__setattr__(self, "k_bits", 0)
        if self.edge_layer_bits not in (0, 2, 4) or isinstance(self.edge_layer_bits, bool):
            raise ValueError(f"edge_layer_bits must be 0 (off), 2 or 4, got {self.edge_layer_bits!r}")
        for name in ("four_bit_layers", "four_bit_k_layers", "four_bit_v_layers"):
            layers = getattr(self, name)
            if isinstance(layers, (str, bytes)) or not isinstance(layers, (tuple, list)) or any(
                    isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"{name} must be a list of layer indices (integers >= 0), got {layers!r}")
            object.__setattr__(self, name, tuple(sorted(set(layers))))  # frozen: coerced once, here
        object.__setattr__(self, "rotation", _rotation(self.rotation))
        for name in ("summation_elimination", "requant_elimination", "range_search"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def replace(self, **changes) -> "HackConfig":
        return replace(self, **changes)

    def for_layer(self, layer: int, num_layers: int) -> "HackConfig":
        """The uniform config that layer `layer` (0-based, of `num_layers`) uses: edge_layer_bits
        resolved into kv_bits for the first and the last layer, four_bit_layers into 4 bits for
        theirs (ValueError when one is beyond the model's layers)."""
        if not isinstance(num_layers, int) or num_layers < 1 or not 0 <= layer < num_layers:
            raise ValueError(f"layer must be in 0..{num_layers - 1} (num_layers {num_layers!r}), got {layer!r}")
        for name in ("four_bit_layers", "four_bit_k_layers", "four_bit_v_layers"):
            beyond = [i for i in getattr(self, name) if i >= num_layers]
            if beyond:
                raise ValueError(f"{name} {list(beyond)} are beyond the model's {num_layers} layers (0-based)")
        if not (self.edge_layer_bits or self.four_bit_layers or self.four_bit_k_layers or self.four_bit_v_layers):
            return self
        raised = self.edge_layer_bits if self.edge_layer_bits and layer in (0, num_layers - 1) else 0
        if layer in self.four_bit_layers:
            raised = 4
        k, v = self.bits("k"), self.bits("v")
        if raised:
            k = raised if self.raised_tensors.raises_k else k
            v = raised if self.raised_tensors.raises_v else v
        k = 4 if layer in self.four_bit_k_layers else k
        v = 4 if layer in self.four_bit_v_layers else v
        return replace(self, kv_bits=v, k_bits=0 if k == v else k, edge_layer_bits=0, four_bit_layers=(),
                       raised_tensors=RaisedTensors.KV, four_bit_k_layers=(), four_bit_v_layers=())

    def bits(self, name: str) -> int:
        """Bits per code of tensor `name` ('k' or 'v') in a uniform config."""
        if name == "k":
            return self.k_bits or self.kv_bits
        if name == "v":
            return self.kv_bits
        raise ValueError(f"name must be 'k' or 'v', got {name!r}")

    def _per_layer_fields(self) -> tuple[str, ...]:
        """The per-layer fields that give some layer other bits than kv_bits."""
        def differs(raised: int) -> bool:
            t = self.raised_tensors
            return (t.raises_k and raised != self.bits("k")) or (t.raises_v and raised != self.bits("v"))

        return tuple(name for name, on in (("edge_layer_bits", self.edge_layer_bits != 0 and differs(self.edge_layer_bits)),
                                           ("four_bit_layers", bool(self.four_bit_layers) and differs(4)),
                                           ("four_bit_k_layers", bool(self.four_bit_k_layers) and self.bits("k") != 4),
                                           ("four_bit_v_layers", bool(self.four_bit_v_layers) and self.bits("v") != 4))
                     if on)

    @property
    def per_layer(self) -> bool:
        """Layers differ (for_layer is not the identity): each layer's pages are laid out with
        its own bits, so page bytes differ between layers."""
        return bool(self._per_layer_fields())

    def reference_only(self) -> tuple[str, ...]:
        """The fields set here that only the dense reference (hack_ops.attention, hence the
        accuracy study) implements; no paged path (PyTorch, compiled CPU store and kernels,
        Triton) does, so HackKVStore and the server refuse a config that sets them."""
        return ("k_outlier_channels",) if self.k_outlier_channels else ()

    @property
    def split_bits(self) -> bool:
        """Some layer's K codes have other bits than its V codes (k_bits, raised_tensors 'k' or 'v', or
        K and V raised in different layers)."""
        return (bool(self.k_bits) or (self.raised_tensors != RaisedTensors.KV and self.per_layer)
                or (self.four_bit_k_layers != self.four_bit_v_layers and self.per_layer))

    def head_group(self, head_dim: int) -> int:
        """Group size along head_dim (Q's INT8 groups, per-token K or V groups)."""
        return min(self.partition_size, head_dim)

    @property
    def k_per_token(self) -> bool:
        return self.orientation == "token_k"

    @property
    def v_per_token(self) -> bool:
        return self.orientation == "channel_k"

    @property
    def k_tail(self) -> bool:
        """K of the open partition is held in FP16 (not yet quantized)."""
        return not self.k_per_token or self.tail_tensors == "kv"

    @property
    def v_tail(self) -> bool:
        """V of the open partition is held in FP16 (not yet quantized)."""
        return not self.v_per_token or self.tail_tensors == "kv"

    def open_mode(self, name: str) -> OpenMode:
        """How attention reads tensor `name` ('k' or 'v') in a query's open partition: from its
        FP16 tail, from per-token codes written as tokens arrive, or from per-channel codes
        re-quantized at every write (the RQE ablation)."""
        if name not in ("k", "v"):
            raise ValueError(f"name must be 'k' or 'v', got {name!r}")
        tail = self.k_tail if name == "k" else self.v_tail
        per_token = self.k_per_token if name == "k" else self.v_per_token
        if tail and self.requant_elimination:
            return OpenMode.FP16
        return OpenMode.QUANT if per_token else OpenMode.REQUANT

    @property
    def tails_hold_open(self) -> bool:
        """Both K and V keep the open partition in FP16: a token that neither is a sink nor
        closes its page is stored by appending it to the tails."""
        return self.open_mode("k") == OpenMode.FP16 and self.open_mode("v") == OpenMode.FP16

    def label(self) -> str:
        bits = f"K{self.k_bits}V{self.kv_bits}bit" if self.k_bits else f"{self.kv_bits}bit"  # k_bits 0: as V
        parts = [f"{self.orientation}", f"P{self.partition_size}", bits]
        if self.tail_tensors != "kv":
            parts.append("tail-" + self.tail_tensors)
        if self.sink_tokens:
            parts.append(f"sink{self.sink_tokens}")
        if self.rounding != "nearest":
            parts.append(self.rounding)
        if not self.requant_elimination:
            parts.append("noRQE")
        if not self.range_search:
            parts.append("minmax")
        if self.rotation != Rotation.NONE:
            parts.append("rot-" + self.rotation.value)
        if self.k_outlier_channels:
            parts.append(f"kout{self.k_outlier_channels}")
        per_layer = self._per_layer_fields()
        if "edge_layer_bits" in per_layer:
            parts.append(f"edge{self.edge_layer_bits}bit")
        if "four_bit_layers" in per_layer:
            parts.append("L" + ",".join(map(str, self.four_bit_layers)) + "-4bit")
        if per_layer and self.raised_tensors != RaisedTensors.KV:
            parts.append("raised-" + self.raised_tensors.value)
        for name, tensor in (("four_bit_k_layers", "K"), ("four_bit_v_layers", "V")):
            if name in per_layer:
                parts.append(f"{tensor}4L" + ",".join(map(str, getattr(self, name))))
        return "-".join(parts)
