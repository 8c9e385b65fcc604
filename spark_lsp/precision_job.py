"""Measuring the precision decision in the background, once per model and machine.

A model loaded with precision "auto" and no stored decision runs on the engine's static rule
(`engine.precision`); loading never measures. The server then runs `spark-lsp tune` for it in a
child process at the lowest CPU priority: a process, so the measurement never holds the server's
GIL or its engine thread. The decision is stored where `Engine.load` reads it and applies from the
next load, as the log says. A stored decision is never measured again here (`spark-lsp tune
--force` does that), so this runs at most once per model and machine.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("spark_lsp")


def decision_stored(model_dir: str | Path) -> bool:
    """Whether a precision decision is stored for this model as the server loads it (the
    engine's defaults: partitioned, default grid and threads). True when that cannot be told, so
    nothing is measured for a model the store does not understand."""
    from engine.precision import decision_key, read_decision  # the engine is loaded by now

    try:
        return read_decision(decision_key(Path(model_dir))) is not None
    except Exception as exc:  # e.g. a model file the digest does not cover
        log.debug("cannot tell whether %s has a precision decision: %s", model_dir, exc)
        return True


def _lowest_priority(pid: int) -> None:
    """Nice 19 for the child, set from here as it starts (not a ``preexec_fn``, which is unsafe
    in a process with threads, as the server is): Python takes far longer to start than this
    call, so its threads, ONNX Runtime's among them, inherit the priority."""
    if not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    except OSError:  # already gone: its outcome is reported by the watcher
        pass


class PrecisionJob:
    """At most one `spark-lsp tune` child at a time; `report(message, level)` gets its outcome
    (called from a watcher thread: pass something thread-safe)."""

    def __init__(self, report: Callable[[str, str], None]) -> None:
        self.report = report
        self.proc: subprocess.Popen | None = None
        self._started: set[str] = set()
        self._lock = threading.Lock()

    def start(self, model_dir: str | Path, name: str) -> bool:
        """Measure `model_dir` in the background unless it was started already; True if started."""
        key = str(model_dir)
        cmd = [sys.executable, "-m", "spark_lsp.cli", "tune", "--model", key, "--json"]
        with self._lock:
            if key in self._started or (self.proc is not None and self.proc.poll() is None):
                return False
            self._started.add(key)
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            _lowest_priority(self.proc.pid)
        self.report(
            f"measuring the weight precision for {name} in the background "
            "(spark-lsp tune); the result applies from the next load",
            "info",
        )
        threading.Thread(
            target=self._wait, args=(self.proc, name), daemon=True, name="spark-precision-job"
        ).start()
        return True

    def _wait(self, proc: subprocess.Popen, name: str) -> None:
        out, err = proc.communicate()
        if proc.returncode != 0:
            last = (err or "").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            if proc.returncode >= 0:  # not stopped by `stop()`
                self.report(f"measuring the precision for {name} failed: {last[0]}", "warning")
            return
        try:
            choice = json.loads(out)
            what = f"{choice['precision']} ({choice.get('reason', '')})"
        except (ValueError, KeyError, TypeError):
            what = out.strip() or "done"
        self.report(
            f"precision decision for {name} stored: {what}; it applies from the next "
            "load (restart the server)",
            "info",
        )

    def stop(self) -> None:
        """Stop a measurement still running (the server is shutting down)."""
        with self._lock:
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
