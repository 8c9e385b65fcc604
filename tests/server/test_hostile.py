"""Hostile and clumsy clients: broken framing, JSON that is not a message, lifecycle violations,
wrong types and missing fields, edits to documents that are not open, absurd settings. Each gets a
JSON-RPC error or a log line, and the next valid request is answered. Property tests send random
messages to an in-process server and random edits through it, against a reference document."""

from __future__ import annotations

import asyncio
import json
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from spark_lsp.documents import Pos, apply_change
from spark_lsp.rpc_client import LspClient, RpcError, server_cmd
from spark_lsp.server import create_server

URI = "file:///t/hostile.py"
SRC = "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n"


def _code(c: LspClient, method: str, params, timeout: float = 30.0):
    try:
        c.call(method, params, timeout)
    except RpcError as exc:
        return exc.code
    return None


def _orphan_codes(c: LspClient, expected: set, timeout: float = 10.0) -> list:
    """(id, error code) of the responses the client could not match, once `expected` are in."""
    deadline = time.time() + timeout
    while True:
        codes = [(o.get("id"), o.get("error", {}).get("code")) for o in c.orphans]
        if expected <= set(codes) or time.time() > deadline:
            return codes
        time.sleep(0.05)


def test_lifecycle_violations_get_the_specified_errors(tiny_llama):
    c = LspClient(server_cmd(str(tiny_llama)))
    try:
        # before initialize: requests -32002, notifications dropped
        assert _code(c, "spark/metrics", {}) == -32002
        assert (
            _code(
                c,
                "textDocument/inlineCompletion",
                {
                    "textDocument": {"uri": URI},
                    "position": {"line": 0, "character": 0},
                    "context": {"triggerKind": 1},
                },
            )
            == -32002
        )
        c.notify(
            "textDocument/didOpen",
            {"textDocument": {"uri": URI, "languageId": "python", "version": 1, "text": SRC}},
        )
        c.initialize({"contextTokens": 128, "maxTokens": 8})
        # the didOpen before initialize was dropped
        assert (
            _code(
                c,
                "textDocument/codeAction",
                {
                    "textDocument": {"uri": URI},
                    "range": {
                        "start": {"line": 0, "character": 0},
                        "end": {"line": 0, "character": 0},
                    },
                    "context": {"diagnostics": []},
                },
            )
            == -32602
        )
        # a second initialize
        assert (
            _code(c, "initialize", {"processId": None, "rootUri": None, "capabilities": {}})
            == -32600
        )
        # unknown methods: -32601 for a request, silence for a notification
        assert _code(c, "spark/noSuchMethod", {}) == -32601
        c.notify("spark/noSuchNotification", {})
        c.wait_ready()
        assert _code(c, "shutdown", None) is None
        # after shutdown, requests are refused (not left unanswered)
        assert _code(c, "spark/metrics", {}) == -32600
        c.notify("exit", None)
        assert c.wait_exit(10) == 0
    finally:
        if c.proc.poll() is None:
            c.proc.kill()
    assert not [
        o for o in c.orphans if o.get("id") is None and "spark/noSuchNotification" in json.dumps(o)
    ]


BAD_BODIES = [
    b"{this is not json",
    b"\xff\xfe\x00garbage",
    b"[1, 2, 3]",
    b'[{"jsonrpc": "2.0", "id": 90, "method": "spark/metrics"}]',
    b"42",
    b'"a string"',
    b"null",
    b"{}",
    b"[" * 50000,
    b'{"jsonrpc": "1.0", "id": 91, "method": "spark/metrics"}',
]


def test_framing_and_json_errors_leave_the_server_answering(tiny_llama):
    c = LspClient(server_cmd(str(tiny_llama)))
    try:
        c.initialize({"contextTokens": 128, "maxTokens": 8})
        c.wait_ready()
        c.open(URI, SRC)
        for body in BAD_BODIES:
            c.send_raw(body)
        with c._wlock:  # framing: garbage between messages, lying and missing Content-Length
            w = c.proc.stdin
            w.write(b"garbage before a header\r\n\r\n")
            w.write(b'Content-Length: 5\r\n\r\n{"jsonrpc": "2.0"}')  # too short
            w.write(b"Content-Length: nope\r\n\r\n")
            w.write(b"Content-Length: -4\r\n\r\n")
            w.write(b"Content-Type: application/json\r\n\r\n{}")
            w.flush()
        expected = {(None, -32700), (None, -32600), (91, -32600)}
        codes = _orphan_codes(c, expected)
        assert expected <= set(codes), codes
        # the next valid request is answered correctly (the stream resynchronised)
        for _ in range(3):
            try:
                res = c.call("spark/metrics", {}, 10)
                break
            except (RpcError, TimeoutError):
                continue  # a body the lying length swallowed
        assert res["loaded"]
        assert "items" in c.inline(URI, SRC.index("add(1") + 4).result(60)
    finally:
        c.shutdown()
    assert c.proc.returncode == 0


def test_wrong_types_and_missing_fields_in_every_request(tiny_llama):
    c = LspClient(server_cmd(str(tiny_llama)))
    try:
        c.initialize({"contextTokens": 128, "maxTokens": 8, "liveEdits": False})
        c.wait_ready()
        c.open(URI, SRC)
        pos = {"line": 0, "character": 4}
        rng = {"start": pos, "end": pos}
        bad = [
            ("textDocument/inlineCompletion", {"textDocument": {"uri": URI}}),
            (
                "textDocument/inlineCompletion",
                {
                    "textDocument": {"uri": URI},
                    "position": {"line": -1, "character": 0},
                    "context": {"triggerKind": 1},
                },
            ),
            (
                "textDocument/inlineCompletion",
                {
                    "textDocument": {"uri": URI},
                    "position": {"line": 1.5, "character": 0},
                    "context": {"triggerKind": 1},
                },
            ),
            (
                "textDocument/inlineCompletion",
                {"textDocument": {"uri": 7}, "position": pos, "context": {"triggerKind": 1}},
            ),
            (
                "textDocument/inlineCompletion",
                {"textDocument": {"uri": URI}, "position": pos, "context": {"triggerKind": 99}},
            ),
            ("textDocument/inlineCompletion", None),
            (
                "textDocument/codeAction",
                {
                    "textDocument": {"uri": URI},
                    "range": "everything",
                    "context": {"diagnostics": []},
                },
            ),
            (
                "textDocument/codeAction",
                {
                    "textDocument": {"uri": URI},
                    "range": {"start": pos, "end": {"line": 0, "character": 0}},
                    "context": {"diagnostics": []},
                },
            ),
            (
                "codeAction/resolve",
                {"title": "x", "data": {"action": "docstring", "uri": URI, "range": "r"}},
            ),
            (
                "codeAction/resolve",
                {
                    "title": "x",
                    "data": {
                        "action": "docstring",
                        "uri": URI,
                        "range": {"start": {"line": "0", "character": 0}, "end": pos},
                    },
                },
            ),
            ("codeAction/resolve", {"title": 5}),
            ("workspace/executeCommand", {"command": "spark.applyAction"}),
            ("workspace/executeCommand", {"command": "spark.applyAction", "arguments": [1, 2]}),
            (
                "workspace/executeCommand",
                {
                    "command": "spark.applyAction",
                    "arguments": [
                        {
                            "action": "docstring",
                            "uri": URI,
                            "range": {"start": {"line": 1.5, "character": 0}, "end": pos},
                        }
                    ],
                },
            ),
            (
                "workspace/executeCommand",
                {"command": "spark.editWithInstruction", "arguments": [URI, rng]},
            ),
            ("workspace/executeCommand", {"command": "spark.toggle", "arguments": ["yes"]}),
            ("workspace/executeCommand", {"command": "spark.configure", "arguments": [[1, 2]]}),
            (
                "workspace/executeCommand",
                {
                    "command": "spark.configure",
                    "arguments": [
                        {
                            "maxTokens": 1e308,
                            "contextTokens": -1,
                            "temperature": "hot",
                            "waferRegion": "0x0",
                            "precision": "fp3",
                        }
                    ],
                },
            ),
            ("workspace/executeCommand", {"command": "spark.nothing", "arguments": []}),
            ("workspace/executeCommand", {"command": 12}),
        ]
        for method, params in bad:
            code = _code(c, method, params)
            assert code is not None and -32700 <= code <= -32600 or code in (-32002, -32001), (
                method,
                params,
                code,
            )
            assert code != -32603, (method, params)  # never an internal error
        # notifications that cannot be applied are logged, not fatal
        c.notify(
            "textDocument/didChange",
            {
                "textDocument": {"uri": "file:///nope.py", "version": 2},
                "contentChanges": [{"text": "x"}],
            },
        )
        c.notify("textDocument/didChange", {"textDocument": {"uri": URI}})
        c.notify(
            "textDocument/didChange",
            {
                "textDocument": {"uri": URI, "version": 1},  # stale version
                "contentChanges": [{"range": rng, "text": ""}],
            },
        )
        c.notify(
            "textDocument/didOpen",
            {"textDocument": {"uri": URI, "languageId": "python", "version": 1, "text": SRC}},
        )  # opened twice
        c.notify("textDocument/didClose", {"textDocument": {"uri": "file:///never-opened.py"}})
        c.notify("workspace/didChangeConfiguration", {"settings": [1, 2]})
        c.notify("workspace/didChangeConfiguration", {"settings": {"spark": {"maxTokens": 10**20}}})
        c.notify("$/cancelRequest", {"id": "never-sent"})
        m = c.call("spark/metrics", {})
        assert m["settings"]["maxTokens"] == 8 and m["settings"]["contextTokens"] == 128
        assert "items" in c.inline(URI, SRC.index("add(1") + 4).result(60)
    finally:
        c.shutdown()
    assert c.proc.returncode == 0


# -- property tests against an in-process server (no model: documents and the protocol only) -----
class _Wire:
    """An in-process server whose responses are collected from its writer."""

    def __init__(self) -> None:
        self.ls = create_server("/nonexistent/spark-lsp-test-model")  # no model: loads fail fast
        self.out: list[dict] = []
        self.ls.protocol.set_writer(self, include_headers=False)

    def write(self, data: bytes) -> None:
        self.out.append(json.loads(data))

    def close(self) -> None:
        pass

    def send(self, msg) -> None:
        self.ls._feed(msg if isinstance(msg, bytes) else json.dumps(msg).encode())

    async def call(self, method: str, params, mid) -> dict:
        self.send({"jsonrpc": "2.0", "id": mid, "method": method, "params": params})
        for _ in range(200):
            for m in self.out:
                if m.get("id") == mid and ("result" in m or "error" in m):
                    return m
            await asyncio.sleep(0)
        raise AssertionError(f"no answer to {method} ({mid})")

    async def start(self, encoding: str = "utf-16") -> None:
        res = await self.call(
            "initialize",
            {
                "processId": None,
                "rootUri": None,
                "capabilities": {"general": {"positionEncodings": [encoding]}},
            },
            "init",
        )
        assert res["result"]["capabilities"]["positionEncoding"] == encoding

    def text(self, uri: str) -> str:
        return self.ls.workspace.get_text_document(uri).source


ALPHABET = st.sampled_from(
    [
        "a",
        " ",
        "\t",
        "\n",
        "\r\n",
        "\r",
        "é",
        "😀",
        "e\u0301",
        "\u0000",
        "\u2028",
        "\x0c",
        "中",
        "x" * 3000,
    ]
)
TEXT = st.lists(ALPHABET, max_size=30).map("".join)


@given(TEXT, st.sampled_from(["utf-16", "utf-8", "utf-32"]), st.data())
@settings(max_examples=40)
def test_random_edits_through_the_server_keep_its_copy_the_editors(text, enc, data):
    """The editor applies each change the way the specification reads it (apply_change, checked
    against an independent reference in test_positions); the server's copy must follow exactly,
    including ranges past a line's end or the document's end."""

    async def run() -> None:
        w = _Wire()
        await w.start(enc)
        w.send(
            {
                "jsonrpc": "2.0",
                "method": "textDocument/didOpen",
                "params": {
                    "textDocument": {"uri": URI, "languageId": "python", "version": 1, "text": text}
                },
            }
        )
        mine = text
        for version in range(2, 2 + data.draw(st.integers(1, 6))):
            changes = []
            for _ in range(data.draw(st.integers(1, 3))):
                lines = mine.count("\n") + mine.count("\r") - mine.count("\r\n") + 1
                a = Pos(
                    data.draw(st.integers(0, lines + 1)),
                    data.draw(st.sampled_from([0, 1, 2, 5, 2147483647])),
                )
                b = Pos(
                    data.draw(st.integers(a.line, lines + 1)),
                    data.draw(st.sampled_from([0, 1, 3, 2147483647])),
                )
                new = data.draw(TEXT)
                mine, _ = apply_change(mine, a, b, new, enc)
                changes.append({"range": {"start": a.__dict__, "end": b.__dict__}, "text": new})
            w.send(
                {
                    "jsonrpc": "2.0",
                    "method": "textDocument/didChange",
                    "params": {
                        "textDocument": {"uri": URI, "version": version},
                        "contentChanges": changes,
                    },
                }
            )
            assert w.text(URI) == mine

    asyncio.run(run())


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4)
    ),
    max_leaves=20,
)
METHODS = st.sampled_from(
    [
        "initialize",
        "initialized",
        "shutdown",
        "textDocument/didOpen",
        "textDocument/didChange",
        "textDocument/didClose",
        "textDocument/inlineCompletion",
        "textDocument/codeAction",
        "codeAction/resolve",
        "workspace/executeCommand",
        "workspace/didChangeConfiguration",
        "$/cancelRequest",
        "spark/metrics",
        "spark/nothing",
        "",
        "exit",
    ]
)


@st.composite
def _message(draw):
    kind = draw(st.sampled_from(["request", "notification", "raw", "json"]))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return json.dumps(draw(JSON)).encode()
    msg = {"jsonrpc": draw(st.sampled_from(["2.0", "2.0", "1.0"])), "method": draw(METHODS)}
    if kind == "request":
        msg["id"] = draw(st.one_of(st.integers(0, 10**6), st.text(max_size=8)))
    params = draw(
        st.one_of(
            JSON,
            st.fixed_dictionaries(
                {
                    "textDocument": st.fixed_dictionaries(
                        {"uri": st.sampled_from([URI, "file:///x.py", 3])}
                    ),
                    "position": st.fixed_dictionaries(
                        {"line": st.integers(-3, 10**10), "character": JSON}
                    ),
                    "command": st.sampled_from(
                        ["spark.configure", "spark.toggle", "spark.applyAction", "spark.cancel"]
                    ),
                    "arguments": st.lists(JSON, max_size=3),
                    "settings": JSON,
                }
            ),
        )
    )
    msg["params"] = params
    return json.dumps(msg).encode()


@given(st.lists(_message(), min_size=1, max_size=12))
@settings(max_examples=60)
def test_random_messages_never_kill_the_server(messages):
    async def run() -> None:
        w = _Wire()
        await w.start()
        w.send(
            {
                "jsonrpc": "2.0",
                "method": "textDocument/didOpen",
                "params": {
                    "textDocument": {"uri": URI, "languageId": "python", "version": 1, "text": SRC}
                },
            }
        )
        w.ls.on_exit = lambda code: None  # `exit` among the random messages ends nothing here
        for m in messages:
            w.send(m)
            await asyncio.sleep(0)
        if w.ls.protocol._shutdown:
            return  # a random `shutdown` was accepted: every later request is refused by design
        res = await w.call(
            "workspace/executeCommand", {"command": "spark.toggle", "arguments": [True]}, "last"
        )
        assert res.get("result") == {"enabled": True}, res
        assert all(m.get("error", {}).get("code") != -32603 for m in w.out), [
            m for m in w.out if "error" in m
        ]
        w.ls.stop_work("test over")

    asyncio.run(run())


async def test_a_notification_with_several_changes_is_not_read_as_stale(caplog):
    """pygls applies a didChange's content changes one by one with the same version: only a
    notification whose version does not move forward is stale, not its second change."""
    w = _Wire()
    await w.start()
    w.send(
        {
            "jsonrpc": "2.0",
            "method": "textDocument/didOpen",
            "params": {
                "textDocument": {"uri": URI, "languageId": "python", "version": 1, "text": "ab\n"}
            },
        }
    )

    async def change(version, *edits):
        changes = [
            {
                "range": {
                    "start": {"line": line, "character": a},
                    "end": {"line": line, "character": b},
                },
                "text": text,
            }
            for (line, a, b), text in edits
        ]
        w.send(
            {
                "jsonrpc": "2.0",
                "method": "textDocument/didChange",
                "params": {
                    "textDocument": {"uri": URI, "version": version},
                    "contentChanges": changes,
                },
            }
        )
        for _ in range(10):
            await asyncio.sleep(0)

    with caplog.at_level("WARNING", logger="spark_lsp"):
        await change(2, ((0, 0, 0), "x"), ((0, 1, 1), "y"))  # two changes, one new version
    assert w.text(URI) == "xyab\n"
    assert not [r for r in caplog.records if "after version" in r.getMessage()]
    with caplog.at_level("WARNING", logger="spark_lsp"):
        await change(2, ((0, 0, 0), "z"))  # the same version again: stale, logged, applied
    assert w.text(URI) == "zxyab\n"
    assert [r for r in caplog.records if "after version" in r.getMessage()]
    w.ls.stop_work("test over")


async def test_finished_handlers_are_forgotten():
    """Memory must not grow with keystrokes: pygls kept every notification's future (and its
    params) for the life of the server."""
    w = _Wire()
    await w.start()
    w.send(
        {
            "jsonrpc": "2.0",
            "method": "textDocument/didOpen",
            "params": {
                "textDocument": {"uri": URI, "languageId": "python", "version": 1, "text": SRC}
            },
        }
    )
    for v in range(2, 302):
        w.send(
            {
                "jsonrpc": "2.0",
                "method": "textDocument/didChange",
                "params": {
                    "textDocument": {"uri": URI, "version": v},
                    "contentChanges": [
                        {
                            "range": {
                                "start": {"line": 0, "character": 0},
                                "end": {"line": 0, "character": 0},
                            },
                            "text": "x",
                        }
                    ],
                },
            }
        )
        if v % 6 == 0:
            await w.call(
                "workspace/executeCommand", {"command": "spark.toggle", "arguments": [True]}, v
            )
    for _ in range(10):
        await asyncio.sleep(0)
    assert w.text(URI) == "x" * 300 + SRC
    assert len(w.ls.protocol._request_futures) == 0
    w.ls.stop_work("test over")


def test_a_lone_surrogate_in_a_document_is_read_as_the_replacement_character(tiny_llama):
    """JSON may escape a lone surrogate (a JavaScript string can hold one). It is no text the
    tokenizer, Python's parser or UTF-8 takes: a document holding one failed every completion
    with an internal error. The server reads it as U+FFFD, what the file holds once saved, the
    same length in every position encoding, so later positions stay right; a surrogate pair (an
    emoji as `ensure_ascii` escapes it) is untouched."""
    c = LspClient(server_cmd(str(tiny_llama)))
    try:
        c.initialize({"contextTokens": 128, "maxTokens": 8})
        c.wait_ready()
        # json.dumps escapes them as an editor's JSON.stringify does: "\\ud800", the pair too
        text = 'def f():\n    s = "\ud800\U0001f600\udc00"\n    return '
        c.send_raw(
            json.dumps(
                {
                    "jsonrpc": "2.0",
                    "method": "textDocument/didOpen",
                    "params": {
                        "textDocument": {
                            "uri": URI,
                            "languageId": "python",
                            "version": 1,
                            "text": text,
                        }
                    },
                }
            ).encode()
        )
        # an insertion after them, at a UTF-16 column: a lone one counts 1, the emoji 2
        change = {"start": {"line": 1, "character": 13}, "end": {"line": 1, "character": 13}}
        c.send_raw(
            json.dumps(
                {
                    "jsonrpc": "2.0",
                    "method": "textDocument/didChange",
                    "params": {
                        "textDocument": {"uri": URI, "version": 2},
                        "contentChanges": [{"range": change, "text": "!\udfff"}],
                    },
                }
            ).encode()
        )
        doc = c.call("spark/document", {"uri": URI}, 10)
        assert doc["text"] == 'def f():\n    s = "\ufffd\U0001f600\ufffd!\ufffd"\n    return ', doc
        for line, character in ((2, 11), (1, 9), (1, 12)):
            res = c.call(
                "textDocument/inlineCompletion",
                {
                    "textDocument": {"uri": URI},
                    "position": {"line": line, "character": character},
                    "context": {"triggerKind": 1},
                },
                60,
            )
            assert "items" in res, res
    finally:
        c.shutdown()
    assert c.proc.returncode == 0
