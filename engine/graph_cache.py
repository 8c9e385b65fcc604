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

A graph is as large as the model (0.5-6 GB), and a new engine version (``GRAPH_VERSION``), another
precision or new weights each make a new entry, so entries that will not be read again are
removed (:func:`prune`, after each build): those of another graph version, once unused for a day
(an older spark-lsp still running keeps its own for that long); any entry unused for
``UNUSED_DAYS``; and a build a crashed process left in a temporary folder. An entry's last use is
its folder's modification time, set on every load.
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


#: An entry not loaded for this many days is removed (the next load of it builds it again).
UNUSED_DAYS = 30
#: An entry of another graph version (or a temporary build folder) is removed after this many.
STALE_DAYS = 1


def prune(root: Path, keep: Path | None = None, now: float | None = None) -> tuple[int, int]:
    """Remove the entries under ``root`` that will not be read again (see the module docstring),
    never ``keep``; returns (entries removed, bytes freed) and logs them in one line."""
    now = time.time() if now is None else now
    removed, freed = 0, 0
    try:
        entries = list(root.iterdir())
    except OSError:
        return 0, 0
    for entry in entries:
        if entry == keep or not entry.is_dir():
            continue
        try:
            idle_days = (now - entry.stat().st_mtime) / 86400
        except OSError:
            continue
        if entry.name.startswith(".tmp-"):
            stale = idle_days > STALE_DAYS  # a build that never finished
        elif (entry / "meta.json").is_file() or (entry / MODEL_FILE).is_file():
            stale = idle_days > UNUSED_DAYS or (
                idle_days > STALE_DAYS and _graph_version(entry) != GRAPH_VERSION
            )
        else:
            continue  # not ours
        if stale:
            size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed, freed = removed + 1, freed + size
    if removed:
        log.info(
            "graph cache: removed %d entr%s not read again (%.2f GB): another graph version, "
            "or unused for %d days",
            removed,
            "y" if removed == 1 else "ies",
            freed / 1e9,
            UNUSED_DAYS,
        )
    return removed, freed


def _graph_version(entry: Path) -> int | None:
    try:
        return json.loads((entry / "meta.json").read_text()).get("graph_version")
    except (OSError, ValueError, AttributeError):
        return None


def _touch(entry: Path) -> None:
    """Record a use of ``entry`` (its folder's modification time) for :func:`prune`."""
    try:
        os.utime(entry)
    except OSError:  # a read-only cache: entries there are simply never pruned
        pass


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
            _touch(entry)
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
    prune(root, keep=entry)
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
