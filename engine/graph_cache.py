"""On-disk cache of built decoder graphs, so a second start does not rebuild (or even read the weights).

Key: the weights' content digest + the validated config + the build options + the linear
emitter's ``cache_key()`` + the graph builder's version.  An entry is a folder
``<root>/<model>-<key>/`` with ``model.onnx`` + ``model.onnx.data`` (external weights, so models
over 2 GB work) and ``meta.json``; it is written to a temporary folder and renamed into place, so
a crash or a concurrent start never leaves a half-written entry behind. The files are flushed to
disk before the rename, and ``meta.json`` records their sizes and the graph file's digest: an entry
truncated or corrupted later (a full disk, a crash of the machine) is noticed on read, logged in one
line and rebuilt, instead of handing ONNX Runtime a broken graph.

Root: ``cache_dir`` argument, else ``$SPARK_LSP_CACHE/graphs``, else ``~/.cache/spark-lsp/graphs``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from .graph import GRAPH_VERSION

log = logging.getLogger(__name__)

#: Number of graphs built (cache misses) in this process — lets tests assert "no rebuild".
builds = 0

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SPARK_LSP_CACHE")
    if env:
        return Path(env).expanduser() / "graphs"
    return Path.home() / ".cache" / "spark-lsp" / "graphs"


def emitter_key(linear: Any) -> str:
    """The emitter's own ``cache_key()`` if it has one, else its class path."""
    fn = getattr(linear, "cache_key", None)
    return str(fn()) if callable(fn) else f"{type(linear).__module__}.{type(linear).__qualname__}"


def graph_key(digest: str, config: Any, options: dict[str, Any], linear: Any) -> str:
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    blob = json.dumps(
        {
            "weights": digest,
            "config": cfg,
            "options": options,
            "emitter": emitter_key(linear),
            "graph_version": GRAPH_VERSION,
            "onnx": onnx.__version__,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.blake2b(blob.encode(), digest_size=12).hexdigest()


def _safe_name(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)[:40] or "model"


def invalidate(model_path: str | Path) -> None:
    """Remove a cache entry (e.g. one ONNX Runtime cannot load: truncated by a full disk)."""
    entry = Path(model_path).parent
    if (entry / "meta.json").is_file() or (entry / MODEL_FILE).is_file():
        shutil.rmtree(entry, ignore_errors=True)


def get_or_build(
    name: str,
    key: str,
    build: Callable[[Path], onnx.ModelProto],
    cache_dir: str | Path | None = None,
    info: dict[str, Any] | None = None,
) -> tuple[Path, bool]:
    """Path of the cached ``model.onnx`` for ``key``, building it with ``build(data_file)`` on a miss.

    ``build`` may stream its weights into ``data_file`` as ONNX external data (named by file name,
    see ``engine.graph.GraphBuilder``), so the model is never held in memory whole; tensors it
    leaves in the returned model are appended to that file.  Returns ``(path, built)``.  ``info``
    is recorded in the entry's ``meta.json``.
    """
    global builds
    root = cache_root(cache_dir)
    entry = root / f"{_safe_name(name)}-{key}"
    model_path = entry / MODEL_FILE
    if model_path.is_file() and (entry / "meta.json").is_file():
        problem = _damage(entry)
        if problem is None:
            return model_path, False
        log.warning("graph cache entry %s is damaged (%s); rebuilding it", entry.name, problem)
        shutil.rmtree(entry, ignore_errors=True)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
    except OSError as e:  # read-only or full home: keep working from a temporary folder
        fallback = (
            Path(tempfile.gettempdir())
            / f"spark-lsp-graphs-{os.getuid() if hasattr(os, 'getuid') else 0}"
        )
        log.warning("graph cache %s is not writable (%s); using %s", root, e, fallback)
        if fallback == root:
            raise
        return get_or_build(name, key, build, fallback, info)
    t0 = time.perf_counter()
    try:
        model = build(tmp / DATA_FILE)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    builds += 1
    try:
        onnx.save_model(
            model,
            str(tmp / MODEL_FILE),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=DATA_FILE,
            size_threshold=1024,
        )
        meta = {
            "name": name,
            "key": key,
            "graph_version": GRAPH_VERSION,
            "build_s": round(time.perf_counter() - t0, 3),
            **(info or {}),
            "files": {
                f.name: f.stat().st_size for f in (tmp / MODEL_FILE, tmp / DATA_FILE) if f.is_file()
            },
            "model_sha256": _sha256(tmp / MODEL_FILE),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in tmp.iterdir():  # on disk before the entry exists under its name
            _fsync(f)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not model_path.is_file():  # not a concurrent writer that won the race: a real error
                raise
        _fsync(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return model_path, True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk; a file system that cannot is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _damage(entry: Path) -> str | None:
    """Why a cache entry cannot be trusted (unreadable meta, a file of the wrong size, a graph whose
    digest changed), or None. Entries written before sizes were recorded are trusted as they are;
    the weights file is checked by size only (hashing gigabytes would cost each start more than
    the cache saves)."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"meta.json unreadable: {e}"
    if not isinstance(meta, dict):
        return "meta.json is not an object"
    files = meta.get("files")
    if files is None:
        return None
    for name, size in files.items():
        try:
            actual = (entry / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written"
    digest = meta.get("model_sha256")
    if digest is not None and _sha256(entry / MODEL_FILE) != digest:
        return f"{MODEL_FILE} changed since it was written"
    return None
