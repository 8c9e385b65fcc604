"""Network transports (TCP and WebSocket): one LSP session per connection, and the checks that keep
a localhost port from becoming everybody's language server.

Every connection gets its own server object (its own documents, settings, model and responses),
so nothing one connection sends or receives reaches another. A network session is not trusted the
way the editor that started the server over stdio is: it cannot point the server at another model
folder or make it read a file (`ServerState.trusted`). The WebSocket transport refuses browser
`Origin`s unless allowed, and asks for a per-user token kept in a file only the user can read;
any web page can open `ws://127.0.0.1:PORT`, and any local user can connect to a loopback port.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from engine.service.address import is_loopback

from .framing import MAX_BODY, MAX_HEADER, Framer, FramingError

log = logging.getLogger("spark_lsp.transports")

MAX_SESSIONS = 4  # network sessions at once (each may hold a model in memory)
TOKEN_ENV = "SPARK_LSP_TOKEN_FILE"
SESSION_STOP_S = 5.0  # how long a closing session waits for its engine thread


# -- sessions ------------------------------------------------------------------------------------
class Session:
    """One connection's language server: messages in, its own protocol's responses out."""

    def __init__(
        self,
        factory: Callable[[], Any],
        writer: Any,
        include_headers: bool,
        trusted: bool = False,
    ) -> None:
        self.ls = factory()
        if not trusted:
            self.ls.state.trusted = False
        self.ls.protocol.set_writer(writer, include_headers=include_headers)
        self.exited = False
        self.ls.on_exit = self._exit

    def _exit(self, code: int) -> None:  # `exit` ends this session only
        self.exited = True

    def deliver(self, body: bytes) -> None:
        """Hand one message body to the session's server (errors become error responses)."""
        self.ls._feed(body)

    def problem(self, text: str) -> None:
        log.warning("client sent a malformed message: %s", text)

    def close(self) -> None:
        """Stop the session's work: its requests, generations and thread pool."""
        self.ls.stop_work("connection closed")
        self.ls.wait_stopped(SESSION_STOP_S)  # the generation stops within a decode step
        try:
            self.ls.shutdown()
        except Exception as exc:  # noqa: BLE001 (a failed cleanup must not stop the listener)
            log.debug("session shutdown: %s", exc)


class SessionLimit:
    def __init__(self, limit: int) -> None:
        self.limit, self.active = limit, 0

    def take(self) -> bool:
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def give(self) -> None:
        self.active -= 1


# -- binding -------------------------------------------------------------------------------------
class BindError(ValueError):
    """A non-loopback address asked for without --allow-remote."""


def check_bind(host: str, allow_remote: bool) -> str | None:
    """None for a loopback host; a warning for another host when allowed; raises BindError if not."""
    if is_loopback(host):
        return None
    if not allow_remote:
        raise BindError(
            f"{host!r} is not a loopback address: anyone who can reach it could use the "
            "server; pass --allow-remote to listen there anyway"
        )
    return (
        f"warning: listening on {host!r}, reachable from other machines; WebSocket clients need "
        "the token, TCP clients need nothing: prefer a WebSocket or an SSH tunnel"
    )


# -- the per-user token --------------------------------------------------------------------------
def token_path() -> Path:
    """$SPARK_LSP_TOKEN_FILE, else $XDG_RUNTIME_DIR/spark-lsp/token, else ~/.cache/spark-lsp/token."""
    if os.environ.get(TOKEN_ENV):
        return Path(os.environ[TOKEN_ENV])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime and os.path.isdir(runtime) else Path.home() / ".cache"
    return base / "spark-lsp" / "token"


class TokenError(RuntimeError):
    """The token file cannot be made private to the user."""


def load_token(path: Path | None = None) -> str:
    """The user's token, created (random, 0600, in a 0700 folder) on first use. A token file that
    other users could read or that belongs to someone else is replaced (or refused)."""
    path = Path(path or token_path())
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        st = path.stat()
    except FileNotFoundError:
        st = None
    if st is not None:
        if st.st_uid != os.getuid():
            raise TokenError(f"{path} belongs to another user; remove it or set {TOKEN_ENV}")
        if stat.S_IMODE(st.st_mode) & 0o077:
            log.warning("%s was readable by other users; replacing the token", path)
            path.unlink()
        else:
            token = path.read_text(encoding="ascii", errors="replace").strip()
            if len(token) >= 32:
                return token
            path.unlink()
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, token.encode("ascii") + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def request_token(path: str, headers: Any) -> str | None:
    """The token a WebSocket handshake carries: `Authorization: Bearer T` or `?token=T`."""
    auth = headers.get("Authorization") or ""
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    values = parse_qs(urlsplit(path).query).get("token")
    return values[0] if values else None


# -- servers -------------------------------------------------------------------------------------
async def run_stream_session(session: Session, reader: asyncio.StreamReader, peer: Any) -> None:
    """Feed a byte stream's LSP messages (Content-Length framed) to `session` until the peer
    closes, sends `exit`, or sends a stream that is not LSP (logged; the caller closes)."""
    framer = Framer(strict=True)
    try:
        while not session.exited:
            data = await reader.read(65536)
            if not data:
                break
            for item in framer.feed(data):
                if isinstance(item, str):
                    session.problem(item)
                else:
                    session.deliver(item)
                    if session.exited:
                        break
    except FramingError as exc:
        log.warning("closed %s: %s", peer, exc)
    except (ConnectionError, OSError) as exc:
        log.info("connection from %s lost: %s", peer, exc)


async def serve_tcp(
    factory: Callable[[], Any],
    host: str,
    port: int,
    *,
    max_sessions: int = MAX_SESSIONS,
    ready: Callable[[list], None] | None = None,
) -> None:
    """Serve LSP over TCP until cancelled: each connection is its own session."""
    limit = SessionLimit(max_sessions)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if not limit.take():
            log.warning("refused %s: already %d sessions", peer, limit.limit)
            writer.close()
            return
        session = Session(factory, writer, include_headers=True)
        log.info("session opened for %s", peer)
        try:
            await run_stream_session(session, reader, peer)
        finally:
            session.close()
            limit.give()
            writer.close()
            log.info("session closed for %s", peer)

    server = await asyncio.start_server(connection, host, port, limit=MAX_HEADER)
    if ready is not None:
        ready([s.getsockname() for s in server.sockets])
    async with server:
        await server.serve_forever()


async def serve_ws(
    factory: Callable[[], Any],
    host: str,
    port: int,
    *,
    token: str | None,
    allowed_origins: Sequence[str] = (),
    max_sessions: int = MAX_SESSIONS,
    ready: Callable[[list], None] | None = None,
) -> None:
    """Serve LSP over WebSocket until cancelled: each connection is its own session. A handshake
    with a browser `Origin` not in `allowed_origins`, or without `token`, is refused with 403."""
    from http import HTTPStatus

    from websockets.asyncio.server import serve
    from websockets.exceptions import ConnectionClosed

    limit = SessionLimit(max_sessions)
    origins = {o.rstrip("/") for o in allowed_origins}

    def check(connection, request):
        origin = request.headers.get("Origin")
        if origin is not None and origin.rstrip("/") not in origins:
            log.warning("refused a WebSocket from origin %r", origin)
            return connection.respond(
                HTTPStatus.FORBIDDEN,
                "spark-lsp: browser origins are refused (start the server with --allow-origin)\n",
            )
        if token is not None:
            given = request_token(request.path, request.headers)
            if given is None or not hmac.compare_digest(given.encode(), token.encode()):
                log.warning("refused a WebSocket without the right token")
                return connection.respond(
                    HTTPStatus.FORBIDDEN,
                    f"spark-lsp: missing or wrong token (see {token_path()})\n",
                )
        return None

    async def connection(ws) -> None:
        if not limit.take():
            await ws.close(1013, f"spark-lsp: already {limit.limit} sessions")
            return
        from pygls.io_ import WebSocketWriter

        session = Session(factory, WebSocketWriter(ws), include_headers=False)
        try:
            while not session.exited:
                try:
                    data = await ws.recv(decode=False)
                except ConnectionClosed:
                    break
                session.deliver(data)
        finally:
            session.close()
            limit.give()
            await ws.close()

    async with serve(
        connection,
        host,
        port,
        process_request=check,
        max_size=MAX_BODY,
        compression=None,
    ) as server:
        if ready is not None:
            ready([s.getsockname() for s in server.sockets])
        await server.serve_forever()


async def until_signalled(main) -> None:
    """Run a server coroutine until SIGTERM or SIGINT; then every session is closed (its
    generations cancelled) before the process exits."""
    import signal

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main)
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, task.cancel)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    try:
        await task
    except asyncio.CancelledError:
        log.warning("stopping: closing every session")
