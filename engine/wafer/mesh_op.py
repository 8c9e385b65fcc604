"""Build and locate ``spark.wafer::MeshLinear``, the ONNX Runtime op that runs a partitioned linear.

``mesh_op.c`` (next to this file) computes a whole tiled linear — every mesh line's partial
products and their chain reduction — in one kernel launch.  It is compiled on first use with the
system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) for this CPU (``-march=native``) into
the spark-lsp cache (``$SPARK_LSP_CACHE/ops``, else ``~/.cache/spark-lsp/ops``), keyed by the
source, compiler and CPU, and loaded into sessions with ``SessionOptions.register_custom_ops_library``.
Like the graph cache, a build is written to a temporary name and renamed, so concurrent servers
never load half a file; each process checks the library on one small linear before using it.

Where it cannot be built (no compiler, an ONNX Runtime older than the op needs, or
``SPARK_LSP_MESH_OP=0``), :func:`library` returns ``None`` with the reason in :func:`why_not`,
and ``TiledLinear`` emits the same partitioning as standard ONNX ops instead (slower on small
models; see docs/wafer.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ..graph_cache import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("mesh_op.c")
DOMAIN = "spark.wafer"
OP = "MeshLinear"
#: The C API table version the op is compiled against (its slots exist from this release on).
MIN_ORT = (1, 20)
FLAGS = ("-O3", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden", "-std=gnu11")

_lock = threading.Lock()
_state: dict[str, object] = {}


def ops_dir() -> Path:
    """Beside the graph cache (``$SPARK_LSP_CACHE``, else ``~/.cache/spark-lsp``)."""
    return cache_root().parent / "ops"


def _compiler() -> str | None:
    found = (shutil.which(c) for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c)
    return next((path for path in found if path), None)


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the architecture and the CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _ort_version() -> tuple[int, ...]:
    return tuple(int(p) for p in ort.__version__.split(".")[:2] if p.isdigit())


def _build(cc: str, out: Path) -> None:
    """Compile into ``out`` (atomically); tries ``-march=native`` first, then a generic build."""
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for arch in (["-march=native"], []):
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        os.close(fd)
        cmd = [cc, *FLAGS, *arch, "-o", tmp, str(SOURCE)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            res = None
            errors.append(f"{' '.join(cmd)}: {e}")
        if res is not None and res.returncode == 0:
            os.replace(tmp, out)
            return
        if res is not None:
            errors.append(f"{' '.join(cmd)}: {res.stderr.strip()[-400:]}")
        Path(tmp).unlink(missing_ok=True)
    raise RuntimeError("; ".join(errors))


def _self_test(path: str) -> None:
    """Load the library into a session and check one uneven, multi-row linear against numpy, so a
    broken build (compiler, ABI) falls back to the standard-op form instead of failing a load."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((70, 130)).astype(np.float32)
    x = rng.standard_normal((7, 70)).astype(np.float32)
    tiles = [numpy_helper.from_array(np.ascontiguousarray(w[:36]), "w0"),
             numpy_helper.from_array(np.ascontiguousarray(w[36:]), "w1")]
    graph = helper.make_graph([helper.make_node(OP, ["x", "w0", "w1"], ["y"], domain=DOMAIN)], "self_test",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [7, 70])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [7, 130])], tiles)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.register_custom_ops_library(path)
    y = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    err = float(np.abs(y - x @ w).max())
    if not err < 1e-3:
        raise RuntimeError(f"self-test: max error {err:g} against numpy")


def library() -> str | None:
    """Path of the compiled op library (built on first call), or ``None`` (see :func:`why_not`)."""
    with _lock:
        if "path" in _state:
            return _state["path"]  # type: ignore[return-value]
        path, reason = None, None
        try:
            if os.environ.get("SPARK_LSP_MESH_OP", "1").strip().lower() in ("0", "false", "no", "off"):
                reason = "disabled by SPARK_LSP_MESH_OP"
            elif _ort_version() < MIN_ORT:
                reason = f"onnxruntime {'.'.join(map(str, _ort_version()))} is older than {'.'.join(map(str, MIN_ORT))}"
            elif (cc := _compiler()) is None:
                reason = "no C compiler found (set CC, or install gcc or clang)"
            else:
                try:
                    ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
                except (OSError, subprocess.TimeoutExpired):
                    ver = ""
                key = hashlib.sha256(b"\0".join(x.encode() for x in (SOURCE.read_text(), cc, ver, " ".join(FLAGS),
                                                                      _cpu_id()))).hexdigest()[:16]
                out = ops_dir() / f"mesh_op-{key}.so"
                if not out.exists():
                    log.info("compiling %s -> %s", SOURCE.name, out)
                    _build(cc, out)
                _self_test(str(out))
                path = str(out)
        except Exception as e:  # a failed build or self-test: fall back to the standard-op form
            reason = f"build failed: {e}"
        if reason:
            log.warning("MeshLinear op unavailable (%s); partitioned linears use standard ONNX ops", reason)
        _state["path"], _state["reason"] = path, reason
        return path


def why_not() -> str | None:
    """Why :func:`library` returned ``None`` (``None`` if it has not failed)."""
    library()
    return _state.get("reason")  # type: ignore[return-value]


def reset() -> None:
    """Forget the cached result (tests; after changing ``CC`` or ``SPARK_LSP_MESH_OP``)."""
    with _lock:
        _state.clear()
