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
8. `LspTextDocument._apply_incremental_change` / `LspWorkspace.update_text_document` /
   `SparkProtocol.lsp_text_document__did_change`: change ranges read as the specification says
   (clamped, logged), in the negotiated encoding, without splitting the whole document each
   keystroke; changes to unopened documents or with stale versions are logged, not crashes.
9. `SparkProtocol.lsp_exit`: `exit` ends the session with 0 after `shutdown`, else 1, through the
   server's `on_exit` (pygls calls sys.exit inside the event loop, which a network transport with
   several sessions cannot allow).
10. `SparkLanguageServer._feed`: a batch or a JSON value that is not a message gets -32600.
11. `SparkLanguageServer._serve_stream`: SIGTERM and the death of the editor's process (the
   `processId` of `initialize`) end the server cleanly, generations cancelled.
12. `SparkProtocol.handle_message`: requests before `initialize` get -32002, a second
   `initialize` or a request after `shutdown` -32600, notifications before `initialize` dropped.
13. `SparkProtocol._execute_handler`: a finished notification handler is forgotten (pygls keeps
   every one, so memory grew with each keystroke).
14. `SparkProtocol.structure_message`: a lone surrogate (JSON may escape one, `"\\ud800"`; a
   JavaScript string can hold one) becomes U+FFFD (`engine.wire_text`): a document holding one
   failed every completion with an internal error.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

import attrs
from cattrs import transform_error
from lsprotocol import types as T
from pygls.exceptions import FeatureRequestError, JsonRpcException, JsonRpcInvalidParams
from pygls.io_ import StdoutWriter
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol, lsp_method
from pygls.workspace import TextDocument, Workspace

from engine import wire_text
from engine.cancel import Cancelled

from .documents import PositionError, apply_change, lsp_lines
from .errors import RequestCancelled, SparkError
from .framing import Framer, not_a_message

log = logging.getLogger("spark_lsp")


# -- 1. documents with LSP line breaks ------------------------------------------------------------
class LspTextDocument(TextDocument):
    """pygls' document with LSP line breaks: pygls splits with str.splitlines, which also breaks at
    \\f, \\v, \\x1c-\\x1e, \\x85, \\u2028 and \\u2029, so an incremental change after one of those
    would land on the wrong line and the server's copy would drift from the editor's."""

    @property
    def lines(self):
        return tuple(lsp_lines(self.source))

    def _apply_incremental_change(self, change) -> None:
        """8. pygls cuts a line at a character past its end *after* the line break (the insertion
        lands on the next line) and splits the whole document into lines each change."""
        enc = getattr(self._position_codec, "encoding", None) or "utf-16"
        enc = str(getattr(enc, "value", enc))
        rng = change.range
        try:
            self._source, lenient = apply_change(self.source, rng.start, rng.end, change.text, enc)
        except PositionError as exc:
            raise JsonRpcInvalidParams(f"didChange for {self.uri}: {exc}") from None
        if lenient:
            log.info(
                "didChange for %s: range %s-%s lies outside the document; read as the "
                "specification says (clamped)",
                self.uri,
                (rng.start.line, rng.start.character),
                (rng.end.line, rng.end.character),
            )


class LspWorkspace(Workspace):
    """A workspace whose text documents are LspTextDocuments (pygls has no hook for the class)."""

    def update_text_document(self, text_doc, change) -> None:
        """8. A change to a document that is not open is logged and dropped (pygls raises
        KeyError). Stale versions are checked once per notification, in `SparkProtocol`."""
        if text_doc.uri not in self.text_documents:
            log.warning("didChange for %s, which is not open: ignored", text_doc.uri)
            return
        super().update_text_document(text_doc, change)

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
    code: int = JsonRpcInvalidParams.CODE


def to_jsonrpc(exc: BaseException) -> JsonRpcException | None:
    """The JSON-RPC error for a service's error (a stopped generation is -32800), else None."""
    if isinstance(exc, SparkError):
        return JsonRpcException(message=str(exc), code=exc.code)
    if isinstance(exc, Cancelled):
        return JsonRpcException(message=f"cancelled: {exc}", code=RequestCancelled.code)
    return None


class SparkProtocol(LanguageServerProtocol):
    bad_position: str | None = None  # see structure_message
    surrogates = False  # the message being parsed escapes a surrogate (see structure_message)

    # pygls memoises these two in a class-wide lru_cache keyed by (protocol, method), which keeps
    # up to 128 (protocol, method) pairs, and so closed sessions with their documents, alive in a
    # process that runs many sessions (the session host, the TCP transport); a dict lookup needs
    # no cache
    def get_message_type(self, method: str) -> Any:
        return T.METHOD_TO_TYPES.get(method, (None,))[0]

    def get_result_type(self, method: str) -> Any:
        return T.METHOD_TO_TYPES.get(method, (None, None))[1]

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
        keep its id so `handle_message` answers -32602 naming what was wrong. A position whose
        line or character is not a non-negative integer is invalid too (cattrs would truncate
        1.5 to 1); json.loads calls this for inner objects first, so a bad one is remembered
        until its message is built. 14. Lone surrogates in its strings become U+FFFD."""
        if self.surrogates:
            data = wire_text.clean(data)
        if "jsonrpc" not in data:
            if len(data) == 2 and "line" in data and "character" in data:
                for v in data.values():
                    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                        self.bad_position = f"position {data} needs non-negative integers"
            return data
        bad, self.bad_position = self.bad_position, None
        if bad is not None and "id" in data and "method" in data:
            return _BadMessage(data["id"], str(data["method"]), f"invalid params: {bad}")
        try:
            return super().structure_message(data)
        except JsonRpcException as exc:
            if not (isinstance(data, dict) and "id" in data and "method" in data):
                raise
            if data.get("jsonrpc") != "2.0":
                return _BadMessage(
                    data["id"],
                    str(data["method"]),
                    'Invalid Request: jsonrpc must be "2.0"',
                    code=-32600,
                )
            detail = _params_error(exc.__cause__)
            return _BadMessage(
                data["id"],
                str(data["method"]),
                f"invalid params for {data['method']}: {detail or exc}",
            )

    def handle_message(self, message):
        if isinstance(message, _BadMessage):
            error = JsonRpcException(code=message.code, message=message.message)
            self._send_response(message.id, error=error.to_response_error())
            return
        refusal = self._refusal(message)
        if refusal is not None:
            code, text = refusal
            self._send_response(
                message.id, error=JsonRpcException(code=code, message=text).to_response_error()
            )
            return
        if getattr(message, "method", None) is not None and not self._may_handle(message):
            return
        return super().handle_message(message)

    def _refusal(self, message) -> tuple[int, str] | None:
        """12. The lifecycle rules of the specification for requests (pygls drops such requests
        silently, and a client waits forever): before `initialize` -32002, a second `initialize`
        or anything after `shutdown` -32600, a message that is not JSON-RPC 2.0 -32600."""
        method = getattr(message, "method", None)
        if method is None or not hasattr(message, "id"):
            return None  # a notification or a response
        if getattr(message, "jsonrpc", None) != "2.0":
            return (-32600, 'Invalid Request: jsonrpc must be "2.0"')
        if self._shutdown:
            return (-32600, f"{method}: the server is shutting down (shutdown was received)")
        initialized = self.__dict__.get("_spark_workspace") is not None
        if method == T.INITIALIZE:
            return (-32600, "initialize was already received") if initialized else None
        if not initialized:
            return (-32002, f"{method}: the server is not initialized (send initialize first)")
        return None

    def _may_handle(self, message) -> bool:
        """12. Notifications before `initialize` are dropped (except `exit`), as the specification
        says; pygls would act on them against a workspace that does not exist yet."""
        method = message.method
        if hasattr(message, "id") or method == T.EXIT:
            return True
        if self.__dict__.get("_spark_workspace") is None:
            log.warning("notification %s before initialize: dropped", method)
            return False
        return True

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
        if inner is not None:
            # 13. pygls files every notification's handler under a fresh id and never removes
            # it (only responses remove theirs): one future and its params per keystroke, kept
            # for the life of the server. Forget each one when it is done.
            inner.add_done_callback(lambda f: self._forget(msg_id, f))

    def _forget(self, msg_id, future) -> None:
        if self._request_futures.get(msg_id) is future:
            del self._request_futures[msg_id]

    @lsp_method(T.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: T.DidChangeTextDocumentParams):
        """8. A notification whose version does not move forward is logged and applied (the
        editor's text is the truth); checked once per notification, before pygls applies its
        content changes one by one."""
        sent = params.text_document
        doc = self.workspace.text_documents.get(sent.uri)
        if (
            doc is not None
            and None not in (sent.version, doc.version)
            and sent.version <= doc.version
        ):
            log.warning(
                "didChange for %s with version %s after version %s: applied anyway",
                sent.uri,
                sent.version,
                doc.version,
            )
        yield from super().lsp_text_document__did_change(params)

    @lsp_method(T.EXIT)
    def lsp_exit(self, *args):
        """9. `exit`: 0 after `shutdown`, 1 without; the server (or its session) decides how to end."""
        self._server.exit_requested(self._server.ending_code())
        yield from ()

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

    exit_code: int | None = None  # set by `exit` (or the end of the input stream)
    on_exit: Any = None  # called with the exit code when the client ends the session

    def request_cancelled_before_start(self) -> None:
        """Called when `$/cancelRequest` cancels a request whose handler never started."""

    def ending_code(self) -> int:
        """The status a session ends with, by `exit` or at the end of its input: 0 after
        `shutdown`, else 1 (LSP)."""
        return 0 if self.protocol._shutdown else 1

    def exit_requested(self, code: int) -> None:
        """The client sent `exit` (or went away): end the session with `code`."""
        if self.exit_code is None:
            self.exit_code = code
        if self.on_exit is not None:
            self.on_exit(code)

    def stop_work(self, reason: str) -> None:
        """Cancel every request in flight and every generation (overridden by the server)."""
        for fut in list(self.protocol._request_futures.values()):
            fut.cancel()

    def wait_stopped(self, timeout: float) -> None:
        """Before the process exits: wait for work `stop_work` stopped (overridden by the server)."""

    def send_error(self, code: int, message: str) -> None:
        """An error response with a null id (to a message that has no usable id)."""
        try:
            self.protocol._send_data(
                {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}
            )
        except Exception as exc:  # noqa: BLE001 (the client may be gone)
            log.debug("could not send an error: %s", exc)

    def start_io(self, stdin=None, stdout=None) -> int:
        """6. Serve over stdio with one reader thread that hands whole messages to the event loop.

        pygls' own stdio reader hops through its thread pool for every header line and body
        (three hops a message); on a busy 2-core machine each hop can cost milliseconds, and an
        editor sends two messages per keystroke. One blocking reader thread costs one hop.
        Returns the exit status: 0 after `shutdown` then `exit`, 1 when the client left without
        `shutdown`, 0 on SIGTERM or when the editor's process died."""
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
            self.wait_stopped(STOP_WAIT_S)
        return 0 if self.exit_code is None else self.exit_code

    def _feed(self, body: bytes) -> None:
        """Parse and handle one message body; nothing a client sends stops the server."""
        try:
            self.protocol.bad_position = None
            self.protocol.surrogates = wire_text.may_hold_surrogates(body)
            message = json.loads(body, object_hook=self.protocol.structure_message)
            problem = not_a_message(message)
            if problem is not None:  # 10.
                log.warning("invalid request: %s", problem)
                self.send_error(-32600, f"Invalid Request: {problem}")
                return
            self.protocol.handle_message(message)
        except (SystemExit, KeyboardInterrupt):
            raise
        except RecursionError:
            self.send_error(-32700, "Parse error: nested too deeply")
        except Exception as exc:
            log.exception("unable to handle message")
            self._report_server_error(exc, JsonRpcException)

    async def _serve_stream(self, inp) -> None:
        loop = asyncio.get_running_loop()
        closed = loop.create_future()

        def end(code: int | None = None) -> None:
            if code is not None and self.exit_code is None:
                self.exit_code = code
            if not closed.done():
                closed.set_result(None)

        self.on_exit = end

        def reader() -> None:
            try:
                for body in _read_messages(inp, self._stop_event):
                    loop.call_soon_threadsafe(self._feed, body)
            except (OSError, ValueError):
                return
            finally:  # the editor closed our input: 0 if it shut us down first, else 1
                loop.call_soon_threadsafe(end, self.ending_code())

        def terminate(why: str) -> None:
            log.warning("%s: stopping", why)
            self.stop_work(why)
            end(0)

        try:  # 11.
            loop.add_signal_handler(signal.SIGTERM, terminate, "SIGTERM")
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / Windows
            pass
        threading.Thread(target=reader, name="spark-stdin", daemon=True).start()
        watch = asyncio.ensure_future(self._watch_parent(terminate))
        try:
            await closed
        finally:
            watch.cancel()
            self.stop_work("server exiting")

    async def _watch_parent(self, terminate) -> None:
        """11. The editor gives its process id in `initialize`; when that process is gone (the
        editor crashed), nobody will send `exit`: stop instead of living on as an orphan."""
        while True:
            await asyncio.sleep(PARENT_POLL_S)
            pid = self.process_id
            if pid and not _process_alive(pid):
                terminate(f"the editor's process {pid} is gone")
                return

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


PARENT_POLL_S = 2.0  # how often the editor's process is checked
STOP_WAIT_S = 10.0  # how long an exiting server waits for the engine to stop


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process, or an id we cannot check: assume alive
    return True


def _read_messages(inp, stop: threading.Event):
    """The bodies of the Content-Length framed messages on `inp`, until it closes or `stop`;
    framing problems are logged and the stream resynchronises (spark_lsp.framing)."""
    # os.read on the descriptor, not the buffered stdin object: a daemon thread blocked inside a
    # BufferedReader aborts the interpreter at exit
    try:
        fd = inp.fileno()
        read = functools.partial(os.read, fd, 65536)
    except (AttributeError, OSError, ValueError):
        read = functools.partial(inp.read1 if hasattr(inp, "read1") else inp.read, 65536)
    framer = Framer()
    while not stop.is_set():
        chunk = read()
        if not chunk:
            return
        for item in framer.feed(chunk):
            if isinstance(item, str):
                log.warning("client sent a malformed message: %s", item)
            else:
                yield item
