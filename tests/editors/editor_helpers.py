"""What the editor tests share: the server command and the model they run against."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def server_executable() -> str | None:
    """The `spark-lsp` console script of the Python running the tests (what `pip install` made)."""
    exe = Path(sys.executable).parent / "spark-lsp"
    return str(exe) if exe.is_file() and os.access(exe, os.X_OK) else None


def server_cmd(log_file: Path | None = None) -> list[str]:
    exe = server_executable()
    cmd = [exe] if exe else [sys.executable, "-m", "spark_lsp.cli"]
    cmd += ["serve", "--stdio"]
    if log_file is not None:
        cmd += ["--log-file", str(log_file), "--log-level", "INFO"]
    return cmd


def bundled_model_present() -> bool:
    """Whether the package ships its default model (then the tests run on it, as a user would)."""
    from engine.models import bundled_model_dir

    return (bundled_model_dir() / "config.json").is_file()


def editor_model(tiny_model: Path) -> str:
    """Model folder for an editor test: $SPARK_EDITOR_TEST_MODEL, else '' (the bundled default model)
    when one is bundled, else the tiny random model (ghost text is gibberish but real)."""
    env = os.environ.get("SPARK_EDITOR_TEST_MODEL")
    if env:
        return env
    return "" if bundled_model_present() else str(tiny_model)
