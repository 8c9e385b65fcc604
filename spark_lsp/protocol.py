"""Every change spark-lsp makes to pygls' behaviour, in one place, each with the reason it exists.

pygls is the JSON-RPC and LSP layer. Where its behaviour falls short of the protocol or of an
interactive server, the fix is here, and only here (several reach into pygls' private names, so a
pygls upgrade is checked against this module alone):

1. `LspTextDocument` / `LspWorkspace`: LSP line breaks in the server's document copies.
2. `SparkProtocol.structure_message` / `handle_message`: malformed params get -32602 by id.
3. `SparkProtocol._send_handler_result`: the services' errors become JSON-RPC errors (one mapping).
4. `SparkProtocol._execute_handler`: `$/cancelRequest` reaches a command's inner task.
5. `SparkProtocol._handle_cancel_notification`: a request cancelled before it started is counted.
6. `SparkLanguageServer.start_io`: one stdin reader thread instead of three pool hops a message.
7. `SparkLanguageServer.report_server_error`: unparsable JSON gets -32700 with a null id.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import os
import sys
import threading
from typing import Any

import attrs
from cattrs import transform_error
from lsprotocol import types as T
from pygls.exceptions import FeatureRequestError, JsonRpcException, JsonRpcInvalidParams
from pygls.io_ import StdoutWriter
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.workspace import TextDocument, Workspace

from engine.cancel import Cancelled

from .documents import lsp_lines
from .errors import RequestCancelled, SparkError

log = logging.getLogger("spark_lsp")


# -- 1. documents with LSP line breaks ------------------------------------------------------------
class LspTextDocument(TextDocument):
    """pygls' document with LSP line breaks: pygls splits with str.splitlines, which also breaks at
    \\f, \\v, \\x1c-\\x1e, \\x85, \\u2028 and \\u2029, so an incremental change after one of those
    would land on the wrong line and the server's copy would drift from the editor's."""

    @property
    def lines(self):
        return tuple(lsp_lines(self.source))


class LspWorkspace(Workspace):
    """A workspace whose text documents are LspTextDocuments (pygls has no hook for the class)."""

    def _create_text_document(self, doc_uri, source=None, version=None, language_id=None):
        return LspTextDocument(
            doc_uri,
            source=source,
            version=version,
            language_id=language_id,
            sync_kind=self._sync_kind,
            position_codec=self._position_codec,
        )


@attrs.define
class _BadMessage:
    """A request whose params failed to deserialise; answered with InvalidParams by id."""

    id: Any
    method: str
    message: str
    jsonrpc: str = "2.0"


def to_jsonrpc(exc: BaseException) -> JsonRpcException | None:
    """The JSON-RPC error for a service's error (a stopped generation is -32800), else None."""
    if isinstance(exc, SparkError):
        return JsonRpcException(message=str(exc), code=exc.code)
    if isinstance(exc, Cancelled):
        return JsonRpcException(message=f"cancelled: {exc}", code=RequestCancelled.code)
    return None


class SparkProtocol(LanguageServerProtocol):
    @property
    def _workspace(self):
        return self.__dict__.get("_spark_workspace")

    @_workspace.setter
    def _workspace(self, ws) -> None:
        # 1. pygls builds its Workspace inside `initialize`: make it create LspTextDocuments
        if type(ws) is Workspace:
            ws.__class__ = LspWorkspace
        self.__dict__["_spark_workspace"] = ws

    def structure_message(self, data: dict[str, Any]):
        """2. pygls drops a request whose params do not deserialise (the client waits forever);
        keep its id so `handle_message` answers -32602 naming what was wrong."""
        try:
            return super().structure_message(data)
        except JsonRpcException as exc:
            if not (isinstance(data, dict) and "id" in data and "method" in data):
                raise
            detail = _params_error(exc.__cause__)
            return _BadMessage(
                data["id"],
                str(data["method"]),
                f"invalid params for {data['method']}: {detail or exc}",
            )

    def handle_message(self, message):
        if isinstance(message, _BadMessage):
            self._send_response(
                message.id, error=JsonRpcInvalidParams(message.message).to_response_error()
            )
            return
        return super().handle_message(message)

    def _send_handler_result(self, future, *, msg_id):
        """3. pygls answers any exception that is not its own with -32603 and a traceback; the
        services raise `spark_lsp.errors` (and `Cancelled`), mapped here to their codes."""
        exc = None if future.cancelled() else future.exception()
        error = to_jsonrpc(exc) if exc is not None else None
        if error is None:
            return super()._send_handler_result(future, msg_id=msg_id)
        self._request_futures.pop(msg_id, None)
        log.debug("request %s: %s", msg_id, error.message)
        self._send_response(msg_id, error=error.to_response_error())

    def _execute_handler(self, msg_id, handler, callback, args=None, kwargs=None):
        """4. pygls runs a command (and other built-in generator features) as an inner task under a
        fresh id, so `$/cancelRequest` for the request only cancels the outer future and the work
        goes on. Link them: cancelling the request cancels the inner task (the engine stops)."""
        super()._execute_handler(msg_id, handler, callback, args, kwargs)
        outer = (
            callback.keywords.get("result_future")
            if isinstance(callback, functools.partial)
            else None
        )
        inner = self._request_futures.get(msg_id)
        if outer is not None and inner is not None:
            outer.add_done_callback(lambda f: f.cancelled() and inner.cancel())
            inner.add_done_callback(lambda f: self._request_futures.pop(msg_id, None))

    def _handle_cancel_notification(self, msg_id):
        """5. A request cancelled before its handler started never runs, so it cannot count itself
        (a started one counts itself where it catches the cancellation): count it here."""
        future = self._request_futures.get(msg_id)
        not_started = future is not None and not future.done() and _not_started(future)
        super()._handle_cancel_notification(msg_id)
        if not_started and (future.cancelled() or getattr(future, "cancelling", lambda: 0)()):
            on_cancelled = getattr(self._server, "request_cancelled_before_start", None)
            if on_cancelled is not None:
                on_cancelled()


def _params_error(cause: BaseException | None) -> str:
    """cattrs' description of what failed to deserialise."""
    if cause is None:
        return ""
    try:
        return "; ".join(transform_error(cause))
    except Exception:
        return str(cause)


def _not_started(future) -> bool:
    """Whether a request's future has not begun running its handler (a task whose coroutine has
    not run yet, or a thread-pool future still queued)."""
    get_coro = getattr(future, "get_coro", None)
    if get_coro is not None:
        coro = get_coro()
        return inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED
    running = getattr(future, "running", None)
    return running is not None and not running()


class SparkLanguageServer(LanguageServer):
    """pygls' LanguageServer with SparkProtocol, the one-thread stdio reader and parse errors."""

    def request_cancelled_before_start(self) -> None:
        """Called when `$/cancelRequest` cancels a request whose handler never started."""

    def start_io(self, stdin=None, stdout=None) -> None:
        """6. Serve over stdio with one reader thread that hands whole messages to the event loop.

        pygls' own stdio reader hops through its thread pool for every header line and body
        (three hops a message); on a busy 2-core machine each hop can cost milliseconds, and an
        editor sends two messages per keystroke. One blocking reader thread costs one hop."""
        self._stop_event = threading.Event()
        self.protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
        try:
            asyncio.run(self._serve_stream(stdin or sys.stdin.buffer))
        except BrokenPipeError:
            log.error("the client closed the connection")
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            self.shutdown()

    def _feed(self, body: bytes) -> None:
        try:
            message = json.loads(body, object_hook=self.protocol.structure_message)
            self.protocol.handle_message(message)
        except (SystemExit, KeyboardInterrupt):
            raise
        except Exception as exc:
            log.exception("unable to handle message")
            self._report_server_error(exc, JsonRpcException)

    async def _serve_stream(self, inp) -> None:
        loop = asyncio.get_running_loop()
        closed = loop.create_future()

        def reader() -> None:
            try:
                for body in _read_messages(inp, self._stop_event):
                    loop.call_soon_threadsafe(self._feed, body)
            except (OSError, ValueError):
                return
            finally:
                loop.call_soon_threadsafe(lambda: closed.done() or closed.set_result(None))

        threading.Thread(target=reader, name="spark-stdin", daemon=True).start()
        await closed

    def report_server_error(self, error: Exception, source) -> None:
        """7. Out-of-band errors (unparsable JSON, failed notifications): a log line, and for a
        parse error a -32700 response with a null id, as JSON-RPC prescribes (pygls sends none)."""
        if source is FeatureRequestError:
            return  # the request already got its error response
        cause = error.__cause__ or error.__context__
        if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)) or isinstance(
            cause, json.JSONDecodeError
        ):
            try:
                self.protocol._send_data(
                    {
                        "jsonrpc": "2.0",
                        "id": None,
                        "error": {"code": -32700, "message": f"Parse error: {error}"},
                    }
                )
            except Exception:
                pass
        log.error("error: %s", error)
        try:
            self.window_log_message(
                T.LogMessageParams(type=T.MessageType.Error, message=f"error: {error}")
            )
        except Exception:
            pass


def _read_messages(inp, stop: threading.Event):
    """The bodies of the Content-Length framed messages on `inp`, until it closes or `stop`."""
    # os.read on the descriptor, not the buffered stdin object: a daemon thread blocked inside a
    # BufferedReader aborts the interpreter at exit
    try:
        fd = inp.fileno()
        read = functools.partial(os.read, fd, 65536)
    except (AttributeError, OSError, ValueError):
        read = functools.partial(inp.read1 if hasattr(inp, "read1") else inp.read, 65536)
    buf = b""
    while not stop.is_set():
        head_end = buf.find(b"\r\n\r\n")
        if head_end < 0:
            chunk = read()
            if not chunk:
                return
            buf += chunk
            continue
        length = _content_length(buf[:head_end])
        if length is None:  # a header block without a length: skip it
            buf = buf[head_end + 4 :]
            continue
        while len(buf) < head_end + 4 + length:
            chunk = read()
            if not chunk:
                return
            buf += chunk
        yield buf[head_end + 4 : head_end + 4 + length]
        buf = buf[head_end + 4 + length :]


def _content_length(head: bytes) -> int | None:
    length = None
    for line in head.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            try:
                length = int(value.strip())
            except ValueError:
                length = None
    return length
