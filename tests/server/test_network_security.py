"""Network transports as attack surface: every TCP/WebSocket connection is its own session (no
response ever reaches another connection), browser origins and connections without the user's
token are refused, loopback is the default, and a network client cannot point the server at files."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from spark_lsp import framing, transports
from spark_lsp.settings import Settings, SettingsError, update

SECRET = (
    "API_KEY = 'sk-very-secret-4242'\n\n\ndef add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n"
)
URI = "file:///home/user/secret.py"
OPTIONS = {"contextTokens": 128, "maxTokens": 8, "liveEdits": False, "minConfidence": 0}


# -- clients -------------------------------------------------------------------------------------
class _Conn:
    """A minimal JSON-RPC client that keeps every message it receives."""

    def __init__(self) -> None:
        self.inbox: list[dict] = []
        self.sent_ids: set = set()
        self._ids = iter(range(1, 10**6))

    def notify(self, method: str, params) -> None:
        self._send({"jsonrpc": "2.0", "method": method, "params": params})

    def request(self, method: str, params):
        mid = next(self._ids)
        self.sent_ids.add(mid)
        self._send({"jsonrpc": "2.0", "id": mid, "method": method, "params": params})
        return mid

    def call(self, method: str, params, timeout: float = 120.0) -> dict:
        mid = self.request(method, params)
        return self.wait(lambda m: m.get("id") == mid and ("result" in m or "error" in m), timeout)

    def wait(self, pred, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for m in self.inbox:
                if pred(m):
                    return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching message; got {self.inbox[-5:]}")
            self.inbox.extend(self._recv(min(left, 0.5)))

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.inbox.extend(self._recv(0.1))

    def start(self, model_wait: bool = True) -> None:
        res = self.call(
            "initialize",
            {
                "processId": None,
                "rootUri": None,
                "capabilities": {},
                "initializationOptions": OPTIONS,
            },
        )
        assert "result" in res, res
        self.notify("initialized", {})
        if model_wait:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                m = self.call("spark/metrics", {})["result"]
                if m["loaded"] or m["loadError"]:
                    break
                time.sleep(0.1)
            assert m["loaded"], m

    def open(self, uri: str, text: str) -> None:
        self.notify(
            "textDocument/didOpen",
            {
                "textDocument": {
                    "uri": uri,
                    "languageId": "python",
                    "version": 1,
                    "text": text,
                }
            },
        )


class TcpConn(_Conn):
    def __init__(self, port: int) -> None:
        super().__init__()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.framer = framing.Framer()

    def _send(self, msg: dict) -> None:
        body = json.dumps(msg).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def _recv(self, timeout: float) -> list[dict]:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return []
        if not data:
            raise ConnectionError("closed by the server")
        return [json.loads(b) for b in self.framer.feed(data) if isinstance(b, bytes)]

    def close(self) -> None:
        self.sock.close()


class WsConn(_Conn):
    def __init__(
        self,
        port: int,
        token: str | None = None,
        origin: str | None = None,
        header: bool = False,
    ):
        from websockets.sync.client import connect

        super().__init__()
        url = f"ws://127.0.0.1:{port}/"
        headers = {}
        if token is not None:
            if header:
                headers["Authorization"] = f"Bearer {token}"
            else:
                url += f"?token={token}"
        if origin is not None:
            headers["Origin"] = origin
        self._cm = connect(url, additional_headers=headers, open_timeout=10, max_size=None)
        self.ws = self._cm.__enter__()

    def _send(self, msg: dict) -> None:
        self.ws.send(json.dumps(msg))

    def _recv(self, timeout: float) -> list[dict]:
        try:
            return [json.loads(self.ws.recv(timeout=timeout))]
        except TimeoutError:
            return []

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tiny_llama, flag: str, tmp_path, *extra: str):
    port = _free_port()
    env = dict(os.environ, SPARK_LSP_TOKEN_FILE=str(tmp_path / "rt" / "token"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spark_lsp.commands.serve",
            flag,
            f"127.0.0.1:{port}",
            "--model",
            str(tiny_llama),
            *extra,
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:  # the server says when it listens
        if "listening on" in line:
            break
    else:
        raise RuntimeError(f"server exited: {proc.wait()}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its log pipe from filling
    return proc, port


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _leaks(conn: _Conn) -> list[dict]:
    """Messages a connection received that are not its own: a response to an id it never sent, or
    anything carrying the other session's secret."""
    return [
        m
        for m in conn.inbox
        if ("result" in m or "error" in m)
        and m.get("id") is not None
        and m["id"] not in conn.sent_ids
        or "sk-very-secret" in json.dumps(m)
    ]


def _isolated_sessions(a: _Conn, b: _Conn) -> None:
    a.start()
    a.open(URI, SECRET)
    b.start()
    pos = {"line": 3, "character": 14}
    # the second session does not see the first one's document through any request
    for method, params in (
        (
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": URI},
                "position": pos,
                "context": {"triggerKind": 1},
            },
        ),
        (
            "textDocument/codeAction",
            {
                "textDocument": {"uri": URI},
                "range": {"start": pos, "end": pos},
                "context": {"diagnostics": []},
            },
        ),
        (
            "workspace/executeCommand",
            {
                "command": "spark.applyAction",
                "arguments": [
                    {
                        "action": "docstring",
                        "uri": URI,
                        "range": {"start": pos, "end": pos},
                    }
                ],
            },
        ),
    ):
        res = b.call(method, params)
        assert "error" in res and "unknown document" in res["error"]["message"], res
    # nor can it change the server's model or read a file through a setting
    res = b.call(
        "workspace/executeCommand",
        {"command": "spark.configure", "arguments": [{"model": "/etc"}]},
    )
    assert "error" in res and "network connection" in res["error"]["message"], res
    res = b.call(
        "workspace/executeCommand",
        {"command": "spark.configure", "arguments": [{"waferChip": "/etc/passwd"}]},
    )
    assert "error" in res and "built-in chip" in res["error"]["message"], res
    # its own settings are its own
    res = b.call(
        "workspace/executeCommand",
        {"command": "spark.configure", "arguments": [{"maxTokens": 3}]},
    )
    assert res["result"]["maxTokens"] == 3
    # the first session is answered, on its own connection, with its own settings
    done = a.call(
        "textDocument/inlineCompletion",
        {"textDocument": {"uri": URI}, "position": pos, "context": {"triggerKind": 2}},
    )
    assert "result" in done, done
    assert a.call("spark/metrics", {})["result"]["settings"]["maxTokens"] == OPTIONS["maxTokens"]
    b.drain(0.5)
    assert not _leaks(b), _leaks(b)
    assert not _leaks(a), _leaks(a)


def test_tcp_connections_are_separate_sessions(tiny_llama, tmp_path):
    proc, port = _serve(tiny_llama, "--tcp", tmp_path)
    a = b = None
    try:
        a, b = TcpConn(port), TcpConn(port)
        _isolated_sessions(a, b)
        # exit ends one session, not the server
        b.notify("exit", None)
        with pytest.raises(ConnectionError):
            b.wait(lambda m: False, 10)
        assert "result" in a.call("spark/metrics", {})
    finally:
        for c in (a, b):
            if c is not None:
                c.close()
        _stop(proc)


def test_websocket_refuses_browser_origins_and_missing_tokens(tiny_llama, tmp_path):
    from websockets.exceptions import InvalidStatus

    proc, port = _serve(tiny_llama, "--ws", tmp_path)
    conns = []
    try:
        token_file = tmp_path / "rt" / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        token = token_file.read_text().strip()
        editor = WsConn(port, token)
        conns.append(editor)
        editor.start()
        editor.open(URI, SECRET)
        # a web page (any Origin), or a local process without the token, is refused at the handshake
        for kw in (
            {"token": token, "origin": "http://evil.example"},
            {"origin": "http://evil.example"},
            {},
            {"token": "guess" * 10},
            {"token": token[:-1]},
        ):
            with pytest.raises(InvalidStatus) as info:
                WsConn(port, **kw)
            assert info.value.response.status_code == 403
        # the editor's requests are still answered, to the editor
        res = editor.call(
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": URI},
                "position": {"line": 7, "character": 10},
                "context": {"triggerKind": 2},
            },
        )
        assert "result" in res
        # a second client with the token (as a header) is a session of its own
        other = WsConn(port, token, header=True)
        conns.append(other)
        other.start()
        res = other.call(
            "textDocument/codeAction",
            {
                "textDocument": {"uri": URI},
                "range": {
                    "start": {"line": 0, "character": 0},
                    "end": {"line": 1, "character": 0},
                },
                "context": {"diagnostics": []},
            },
        )
        assert "error" in res
        assert not _leaks(other) and not _leaks(editor)
    finally:
        for c in conns:
            c.close()
        _stop(proc)


def test_websocket_sessions_are_isolated(tiny_llama, tmp_path):
    proc, port = _serve(tiny_llama, "--ws", tmp_path, "--allow-origin", "https://ok.example")
    conns = []
    try:
        token = (tmp_path / "rt" / "token").read_text().strip()
        a = WsConn(port, token)
        conns.append(a)
        b = WsConn(port, token, origin="https://ok.example")  # an allowed origin, with the token
        conns.append(b)
        _isolated_sessions(a, b)
    finally:
        for c in conns:
            c.close()
        _stop(proc)


def test_an_http_request_to_the_tcp_port_is_not_read_as_lsp(tiny_llama, tmp_path):
    """What a web page can do to a TCP port: POST a body that looks like LSP. The connection is
    closed without an answer."""
    proc, port = _serve(tiny_llama, "--tcp", tmp_path)
    try:
        body = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {"processId": None, "rootUri": None, "capabilities": {}},
            }
        ).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\n"
                b"Content-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            got = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        assert got == b""
        c = TcpConn(port)  # the server still serves real clients
        try:
            assert "result" in c.call(
                "initialize", {"processId": None, "rootUri": None, "capabilities": {}}
            )
        finally:
            c.close()
    finally:
        _stop(proc)


# -- units ---------------------------------------------------------------------------------------
def test_loopback_is_the_default_and_remote_needs_a_flag():
    assert transports.check_bind("127.0.0.1", False) is None
    assert transports.check_bind("::1", False) is None
    assert transports.check_bind("localhost", False) is None
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        with pytest.raises(transports.BindError):
            transports.check_bind(host, False)
        assert "warning" in transports.check_bind(host, True)
    out = subprocess.run(
        [sys.executable, "-m", "spark_lsp.commands.serve", "--tcp", "0.0.0.0:1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and "--allow-remote" in out.stderr


def test_token_file_is_private_and_a_readable_one_is_replaced(tmp_path):
    path = tmp_path / "run" / "spark-lsp" / "token"
    token = transports.load_token(path)
    assert len(token) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert transports.load_token(path) == token
    path.chmod(0o644)
    new = transports.load_token(path)
    assert new != token and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert transports.request_token("/?token=abc", {}) == "abc"
    assert transports.request_token("/", {"Authorization": "Bearer xyz"}) == "xyz"
    assert transports.request_token("/", {}) is None


def test_network_settings_cannot_reach_files():
    current = Settings(model="/models/m")
    for bad in (
        {"model": "/etc"},
        {"model": None},
        {"waferChip": "../../etc/passwd"},
        {"waferChip": "/tmp/x.toml"},
    ):
        with pytest.raises(SettingsError):
            update(current, bad, trusted=False)
    ok = update(current, {"model": "/models/m", "waferChip": "wse3"}, trusted=False)[0]
    assert ok.wafer_chip == "wse3"
    assert update(Settings(), {"model": "/etc"})[0].model == "/etc"  # the stdio client is the user


def test_framer_splits_resynchronises_and_refuses_http():
    f = framing.Framer()
    msg = b'{"a": 1}'
    frame = b"Content-Length: %d\r\n\r\n" % len(msg) + msg
    out = []
    for i in range(0, len(frame) * 2, 3):  # byte by byte-ish across two frames
        out += f.feed((frame * 2)[i : i + 3])
    assert out == [msg, msg]
    assert framing.Framer().feed(b"X-Junk: 1\r\n\r\n" + frame) == [
        "header block without Content-Length skipped",
        msg,
    ]
    assert framing.Framer().feed(b"Content-Length: -3\r\n\r\n" + frame)[1:] == [msg]
    small = framing.Framer(max_body=4)
    assert (
        small.feed(frame + b"Content-Length: 2\r\n\r\n{}")[0].startswith("message of")
        and small.feed(b"") == []
    )
    with pytest.raises(framing.FramingError):
        framing.Framer(strict=True).feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(framing.FramingError):
        framing.Framer(strict=True).feed(b"POST /x HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
    assert framing.Framer(strict=True).feed(frame) == [msg]
    assert (
        framing.not_a_message([{"id": 1}])
        and framing.not_a_message(3)
        and framing.not_a_message({})
    )
    assert framing.not_a_message({"id": 1, "result": None}) is None


def test_sigterm_closes_the_network_server_cleanly(tiny_llama, tmp_path):
    proc, port = _serve(tiny_llama, "--tcp", tmp_path)
    c = TcpConn(port)
    try:
        c.start()
        c.open(URI, SECRET)
        c.request(
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": URI},
                "position": {"line": 7, "character": 10},
                "context": {"triggerKind": 1},
            },
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        c.close()
        if proc.poll() is None:
            proc.kill()
