"""A served model's prompt files (configuration, tokenizer, chat template) sent to a client, so a
language server whose engine runs elsewhere needs nothing of the model on its own machine.

The service names each model's files by a digest in ``hello`` (``files``); a client asks for
them with ``model_files`` only when its cache has no folder of that digest, and receives them in
``model_file`` chunks (any one frame stays far below the protocol's frame limit, whatever the
tokenizer's size) and a closing ``model_files`` that repeats the digest.  The client checks the
names (a fixed set: a server cannot write anywhere else), the total size and the digest before
the folder is put in place, in one rename: a cached folder is always whole.

Cache: ``$SPARK_LSP_CACHE/served``, else ``~/.cache/spark-lsp/served``; one folder per digest,
removed after UNUSED_DAYS without use (``prune``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..config import ModelError
from ..source import PROMPT_FILES, prompt_files

log = logging.getLogger(__name__)

#: Characters of a file in one ``model_file`` message (a frame of at most ~6x that as JSON).
CHUNK_CHARS = 1 << 18
#: A cached folder not used for this many days is removed (by a client's next download).
UNUSED_DAYS = 30
#: Largest set of prompt files a client accepts (the largest tokenizer.json of a real model is
#: ~35 MB: Gemma's 256k vocabulary).
MAX_TOTAL_CHARS = 128 << 20


class ModelFilesError(ValueError):
    """Files a server sent that a client refuses (names, size, digest)."""


def files_digest(files: dict[str, str]) -> str:
    """The digest of a set of prompt files: their names and contents, in name order."""
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name].encode("utf-8")
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


class ServedFiles:
    """The digest of each served model's prompt files, taken when the service loads it (what
    ``hello`` names); the files themselves are read again (a GGUF's made again) when a client
    asks for them, rather than held for the service's life, and sent only while they still
    match that digest."""

    def __init__(self) -> None:
        self._digests: dict[str, str | None] = {}

    def offer(self, path: str | Path, tokenizer: Any = None) -> str | None:
        """The digest of the model at ``path`` (``tokenizer``: its loaded tokenizer, which a
        GGUF's files are made from), or None when its files cannot be read: then no client is
        offered them."""
        try:
            digest: str | None = files_digest(prompt_files(path, tokenizer))
        except (ModelError, OSError) as e:
            log.warning("%s: its prompt files will not be offered to clients: %s", path, e)
            digest = None
        self._digests[str(path)] = digest
        return digest

    def digest(self, path: str | Path) -> str | None:
        """The digest ``offer`` took of the model at ``path`` (None: none offered)."""
        return self._digests.get(str(path))

    def read(self, path: str | Path, tokenizer: Any = None) -> tuple[dict[str, str], str]:
        """(files by name, digest) of a model ``offer`` took; ModelError when it offered none
        or they changed on disk since."""
        want = self.digest(path)
        if want is None:
            raise ModelError(f"{Path(path).name}: this service does not offer its model files")
        files = prompt_files(path, tokenizer)
        digest = files_digest(files)
        if digest != want:
            raise ModelError(
                f"{Path(path).name}: its files changed on disk since this service loaded it "
                "(restart the service)"
            )
        return files, digest


def chunks(gid: str, model: str, files: dict[str, str], digest: str) -> Iterator[dict[str, Any]]:
    """The messages that answer ``model_files`` ``gid``: each file in ``model_file`` chunks of at
    most CHUNK_CHARS characters, then ``model_files`` with the model's name, the file names and
    the digest."""
    for name in sorted(files):
        text = files[name]
        for at in range(0, max(len(text), 1), CHUNK_CHARS):
            yield {
                "type": "model_file",
                "id": gid,
                "name": name,
                "data": text[at : at + CHUNK_CHARS],
            }
    yield {
        "type": "model_files",
        "id": gid,
        "model": model,
        "files": sorted(files),
        "digest": digest,
    }


class Receiver:
    """A client's side of one ``model_files`` answer: the chunks, checked as they arrive."""

    def __init__(self) -> None:
        self.parts: dict[str, list[str]] = {}
        self.chars = 0

    def add(self, msg: dict[str, Any]) -> None:
        name, data = msg.get("name"), msg.get("data")
        if name not in PROMPT_FILES or not isinstance(data, str):
            raise ModelFilesError(f"the service sent a file that is not a model's: {name!r}")
        self.chars += len(data)
        if self.chars > MAX_TOTAL_CHARS:
            raise ModelFilesError(f"the service sent more than {MAX_TOTAL_CHARS} characters")
        self.parts.setdefault(name, []).append(data)

    def finish(self, msg: dict[str, Any]) -> dict[str, str]:
        """The files, once the closing message's names and digest match what arrived."""
        files = {name: "".join(parts) for name, parts in self.parts.items()}
        if sorted(files) != msg.get("files") or files_digest(files) != msg.get("digest"):
            raise ModelFilesError("the model files the service sent do not match their digest")
        return files


def cache_root() -> Path:
    env = os.environ.get("SPARK_LSP_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "spark-lsp"
    return root / "served"


def _valid(digest: Any) -> bool:
    return (
        isinstance(digest, str)
        and len(digest) == 64
        and all(c in "0123456789abcdef" for c in digest)
    )


def cached(digest: Any) -> Path | None:
    """The cached folder of ``digest``, or None when there is none (or it is not a digest)."""
    if not _valid(digest):
        return None
    folder = cache_root() / digest
    return folder if folder.is_dir() else None


def fetch(digest: Any, download: Callable[[], dict[str, str]]) -> Path:
    """The folder of the prompt files named ``digest``: the cached one, else what ``download``
    returns, checked against ``digest`` and put in place atomically."""
    if not _valid(digest):
        raise ModelFilesError(f"the service named its model files by {digest!r}, not a digest")
    folder = cached(digest)
    if folder is not None:
        with contextlib.suppress(OSError):
            os.utime(folder)  # used: kept by ``prune``
        return folder
    files = download()
    if files_digest(files) != digest or not set(files) <= set(PROMPT_FILES):
        raise ModelFilesError("the model files the service sent are not the ones it named")
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=root))
    try:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8", newline="")
        try:
            os.rename(tmp, root / digest)
        except OSError:  # another client put the same folder in place first
            if not (root / digest).is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune(root, keep=root / digest)
    return root / digest


def prune(root: Path, keep: Path | None = None, now: float | None = None) -> int:
    """Remove the cached folders not used for UNUSED_DAYS (a service that has since changed its
    model's files) and temporary ones a day old (a download that never finished), never
    ``keep``; returns how many."""
    now = time.time() if now is None else now
    removed = 0
    for entry in root.iterdir() if root.is_dir() else ():
        try:
            idle_days = (now - entry.stat().st_mtime) / 86400
        except OSError:
            continue
        temporary = entry.name.startswith(".")
        if entry == keep or not (temporary or _valid(entry.name)) or not entry.is_dir():
            continue
        if idle_days > (1 if temporary else UNUSED_DAYS):
            shutil.rmtree(entry, ignore_errors=True)
            removed += not entry.exists()
    if removed:
        log.info(
            "served model files: removed %d folder(s) unused for %d days", removed, UNUSED_DAYS
        )
    return removed
