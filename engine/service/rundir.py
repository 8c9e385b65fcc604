"""Where a user's engine daemons leave their address and access token.

Each daemon writes ``<runtime dir>/engine-<key>.json`` (mode 0600, in a 0700 folder): its URL,
its random token, its pid and the model folders it serves.  ``key`` names the model set, so a
client looking for "a daemon serving model M" finds it without scanning ports, and only the
user (who can read the file) can connect.  The runtime dir is ``$XDG_RUNTIME_DIR/spark-lsp`` when
the session has one, else ``~/.cache/spark-lsp/run``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ENV_DIR = "SPARK_LSP_RUN_DIR"  # overrides the runtime dir (tests, several users on one account)
#: Environment variable with the token of a service not found in the user's records (a team's
#: daemon, a Ray deployment on another machine).
TOKEN_ENV = "SPARK_LSP_ENGINE_TOKEN"


def runtime_dir() -> Path:
    """The private folder for daemon records (created 0700 if missing)."""
    env = os.environ.get(ENV_DIR, "").strip()
    if env:
        path = Path(env).expanduser()
    elif os.environ.get("XDG_RUNTIME_DIR") and Path(os.environ["XDG_RUNTIME_DIR"]).is_dir():
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "spark-lsp"
    else:
        path = Path.home() / ".cache" / "spark-lsp" / "run"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def new_token() -> str:
    return secrets.token_urlsafe(32)


def model_key(models: Iterable[str | os.PathLike]) -> str:
    """A short name for a set of model folders (their resolved paths, in order)."""
    joined = "\n".join(str(Path(m).expanduser().resolve()) for m in models)
    return hashlib.sha256(joined.encode()).hexdigest()[:16]


def record_path(key: str) -> Path:
    return runtime_dir() / f"engine-{key}.json"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the owner only (never world-readable, not even briefly)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_record(key: str, url: str, token: str, models: list[str], **extra: Any) -> Path:
    """This process's record: where it serves, its token, and who it is (pid, with the pid's
    start time, which tells a reused pid from it: ``engine.service.manage``)."""
    path = record_path(key)
    pid = os.getpid()
    data = {
        "url": url,
        "token": token,
        "pid": pid,
        "started": process_start(pid),
        "since": time.time(),
        "models": models,
        **extra,
    }
    write_private(path, json.dumps(data, indent=1))
    return path


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat(pid)
    return not fields or fields[0] != "Z"  # unknown (no /proc): it answered the signal


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (/proc/PID/stat's 22nd field):
    with the pid, what names one process for as long as the machine runs; None where unknown."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (ValueError, IndexError):
        return None


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first); None where unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2 :].split()
    except (OSError, ValueError):
        return None


def read_record(key: str) -> dict[str, Any] | None:
    """The record of a live daemon for ``key`` (a stale one, whose process is gone, is removed)."""
    path = record_path(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("pid"), int)
        or not isinstance(data.get("url"), str)
    ):
        return None
    if not pid_alive(data["pid"]):
        remove_record(key, data["pid"])
        return None
    return data


def remove_record(key: str, pid: int | None = None) -> None:
    """Delete the record (only if it is still ``pid``'s, when given: a successor may own it)."""
    path = record_path(key)
    if pid is not None:
        try:
            if json.loads(path.read_text()).get("pid") != pid:
                return
        except (OSError, ValueError):
            pass
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def token_for(url: str) -> str | None:
    """The token of the service at ``url``: from its record in the runtime dir (one of the
    user's own), else $TOKEN_ENV."""
    for path in runtime_dir().glob("engine-*.json"):
        rec = read_record(path.stem.removeprefix("engine-"))
        if rec is not None and rec.get("url", "").rstrip("/") == url.rstrip("/"):
            return rec.get("token")
    return os.environ.get(TOKEN_ENV) or None
