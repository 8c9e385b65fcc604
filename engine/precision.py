"""Which weight precision ``Engine.load(precision="auto")`` loads: a stored decision, else a rule.

Loading never measures.  Measuring is a separate step (``spark-lsp tune``, or
:func:`engine.lab.tune.measure_and_store` from a background job): it times fp32 against the
quantised precisions on the model itself, checks their greedy agreement with fp32, and stores the
decision here, keyed by the model's weights and this machine.  :func:`resolve` reads it back.

Without a stored decision the **static rule** applies:

    int8 when the CPU has int8 arithmetic (an int8 dot-product instruction: x86 AVX-VNNI,
    AVX512-VNNI or AMX-INT8, Arm dotprod; or AVX2 with FMA and F16C) and the model's linear
    weights hold at least :data:`INT8_MIN_PARAMS` parameters; fp32 otherwise.

Why: decoding one token reads every weight once, so once the weights outgrow the CPU's caches a
step is bound by the bytes read; int8 reads a quarter of fp32's, and with int8 arithmetic
(MeshLinearQ's VNNI or AVX2 loop) its arithmetic is no slower (BENCHMARKS.md: the Zen 3 rows).  Among the quantised precisions int8 (per-block scales and zero points)
is the one that keeps greedy agreement with fp32 close to complete on real code, so it is the one
safe to take without a measurement; int4 and int8-rowq are chosen only by a measurement.  A small
model's weights stay in cache, where fp32 loses nothing and is exact.  Without int8 arithmetic
(pre-AVX2 x86, Arm without dotprod) the int8 kernels are plain loops and the rule stays at fp32.

A decision is a JSON file ``<cache>/precision/<key>.json`` (the key hashes the weights digest,
the wafer setting and grid, the thread count, the CPU model and the ONNX Runtime version).  It is
written to a temporary name and renamed, so a reader never sees half a file; a file that does not
parse or does not match its key counts as no decision (one log line says so).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnxruntime as ort

from .config import ModelConfig
from .cpu import AVX2_FLAGS, INT8_DOT_FLAGS, cpu_flags, cpu_id, int8_fast
from .files import write_json_atomic
from .graph_cache import cache_root
from .linears import PRECISIONS
from .weights import weights_digest

log = logging.getLogger(__name__)

#: Linear-weight parameters from which the static rule takes int8 (8 MB of fp32 weights: more
#: than a core's L2 cache on current CPUs).
INT8_MIN_PARAMS = 2_000_000
#: Bumped when the stored format or the key changes (old files are then ignored).
FORMAT = 1


@dataclass
class PrecisionChoice:
    """A precision decision: what to load (``precision``) and why.

    ``cached``: read from the store; ``contended``: measured while other work competed for the CPU
    (its speeds are unreliable, so a measuring tool measures again when the CPU is calm).  The
    measurement fields are empty for the static rule.
    """

    precision: str
    decode_tok_s: dict[str, float] = field(default_factory=dict)
    agreement: dict[str, float] = field(default_factory=dict)
    speedup: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    measured_at: str = ""
    cached: bool = False
    contended: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def linear_params(config: ModelConfig) -> int:
    """Parameters in the model's weight matmuls (every layer's projections and the LM head)."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    return config.num_hidden_layers * per_layer + config.vocab_size * h


def static_rule(config: ModelConfig, flags: frozenset[str] | None = None) -> PrecisionChoice:
    """The precision to load without a stored decision (see the module docstring)."""
    flags = cpu_flags() if flags is None else flags
    n = linear_params(config)
    dot = sorted(flags & INT8_DOT_FLAGS) or sorted(flags & AVX2_FLAGS)
    if int8_fast(flags) and n >= INT8_MIN_PARAMS:
        return PrecisionChoice(
            "int8",
            reason=f"static rule: {n / 1e6:.1f}M linear weights and "
            f"int8 arithmetic ({', '.join(dot)})",
        )
    why = (
        f"{n / 1e6:.1f}M linear weights (< {INT8_MIN_PARAMS / 1e6:.0f}M)"
        if n < INT8_MIN_PARAMS
        else "no int8 dot-product instruction or AVX2 on this CPU"
    )
    return PrecisionChoice("fp32", reason=f"static rule: {why}")


def decision_key(
    model_dir: Path,
    *,
    wafer: bool = True,
    grid: tuple[int, int] | None = None,
    threads: int | None = None,
) -> str:
    """The key of a decision for this model (its weights) on this machine."""
    blob = json.dumps(
        {
            "weights": weights_digest(model_dir),
            "wafer": bool(wafer),
            "grid": list(grid) if grid else None,
            "threads": threads,
            "cpu": cpu_id(),
            "ort": ort.__version__,
            "format": FORMAT,
        },
        sort_keys=True,
    )
    return hashlib.blake2b(blob.encode(), digest_size=12).hexdigest()


def decision_path(key: str, cache_dir: str | Path | None = None) -> Path:
    """Where the decision ``key`` is stored: an explicit ``cache_dir`` holds everything (graphs
    and decisions); the default cache root's ``graphs/`` folder gets a sibling ``precision/``."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else cache_root().parent
    return base / "precision" / f"{key}.json"


def read_decision(key: str, cache_dir: str | Path | None = None) -> PrecisionChoice | None:
    """The stored decision ``key``, or None when there is none or it is unreadable (logged)."""
    path = decision_path(key, cache_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("precision decision %s cannot be read (%s); ignoring it", path, e)
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("key") != key or data.get("format") != FORMAT:
            raise ValueError("not a decision for this model and machine")
        choice = PrecisionChoice(**{**data["choice"], "cached": True})
        if choice.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {choice.precision!r}")
    except (ValueError, TypeError, KeyError) as e:
        log.warning("precision decision %s is corrupt (%s); ignoring it", path, e)
        return None
    return choice


def store_decision(
    key: str, choice: PrecisionChoice, cache_dir: str | Path | None = None, model: str = ""
) -> Path:
    """Write ``choice`` as the decision ``key`` atomically (temporary file + rename)."""
    if choice.precision not in PRECISIONS:
        raise ValueError(f"precision={choice.precision!r}: expected one of {PRECISIONS}")
    path = decision_path(key, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "format": FORMAT,
        "key": key,
        "model": model,
        "choice": {**choice.to_dict(), "cached": False},
    }
    write_json_atomic(path, data, indent=2)
    return path


def resolve(
    model_dir: Path,
    config: ModelConfig,
    *,
    wafer: bool = True,
    grid: tuple[int, int] | None = None,
    threads: int | None = None,
    cache_dir: str | Path | None = None,
) -> PrecisionChoice:
    """What ``precision="auto"`` means for this model here: the stored decision, else the rule."""
    stored = read_decision(
        decision_key(model_dir, wafer=wafer, grid=grid, threads=threads), cache_dir
    )
    if stored is not None:
        return stored
    rule = static_rule(config)
    rule.reason = (
        f"no stored decision for this model and machine (measure: spark-lsp tune); {rule.reason}"
    )
    return rule
