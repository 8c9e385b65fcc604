"""Finding or starting the user's engine daemon (what a client of ``engine.service`` runs).

``join_or_start`` reads the daemon's record for a model set, or starts a detached daemon
(``python -m engine.service.daemon``) and waits for its record; a lock file keeps two clients
from starting two.  Apart from ``engine.service.daemon`` so that a client (a language server
with ``engine: auto``) imports neither the WebSocket server nor, through it, the engine.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..hub import Progress, resolve_model
from ..models import default_model_dir
from . import rundir


class DaemonError(RuntimeError):
    """The daemon cannot start as asked (a refused option, or a start that did not come up)."""


def resolve_models(
    models: Sequence[str | None], progress: Progress | None = None, weights: bool = True
) -> list[Path]:
    """The models a daemon serves, as absolute paths (None or an empty list: the default model):
    a folder or a .gguf file as itself, a catalogue name or ``hf:ORG/REPO`` as its folder in the
    Hugging Face cache, downloaded first when it is not there (``progress`` hears the bytes;
    None: a progress bar on stderr), as ``spark-lsp serve --model`` takes them.  ``weights=False``:
    what a client of a daemon elsewhere reads (configuration and tokenizer), not the weights."""
    # absolute, not resolved: a Hub GGUF is a link into the cache's blobs, named by its hash
    return [
        Path(
            os.path.abspath(
                (
                    resolve_model(m, progress=progress, weights=weights) or default_model_dir()
                ).expanduser()
            )
        )
        for m in (models or [None])
    ]


def daemon_command(
    folder: Path,
    *,
    idle_exit_s: float = 900.0,
    log_file: Path | None = None,
    precision: str | None = None,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "engine.service.daemon",
        "--model",
        str(folder),
        "--idle-exit",
        str(idle_exit_s),
    ]
    if precision is not None:
        cmd += ["--precision", precision]
    if log_file is not None:
        cmd += ["--log-file", str(log_file)]
    return cmd


def join_or_start(
    model: str | None,
    *,
    timeout_s: float = 120.0,
    idle_exit_s: float = 900.0,
    precision: str | None = None,
    command: list[str] | None = None,
) -> dict[str, Any]:
    """The record (url, token, pid) of the user's daemon for ``model``, starting a detached one
    (in its own session, so it outlives the caller) when none runs, at ``precision`` (None: the
    daemon's default).  A daemon already serving the model is joined whatever its precision.  A
    lock file keeps two callers from starting two daemons for the same model."""
    folders = resolve_models([model])
    key = rundir.model_key(folders)
    found = rundir.read_record(key)
    if found is not None:
        return found
    lock_path = rundir.runtime_dir() / f"engine-{key}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = rundir.read_record(key)
        if found is not None:
            return found
        log_file = rundir.runtime_dir() / f"engine-{key}.log"
        cmd = command or daemon_command(
            folders[0], idle_exit_s=idle_exit_s, log_file=log_file, precision=precision
        )
        env = dict(os.environ)
        root = str(
            Path(__file__).resolve().parents[2]
        )  # the engine package must import in the child
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
            close_fds=True,
        )
        # reap it when it exits, so a dead daemon is not a zombie that looks alive
        threading.Thread(target=proc.wait, name="spark-engine-daemon-reaper", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = rundir.read_record(key)
            if found is not None and found.get("pid") == proc.pid:
                return found
            if proc.poll() is not None:
                raise DaemonError(
                    f"the engine daemon exited with status {proc.returncode} before serving "
                    f"(log: {log_file})"
                )
            time.sleep(0.05)
        proc.terminate()
        raise DaemonError(
            f"the engine daemon did not come up within {timeout_s:g} s (log: {log_file})"
        )
