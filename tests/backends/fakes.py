"""A small local HTTP server that replays the documented streaming replies of Ollama
(``/api/generate``, ``/api/chat``: NDJSON) and of OpenAI-compatible servers (``/v1/completions``,
``/v1/chat/completions``: SSE) and llama.cpp's server (``/infill``, ``/completion``: SSE). No Ollama binary can be installed in CI, so the Ollama backend is
tested against this replay of its documented format (https://github.com/ollama/ollama/blob/main/docs/api.md).

Like the real servers it stops generating when the client closes the connection (a write fails),
and records what it saw: request bodies, connections opened, tokens written per request.
Behaviour is set on `FakeServer.mode`: ``ok`` (stream `answer` token by token), ``endless``
(tokens until the client goes away), ``garbage`` (a line that is not JSON), ``error`` (HTTP 500
with an Ollama-style error body), ``hang`` (headers, then nothing), ``no-insert`` (Ollama's reply
for a model whose template has no suffix).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeServer:
    def __init__(self, answer: list[str] | None = None, token_delay_s: float = 0.002) -> None:
        self.answer = answer if answer is not None else ["return", " a", " +", " b", "\n"]
        self.token_delay_s = token_delay_s
        self.mode = "ok"
        self.requests: list[tuple[str, dict]] = []
        self.headers: list[dict] = []
        self.connections = 0
        self.written: list[int] = []  # tokens written, per request
        self.stopped = threading.Event()  # set when an endless stream ended (client went away)
        self.stopped_at: float | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                fake.connections += 1

            def log_message(self, *a) -> None:
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                fake.requests.append((self.path, body))
                fake.headers.append(dict(self.headers))
                fake.handle(self, self.path, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- replies ---------------------------------------------------------------------------------
    def handle(self, h: BaseHTTPRequestHandler, path: str, body: dict) -> None:
        llama = path in ("/infill", "/completion")
        sse = path.startswith("/v1/") or llama
        chat = path.endswith("/chat") or path.endswith("/chat/completions")
        if self.mode == "error":
            return self._plain(h, 500, {"error": "model runner has unexpectedly stopped"})
        if self.mode == "no-insert" and "suffix" in body:
            return self._plain(
                h,
                400,
                {
                    "error": f"registry.ollama.ai/library/{body.get('model')} does not support insert"
                },
            )
        if path not in (
            "/api/generate",
            "/api/chat",
            "/v1/completions",
            "/v1/chat/completions",
            "/infill",
            "/completion",
        ):
            return self._plain(h, 404, {"error": "404 page not found"})
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream" if sse else "application/x-ndjson")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        written = 0
        self.written.append(0)
        try:
            if self.mode == "hang":
                time.sleep(30)
                return
            if self.mode == "garbage":
                self._chunk(h, "<html>502 Bad Gateway</html>\n")
                self._chunk(h, "")
                return
            limit = (
                body.get("max_tokens")
                or body.get("n_predict")
                or body.get("options", {}).get("num_predict")
                or 10**9
            )
            tokens = (
                iter(self.answer) if self.mode != "endless" else (f" t{i}" for i in range(10**9))
            )
            for tok in tokens:
                if written >= limit:
                    break
                time.sleep(self.token_delay_s)
                self._chunk(
                    h, self._llama_event(tok) if llama else self._event(tok, sse, chat, done=False)
                )
                written += 1
                self.written[-1] = written
            if llama:
                self._chunk(h, self._llama_final(written, "limit" if written >= limit else "eos"))
            else:
                self._chunk(
                    h, self._final(sse, chat, written, "length" if written >= limit else "stop")
                )
            self._chunk(h, "")
        except (TimeoutError, BrokenPipeError, ConnectionResetError, OSError):
            pass  # the client closed the stream: stop generating, like the real servers
        finally:
            if self.mode == "endless":
                self.stopped_at = time.perf_counter()
                self.stopped.set()
            h.close_connection = self.mode != "ok"

    def _event(self, tok: str, sse: bool, chat: bool, done: bool) -> str:
        if sse:
            choice = {"index": 0, "finish_reason": None}
            choice.update({"delta": {"content": tok}} if chat else {"text": tok})
            return (
                "data: "
                + json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
                + "\n\n"
            )
        key = {"message": {"role": "assistant", "content": tok}} if chat else {"response": tok}
        return (
            json.dumps({"model": "m", "created_at": "2026-01-01T00:00:00Z", **key, "done": False})
            + "\n"
        )

    @staticmethod
    def _llama_event(tok: str) -> str:
        # llama.cpp server (tools/server/README.md): one SSE event per token while streaming
        return (
            "data: "
            + json.dumps({"content": tok, "stop": False, "id_slot": 0, "index": 0})
            + "\n\n"
        )

    @staticmethod
    def _llama_final(n: int, stop_type: str) -> str:
        return (
            "data: "
            + json.dumps(
                {
                    "content": "",
                    "stop": True,
                    "stop_type": stop_type,
                    "tokens_predicted": n,
                    "tokens_cached": 7 + n,
                    "timings": {
                        "prompt_n": 7,
                        "prompt_ms": 1.5,
                        "predicted_n": n,
                        "predicted_ms": 2.0 * n,
                    },
                }
            )
            + "\n\n"
        )

    def _final(self, sse: bool, chat: bool, n: int, reason: str) -> str:
        if sse:
            choice = {"index": 0, "finish_reason": reason}
            choice.update({"delta": {}} if chat else {"text": ""})
            return (
                "data: "
                + json.dumps(
                    {
                        "id": "cmpl-1",
                        "choices": [choice],
                        "usage": {"prompt_tokens": 3, "completion_tokens": n},
                    }
                )
                + "\n\ndata: [DONE]\n\n"
            )
        key = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        return (
            json.dumps(
                {
                    "model": "m",
                    "created_at": "2026-01-01T00:00:01Z",
                    **key,
                    "done": True,
                    "done_reason": reason,
                    "total_duration": 1000,
                    "prompt_eval_count": 3,
                    "eval_count": n,
                    "eval_duration": 900,
                }
            )
            + "\n"
        )

    @staticmethod
    def _chunk(h: BaseHTTPRequestHandler, text: str) -> None:
        data = text.encode()
        h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        h.wfile.flush()

    @staticmethod
    def _plain(h: BaseHTTPRequestHandler, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
