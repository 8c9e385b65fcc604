"""The form of quantised linears, for tests that exercise the wafer ops.

On a grid, quantised linears default to the ``op`` form (``MeshLinearQ``, and with it the
``DecoderAttention`` op and a float16 KV cache) only where the op library has a vector loop
(``engine.quant.op_is_default``: AVX-512 VNNI or AVX2); elsewhere (ARM, x86 before AVX2) they
default to fused ``MatMulNBits``.  Tests of the ops ask for the op form with :func:`op_linear`;
tests of what the default brings with it are marked :data:`needs_op_default`.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.linears import make_linear
from engine.quant import op_is_default

#: Whether quantised linears on a grid default to the op form on this machine.
OP_DEFAULT = op_is_default()

#: A test of what the op form's default brings (the attention op, the half cache, the op's
#: nodes in a profile): skipped where quantised linears default to fused MatMulNBits.
needs_op_default = pytest.mark.skipif(
    not OP_DEFAULT,
    reason="quantised linears default to fused MatMulNBits here (MeshLinearQ has no vector loop)",
)


def op_linear(precision: str, **kw: Any) -> Any:
    """``make_linear(precision, **kw)`` with the partition executed by the wafer ops at every
    precision (``form="op"`` for quantised ones), whatever this machine's default."""
    if precision != "fp32":
        kw.setdefault("form", "op")
    return make_linear(precision, **kw)
