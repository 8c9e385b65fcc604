"""Raw wire behaviour (garbage bytes, malformed params), TCP and WebSocket round trips, and the
demo and `bench lsp` commands run end to end on a tiny model."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest
from lsprotocol import types as T

from spark_lsp.rpc_client import LspClient, RpcError, server_cmd

SRC = "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n"
URI = "file:///t/raw.py"


def test_garbage_and_malformed_messages_get_errors_and_the_server_keeps_answering(tiny_llama):
    c = LspClient(server_cmd(str(tiny_llama)))
    try:
        c.initialize({"contextTokens": 128, "maxTokens": 8, "minConfidence": 0})
        c.wait_ready()
        c.open(URI, SRC)
        c.send_raw(b"{this is not json")
        c.send_raw(
            b'{"jsonrpc": "2.0", "id": 77, "method": "textDocument/inlineCompletion", '
            b'"params": {"textDocument": {"uri": "file:///t/raw.py"}}}'
        )
        with pytest.raises(RpcError) as info:
            c.call(
                "textDocument/inlineCompletion",
                {"textDocument": {"uri": URI}, "position": {"line": "x"}},
            )
        assert info.value.code == -32602
        with pytest.raises(RpcError) as info:
            c.call("spark/doesNotExist", {})
        assert info.value.code == -32601
        deadline = time.time() + 10
        while time.time() < deadline and len(c.orphans) < 2:
            time.sleep(0.05)
        errors = {(o.get("id"), o["error"]["code"]) for o in c.orphans if "error" in o}
        assert (None, -32700) in errors and (77, -32602) in errors, c.orphans
        res = c.inline(URI, SRC.index("add(1") + 4).result(30)
        assert "items" in res
    finally:
        c.shutdown()
    assert c.proc.returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _round_trip(tiny_llama, flag: str, connect, env=None):
    """Serve on a free port and make one full session through it. Each connection is a session of
    its own, so the client retries until the listener is up instead of probing."""
    from conftest import start_editor

    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spark_lsp.commands.serve",
            flag,
            f"127.0.0.1:{port}",
            "--model",
            str(tiny_llama),
        ],
        env=env,
    )

    async def transport(cl):
        for _ in range(300):
            try:
                return await connect(cl, port)
            except OSError:
                await asyncio.sleep(0.1)
        raise TimeoutError(f"server did not listen on port {port}")

    try:
        client, ed = await start_editor(tiny_llama, transport=transport)
        ed.open(URI, SRC)
        res = await ed.inline(URI, SRC.index("add(1") + 4)
        assert isinstance(res, T.InlineCompletionList)
        assert (await ed.metrics())["modelCalls"] == 1
        await client.shutdown_session()
        await client.stop()
    finally:
        proc.kill()
        proc.wait()


async def test_websocket_round_trip(tiny_llama, tmp_path):
    """A WebSocket client passes the user's token (the file the server creates) in the URL."""
    import logging
    import os

    from pygls.io_ import run_websocket
    from websockets.asyncio.client import connect as ws_connect

    token_file = tmp_path / "token"

    async def connect(cl, port):
        if not token_file.exists():
            raise OSError("the server has not written its token yet")
        ws = await ws_connect(f"ws://127.0.0.1:{port}/?token={token_file.read_text().strip()}")
        cl._async_tasks.append(
            asyncio.create_task(
                run_websocket(
                    stop_event=cl._stop_event,
                    websocket=ws,
                    protocol=cl.protocol,
                    logger=logging.getLogger("test"),
                    error_handler=cl.report_server_error,
                )
            )
        )
        await asyncio.sleep(0)  # the task sets the protocol's writer when it starts

    await _round_trip(
        tiny_llama, "--ws", connect, env=dict(os.environ, SPARK_LSP_TOKEN_FILE=str(token_file))
    )


async def test_tcp_round_trip(tiny_llama):
    await _round_trip(tiny_llama, "--tcp", lambda cl, port: cl.start_tcp("127.0.0.1", port))


@pytest.mark.slow
def test_demo_runs_without_a_terminal(tiny_llama):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_lsp.commands.demo",
            "--model",
            str(tiny_llama),
            "--cps",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    for part in (
        "1. Typing",
        "2. A long suggestion",
        "3. Code action",
        "Figures",
        "keystroke -> suggestion",
    ):
        assert part in out.stdout
    assert "\x1b[" not in out.stdout  # plain text when stdout is not a terminal


@pytest.mark.slow
@pytest.mark.parametrize("shared", [[], ["--shared"]], ids=["stdio", "shared"])
def test_bench_lsp_replays_typing(tiny_llama, shared):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_lsp.bench.lsp",
            "--model",
            str(tiny_llama),
            "--json",
            "--speed",
            "10",
            "--max-chars",
            "80",
            "--context-tokens",
            "256",
            "--max-tokens",
            "8",
            *shared,  # through a bridge and a session host of the run's own
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["lines"] > 900 and r["keystrokes"] > 0
    assert r["shared"] == bool(shared)
    assert r["answered"] + r["cancelled_or_superseded"] == r["keystrokes"]
    assert r["latency_ms_median"] is not None and r["latency_ms_p95"] >= r["latency_ms_median"]
    # every inline request (one per keystroke, plus the Invoked ones the replay starts and cancels
    # after block openers) is served by at most one of: a model call, typing-through
    assert r["inline_requests"] >= r["keystrokes"]
    assert r["model_calls"] + r["typing_through"] <= r["inline_requests"]


def test_bench_arguments_that_cannot_run_are_refused_in_words(tmp_path, capsys):
    """A model that is not there, or editor counts that are not counts, are said before any
    server starts (a missing model was a server that exited, seen as a traceback)."""
    from spark_lsp.bench import lsp, service

    assert lsp.main(["--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spark-lsp bench lsp: error: --model {tmp_path / 'nope'}: not found")
    for bad in ("0", "a,b", ""):
        assert service.main(["--editors", bad]) == 2
        assert "--editors" in capsys.readouterr().err


def test_the_typing_replay_takes_only_a_python_file():
    from spark_lsp.bench.trace import pick_function

    for text in ("root:x:0:0:root:/root:/bin/bash\n", "def f():\x00\n"):
        with pytest.raises(SystemExit, match="not Python"):
            pick_function(text, None)
