"""What the editor tests share: the server command and the model they run against."""

from __future__ import annotations

import os
import sys
import tempfile
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


class PrivateSessionHost:
    """`serve --shared` for one editor test: `env` points the bridges at a runtime directory of the
    test's own (short: the host's Unix socket lives in it), so the session host they start is not
    the user's; on leaving, that host is stopped, its log kept in `log` and the folder removed."""

    def __init__(self) -> None:
        from spark_lsp import bridge

        self._dir = tempfile.TemporaryDirectory(prefix="spark-")
        self.env = {bridge.ENV_DIR: self._dir.name, "SPARK_LSP_HOST_IDLE_EXIT": "2"}
        self.log = ""

    def __enter__(self) -> PrivateSessionHost:
        return self

    def __exit__(self, *exc) -> None:
        from spark_lsp import bridge

        record = bridge.read_record(self._dir.name)
        if record is not None:
            bridge.stop_host(record["pid"])
        log = Path(self._dir.name) / bridge.LOG
        self.log = log.read_text(errors="replace") if log.exists() else ""
        self._dir.cleanup()

    @property
    def handed_over(self) -> bool:
        """Whether the host ran a session on the editor's own stdio (the bridge handed it over)."""
        from spark_lsp.session_host import HANDED_OVER

        return HANDED_OVER in self.log


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
