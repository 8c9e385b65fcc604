"""The session host: one process per user that runs every editor's language-server session, the
sessions sharing one engine per model (`model_host.SharedModels`).

Editors start `spark-lsp serve --stdio --shared`, a tiny bridge (`spark_lsp.bridge`) that
connects here over a Unix socket in the user's runtime directory and hands over the editor's stdin
and stdout (`SCM_RIGHTS`; the host then reads and writes the editor's pipes itself, with no
process relaying between them, and tells the waiting bridge its exit status at the end), or, where
its stdio is not a pipe, copies the editor's bytes over the socket. Each connection is one full
session of the same server `serve --stdio` runs (`create_server`, fed as the TCP transport feeds
its sessions: `transports.run_stream_session`), so every feature is the same; its own documents,
settings, engine thread and responses. Sessions that configure
the same model (folder and precision) share one `LocalModel` (weights, KV cache pool, tokenizer);
one that configures another model gets its own; `engine: auto` / `ws://` sessions use a daemon as
they would from `serve --stdio`.

Access: the socket lives in the 0700 runtime directory, its peer must be this user (SO_PEERCRED),
and the first line a bridge sends must carry the random token of the host's 0600 record
(`lsp-host-KEY.json`, KEY naming this installation: `bridge.install_key`), as the engine daemon's clients present its token. A session that sends garbage
or fails is closed alone; a session's close frees its documents, its KV slots and, if it was the
last to use it, its model. The host exits (record and socket removed) `--idle-exit` seconds after
its last session closes, and on SIGTERM (every session's generations cancelled first).

`python -m spark_lsp.session_host [--idle-exit S]`: what a bridge starts, detached.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import hmac
import itertools
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from engine.service import rundir
from engine.service.options import SPINNING

from . import __version__, bridge, model_host, transports
from .framing import MAX_HEADER
from .status import WaferProjector

log = logging.getLogger("spark_lsp.session_host")

#: Seconds the host stays up with no session (the next editor then finds it loaded).
IDLE_EXIT_S = 600.0
IDLE_ENV = "SPARK_LSP_HOST_IDLE_EXIT"
SPINNING_ENV = "SPARK_LSP_HOST_SPINNING"
HELLO_TIMEOUT_S = 10.0
#: How long a closing session waits for the editor to read what was written to it.
FLUSH_TIMEOUT_S = 5.0
#: What the log says of a session opened on the editor's own stdio (the editor tests look for it).
HANDED_OVER = "the editor's stdio handed over"
#: The longest Unix socket path (sun_path holds 108 bytes with its terminating NUL).
MAX_SOCKET_PATH = 107


class HostError(RuntimeError):
    """The host cannot serve (its socket path is too long, another host holds the lock)."""


class SessionHost:
    """Accepts bridge connections and runs one language-server session per connection."""

    def __init__(self, folder: Path, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self.folder = folder
        self.idle_exit_s = idle_exit_s
        self.socket_path = folder / bridge.SOCKET
        self.record_path = folder / bridge.RECORD
        self.token = rundir.new_token()
        self.sessions: dict[int, transports.Session] = {}
        self.opened = 0  # sessions since the start
        self.handshakes = 0  # connections between accept and their session
        self.last_active = time.monotonic()
        self.stop = asyncio.Event()
        self._ids = itertools.count(1)
        self._life: Any = None
        self._converter: Any = None  # one LSP converter for every session (see create_server)
        self._wafer = WaferProjector()

    # -- life ------------------------------------------------------------------------------------
    def claim(self) -> None:
        """Take the host's lifetime lock; HostError when another host holds it."""
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise HostError(
                f"the socket path {self.socket_path} is longer than a Unix socket allows; "
                f"set {bridge.ENV_DIR} to a shorter folder"
            )
        life = open(self.folder / bridge.LIFE_LOCK, "w")
        try:
            fcntl.flock(life, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            life.close()
            raise HostError("another session host is running") from None
        self._life = life

    async def serve(self) -> None:
        """Serve until SIGTERM/SIGINT or `idle_exit_s` with no session, then close everything."""
        self.claim()
        try:
            self.socket_path.unlink()  # a dead host's (we hold the lifetime lock)
        except FileNotFoundError:
            pass
        old = os.umask(0o077)
        try:
            server = await asyncio.start_unix_server(
                self.connection, path=str(self.socket_path), limit=MAX_HEADER
            )
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        rundir.write_private(
            self.record_path,
            json.dumps(
                {
                    "socket": str(self.socket_path),
                    "token": self.token,
                    "pid": os.getpid(),
                    # the process's start: `engine stop` signals the pid only while it is this
                    "started": rundir.process_start(os.getpid()),
                    "since": time.time(),
                    "protocol": bridge.PROTOCOL,
                    "version": __version__,
                },
                indent=1,
            ),
        )
        log.info("session host %d serving on %s", os.getpid(), self.socket_path)
        # the idle clock starts now, not at construction: the bridge that started this host
        # connects once it sees the record, which on a busy machine can take a while
        self.last_active = time.monotonic()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        idle = asyncio.ensure_future(self._idle_watch())
        try:
            await self.stop.wait()
        finally:
            idle.cancel()
            self._remove_record()  # a bridge from now on starts a new host
            server.close()
            for n, session in list(self.sessions.items()):
                log.info("closing session %d", n)
                session.close()
            self.sessions.clear()
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass
            log.info("session host %d stopped", os.getpid())

    def _remove_record(self) -> None:
        try:
            if json.loads(self.record_path.read_text()).get("pid") == os.getpid():
                self.record_path.unlink()
        except (OSError, ValueError):
            pass

    async def _idle_watch(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(min(1.0, self.idle_exit_s))
            if self.sessions or self.handshakes:
                self.last_active = time.monotonic()
            elif time.monotonic() - self.last_active >= self.idle_exit_s:
                log.info("no session for %.0f s: exiting", self.idle_exit_s)
                self._remove_record()  # before the listener closes: no bridge is left waiting
                self.stop.set()

    # -- sessions --------------------------------------------------------------------------------
    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        try:
            opened = await self._hello(reader, writer)
        finally:
            self.handshakes -= 1
        if opened is None:
            writer.close()
            return
        n, session, stdio = opened
        status: int | None = None
        try:
            if stdio is None:
                await transports.run_stream_session(session, reader, f"session {n}")
            else:
                status = await self._run_handed_off(n, session, reader, stdio.reader)
        except Exception:  # a session's failure ends that session only
            log.exception("session %d failed", n)
        finally:
            try:
                session.close()  # its generations stop, its model and KV slots are given back
            finally:  # counted until then: `sessions` never runs ahead of the models' `sharedBy`
                self.sessions.pop(n, None)
            if stdio is not None:
                await self._end_handed_off(writer, stdio, status)
            writer.close()
            self.last_active = time.monotonic()
            model_host.settle_heap()  # the closed session's objects are collected, not frozen
            log.info("session %d closed (%d open)", n, len(self.sessions))

    async def _run_handed_off(
        self,
        n: int,
        session: transports.Session,
        control: asyncio.StreamReader,
        editor: asyncio.StreamReader,
    ) -> int | None:
        """Run a session on the editor's own stdin until the editor ends it (its exit status:
        `exit`'s, or at the end of its input 0 after `shutdown`, else 1, as `serve --stdio`),
        its waiting bridge goes away (-1: nobody to tell) or the host closes it (None)."""
        run = asyncio.ensure_future(transports.run_stream_session(session, editor, f"session {n}"))
        gone = asyncio.ensure_future(control.read(1))  # the waiter sends nothing: EOF = gone
        try:
            await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (run, gone):
                task.cancel()
        if gone.done() and not gone.cancelled():
            return -1
        run.result()  # a session's failure is logged by the caller
        ls = session.ls
        if session.exited and ls.exit_code is not None:
            return ls.exit_code
        if editor.at_eof():
            return ls.ending_code()
        return None  # a stream that is not LSP: closed by the host

    async def _end_handed_off(
        self, control: asyncio.StreamWriter, stdio: EditorStdio, status: int | None
    ) -> None:
        """Finish a handed-off session: the editor gets every byte written to it (and, when the
        host closed the session, a message saying so), then the bridge its exit status."""
        stdio.inbound.close()
        out = stdio.writer
        if status is None:
            what = "closed this editor's session"
            out.write(bridge.host_notice(os.getpid(), what, str(self.folder))[0])
            status = 1
        out.close()
        try:
            await asyncio.wait_for(asyncio.shield(stdio.outbound.closed), FLUSH_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError):
            pass  # an editor that stopped reading: its pipe is closed with what it did not read
        if status >= 0:
            control.write(b"%d\n" % status)
            try:
                await asyncio.wait_for(control.drain(), FLUSH_TIMEOUT_S)
            except (asyncio.TimeoutError, OSError):
                pass

    async def _hello(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int, transports.Session, EditorStdio | None] | None:
        """Check the connection and its hello line; the new session and, when the bridge handed
        over the editor's stdio, its streams; None when refused."""

        def refuse(why: str) -> None:
            log.warning("refused a connection: %s", why)
            writer.write(json.dumps({"ok": False, "error": why}).encode() + b"\n")

        uid = peer_uid(writer.get_extra_info("socket"))
        if uid is not None and uid != os.getuid():
            refuse(f"uid {uid} is not this host's user")
            return None
        try:
            line = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
            hello = json.loads(line)
        except (asyncio.TimeoutError, ValueError, ConnectionError, asyncio.LimitOverrunError):
            refuse("no hello line")
            return None
        if not isinstance(hello, dict):
            refuse("the hello is not an object")
            return None
        token = hello.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(
            token.encode(), self.token.encode()
        ):
            refuse("wrong token")
            return None
        if hello.get("protocol") != bridge.PROTOCOL:
            refuse(f"bridge protocol {hello.get('protocol')!r}, this host speaks {bridge.PROTOCOL}")
            return None
        if hello.get("status") is True:  # `spark-lsp engine list`: what it serves, no session
            writer.write(json.dumps({"ok": True, "status": self.status()}).encode() + b"\n")
            return None
        model, engine = hello.get("model"), hello.get("engine")
        try:
            if not isinstance(model, (str, type(None))) or not isinstance(
                engine, (str, type(None))
            ):
                raise model_host.BadModel("model and engine must be strings")
            model = model_host.model_argument(model)
        except model_host.BadModel as exc:
            refuse(str(exc))
            return None
        n = next(self._ids)
        try:
            session = transports.Session(
                lambda: self._server(model, engine), writer, include_headers=True, trusted=True
            )
        except Exception as exc:  # noqa: BLE001 - told to the bridge, the host goes on
            log.exception("cannot start session %d", n)
            refuse(f"cannot start a session: {type(exc).__name__}: {exc}")
            return None
        session.ls.state.host_info = lambda: self.info(n)
        handoff = hello.get("handoff") is True and hasattr(socket, "recv_fds")
        if handoff:  # the bridge's next byte carries its stdio: the transport must not read it
            writer.transport.pause_reading()
        answer = {"ok": True, "pid": os.getpid(), "session": n, "handoff": handoff}
        writer.write(json.dumps(answer).encode() + b"\n")
        stdio = None
        if handoff:
            try:
                stdio = await take_stdio(writer.get_extra_info("socket"), HELLO_TIMEOUT_S)
            except (OSError, ValueError, asyncio.TimeoutError) as exc:
                log.warning("session %d: no stdio from its bridge: %s", n, exc)
                session.close()
                return None
            session.ls.protocol.set_writer(stdio.writer, include_headers=True)
            writer.transport.resume_reading()  # from now on only the bridge's end: EOF
        self.sessions[n] = session
        self.opened += 1
        log.info(
            "session %d opened (model %s, engine %s%s)",
            n,
            model or "default",
            engine,
            f", {HANDED_OVER}" if stdio else "",
        )
        return n, session, stdio

    def _server(self, model: str | None, engine: str | None) -> Any:
        from pygls.protocol import default_converter

        from .server import create_server

        if self._converter is None:
            self._converter = default_converter()
        ls = create_server(model, engine, lambda: self._converter)
        ls.state.wafer = self._wafer  # a model's projection is computed once, not per session
        return ls

    def status(self) -> dict:
        """What `spark-lsp engine list` shows of the host: its sessions and shared models."""
        shared = model_host.SHARED
        runs: dict[str, int] = {}  # where the sessions' models run (`Model.where`): how many
        for session in list(self.sessions.values()):
            model = session.ls.state.host.model
            where = getattr(model, "where", None) if model is not None else "loading"
            runs[str(where)] = runs.get(str(where), 0) + 1
        return {
            "pid": os.getpid(),
            "version": __version__,
            "sessions": len(self.sessions),
            "opened": self.opened,
            "models": shared.describe() if shared is not None else [],
            "runs": runs,
        }

    def info(self, n: int) -> dict:
        """What `spark/metrics` shows of the host in session `n`."""
        shared = model_host.SHARED
        return {
            "pid": os.getpid(),
            "session": n,
            "sessions": len(self.sessions),
            "models": shared.describe() if shared is not None else [],
        }


class _PipeWriter(asyncio.streams.FlowControlMixin):
    """The protocol of a `StreamWriter` on the editor's stdout pipe: flow control (`drain`), and
    `closed`, done once the pipe's buffered bytes are written and it is closed (or broken)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self.closed.done():
            self.closed.set_result(None)


class EditorStdio(NamedTuple):
    """A handed-over editor's stdin (as a stream reader and its transport) and stdout."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    inbound: asyncio.ReadTransport
    outbound: _PipeWriter


async def take_stdio(sock: Any, timeout_s: float) -> EditorStdio:
    """Receive the editor's stdin and stdout from a bridge (one byte with two descriptors over
    `sock`, the connection's socket) and open them as the session's streams."""
    loop = asyncio.get_running_loop()
    own = socket.socket(fileno=os.dup(sock.fileno()))  # asyncio's socket object has no recvmsg
    own.setblocking(False)
    got: asyncio.Future = loop.create_future()

    def ready() -> None:
        if got.done():  # readable again before the waiting coroutine ran
            return
        try:
            got.set_result(socket.recv_fds(own, 1, 2))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            got.set_exception(exc)

    loop.add_reader(own.fileno(), ready)
    try:
        _, fds, _, _ = await asyncio.wait_for(got, timeout_s)
    finally:
        loop.remove_reader(own.fileno())
        own.close()
    for fd in fds:
        os.set_inheritable(fd, False)  # never into a daemon the host starts
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected the editor's stdin and stdout, got {len(fds)} descriptors")
    inp = os.fdopen(fds[0], "rb", buffering=0)
    out = os.fdopen(fds[1], "wb", buffering=0)
    reader = asyncio.StreamReader(limit=MAX_HEADER)
    inbound = None
    try:
        inbound, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), inp)
        transport, protocol = await loop.connect_write_pipe(_PipeWriter, out)
    except BaseException:  # e.g. a descriptor that is not a pipe or a socket (ValueError)
        if inbound is not None:
            inbound.close()
        else:
            inp.close()
        out.close()
        raise
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    return EditorStdio(reader, writer, inbound, protocol)


def peer_uid(sock: socket.socket | None) -> int | None:
    """The uid of a Unix socket's peer (None where the platform cannot say)."""
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return struct.unpack("3i", creds)[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spark_lsp.session_host", description=__doc__)
    p.add_argument(
        "--idle-exit",
        type=float,
        default=float(os.environ.get(IDLE_ENV) or IDLE_EXIT_S),
        metavar="SECONDS",
        help=f"exit this long after the last session closes (default {IDLE_EXIT_S:g}, ${IDLE_ENV})",
    )
    p.add_argument(
        "--spinning",
        choices=sorted(SPINNING),
        default=os.environ.get(SPINNING_ENV) or "off",
        help="ONNX Runtime threads spin between steps: off (default: the editors' bridges need "
        f"the cores to pass messages), on, or auto (while the CPU is calm); ${SPINNING_ENV}",
    )
    p.add_argument(
        "--log-level",
        default=os.environ.get("SPARK_LSP_LOG", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
    )
    args = p.parse_args(argv)
    from .server import configure_process  # pygls and the server, once the arguments are good

    # the bridge points stderr at lsp-host.log
    configure_process(logging.StreamHandler(sys.stderr), args.log_level)
    model_host.SHARED = model_host.SharedModels(spinning=SPINNING[args.spinning])
    host = SessionHost(Path(bridge.runtime_dir()), args.idle_exit)
    try:
        asyncio.run(host.serve())
    except HostError as exc:
        print(f"spark-lsp session host: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
