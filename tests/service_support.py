"""Helpers the engine-service tests share (tests/service): a private runtime dir (the `run_dir`
fixture: a test module imports it), a daemon started as the user starts it, the wait for a
generation that a slow client holds, and tests/server's editor client.  (Not a conftest in
tests/service: tests/server's modules import their own conftest by that module name.)"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.service import rundir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_dir(tmp_path, monkeypatch) -> Path:
    """A private runtime dir for daemon records, shared by the test and the processes it starts
    (which import this checkout's packages). test_session_host has its own (a short path)."""
    d = tmp_path / "run"
    monkeypatch.setenv(rundir.ENV_DIR, str(d))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return d


def start_daemon(*args: str) -> subprocess.Popen:
    """``spark-lsp engine serve ARGS`` in a child process (stderr piped, for its messages)."""
    return subprocess.Popen(
        [sys.executable, "-m", "spark_lsp.cli", "engine", "serve", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )


def wait_until_stalled(run, timeout_s: float = 60.0) -> int:
    """How many tokens a connection's generation ``run`` made before it stopped making more
    (its stream unchanged for 0.3 s): the client stopped reading and the generation waits for
    it.  -1 if it never stalled within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = len(run.stream.ids)
        time.sleep(0.3)
        if len(run.stream.ids) == n:
            return n
    return -1


@functools.cache
def editor_client():
    """tests/server's editor client (its conftest module, loaded once under its own name):
    ``start_editor``, ``SAMPLE``, ``OPTIONS`` for tests that drive a real language server."""
    path = ROOT / "tests" / "server" / "conftest.py"
    spec = importlib.util.spec_from_file_location("server_editor_client", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
