"""A plain HTTP endpoint, one request per generation with the tokens as Server-Sent Events.

The baseline that ``spark-lsp bench service`` compares the persistent WebSocket with: what a
request-per-keystroke HTTP client of an inference server pays (a TCP connection, an HTTP request
and its parsing per generation).  Standard library only (``http.server``), one thread per request.

``POST /generate`` with the JSON body ``{"prompt": text or ids, "params": {...}, "slot": key}``
answers ``text/event-stream``: ``data: {"text": ..., "ids": [...]}`` per chunk, then
``event: done`` with ``{"finish_reason": ..., "stats": {...}}``.  Closing the connection
cancels the generation.  With a certificate and its key (``--tls-cert`` / ``--tls-key``) it
serves HTTPS, each request on a new TCP + TLS connection.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import socket
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .. import wire_text
from ..config import ModelError
from . import protocol as P
from . import tls
from .options import SPINNING

log = logging.getLogger(__name__)

#: Seconds a client has to complete the TLS handshake.
HANDSHAKE_TIMEOUT_S = 10.0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as every production HTTP server: events leave at once
    engine: Any = None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        log.debug(format, *args)

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path != "/generate":
            return self._reply(404, {"error": "POST /generate"})
        try:
            n = int(self.headers.get("Content-Length", "0"))
            if not 0 <= n <= P.MAX_MESSAGE_BYTES:
                return self._reply(413, {"error": "request too large"})
            body = self.rfile.read(n)
            req = json.loads(body)
            if wire_text.may_hold_surrogates(body):
                req = wire_text.clean(req)
            params = P.params_from_json(req.get("params"))
            slot = req.get("slot")
            gen = self.engine.generate(
                req["prompt"], params, slot=("sse", slot) if slot is not None else None
            )
        except P.ProtocolError as e:
            return self._reply(400, {"error": e.message, "code": e.code})
        except (ValueError, KeyError, TypeError, ModelError) as e:
            return self._reply(400, {"error": str(e)})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            for chunk in gen:
                self.wfile.write(
                    f"data: {json.dumps({'text': chunk.text, 'ids': [chunk.token_id]})}\n\n".encode()
                )
                self.wfile.flush()
            done = {"finish_reason": gen.finish_reason, "stats": gen.stats}
            self.wfile.write(f"event: done\ndata: {json.dumps(done)}\n\n".encode())
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            gen.cancel()  # the client went away (over TLS: an SSLError): stop generating


class _Server(ThreadingHTTPServer):
    """A thread per request; with ``ssl_context``, its TLS handshake runs on that thread (not on
    the accepting one, where a slow or silent client would hold every other client)."""

    daemon_threads = True
    ssl_context: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.ssl_context is None:
            return super().finish_request(request, client_address)
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            conn = self.ssl_context.wrap_socket(request, server_side=True)
        except OSError:  # ssl.SSLError too: logged by the context's watch (serve)
            return
        conn.settimeout(None)
        try:
            super().finish_request(conn, client_address)
        finally:
            try:
                conn.shutdown(socket.SHUT_WR)
            except OSError:  # the client went away
                pass
            conn.close()


def serve(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
) -> ThreadingHTTPServer:
    """Start the endpoint in a background thread; ``server_address`` has the bound port.
    ``ssl_context`` (``engine.service.tls.server_context``): serve HTTPS."""
    handler = type("Handler", (_Handler,), {"engine": engine})
    server = _Server((host, port), handler)
    if ssl_context is not None:  # each failed TLS handshake is logged (rate-limited)
        server.ssl_context = tls.FailedHandshakes(log, "sse").watch(ssl_context)
    threading.Thread(target=server.serve_forever, name="spark-sse", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.service.sse [--model DIR] [--port N] [--spinning off|on|auto]
    [--tls-cert PEM --tls-key PEM]``: prints the URL, serves until SIGTERM."""
    from ..engine import Engine  # ONNX Runtime loads only when the endpoint really starts

    p = argparse.ArgumentParser(
        prog="python -m engine.service.sse", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default=None)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument(
        "--spinning",
        choices=sorted(SPINNING),
        default="auto",
        help="ONNX Runtime threads spin between steps (default auto, as in-process)",
    )
    p.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate")
    p.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    args = p.parse_args(argv)
    try:
        ctx = tls.server_context_for(args.tls_cert, args.tls_key)
    except tls.TLSConfigError as e:
        print(f"python -m engine.service.sse: {e}", file=sys.stderr)
        return 2
    engine = Engine.load(args.model, slots=args.slots, spinning=SPINNING[args.spinning])
    gc.collect()
    gc.freeze()  # as the daemon does: the model's objects stay out of full collections
    server = serve(engine, port=args.port, ssl_context=ctx)
    scheme = "https" if ctx is not None else "http"
    print(f"{scheme}://127.0.0.1:{server.server_address[1]}/generate", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
