"""What this CPU is and which int8 instructions it has (``/proc/cpuinfo``).

The engine's choices that depend on the CPU read it here: the precision ``auto`` loads
(:mod:`engine.precision`: :func:`int8_fast`) and how int8-rowq stores its weights (:mod:`engine.quant`: a CPU
without an int8 dot-product instruction multiplies u8 x s8 in saturating 16-bit pairs).
"""

from __future__ import annotations

import platform
from pathlib import Path

#: CPU feature flags (``/proc/cpuinfo``) that give int8 dot products: four u8 x s8 products
#: summed into an int32 with no 16-bit saturation on the way.
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"})
#: AVX2 with FMA and F16C (x86-64-v3): int8 products in 16-bit multiply-adds.
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})


def cpu_id() -> str:
    """The CPU model name (``/proc/cpuinfo``), else what ``platform`` reports."""
    model = platform.processor() or platform.machine()
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return model


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty where unknown."""
    for line in _cpuinfo().splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def int8_dot(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has an int8 dot-product instruction (:data:`INT8_DOT_FLAGS`)."""
    return bool((cpu_flags() if flags is None else flags) & INT8_DOT_FLAGS)


def int8_fast(flags: frozenset[str] | None = None) -> bool:
    """Whether int8 weights decode faster than float32 ones once a model outgrows the caches:
    with an int8 dot product, or with AVX2 + FMA + F16C (``vpmaddubsw`` / ``vpmaddwd``:
    MeshLinearQ's AVX2 loop and ONNX Runtime's AVX2 kernels), which x86 CPUs from 2013 on have."""
    flags = cpu_flags() if flags is None else flags
    return int8_dot(flags) or AVX2_FLAGS <= flags


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
