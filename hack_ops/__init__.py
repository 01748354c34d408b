"""hack_ops: the HACK math, engine-agnostic (imports torch, and triton for GPU kernels only).

Public API (names are fixed; other parts of the project and outside checks call them):
HackConfig, QTensor, quantize, dequantize, pack, unpack, homomorphic_matmul, attention.
"""
from .attention import MODES, attention
from .config import HackConfig
from .homomorphic import homomorphic_matmul, homomorphic_matmul_q
from .modes import AttentionMode, PrefillMode
from .packing import pack, unpack
from .quant import QTensor, dequantize, quantize, sums_dtype

__all__ = [
    "HackConfig",
    "QTensor",
    "quantize",
    "dequantize",
    "pack",
    "unpack",
    "homomorphic_matmul",
    "homomorphic_matmul_q",
    "attention",
    "sums_dtype",
    "MODES",
    "AttentionMode",
    "PrefillMode",
]
