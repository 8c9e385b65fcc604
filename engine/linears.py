"""Linear emitters by name: the one place that turns a precision and a grid into an emitter.

Every weight matmul of the decoder graph goes through a *linear emitter*
(``engine.graph.DenseLinear``'s interface).  The float emitter is ``TiledLinear`` (the weights
partitioned over an emulated wafer grid, ``engine.wafer.partition``) or ``DenseLinear`` (plain
MatMuls); the quantised precisions wrap it (``engine.quant.QuantLinear``), per PE tile when it is
tiled.  ``Engine.load`` and the measuring tools both build their emitters here, so an engine and
a benchmark of "int8" run the same graph.
"""

from __future__ import annotations

from typing import Any

from .graph import DenseLinear
from .params import PRECISIONS
from .quant import QuantLinear
from .wafer.partition import TiledLinear

#: precision -> QuantLinear arguments (PRECISIONS, in engine.params, names every precision;
#: "auto" is resolved to one of them by engine.precision)
QUANT_ARGS = {"int8": {"bits": 8}, "int8-rowq": {"bits": 8, "op": "rowq"}, "int4": {"bits": 4}}


def float_linear(wafer: bool = True, grid: tuple[int, int] | None = None) -> Any:
    """The float emitter: ``TiledLinear(grid)`` (partitioned) when ``wafer``, else ``DenseLinear``."""
    return TiledLinear(grid) if wafer else DenseLinear()


def make_linear(
    precision: str = "fp32", wafer: bool = True, grid: tuple[int, int] | None = None, **kw: Any
) -> Any:
    """The linear emitter for ``precision`` on the engine's float emitter.

    'fp32': the float emitter itself; 'int8' / 'int4': MatMulNBits (block-quantised weights, int8
    compute); 'int8-rowq': per-row int8 activations x per-column int8 weights with MatMulInteger
    (cheaper multi-token passes: speculative verification, prefill).  ``kw`` go to
    :class:`~engine.quant.QuantLinear` (e.g. ``block_size``, ``form``).

    ``wafer``/``grid`` mean what they mean for ``Engine.load``: the float emitter is TiledLinear
    (partitioned, the default) or DenseLinear; quantised precisions wrap it per tile.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    base = float_linear(wafer, grid)
    if precision == "fp32":
        return base
    return QuantLinear(inner=base, **{**QUANT_ARGS[precision], **kw})
