"""A GGUF file's quantisation kept as it is: the linear emitter for a file's own blocks.

Apart from :mod:`engine.gguf`, which reads a file's configuration, tokenizer and weights with no
part of the graph builder, so that a language server whose engine is a daemon can read a GGUF
model's tokenizer without importing ONNX.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .gguf import GGUFModel
from .linears import float_linear, make_linear
from .quant import QuantizedWeight, QuantLinear


def q4_0_codes(w: np.ndarray, block: int = 32) -> QuantizedWeight | None:
    """Q4_0's own 4-bit codes and scales, recovered exactly from its dequantised ``W[K, N]``, in
    MatMulNBits' layout (symmetric: value = (code - 8) * scale), or None when ``w`` is not a Q4_0
    grid.  llama.cpp's Q4_0 maps each block's largest-magnitude weight to code 0, so that weight
    is -8 * scale: the scale, then every code, follows exactly (and is checked)."""
    K, N = w.shape
    if block != 32 or K % 32:
        return None
    blocks = np.ascontiguousarray(w.T, dtype=np.float32).reshape(N, K // 32, 32)
    ext = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    d = -ext / np.float32(8)
    q = blocks / np.where(d == 0, np.float32(1), d)[..., None] + np.float32(8)
    codes = np.rint(q)
    if not (np.array_equal(codes, q) and codes.min() >= 0 and codes.max() <= 15):
        return None
    if not np.array_equal((codes - 8) * d[..., None], blocks):
        return None
    c = codes.astype(np.uint8)
    packed = np.ascontiguousarray(c[..., 0::2] | (c[..., 1::2] << 4))
    return QuantizedWeight(packed, d.astype(np.float32), None, K, N, 4, 32)


class Q4_0Linear(QuantLinear):
    """int4 MatMulNBits that keeps a Q4_0 file's blocks as they are (codes and scales recovered
    exactly, :func:`q4_0_codes`); weights that are not on a Q4_0 grid, or tiles whose K extent
    is not a multiple of 32, are quantised as usual."""

    def quantize(self, w: np.ndarray, block: int) -> QuantizedWeight:
        return (q4_0_codes(w, block) if self.bits == 4 else None) or super().quantize(w, block)

    def cache_key(self) -> str:
        return "q4_0grid-" + super().cache_key()


def gguf_linear(model: GGUFModel, precision: str, wafer: bool, grid) -> Any | None:
    """The linear emitter that keeps a file's own blocks at ``precision``, or None (the usual one):
    Q8_0 at int8 (MatMulNBits blocks of 32 hold its codes and scales exactly after the symmetric
    quantiser) and Q4_0 at int4 (:class:`Q4_0Linear`)."""
    kinds = model.tensor_types()
    if precision == "int8" and kinds.get("Q8_0"):
        return make_linear("int8", wafer=wafer, grid=grid, block_size=32, symmetric=True)
    if precision == "int4" and kinds.get("Q4_0"):
        return Q4_0Linear(bits=4, inner=float_linear(wafer, grid), block_size=32, symmetric=True)
    return None
