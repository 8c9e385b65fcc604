"""`spark-lsp serve --stdio --shared`: editors' bridges and the session host they share.

Real processes end to end: each editor runs the `spark-lsp` command as an editor does
(`python -m spark_lsp.cli serve --stdio --shared`), the first bridge starts the host (detached),
the tiny model is the engine. pytest-lsp editors (tests/server's client) for the features,
`rpc_client.LspClient` where a test needs the raw stream (garbage, the host's death).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from lsprotocol import types as T
from service_support import editor_client

from engine.service import rundir
from spark_lsp import bridge
from spark_lsp.rpc_client import LspClient

_editor = editor_client()
SAMPLE, OPTIONS, start_editor = _editor.SAMPLE, _editor.OPTIONS, _editor.start_editor

ROOT = Path(__file__).resolve().parents[2]
URI = "file:///work/sample.py"
OFFSETS = [SAMPLE.index(s) + len(s) for s in ("total = add(", "out.append(", "def scale(")]
SECRET = 'API_KEY = "sk-very-secret-value"\n\n\ndef handler(event):\n    return '


def bridge_cmd(model: Path) -> list[str]:
    """What an editor runs: the `spark-lsp` command's `serve --stdio --shared`."""
    return [
        sys.executable,
        "-m",
        "spark_lsp.cli",
        "serve",
        "--stdio",
        "--shared",
        "--model",
        str(model),
    ]


@pytest.fixture
def run_dir(tmp_path_factory, monkeypatch):
    # short: the host's Unix socket lives here (a socket path holds at most 107 bytes)
    d = Path(tmp_path_factory.mktemp("run"))
    monkeypatch.setenv(bridge.ENV_DIR, str(d))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("SPARK_LSP_HOST_IDLE_EXIT", "2")
    yield d
    rec = bridge.read_record(str(d))
    if rec is not None:  # a host a failed test left behind
        stop(rec["pid"])


def stop(pid: int) -> None:
    bridge.stop_host(pid)


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not rundir.pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


async def bridged(model: Path, options: dict | None = None):
    """A pytest-lsp editor whose server is a bridge."""

    async def transport(client):
        await client.start_io(*bridge_cmd(model))

    return await start_editor(model, options, transport=transport)


async def live_rewrite(ed, uri: str) -> tuple[dict, str, bool]:
    """A live `rewrite` of `scale`'s body streamed into the document: (the command's result
    without timings, the document's text after it, whether edits were streamed). The random
    tiny model's rewrite fails the edit checks, so it is streamed and then taken back."""
    await ed.command("spark.configure", {"liveEdits": True, "liveEditHz": 100})
    ed.open(uri, SAMPLE)
    start, end = SAMPLE.index("    out = []"), SAMPLE.index("\n\n\ndef main")
    rng = T.Range(ed.pos(uri, start), ed.pos(uri, end))
    listed = await ed.client.text_document_code_action_async(
        T.CodeActionParams(T.TextDocumentIdentifier(uri), rng, T.CodeActionContext(diagnostics=[]))
    )
    rewrite = next(
        a
        for a in listed
        if getattr(a, "data", None) and _editor.plain(a.data)["action"] == "rewrite"
    )
    resolved = await ed.client.code_action_resolve_async(rewrite)
    applied = len(ed.applied)
    res = await ed.command(resolved.command.command, *resolved.command.arguments)
    streamed = len(ed.applied) > applied  # workspace/applyEdit reached this editor
    return {k: res[k] for k in ("outcome", "complete")}, ed.text(uri), streamed


async def suggestions(ed, uri: str, offsets: list[int]) -> list[list[str]]:
    out = []
    for off in offsets:
        res = await ed.inline(uri, off)
        out.append([i.insert_text for i in res.items])
    return out


def raw(model: Path) -> LspClient:
    client = LspClient(bridge_cmd(model))
    client.initialize({**OPTIONS})
    client.wait_ready(120)
    return client


# -- the bridge alone ----------------------------------------------------------------------------
def test_bridge_imports_only_the_standard_library():
    """What the bridge runs as (`python -I -S bridge.py`) imports no pygls, numpy, lsprotocol,
    engine or spark_lsp module."""
    code = (
        "import runpy, sys; runpy.run_path(sys.argv[1], run_name='bridge'); "
        "print(' '.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(ROOT / "spark_lsp" / "bridge.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    heavy = [
        m
        for m in out
        if m.split(".")[0]
        in (
            "pygls",
            "numpy",
            "lsprotocol",
            "engine",
            "spark_lsp",
            "onnxruntime",
            "cattrs",
            "argparse",
        )
    ]
    assert heavy == [], heavy
    assert "json" in out and "_socket" in out  # it did import what it needs


def test_bridge_runtime_dir_is_the_daemons(tmp_path, monkeypatch):
    for env in ({bridge.ENV_DIR: str(tmp_path / "a")}, {"XDG_RUNTIME_DIR": str(tmp_path)}):
        monkeypatch.delenv(bridge.ENV_DIR, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert Path(bridge.runtime_dir()) == rundir.runtime_dir()
        assert (Path(bridge.runtime_dir()).stat().st_mode & 0o777) == 0o700


def test_bridge_arguments():
    assert bridge.parse(["--stdio", "--shared", "--model", "m", "--engine=auto"]) == {
        "--model": "m",
        "--engine": "auto",
    }
    for bad in (["--tcp", "1"], ["--model"], ["extra"]):
        with pytest.raises(ValueError):
            bridge.parse(bad)
    assert bridge.wants_bridge(["--stdio", "--shared"])
    assert not bridge.wants_bridge(["--tcp", "127.0.0.1:1", "--shared"])


def test_no_host_to_reach_gives_the_editor_its_own_server(tmp_path, monkeypatch):
    """A runtime directory that cannot be made (here: under a file) is no host to reach: the
    bridge hands over to `own_server` with the reason, before reading anything from the editor;
    without one it exits 1 as before. A host that refuses the session is not worked around."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(bridge.ENV_DIR, str(blocker / "run"))
    with pytest.raises(bridge.BridgeError, match="no runtime directory"):
        bridge.open_session({})
    reasons: list[str] = []
    assert bridge.main(None, None, own_server=lambda why: reasons.append(why) or 7) == 7
    assert len(reasons) == 1 and "no runtime directory" in reasons[0]
    assert bridge.main(None, None) == 1

    def refused(options):
        raise bridge.HostRefused("the session host refused the session: --model x: not found")

    monkeypatch.setattr(bridge, "open_session", refused)
    assert bridge.main("x", None, own_server=lambda why: pytest.fail("worked around")) == 2


@pytest.mark.slow
def test_a_bridge_without_a_host_runs_the_editors_own_server(tiny_llama, tmp_path, monkeypatch):
    """A host that cannot serve (a socket path past the 107 bytes a Unix socket takes) exits
    before serving; the bridge then becomes the editor's own `serve --stdio`, which says why in
    the editor once and answers as usual."""
    deep = tmp_path / ("d" * 110)
    monkeypatch.setenv(bridge.ENV_DIR, str(deep))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(bridge.ENV_SHARED, "1")  # the bridge's own server must not be a bridge
    client = raw(tiny_llama)
    try:
        shown = client.wait_notification("window/showMessage", timeout=30)
        assert shown["type"] == 2 and "found no session host" in shown["message"]
        assert "the session host exited" in shown["message"]
        assert client.call("spark/metrics", {})["sessionHost"] is None  # its own server
        assert bridge.read_record(str(deep)) is None
        client.open(URI, SAMPLE)
        assert client.inline(URI, OFFSETS[0]).result(60) is not None
    finally:
        client.shutdown()
    assert client.proc.returncode == 0


def test_a_host_serves_only_its_own_installation(tmp_path):
    """The host's files are named by the installation's key, which changes when the interpreter,
    the folder or any source file does: an upgraded spark-lsp starts its own host."""
    root = tmp_path / "site"
    for rel in ("spark_lsp/a.py", "engine/wafer/mesh_op.c", "engine/__pycache__/x.pyc"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    key = bridge.install_key(str(root))
    assert key == bridge.install_key(str(root))  # stable
    assert bridge.install_key(str(tmp_path / "elsewhere")) != key
    pyc = root / "engine/__pycache__/x.pyc"
    os.utime(pyc, ns=(1, 1))
    assert bridge.install_key(str(root)) == key  # compiled files do not count
    src = root / "engine/wafer/mesh_op.c"
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert bridge.install_key(str(root)) != key  # an edited source file does
    assert bridge.INSTALL in bridge.RECORD and bridge.INSTALL in bridge.SOCKET
    assert bridge.INSTALL in bridge.LIFE_LOCK


def test_frames_follow_lsp_framing_across_chunks():
    f = bridge.Frames(keep=64)
    a = bridge.frame({"jsonrpc": "2.0", "id": 1, "method": "shutdown"})
    b = b"Content-Length: 300\r\n\r\n" + b"x" * 300
    c = bridge.frame({"jsonrpc": "2.0", "method": "exit"})
    stream = a + b + c
    bodies = []
    for i in range(0, len(stream), 7):
        bodies += f.feed(stream[i : i + 7])
        if i + 7 == len(a):
            assert f.at_boundary
    assert [json.loads(x)["method"] for x in bodies] == ["shutdown", "exit"]  # the big one skipped
    assert f.at_boundary
    f.feed(b"Content-Len")
    assert not f.at_boundary  # inside a header: nothing may be written in between
    g = bridge.Frames()
    g.feed(b"garbage\r\n\r\n")
    assert g.broken and not g.at_boundary


def _waiter(*, send: bytes | None) -> tuple[int, bytes, bytes]:
    """Run `bridge.WAITER` as a bridge runs it, the host's end of its socket sending `send`
    (None: closing at once, as a dying host's socket does): (status, stdout, stderr)."""
    host, ours = socket.socketpair()
    notice, line = bridge.death_notice(4321)
    proc = subprocess.Popen(
        [bridge.SHELL, "-c", bridge.WAITER, "spark-lsp-bridge", notice.decode(), line],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        close_fds=False,  # the socketpair is not inheritable; fd 3, its dup, is
        preexec_fn=lambda: os.dup2(ours.fileno(), 3),  # noqa: PLW1509 (the child only dup2s)
    )
    ours.close()
    time.sleep(0.05)
    assert proc.poll() is None  # it waits for the host
    if send is not None:
        host.sendall(send)
    host.close()
    out, err = proc.communicate(timeout=10)
    return proc.returncode, out, err


def test_the_waiter_exits_with_the_hosts_status_or_reports_its_death():
    assert _waiter(send=b"0\n") == (0, b"", b"")
    assert _waiter(send=b"1\n") == (1, b"", b"")
    for death in (None, b"", b"2\n", b"0"):  # nothing, garbage or half a line: the host died
        status, out, err = _waiter(send=death)
        assert status == 1
        head, _, body = out.partition(b"\r\n\r\n")
        assert head == b"Content-Length: %d" % len(body)
        msg = json.loads(body)
        assert msg["method"] == "window/showMessage" and msg["params"]["type"] == 1
        assert "session host (pid 4321) stopped" in msg["params"]["message"]
        assert b"(pid 4321) stopped" in err
    # the Python waiter (where the shell cannot run) says the same
    for send, expected in ((b"0\n", 0), (b"1\n", 1), (b"", 1)):
        host, ours = socket.socketpair()
        host.sendall(send)
        host.close()
        r, w = os.pipe()
        assert bridge.wait_host(ours, 4321, stdout=w) == expected
        os.close(w)
        assert (b"(pid 4321) stopped" in os.read(r, 65536)) == (send == b"")
        os.close(r)
        ours.close()


def test_only_pipes_and_sockets_are_handed_over(tmp_path):
    r, _w = os.pipe()
    _r, w = os.pipe()
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    f = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        assert bridge.can_hand_off(r, w)  # what most editors spawn a server with
        assert bridge.can_hand_off(a.fileno(), c.fileno())  # libuv's (Neovim, VS Code)
        assert not bridge.can_hand_off(a.fileno(), a.fileno())  # one socket both ways
        assert not bridge.can_hand_off(r, f)  # a file
    finally:
        for fd in (r, w, _r, _w, f):
            os.close(fd)
        for s in (a, b, c, d):
            s.close()


# -- end to end ----------------------------------------------------------------------------------
@pytest.mark.slow
async def test_two_editors_share_one_host_and_one_engine(tiny_llama, run_dir):
    local, led = await start_editor(tiny_llama)  # `serve --stdio`: what every feature must match
    try:
        led.open(URI, SAMPLE)
        expected = await suggestions(led, URI, OFFSETS)
        expected_edit = await live_rewrite(led, "file:///work/edit.py")
    finally:
        await local.shutdown_session()
        await local.stop()

    assert bridge.read_record(str(run_dir)) is None
    a, ea = await bridged(tiny_llama)
    b, eb = await bridged(tiny_llama)
    try:
        rec = bridge.read_record(str(run_dir))
        assert rec is not None  # the first bridge started it, the second joined it
        host = rec["pid"]
        assert os.getsid(host) == host  # detached: its own session, it outlives the editor
        assert (run_dir / bridge.RECORD).stat().st_mode & 0o777 == 0o600
        # the same file open in both editors: each session its own document and KV slot
        ea.open(URI, SAMPLE)
        eb.open(URI, SAMPLE)
        assert await suggestions(ea, URI, OFFSETS) == expected
        assert await suggestions(eb, URI, OFFSETS) == expected
        # a live edit streams into the editor as from `serve --stdio`, while the other session
        # has a suggestion made on the same engine
        edit = asyncio.ensure_future(live_rewrite(ea, "file:///work/edit.py"))
        assert await suggestions(eb, URI, OFFSETS[:1]) == expected[:1]
        assert await edit == expected_edit
        assert expected_edit[2]  # it streamed
        ma, mb = await ea.metrics(), await eb.metrics()
        assert ma["sessionHost"]["pid"] == mb["sessionHost"]["pid"] == host
        assert ma["sessionHost"]["session"] != mb["sessionHost"]["session"]
        assert [m["sessions"] for m in mb["sessionHost"]["models"]] == [2]  # one engine, 2 users
        assert mb["engine"]["sharedBy"] == 2
        # a thin editor process: the bridge handed the editor's pipes to the host and waits as
        # a shell (no Python, ONNX Runtime or numpy), with no copy of the editor's stdin (here a
        # socket, as asyncio spawns processes)
        for client in (a, b):
            pid = client._server.pid
            assert os.path.realpath(f"/proc/{pid}/exe") == os.path.realpath(bridge.SHELL)
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert bridge.WAITER.encode() in args
            control = os.readlink(f"/proc/{pid}/fd/3")
            assert os.readlink(f"/proc/{pid}/fd/0") == control  # the shell reads it as fd 0
            held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            assert {h for h in held if h.startswith("socket:")} == {control}
        # typing-through and cancel work as with `serve --stdio`
        await ea.command("spark.configure", {"maxTokens": 300, "maxLines": 200})
        mid, fut = ea.start_inline(URI, OFFSETS[0], T.InlineCompletionTriggerKind.Invoked)
        await asyncio.sleep(0.01)
        ea.client.protocol.notify("$/cancelRequest", T.CancelParams(id=mid))
        try:
            await fut
        except Exception:
            pass
        assert isinstance(await eb.inline(URI, OFFSETS[1]), T.InlineCompletionList)
        assert (await eb.metrics())["settings"]["maxTokens"] == OPTIONS["maxTokens"]  # its own
        # a session configuring another model gets its own engine; the first one is kept
        await eb.command("spark.configure", {"precision": "int8"})
        for _ in range(200):
            models = (await eb.metrics())["sessionHost"]["models"]
            if len(models) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted((m["precision"], m["sessions"]) for m in models) == [("auto", 1), ("int8", 1)]
    finally:
        for client in (a, b):
            await client.shutdown_session()
            await client.stop()
    # the host exits (record removed) a while after its last session closed
    assert wait_gone(host, 30)
    assert bridge.read_record(str(run_dir)) is None
    assert not (run_dir / bridge.SOCKET).exists()


async def test_engine_list_shows_the_session_host_and_engine_stop_stops_it(
    tiny_llama, run_dir, capsys
):
    """`spark-lsp engine list` shows the host (its sessions, where they run, its shared models,
    asked over its socket without opening a session) beside the daemon a session of it uses;
    `engine stop --session-host` stops the host alone, `--all` what is left."""
    from spark_lsp.cli import main

    a, ea = await bridged(tiny_llama)
    b, eb = await bridged(tiny_llama, {"engine": "auto"})  # a session on a daemon
    try:
        rec = bridge.read_record(str(run_dir))
        host = rec["pid"]
        daemon = (await eb.metrics())["engine"]["engine"]
        capsys.readouterr()
        assert await asyncio.to_thread(main, ["engine", "list", "--json"]) == 0
        out = capsys.readouterr().out
        assert rec["token"] not in out
        listed = json.loads(out)
        [h] = [x for x in listed if x["kind"] == "session-host"]
        assert [x["url"] for x in listed if x["kind"] == "engine"] == [daemon]
        assert h["pid"] == host and h["answers"] and h["status"]["sessions"] == 2, h
        assert h["status"]["runs"] == {
            "session host (one engine for its editors)": 1,
            f"engine service {daemon}": 1,
        }, h
        assert [(m["precision"], m["sessions"]) for m in h["status"]["models"]] == [("auto", 1)]
        assert await asyncio.to_thread(main, ["engine", "list"]) == 0
        line = capsys.readouterr().out.splitlines()[-1]
        assert line.startswith(f"session host (serve --shared)  pid {host}  up "), line
        assert line.endswith(
            f"2 session(s)  1 on engine service {daemon}  {tiny_llama.name} (auto, 1 session(s))"
        ), line
        metrics = await ea.metrics()  # asking opened no session
        assert metrics["sessionHost"]["sessions"] == 2 and metrics["sessionHost"]["session"] == 1
        assert await asyncio.to_thread(main, ["engine", "stop", "--session-host"]) == 0
        assert capsys.readouterr().out == f"session host (pid {host}): stopped\n"
        assert not rundir.pid_alive(host) and bridge.read_record(str(run_dir)) is None
        assert await asyncio.to_thread(main, ["engine", "list", "--json"]) == 0
        assert [x["kind"] for x in json.loads(capsys.readouterr().out)] == ["engine"]
        assert await asyncio.to_thread(main, ["engine", "stop", "--all"]) == 0
        assert f"on {daemon}" in capsys.readouterr().out
        assert await asyncio.to_thread(main, ["engine", "list"]) == 0
        assert capsys.readouterr().out == "no engine service runs\n"
    finally:
        for client in (a, b):
            try:
                await client.stop()  # its server ended with the host
            except Exception:  # noqa: BLE001
                pass


@pytest.mark.slow
def test_sessions_are_isolated_and_one_failing_leaves_the_others(tiny_llama, run_dir):
    a = raw(tiny_llama)
    b = c = None
    try:
        b = raw(tiny_llama)
        a.open(URI, SECRET)
        pos = {"line": 3, "character": 14}
        # the other session does not see the first one's document through any request
        for method, params in (
            (
                "textDocument/inlineCompletion",
                {"textDocument": {"uri": URI}, "position": pos, "context": {"triggerKind": 1}},
            ),
            ("spark/document", {"uri": URI}),
        ):
            with pytest.raises(Exception, match="unknown document"):
                b.call(method, params, 30)
        # both ask at once: each answer reaches the one who asked, on its own stream
        fa = a.inline(URI, len(SECRET), trigger=1)
        b.open("file:///work/other.py", SAMPLE)
        fb = b.inline("file:///work/other.py", OFFSETS[0], trigger=1)
        fa.result(60), fb.result(60)
        host = a.call("spark/metrics", {})["sessionHost"]["pid"]
        assert b.call("spark/metrics", {})["sessionHost"]["pid"] == host
        # a third session sends garbage: that message is lost, the session goes on
        c = LspClient(bridge_cmd(tiny_llama))
        c.proc.stdin.write(b"Content-Length: nope\r\n\r\n{}")
        c.proc.stdin.flush()
        c.initialize({**OPTIONS})
        assert c.call("spark/metrics", {}, 30)["sessionHost"]["pid"] == host
        # ... and then a stream that is not LSP at all (an HTTP request): it is closed, alone
        c.proc.stdin.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        c.proc.stdin.flush()
        assert c.wait_exit(30) == 1  # its bridge saw the host close it, and says so
        shown = [p for _, m, p in c.notifications if m == "window/showMessage"]
        assert shown and "closed this editor's session" in shown[-1]["message"]
        # the two others go on; the first session's exit frees its documents, not the second's
        assert "result" in {"result": a.inline(URI, len(SECRET), trigger=2).result(60)}
        a.shutdown()
        for _ in range(100):
            if b.call("spark/metrics", {})["sessionHost"]["sessions"] == 1:
                break
            time.sleep(0.05)
        m = b.call("spark/metrics", {})
        assert m["sessionHost"]["sessions"] == 1 and m["engine"]["sharedBy"] == 1
        assert b.inline("file:///work/other.py", OFFSETS[1]).result(60) is not None
        # nothing of one session reached another
        for client in (a, b):
            assert client.orphans == []
            assert "sk-very-secret" not in json.dumps(client.notifications)
        assert "sk-very-secret" not in json.dumps(b.notifications)
    finally:
        for client in (a, b, c):
            if client is not None and client.proc.poll() is None:
                client.shutdown()


@pytest.mark.slow
def test_a_bridge_whose_stdio_is_one_socket_copies_the_bytes(tiny_llama, run_dir):
    """stdin and stdout one socket (as inetd or socat start a server): there is nothing the host
    could take as two pipes, so the bridge stays a Python process and copies the bytes; the
    session is the same, and `shutdown` then `exit` end it with status 0."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(bridge_cmd(tiny_llama), stdin=theirs, stdout=theirs)
    theirs.close()
    frames = ours.makefile("rb")

    def send(msg: dict) -> None:
        ours.sendall(bridge.frame({"jsonrpc": "2.0", **msg}))

    def answer(msg_id: int) -> dict:
        while True:
            length = 0
            while (line := frames.readline().strip()) != b"":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            msg = json.loads(frames.read(length))
            if msg.get("id") == msg_id and "method" not in msg:
                return msg
            if "method" in msg and "id" in msg:  # the server's own requests
                send({"id": msg["id"], "result": None})

    try:
        params = {"processId": None, "rootUri": None, "capabilities": {}}
        send(
            {
                "id": 1,
                "method": "initialize",
                "params": {**params, "initializationOptions": OPTIONS},
            }
        )
        assert "capabilities" in answer(1)["result"]
        send({"method": "initialized", "params": {}})
        send({"id": 2, "method": "spark/metrics", "params": {}})
        host = answer(2)["result"]["sessionHost"]["pid"]
        assert host == bridge.read_record(str(run_dir))["pid"]
        assert b"-S" in Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        send({"id": 3, "method": "shutdown"})
        answer(3)
        send({"method": "exit"})
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        frames.close()
        ours.close()


@pytest.mark.slow
def test_a_handed_over_session_ends_with_the_status_lsp_asks(tiny_llama, run_dir):
    """The host tells the waiting bridge the status `serve --stdio` would exit with: 0 after
    `shutdown` then `exit`, 1 for `exit` alone, and at the end of the editor's input 0 after
    `shutdown`, else 1; every response written before the exit reaches the editor. A host
    stopped by SIGTERM tells each editor it closed its session, and the status is 1."""
    a, b, c = raw(tiny_llama), raw(tiny_llama), raw(tiny_llama)
    d, e = raw(tiny_llama), raw(tiny_llama)
    try:
        a.shutdown()
        assert a.proc.returncode == 0
        b.notify("exit")
        assert b.proc.wait(30) == 1
        c.call("shutdown", None, 30)
        c.proc.stdin.close()
        assert c.proc.wait(30) == 0
        d.proc.stdin.close()
        assert d.proc.wait(30) == 1
        host = e.call("spark/metrics", {})["sessionHost"]["pid"]
        os.kill(host, signal.SIGTERM)
        assert e.wait_exit(30) == 1
        shown = [p for _, m, p in e.notifications if m == "window/showMessage"]
        assert shown and f"(pid {host}) closed this editor's session" in shown[-1]["message"]
        assert wait_gone(host, 30)
    finally:
        for client in (a, b, c, d, e):
            if client.proc.poll() is None:
                client.proc.kill()


@pytest.mark.slow
def test_host_death_is_reported_to_the_editor(tiny_llama, run_dir):
    client = raw(tiny_llama)
    try:
        host = client.call("spark/metrics", {})["sessionHost"]["pid"]
        os.kill(host, signal.SIGKILL)
        assert client.wait_exit(30) == 1  # a clean exit the editor reports (and restarts)
        shown = [p for _, m, p in client.notifications if m == "window/showMessage"]
        assert shown and shown[-1]["type"] == 1 and "session host" in shown[-1]["message"]
        assert f"(pid {host}) stopped" in shown[-1]["message"]
    finally:
        if client.proc.poll() is None:
            client.proc.kill()
    # the next editor starts a new host over the dead one's record and socket
    again = raw(tiny_llama)
    try:
        new = again.call("spark/metrics", {})["sessionHost"]["pid"]
        assert new != host
        again.open(URI, SAMPLE)
        assert again.inline(URI, OFFSETS[0]).result(60) is not None
    finally:
        again.shutdown()


@pytest.mark.slow
def test_editors_starting_at_once_get_one_host(tiny_llama, run_dir):
    clients: list[LspClient] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def editor() -> None:
        try:
            c = raw(tiny_llama)
            with lock:
                clients.append(c)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=editor) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    try:
        assert errors == [] and len(clients) == 3
        pids = {c.call("spark/metrics", {})["sessionHost"]["pid"] for c in clients}
        assert len(pids) == 1
        assert bridge.read_record(str(run_dir))["pid"] == pids.pop()
    finally:
        for c in clients:
            c.shutdown()


@pytest.mark.slow
def test_a_wrong_token_is_refused(tiny_llama, run_dir):
    client = raw(tiny_llama)
    try:
        rec = bridge.read_record(str(run_dir))
        with pytest.raises(bridge.HostRefused, match="wrong token"):
            bridge.hello({**rec, "token": rec["token"][:-1] + "x"}, {"model": str(tiny_llama)})
        with pytest.raises(bridge.HostRefused, match="not found"):
            bridge.hello(rec, {"model": "/no/such/model"})
        sock, reply = bridge.hello(rec, {"model": str(tiny_llama)})  # the right one is let in
        sock.close()
        assert reply["ok"] and reply["pid"] == rec["pid"]
        assert "result" in {"result": client.call("spark/metrics", {})}
    finally:
        client.shutdown()


@pytest.mark.slow
def test_a_handoff_without_two_pipes_is_refused(tiny_llama, run_dir, tmp_path):
    """A connection that asks to hand over its stdio and then sends no descriptors, or a file,
    is closed; the host keeps no descriptor of it and goes on serving."""
    client = raw(tiny_llama)
    try:
        rec = bridge.read_record(str(run_dir))
        fds = lambda: set(os.listdir(f"/proc/{rec['pid']}/fd"))  # noqa: E731
        before = fds()
        f = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT)
        try:
            for send in (lambda s: s.sendall(b"F"), lambda s: bridge.send_stdio(s, f, f)):
                sock, reply = bridge.hello(rec, {"model": str(tiny_llama), "handoff": True})
                assert reply["handoff"]
                send(sock)
                sock.settimeout(30)
                assert sock.recv(16) == b""  # closed by the host
                sock.close()
        finally:
            os.close(f)
        assert client.call("spark/metrics", {})["sessionHost"]["sessions"] == 1
        for _ in range(100):
            if fds() == before:
                break
            time.sleep(0.05)
        assert fds() == before
    finally:
        client.shutdown()


@pytest.mark.slow
def test_a_stale_record_whose_pid_runs_is_replaced(tiny_llama, run_dir):
    """A record left by a host that died, its pid since taken by another process (here: this
    test's own): no process holds the host's lifetime lock, so the bridge starts a new host."""
    (run_dir / bridge.RECORD).write_text(
        json.dumps({"socket": str(run_dir / bridge.SOCKET), "token": "x" * 43, "pid": os.getpid()})
    )
    client = raw(tiny_llama)
    try:
        host = client.call("spark/metrics", {})["sessionHost"]["pid"]
        assert host != os.getpid() and bridge.read_record(str(run_dir))["pid"] == host
    finally:
        client.shutdown()
