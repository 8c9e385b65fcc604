"""Fixtures the engine-service tests share."""

from __future__ import annotations

import os

import pytest
from service_support import ROOT

from engine.service import rundir


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A runtime dir of this test's own, which the daemons, the language servers they start
    and the test share (the children import this checkout's code)."""
    d = tmp_path / "run"
    monkeypatch.setenv(rundir.ENV_DIR, str(d))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return d
