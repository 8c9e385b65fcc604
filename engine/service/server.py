"""The engine service over WebSocket: the ``websockets`` library's threaded server.

Before the upgrade, a connection must present the daemon's token (``Authorization: Bearer …``)
and, if it comes from a browser, an allowed ``Origin``; anything else gets HTTP 401 / 403.  After
it, each connection is an :class:`engine.service.connection.ThreadConnection`: the thread that
reads the socket handles every message as it arrives (a ``cancel`` stops its generation from
there), and each generation's thread writes its own tokens.  No event loop sits between the
socket and the engine, so a token or a cancel crosses no thread hand-over in the daemon (on a
machine whose cores the engine keeps busy, each hand-over is a wait for a core).  ``stop()``
cancels every generation in flight and delivers their ``done`` messages before closing the
sockets.

With ``ssl_context`` (``engine.service.tls.server_context``) it serves ``wss://``: the library
wraps each accepted socket and shakes hands on the connection's thread (a client that fails the
TLS handshake, a plain ``ws://`` one included, is dropped there and the server goes on).  The
library says nothing of such a client; ``tls.FailedHandshakes`` logs each (rate-limited), so a
client that cannot connect leaves a reason in the daemon's log.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import logging
import ssl
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.sync.server import Server, ServerConnection, serve

from ..heap import trim_heap
from . import protocol as P
from . import tls
from .address import is_loopback
from .connection import MAX_GENERATIONS, ThreadConnection
from .direct import DirectServerConnection

log = logging.getLogger(__name__)


def bearer(headers: Headers) -> str | None:
    auth = headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value:
        return value.strip()
    return None


class EngineServer:
    """Serve ``models`` (``engine.service.local.LocalModels`` or compatible) to WebSocket clients,
    over TLS (``wss://``) when given ``ssl_context``."""

    def __init__(
        self,
        models: Any,
        *,
        token: str | None,
        origins: Sequence[str] = (),
        max_generations: int = MAX_GENERATIONS,
        ssl_context: ssl.SSLContext | None = None,
        flags_dir: Path | None = None,
    ) -> None:
        self.models = models
        self.ssl_context = ssl_context  # a server context (engine.service.tls): wss://
        # shared cancel flags for clients on this machine go here (None: not offered)
        self.flags_dir = flags_dir
        self.token = token
        self.origins = tuple(origins)
        self.max_generations = max_generations
        self.connections: set[ThreadConnection] = set()
        self._lock = threading.Lock()
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.handshakes = tls.FailedHandshakes(log)
        self.host = ""
        self.port = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "wss" if self.ssl_context is not None else "ws"
        return f"{scheme}://{host}:{self.port}"

    def open(self, host: str = "127.0.0.1", port: int = 0) -> EngineServer:
        """Listen on ``host``:``port`` (0: a free port) and serve from a background thread."""
        self._server = serve(
            self._handler,
            host,
            port,
            origins=[None, *self.origins],  # no Origin header: not a browser; browsers if allowed
            process_request=self._authorise,
            **P.SOCKET_OPTIONS,
            create_connection=DirectServerConnection,
            # the TLS handshake runs on the connection's own thread; a failed one is logged
            ssl=self.handshakes.watch(self.ssl_context) if self.ssl_context else None,
        )
        self.host, self.port = self._server.socket.getsockname()[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="spark-engine-accept", daemon=True
        )
        self._thread.start()
        return self

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> EngineServer:
        """``open`` for asyncio callers (the server itself runs on its own threads)."""
        return self.open(host, port)

    def _authorise(self, conn: ServerConnection, request: Request) -> Response | None:
        if self._stopping:
            return conn.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "shutting down\n")
        if self.token is None:
            return None
        given = bearer(request.headers)
        if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
            log.warning("engine: refused %s: missing or wrong token", peer_name(conn))
            return conn.respond(http.HTTPStatus.UNAUTHORIZED, "a valid engine token is required\n")
        return None

    def _handler(self, ws: DirectServerConnection) -> None:
        """One connection's life (on its own thread, which waits while the reading thread and
        the generations do the work)."""
        peer = peer_name(ws)
        log.info(
            "engine: client %s connected (origin %s, %s)",
            peer,
            ws.request.headers.get("Origin", "-"),
            ws.request.headers.get("User-Agent", "-"),
        )
        conn = ThreadConnection(
            self.models,
            ws.send,
            ws.socket,
            send_batch=ws.send_batch,
            peer=peer,
            max_generations=self.max_generations,
            flags_dir=self.flags_dir if _on_this_machine(ws) else None,
        )
        with self._lock:
            self.connections.add(conn)
        try:
            ws.attach(conn.handle)
            ws.recv_events_thread.join()  # until the socket closes
        finally:
            conn.close(drain_s=0.0)
            with self._lock:
                self.connections.discard(conn)
            trim_heap()  # what the connection's threads freed goes back, as a session host's does
            log.info("engine: client %s disconnected", peer)

    def generations(self) -> int:
        """Generations in flight on all connections."""
        with self._lock:
            conns = list(self.connections)
        return sum(len(c.runs) for c in conns)

    def close(self, drain_s: float = 5.0) -> None:
        """Cancel all generations, deliver their last messages, close every socket."""
        if self._server is None:
            return
        self._stopping = True  # new connections are refused (HTTP 503)
        with self._lock:
            conns = list(self.connections)
        for c in conns:  # every generation is told to stop at once ...
            with c.lock:
                c.closing = True
                for run in list(c.runs.values()):
                    run.stop()
        deadline = time.monotonic() + drain_s
        for c in conns:  # ... then their `done` messages are awaited
            c.close(max(0.0, deadline - time.monotonic()))
        self._server.shutdown()  # closes the sockets (1001) and waits for their handlers
        self.handshakes.flush()  # failed handshakes not logged yet are summed up now
        if self._thread is not None:
            self._thread.join(5.0)
        self._server = None

    async def stop(self, drain_s: float = 5.0) -> None:
        """``close`` for asyncio callers, off the event loop (its clients keep reading)."""
        await asyncio.to_thread(self.close, drain_s)


def _on_this_machine(ws: ServerConnection) -> bool:
    addr = ws.remote_address
    return isinstance(addr, tuple) and bool(addr) and is_loopback(str(addr[0]))


def peer_name(ws: Any) -> str:
    """``host:port`` of a connection's client (a ``websockets`` server connection, either
    implementation), for the log."""
    addr = ws.remote_address
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)
