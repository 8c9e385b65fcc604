"""The engine service over WebSocket (the ``websockets`` library's asyncio server).

Before the upgrade, a connection must present the daemon's token (``Authorization: Bearer …``)
and, if it comes from a browser, an allowed ``Origin``; anything else gets HTTP 401 / 403.  After
it, each connection is an :class:`engine.service.connection.Connection`.  ``stop()`` cancels
every generation in flight and delivers their ``done`` messages before closing the sockets.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import logging
from collections.abc import Sequence
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from . import protocol as P
from .connection import MAX_GENERATIONS, Connection

log = logging.getLogger(__name__)


def bearer(headers: Headers) -> str | None:
    auth = headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value:
        return value.strip()
    return None


class EngineServer:
    """Serve ``models`` (``engine.service.local.LocalModels`` or compatible) to WebSocket clients."""

    def __init__(
        self,
        models: Any,
        *,
        token: str | None,
        origins: Sequence[str] = (),
        max_generations: int = MAX_GENERATIONS,
    ) -> None:
        self.models = models
        self.token = token
        self.origins = tuple(origins)
        self.max_generations = max_generations
        self.connections: set[Connection] = set()
        self._server: Server | None = None
        self.host = ""
        self.port = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"ws://{host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> EngineServer:
        self._server = await serve(
            self._handler,
            host,
            port,
            origins=[
                None,
                *self.origins,
            ],  # no Origin header: not a browser; browsers only if allowed
            process_request=self._authorise,
            max_size=P.MAX_FRAME_BYTES,
            compression=None,  # small JSON frames: deflate costs latency and buys nothing
            ping_interval=20,
            ping_timeout=60,
        )
        sock = next(iter(self._server.sockets))
        self.host, self.port = sock.getsockname()[:2]
        return self

    def _authorise(self, conn: ServerConnection, request: Request) -> Response | None:
        if self.token is None:
            return None
        given = bearer(request.headers)
        if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
            log.warning("engine: refused %s: missing or wrong token", _peer(conn))
            return conn.respond(http.HTTPStatus.UNAUTHORIZED, "a valid engine token is required\n")
        return None

    async def _handler(self, ws: ServerConnection) -> None:
        peer = _peer(ws)
        log.info(
            "engine: client %s connected (origin %s, %s)",
            peer,
            ws.request.headers.get("Origin", "-"),
            ws.request.headers.get("User-Agent", "-"),
        )
        conn = Connection(self.models, ws.send, peer=peer, max_generations=self.max_generations)
        self.connections.add(conn)
        try:
            async for raw in ws:
                await conn.handle(raw)
        except ConnectionClosed:
            pass
        finally:
            await conn.close(drain_s=0.0 if ws.state.name != "OPEN" else 2.0)
            self.connections.discard(conn)
            log.info("engine: client %s disconnected", peer)

    async def stop(self, drain_s: float = 5.0) -> None:
        """Cancel all generations, deliver their last messages, close every socket."""
        if self._server is None:
            return
        self._server.close(close_connections=False)  # stop accepting
        await asyncio.gather(
            *(c.close(drain_s) for c in list(self.connections)), return_exceptions=True
        )
        self._server.close(close_connections=True)
        await self._server.wait_closed()
        self._server = None

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()


def _peer(ws: ServerConnection) -> str:
    addr = ws.remote_address
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)
