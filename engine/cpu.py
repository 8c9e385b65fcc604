"""What this CPU is and which int8 instructions it has (``/proc/cpuinfo``).

The engine's choices that depend on the CPU read it here: the precision ``auto`` loads
(:mod:`engine.precision`) and how int8-rowq stores its weights (:mod:`engine.quant`: a CPU
without an int8 dot-product instruction multiplies u8 x s8 in saturating 16-bit pairs).
"""

from __future__ import annotations

import platform
from pathlib import Path

#: CPU feature flags (``/proc/cpuinfo``) that give int8 dot products: four u8 x s8 products
#: summed into an int32 with no 16-bit saturation on the way.
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"})


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


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
