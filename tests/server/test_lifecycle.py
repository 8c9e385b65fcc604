"""Process lifecycle as the specification asks: `shutdown` then `exit` -> 0, `exit` alone -> 1,
stdin closed -> the server exits, the editor's process (`processId`) gone -> the server exits,
SIGTERM -> a clean exit with the generations in flight cancelled."""

from __future__ import annotations

import signal
import subprocess
import sys

from spark_lsp.rpc_client import LspClient, server_cmd

URI = "file:///t/life.py"
SRC = "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n"
EXIT_WAIT_S = 30  # generous: a bound for a hang, not a measurement


def _client(tiny_llama, process_id=None) -> LspClient:
    c = LspClient(server_cmd(str(tiny_llama)), stderr=subprocess.PIPE)
    if process_id is None:
        c.initialize({"contextTokens": 128, "maxTokens": 8})
    else:
        c.call(
            "initialize",
            {
                "processId": process_id,
                "rootUri": None,
                "capabilities": {},
                "initializationOptions": {"contextTokens": 128, "maxTokens": 8},
            },
        )
        c.notify("initialized", {})
    return c


def test_shutdown_then_exit_is_0_and_exit_alone_is_1(tiny_llama):
    c = _client(tiny_llama)
    c.call("shutdown", None)
    c.notify("exit", None)
    assert c.proc.wait(EXIT_WAIT_S) == 0
    c = _client(tiny_llama)
    c.notify("exit", None)
    assert c.proc.wait(EXIT_WAIT_S) == 1


def test_closed_stdin_ends_the_server(tiny_llama):
    c = _client(tiny_llama)
    c.wait_ready()
    c.proc.stdin.close()
    assert c.proc.wait(EXIT_WAIT_S) == 1  # no shutdown came first


def test_the_editor_process_dying_ends_the_server(tiny_llama):
    editor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        c = _client(tiny_llama, process_id=editor.pid)
        c.wait_ready()
        assert c.proc.poll() is None  # alive while the editor is
    finally:
        editor.kill()
        editor.wait()
    assert c.proc.wait(EXIT_WAIT_S) == 0
    assert "is gone" in c.proc.stderr.read().decode(errors="replace")


def test_sigterm_cancels_generations_and_exits_cleanly(tiny_llama):
    c = _client(tiny_llama)
    c.wait_ready()
    c.open(URI, SRC)
    c.call(
        "workspace/executeCommand",
        {"command": "spark.configure", "arguments": [{"maxTokens": 4096, "contextTokens": 256}]},
    )
    fut = c.inline(URI, SRC.index("add(1") + 4, trigger=1)
    c.proc.send_signal(signal.SIGTERM)
    assert c.wait_exit(EXIT_WAIT_S) == 0
    assert "SIGTERM: stopping" in c.proc.stderr.read().decode(errors="replace")
    assert fut.done()  # answered (cancelled) or failed with the connection: nothing left hanging
