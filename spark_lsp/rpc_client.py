"""A small LSP client over a child process's stdio, as an editor would talk to the server.

Used by `spark-lsp demo`, `spark-lsp bench lsp` and the end-to-end tests that need what pytest-lsp
cannot do (garbage bytes, timing each message). It keeps its own copy of each open document, applies
the server's `workspace/applyEdit` to it and echoes the change back as `didChange`, like an editor.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .documents import Edit, apply_edits, offset_at, position_at


class RpcError(Exception):
    def __init__(self, error: dict):
        self.code = error.get("code")
        self.message = error.get("message", "")
        super().__init__(f"{self.code}: {self.message}")


class Doc:
    def __init__(self, uri: str, text: str, version: int = 0):
        self.uri, self.text, self.version = uri, text, version


class LspClient:
    """Spawn `cmd` and speak LSP with it. Thread-safe; responses resolve concurrent Futures."""

    def __init__(
        self,
        cmd: list[str],
        env: dict | None = None,
        stderr: Any = subprocess.DEVNULL,
        apply_edits: bool = True,
    ):
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env={**os.environ, **(env or {})},
        )
        self._ids = itertools.count(1)
        self._pending: dict[Any, Future] = {}
        self._sent_at: dict[Any, float] = {}
        self._lock = threading.Lock()
        self._wlock = threading.Lock()
        self._cond = threading.Condition()
        self.notifications: list[tuple[float, str, Any]] = []
        self.orphans: list[dict] = []  # responses with an unknown or null id
        self.docs: dict[str, Doc] = {}
        self.apply_edits = apply_edits
        self.applied_edits: list[tuple[float, dict]] = []
        self.on_apply: Callable[[str], None] | None = None
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    # -- wire ----------------------------------------------------------------------------------
    def send_raw(self, body: bytes) -> None:
        with self._wlock:
            self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
            self.proc.stdin.flush()

    def _send(self, msg: dict) -> None:
        self.send_raw(json.dumps(msg).encode("utf-8"))

    def request(self, method: str, params: Any = None) -> Future:
        mid = next(self._ids)
        fut: Future = Future()
        fut.id = mid  # type: ignore[attr-defined]
        with self._lock:
            self._pending[mid] = fut
            self._sent_at[mid] = time.perf_counter()
        self._send({"jsonrpc": "2.0", "id": mid, "method": method, "params": params})
        return fut

    def call(self, method: str, params: Any = None, timeout: float = 60.0) -> Any:
        return self.request(method, params).result(timeout)

    def notify(self, method: str, params: Any = None) -> None:
        self._send({"jsonrpc": "2.0", "method": method, "params": params})

    def cancel(self, fut: Future) -> None:
        self.notify("$/cancelRequest", {"id": fut.id})  # type: ignore[attr-defined]

    def _read_loop(self) -> None:
        out = self.proc.stdout
        while True:
            length = None
            while True:
                line = out.readline()
                if not line:
                    self._fail_all("server closed its stdout")
                    return
                line = line.strip()
                if not line:
                    break
                k, _, v = line.partition(b":")
                if k.lower() == b"content-length":
                    length = int(v)
            if length is None:
                continue
            body = out.read(length)
            try:
                msg = json.loads(body)
            except ValueError:
                continue
            try:
                self._dispatch(msg)
            except Exception as exc:  # never let the reader die
                print(f"lsp client: {exc!r}", file=sys.stderr)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for f in pending:
            if not f.done():
                f.set_exception(ConnectionError(why))

    def _dispatch(self, msg: dict) -> None:
        now = time.perf_counter()
        if "method" in msg and "id" in msg:
            self._answer(msg)
        elif "method" in msg:
            with self._cond:
                self.notifications.append((now, msg["method"], msg.get("params")))
                self._cond.notify_all()
        else:
            with self._lock:
                fut = self._pending.pop(msg.get("id"), None)
                sent = self._sent_at.pop(msg.get("id"), None)
            if fut is None:
                with self._cond:
                    self.orphans.append(msg)
                    self._cond.notify_all()
                return
            fut.latency_ms = (now - sent) * 1e3 if sent else None  # type: ignore[attr-defined]
            fut.received_at = now  # type: ignore[attr-defined]
            if "error" in msg and msg["error"] is not None:
                fut.set_exception(RpcError(msg["error"]))
            else:
                fut.set_result(msg.get("result"))

    def _answer(self, msg: dict) -> None:
        method, params, mid = msg["method"], msg.get("params") or {}, msg["id"]
        result: Any = None
        if method == "workspace/applyEdit":
            result = {"applied": self._apply(params.get("edit") or {})}
        elif method == "workspace/configuration":
            result = [None for _ in params.get("items", [])]
        self._send({"jsonrpc": "2.0", "id": mid, "result": result})

    def _apply(self, edit: dict) -> bool:
        self.applied_edits.append((time.perf_counter(), edit))
        if not self.apply_edits:
            return False
        for uri, edits in (edit.get("changes") or {}).items():
            doc = self.docs.get(uri)
            if doc is None:
                return False
            self.edit(uri, [(e["range"], e["newText"]) for e in edits])
            if self.on_apply is not None:
                self.on_apply(uri)
        return True

    # -- lifecycle -----------------------------------------------------------------------------
    def initialize(self, options: dict | None = None, timeout: float = 60.0) -> dict:
        caps = {
            "window": {"workDoneProgress": True},
            "workspace": {"applyEdit": True, "configuration": True},
            "textDocument": {
                "inlineCompletion": {},
                "codeAction": {"resolveSupport": {"properties": ["edit"]}},
                "synchronization": {"didSave": False},
            },
        }
        res = self.call(
            "initialize",
            {
                "processId": os.getpid(),
                "rootUri": None,
                "capabilities": caps,
                "initializationOptions": options or {},
            },
            timeout,
        )
        self.notify("initialized", {})
        return res

    def wait_ready(self, timeout: float = 300.0, on_progress: Any = None) -> dict:
        """Poll spark/metrics until the model has loaded (raises on a load error or timeout);
        `on_progress(message)` hears the server's progress reports meanwhile (what the load does)."""
        end = time.time() + timeout
        seen = 0
        while time.time() < end:
            if on_progress is not None:
                with self._cond:
                    new, seen = self.notifications[seen:], len(self.notifications)
                for _, method, params in new:
                    value = (params or {}).get("value") or {} if method == "$/progress" else {}
                    if value.get("kind") == "report" and value.get("message"):
                        on_progress(value["message"])
            m = self.call("spark/metrics", {})
            if m.get("loaded"):
                return m
            if m.get("loadError"):
                raise RuntimeError(m["loadError"])
            time.sleep(0.1)
        raise TimeoutError("model did not load in time")

    def shutdown(self, timeout: float = 10.0) -> None:
        """The LSP's orderly end (`shutdown`, then `exit`); the server is killed if it does not
        answer or go within `timeout`. Its last messages have been read when this returns."""
        try:
            self.call("shutdown", None, timeout)
            self.notify("exit", None)
            self.wait_exit(timeout)
        except Exception:
            self.proc.kill()
        finally:
            try:
                self.proc.stdin.close()
            except Exception:
                pass

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the server to exit and for everything it wrote to have been read: a
        process's exit can come before the reader thread has dispatched its last messages."""
        status = self.proc.wait(timeout)
        self._reader.join(timeout)
        return status

    def wait_notification(self, method: str, after: float = 0.0, timeout: float = 30.0) -> Any:
        end = time.perf_counter() + timeout
        with self._cond:
            while True:
                for t, m, p in self.notifications:
                    if m == method and t >= after:
                        return p
                left = end - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(f"no {method} notification")
                self._cond.wait(left)

    # -- documents -----------------------------------------------------------------------------
    def open(self, uri: str, text: str, language: str = "python") -> Doc:
        doc = self.docs[uri] = Doc(uri, text, 1)
        self.notify(
            "textDocument/didOpen",
            {"textDocument": {"uri": uri, "languageId": language, "version": 1, "text": text}},
        )
        return doc

    def edit(self, uri: str, changes: list[tuple[dict, str]]) -> None:
        """Apply (range, text) changes in order and send them as one incremental didChange."""
        doc = self.docs[uri]
        content = []
        for rng, new in changes:
            s = offset_at(doc.text, rng["start"]["line"], rng["start"]["character"], strict=False)
            e = offset_at(doc.text, rng["end"]["line"], rng["end"]["character"], strict=False)
            doc.text = apply_edits(doc.text, [Edit(s, e, new)])
            content.append({"range": rng, "text": new})
        doc.version += 1
        self.notify(
            "textDocument/didChange",
            {"textDocument": {"uri": uri, "version": doc.version}, "contentChanges": content},
        )

    def type_text(self, uri: str, offset: int, s: str) -> int:
        """Insert `s` at `offset` (one didChange); returns the new cursor offset."""
        doc = self.docs[uri]
        p = position_at(doc.text, offset)
        rng = {
            "start": {"line": p.line, "character": p.character},
            "end": {"line": p.line, "character": p.character},
        }
        self.edit(uri, [(rng, s)])
        return offset + len(s)

    def position(self, uri: str, offset: int) -> dict:
        p = position_at(self.docs[uri].text, offset)
        return {"line": p.line, "character": p.character}

    def inline(self, uri: str, offset: int, trigger: int = 2) -> Future:
        return self.request(
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": uri},
                "position": self.position(uri, offset),
                "context": {"triggerKind": trigger},
            },
        )


def server_cmd(model: str | None = None, extra: list[str] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "spark_lsp.commands.serve", "--stdio"]
    if model:
        cmd += ["--model", model]
    return cmd + list(extra or [])
