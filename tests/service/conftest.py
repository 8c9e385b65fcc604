"""Fixtures the service tests share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.service import rundir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_dir(tmp_path, monkeypatch) -> Path:
    """A private runtime dir for daemon records, shared by this test and the processes it starts
    (which import this checkout's packages). test_session_host has its own (a short path)."""
    d = tmp_path / "run"
    monkeypatch.setenv(rundir.ENV_DIR, str(d))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return d
