"""The pygls language server: thin handlers over the completion, action and live-edit modules.

Handlers are async and never run model work themselves: they validate, snapshot the document and
await a Job on the engine thread (spark_lsp.scheduler), so the reader keeps reading and a
`$/cancelRequest` or a `didChange` stops the engine within one decode step. Every failure becomes a
JSON-RPC error or a `window/logMessage` line; nothing kills the server.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from typing import Any

import attrs
from lsprotocol import types as T
from pygls.exceptions import (JsonRpcContentModified, JsonRpcException, JsonRpcInvalidParams,
                              JsonRpcRequestCancelled)
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol, default_converter
from pygls.workspace import TextDocument, Workspace

from . import __version__ as _pkg_version
from . import actions, completions, live_edits
from .documents import PositionError, line_ending, lsp_lines, minimal_edits, normalize_eol, offset_at, position_at
from .model_host import ModelHost, ModelNotReady
from .scheduler import Cancelled, Job, Scheduler, run_job
from .settings import Settings, SettingsError, to_json, update
from .status import METRICS_METHOD, STATUS_METHOD, Metrics, WaferProjector, status_payload

log = logging.getLogger("spark_lsp")

CMD_APPLY = "spark.applyAction"
CMD_INSTRUCT = "spark.editWithInstruction"
CMD_CANCEL = "spark.cancel"
CMD_TOGGLE = "spark.toggle"
CMD_CONFIGURE = "spark.configure"
CMD_STATUS = "spark.status"
CMD_ACCEPTED = "spark.accepted"
EDIT_SUFFIX = "#edit"   # scheduler key of a document's code-action edit
JOIN_GRACE_S = 0.25     # how long a generation the user types along with waits for its next request


@attrs.define
class _BadMessage:
    """A request whose params failed to deserialise; answered with InvalidParams by id."""

    id: Any
    method: str
    message: str
    jsonrpc: str = "2.0"


class LspTextDocument(TextDocument):
    """pygls' document with LSP line breaks: pygls splits with str.splitlines, which also breaks at
    \\f, \\v, \\x1c-\\x1e, \\x85, \\u2028 and \\u2029, so an incremental change after one of those
    would land on the wrong line and the server's copy would drift from the editor's."""

    @property
    def lines(self):
        return tuple(lsp_lines(self.source))


class LspWorkspace(Workspace):
    """A workspace whose text documents are LspTextDocuments."""

    def _create_text_document(self, doc_uri, source=None, version=None, language_id=None):
        return LspTextDocument(doc_uri, source=source, version=version, language_id=language_id,
                               sync_kind=self._sync_kind, position_codec=self._position_codec)


class SparkProtocol(LanguageServerProtocol):
    """pygls' protocol, plus answers for requests pygls would otherwise drop silently: malformed
    params get -32602 with the request id, unparsable JSON gets -32700; documents keep LSP line
    breaks (LspTextDocument)."""

    @property
    def _workspace(self):
        return self.__dict__.get("_spark_workspace")

    @_workspace.setter
    def _workspace(self, ws) -> None:
        # pygls builds its Workspace inside `initialize`; make it one that creates LspTextDocuments
        if type(ws) is Workspace:
            ws.__class__ = LspWorkspace
        self.__dict__["_spark_workspace"] = ws

    def structure_message(self, data: dict[str, Any]):
        try:
            return super().structure_message(data)
        except JsonRpcException as exc:
            if isinstance(data, dict) and "id" in data and "method" in data:
                cause = exc.__cause__
                detail = ""
                if cause is not None:
                    try:
                        from cattrs import transform_error
                        detail = "; ".join(transform_error(cause))
                    except Exception:
                        detail = str(cause)
                return _BadMessage(data["id"], str(data["method"]),
                                   f"invalid params for {data['method']}: {detail or exc}")
            raise

    def _execute_handler(self, msg_id, handler, callback, args=None, kwargs=None):
        """pygls runs a command (and other built-in generator features) as an inner task under a
        fresh id, so `$/cancelRequest` for the request only cancels the outer future and the work
        goes on. Link them: cancelling the request cancels the inner task (the engine stops)."""
        super()._execute_handler(msg_id, handler, callback, args, kwargs)
        outer = callback.keywords.get("result_future") if isinstance(callback, functools.partial) else None
        inner = self._request_futures.get(msg_id)
        if outer is not None and inner is not None:
            outer.add_done_callback(lambda f: f.cancelled() and inner.cancel())
            inner.add_done_callback(lambda f: self._request_futures.pop(msg_id, None))

    def _handle_cancel_notification(self, msg_id):
        """Count a request cancelled before its handler started: its handler never runs, so it
        cannot count itself (a started one counts itself where it catches the cancellation)."""
        future = self._request_futures.get(msg_id)
        not_started = future is not None and not future.done() and _not_started(future)
        super()._handle_cancel_notification(msg_id)
        if not_started and (future.cancelled() or getattr(future, "cancelling", lambda: 0)()):
            metrics = getattr(self._server, "metrics", None)
            if metrics is not None:
                metrics.cancelled += 1

    def handle_message(self, message):
        if isinstance(message, _BadMessage):
            self._send_response(message.id, error=JsonRpcInvalidParams(message.message).to_response_error())
            return
        return super().handle_message(message)


def _not_started(future) -> bool:
    """Whether a request's future has not begun running its handler (a task whose coroutine has
    not run yet, or a thread-pool future still queued)."""
    import inspect

    get_coro = getattr(future, "get_coro", None)
    if get_coro is not None:
        coro = get_coro()
        return inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED
    running = getattr(future, "running", None)
    return running is not None and not running()


class SparkServer(LanguageServer):
    def __init__(self, model_dir: str | None = None):
        super().__init__("spark-lsp", _pkg_version, protocol_cls=SparkProtocol,
                         converter_factory=default_converter, max_workers=4)
        self.settings = Settings(model=model_dir)
        self.host = ModelHost()
        self.scheduler: Scheduler | None = None
        self.typing = completions.TypingThrough()
        self.metrics = Metrics()
        self.wafer = WaferProjector()
        self.live: dict[str, live_edits.LiveEdit] = {}
        self.inflight: dict[str, completions.Inflight] = {}
        self.enabled = True
        self._tokens = itertools.count(1)

    # -- transport ------------------------------------------------------------------------------
    def start_io(self, stdin=None, stdout=None) -> None:
        """Serve over stdio with one reader thread that hands whole messages to the event loop.

        pygls' own stdio reader hops through its thread pool for every header line and body
        (three hops a message); on a busy 2-core machine each hop can cost milliseconds, and an
        editor sends two messages per keystroke. One blocking reader thread costs one hop."""
        import json
        import os
        import sys
        import threading

        from pygls.io_ import StdoutWriter

        self._stop_event = threading.Event()
        self.protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
        inp = stdin or sys.stdin.buffer

        def feed(body: bytes) -> None:
            try:
                message = json.loads(body, object_hook=self.protocol.structure_message)
                self.protocol.handle_message(message)
            except (SystemExit, KeyboardInterrupt):
                raise
            except Exception as exc:
                log.exception("unable to handle message")
                self._report_server_error(exc, JsonRpcException)

        async def main() -> None:
            loop = asyncio.get_running_loop()
            closed = loop.create_future()

            def reader() -> None:
                # os.read on the descriptor, not the buffered stdin object: a daemon thread blocked
                # inside a BufferedReader aborts the interpreter at exit
                try:
                    fd = inp.fileno()
                    read = lambda: os.read(fd, 65536)  # noqa: E731
                except (AttributeError, OSError, ValueError):
                    read = lambda: inp.read1(65536) if hasattr(inp, "read1") else inp.read(65536)  # noqa: E731
                buf = b""
                try:
                    while not self._stop_event.is_set():
                        head_end = buf.find(b"\r\n\r\n")
                        if head_end < 0:
                            chunk = read()
                            if not chunk:
                                return
                            buf += chunk
                            continue
                        length = None
                        for line in buf[:head_end].split(b"\r\n"):
                            key, _, value = line.partition(b":")
                            if key.strip().lower() == b"content-length":
                                try:
                                    length = int(value.strip())
                                except ValueError:
                                    length = None
                        if length is None:  # a header block without a length: skip it
                            buf = buf[head_end + 4:]
                            continue
                        while len(buf) < head_end + 4 + length:
                            chunk = read()
                            if not chunk:
                                return
                            buf += chunk
                        body = buf[head_end + 4:head_end + 4 + length]
                        buf = buf[head_end + 4 + length:]
                        loop.call_soon_threadsafe(feed, body)
                except (OSError, ValueError):
                    return
                finally:
                    loop.call_soon_threadsafe(lambda: closed.done() or closed.set_result(None))

            threading.Thread(target=reader, name="spark-stdin", daemon=True).start()
            await closed

        try:
            asyncio.run(main())
        except BrokenPipeError:
            log.error("the client closed the connection")
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            self.shutdown()

    # -- plumbing --------------------------------------------------------------------------------
    def log(self, message: str, level: T.MessageType = T.MessageType.Info) -> None:
        log.log({T.MessageType.Error: logging.ERROR, T.MessageType.Warning: logging.WARNING}.get(
            level, logging.INFO), message)
        try:
            self.window_log_message(T.LogMessageParams(type=level, message=message))
        except Exception:
            pass

    def report_server_error(self, error: Exception, source) -> None:
        """Out-of-band errors (unparsable JSON, failed notifications): a log line, and for a
        parse error a -32700 response with a null id, as JSON-RPC prescribes."""
        import json

        from pygls.exceptions import FeatureRequestError

        if source is FeatureRequestError:
            return  # the request already got its error response
        cause = error.__cause__ or error.__context__
        if isinstance(error, json.JSONDecodeError) or isinstance(cause, json.JSONDecodeError) \
                or isinstance(error, UnicodeDecodeError):
            try:
                self.protocol._send_data({"jsonrpc": "2.0", "id": None,
                                          "error": {"code": -32700, "message": f"Parse error: {error}"}})
            except Exception:
                pass
        self.log(f"error: {error}", T.MessageType.Error)

    def _sched(self) -> Scheduler:
        if self.scheduler is None:
            self.scheduler = Scheduler()
        return self.scheduler

    def _doc(self, uri: str):
        try:
            docs = self.workspace.text_documents
        except RuntimeError as exc:
            raise JsonRpcInvalidParams(str(exc)) from None
        if uri not in docs:
            raise JsonRpcInvalidParams(f"unknown document {uri!r}: send textDocument/didOpen first")
        return docs[uri]

    @property
    def enc(self) -> str:
        """The negotiated position encoding ('utf-16' unless the client asked for another)."""
        try:
            return str(self.workspace.position_encoding.value if hasattr(self.workspace.position_encoding, "value")
                       else self.workspace.position_encoding)
        except Exception:
            return "utf-16"

    def _offset(self, text: str, pos: T.Position) -> int:
        try:
            return offset_at(text, pos.line, pos.character, enc=self.enc)
        except PositionError as exc:
            raise JsonRpcInvalidParams(f"position {{line: {pos.line}, character: {pos.character}}}: {exc}") from None

    async def _ready(self) -> None:
        try:
            await self.host.ready(self.settings.load_timeout_s)
        except ModelNotReady as exc:
            raise SparkServerError(str(exc)) from None

    def apply_settings(self, raw: Any, source: str) -> None:
        """Validate and apply settings; raises SettingsError (the caller reports it)."""
        new, warnings = update(self.settings, raw)
        if new.wafer_chip and new.wafer_chip != self.settings.wafer_chip:
            try:
                from engine.wafer.chips import ChipError, load_chip
            except ImportError:
                pass
            else:
                try:
                    load_chip(new.wafer_chip)
                except ChipError as exc:
                    raise SettingsError(f"setting 'waferChip': {exc}") from None
        for w in warnings:
            self.log(f"{source}: {w}", T.MessageType.Warning)
        old = self.settings
        self.settings = new
        if (new.model, new.precision) != (old.model, old.precision) and self.host._event is not None:
            self.log(f"model changed to {new.model or '(bundled default)'} ({new.precision}); reloading")
            self.start_loading()

    def send_status(self, kind: str, stats: dict) -> None:
        self.metrics.record_generation(stats)
        try:
            wafer = self.wafer.get(self.host.engine, self.settings)
            self.protocol.notify(STATUS_METHOD, status_payload(self.host.name, kind, stats, wafer))
        except Exception as exc:
            log.debug("status notification failed: %s", exc)

    def start_loading(self) -> None:
        loop = asyncio.get_running_loop()
        token = f"spark-load-{next(self._tokens)}"
        use_progress = bool(getattr(getattr(self.client_capabilities, "window", None), "work_done_progress", False))

        def done(ok: bool, msg: str) -> None:
            if use_progress:
                self.work_done_progress.end(token, T.WorkDoneProgressEnd(
                    message="ready" if ok else "failed"))
            if ok:
                self.log(f"model {self.host.name} loaded in {self.host.load_s:.1f} s")
                self.wafer.get(self.host.engine, self.settings)  # start the projection early
            else:
                self.log(msg, T.MessageType.Error)
                self.window_show_message(T.ShowMessageParams(type=T.MessageType.Error, message=msg))

        async def begin() -> None:
            if use_progress:
                try:
                    await self.work_done_progress.create_async(token)
                    self.work_done_progress.begin(token, T.WorkDoneProgressBegin(
                        title="spark-lsp", message=f"loading model {self.settings.model or '(bundled default)'}"))
                except Exception as exc:
                    log.debug("progress unavailable: %s", exc)
            self.host.start(loop, self.settings.model, done, precision=self.settings.precision)

        self.host.expect()  # requests arriving while the progress is being created wait too
        asyncio.ensure_future(begin())

    def _client_document_changes(self) -> bool:
        """Whether the client takes `documentChanges` (versioned edits) in a WorkspaceEdit."""
        ws = getattr(self.client_capabilities, "workspace", None)
        return bool(getattr(getattr(ws, "workspace_edit", None), "document_changes", False))

    # -- inline completion ----------------------------------------------------------------------
    async def inline_completion(self, params: T.InlineCompletionParams):
        uri = params.text_document.uri
        doc = self._doc(uri)
        text = doc.source
        offset = self._offset(text, params.position)
        self.metrics.inline_requests += 1
        if not self.enabled or uri in self.live or self._sched().busy(uri + EDIT_SUFFIX):
            return T.InlineCompletionList(items=[])  # one generation per document: an edit is running
        trigger = int(params.context.trigger_kind) if params.context else completions.AUTOMATIC
        sel = params.context.selected_completion_info if params.context else None
        if sel is not None:
            return await self._complete_selected(uri, text, offset, trigger, sel)
        through = self.typing.answer(uri, text, offset)
        if through is not None and (trigger == completions.AUTOMATIC or len(through) > 1):
            self.metrics.typing_through += 1
            self._sched().cancel(uri, "superseded", kind="completion")  # stale work is useless now
            return self._items(through, params.position, trigger)
        inf = self.inflight.get(uri)
        if inf is not None and not inf.job.future.done() and not inf.job.cancelled:
            typed = inf.followed_by(text)
            if typed is not None and offset == inf.offset + len(typed):
                inf.expect_join = False
                result = await self._await_inflight(uri, inf)
                rest = [it[len(typed):] for it in result.items if it.startswith(typed) and len(it) > len(typed)]
                if rest:
                    self.metrics.joined += 1
                    self.typing.remember(uri, inf.text, inf.offset, result.items)
                    return self._items(rest, params.position, trigger)
        if self.settings.debounce_ms and trigger == completions.AUTOMATIC:
            await asyncio.sleep(self.settings.debounce_ms / 1000)
        result = await self._generate(uri, text, offset, trigger)
        self.typing.remember(uri, text, offset, result.items)
        return self._items(result.items, params.position, trigger)

    def _is_python(self, uri: str) -> bool:
        """The client says the document is Python (or, saying nothing, its name ends in .py/.pyi)."""
        # not `_doc`: the document may have been closed while this request waited (debounce)
        lang = getattr(self.workspace.text_documents.get(uri), "language_id", None)
        return lang == "python" or (not lang and uri.endswith((".py", ".pyi")))

    async def _generate(self, uri: str, text: str, offset: int, trigger: int) -> completions.Result:
        """A fresh completion for `text` at `offset` on the engine thread (joinable while it runs)."""
        await self._ready()
        engine, builder, params_cls, settings = self.host.engine, self.host.builder, self.host.params_cls, self.settings
        holder: dict = {}
        python = self._is_python(uri)
        job = Job(uri, lambda j: completions.complete_steps(engine, builder, j, text, offset, settings, trigger,
                                                            params_cls,
                                                            on_partial=lambda s: setattr(holder["inf"], "partial", s),
                                                            python=python),
                  asyncio.get_running_loop(), kind="completion")
        inf = holder["inf"] = completions.Inflight(job, text, offset)
        self.inflight[uri] = inf
        self._sched().submit(job)
        result = await self._await_inflight(uri, inf)
        self.send_status("completion", result.stats)
        return result

    async def _complete_selected(self, uri: str, text: str, offset: int, trigger: int,
                                 sel: T.SelectedCompletionInfo) -> T.InlineCompletionList:
        """The completion menu has an item selected: suggest as if it were accepted, and return
        items that extend its text over its range (as the protocol requires)."""
        s, e = self._offset(text, sel.range.start), self._offset(text, sel.range.end)
        if not s <= offset <= e or sel.range.start.line != sel.range.end.line:
            raise JsonRpcInvalidParams("selectedCompletionInfo.range must be on the cursor's line and contain it")
        result = await self._generate(uri, text[:s] + sel.text + text[e:], s + len(sel.text), trigger)
        items = [sel.text + it for it in result.items] or [sel.text]
        if trigger != completions.INVOKED:
            items = items[:1]
        return T.InlineCompletionList(items=[T.InlineCompletionItem(insert_text=t, filter_text=t, range=sel.range)
                                             for t in items])

    async def _await_inflight(self, uri: str, inf: completions.Inflight) -> completions.Result:
        """Await a completion job shared by the requests that joined it; a cancelled request
        (`$/cancelRequest`) cancels the job only if no other request still waits for it."""
        inf.waiters += 1
        try:
            return await asyncio.shield(inf.job.future)
        except asyncio.CancelledError:  # counted by the request handler (inline_completion)
            if inf.waiters <= 1:
                if inf.expect_join:
                    # the user typed what the model is writing; editors cancel the old request
                    # before sending the new one that will join, so give it a moment
                    asyncio.get_running_loop().call_later(JOIN_GRACE_S, self._cancel_unjoined, inf)
                else:
                    inf.job.cancel("request cancelled")
            raise
        except Cancelled as exc:
            self.metrics.superseded += 1
            if str(exc) == "content modified":
                raise JsonRpcContentModified(f"{uri} changed while the suggestion was computed") from None
            raise JsonRpcRequestCancelled(f"superseded ({exc})") from None
        except ValueError as exc:
            self.metrics.errors += 1
            raise JsonRpcInvalidParams(str(exc)) from None
        finally:
            inf.waiters -= 1
            if inf.job.future.done() and self.inflight.get(uri) is inf:
                del self.inflight[uri]

    @staticmethod
    def _cancel_unjoined(inf: completions.Inflight) -> None:
        if inf.waiters <= 0 and not inf.job.future.done():
            inf.job.cancel("request cancelled")

    @staticmethod
    def _items(items: list[str], pos: T.Position, trigger: int) -> T.InlineCompletionList:
        if trigger != completions.INVOKED:
            items = items[:1]
        rng = T.Range(pos, pos)
        # the command runs when the user accepts an item: counts accepted suggestions and characters
        return T.InlineCompletionList(items=[T.InlineCompletionItem(
            insert_text=s, filter_text=s, range=rng,
            command=T.Command(title="spark: suggestion accepted", command=CMD_ACCEPTED, arguments=[len(s)]))
            for s in items])

    def on_did_change(self, params: T.DidChangeTextDocumentParams) -> None:
        uri = params.text_document.uri
        session = self.live.get(uri)
        if session is not None:
            try:
                text = self.workspace.get_text_document(uri).source
            except Exception:
                text = None
            if text is not None and session.on_did_change(text, params.text_document.version):
                return  # our own streamed edit coming back
        inf = self.inflight.get(uri)
        if inf is not None and not inf.job.future.done():
            try:
                text = self.workspace.get_text_document(uri).source
            except Exception:
                text = None
            if text is not None and inf.followed_by(text) is not None:
                inf.expect_join = True
                return  # the user is typing what the model is writing: keep generating
        if self.scheduler is not None:
            self.scheduler.cancel(uri, "content modified", kind="completion")

    # -- code actions ---------------------------------------------------------------------------
    def code_actions(self, params: T.CodeActionParams) -> list[T.CodeAction]:
        uri = params.text_document.uri
        doc = self._doc(uri)
        text = doc.source
        start = self._offset(text, params.range.start)
        end = self._offset(text, params.range.end)
        if end < start:
            raise JsonRpcInvalidParams("range end is before its start")
        only = params.context.only if params.context else None
        out = []
        for name in actions.available(text, start, end, params.range.start.line):
            kind = actions.KINDS[name]
            if only and not any(kind == k or kind.startswith(f"{k}.") for k in only):
                continue
            data = {"action": name, "uri": uri, "range": _range_json(params.range), "version": doc.version}
            if name == actions.INSTRUCT:
                out.append(T.CodeAction(title=actions.TITLES[name], kind=kind, command=T.Command(
                    title=actions.TITLES[name], command=CMD_INSTRUCT, arguments=[uri, _range_json(params.range)])))
            else:
                out.append(T.CodeAction(title=actions.TITLES[name], kind=kind, data=data))
        return out

    async def resolve_action(self, action: T.CodeAction) -> T.CodeAction:
        data = action.data
        if not isinstance(data, dict) or data.get("action") not in actions.ACTIONS:
            raise JsonRpcInvalidParams("codeAction/resolve: 'data' is not an action this server listed")
        if self.settings.live_edits:
            action.command = T.Command(title=action.title, command=CMD_APPLY, arguments=[data])
            return action
        action.edit = await self.run_edit(data, stream=False)
        return action

    async def run_edit(self, data: dict, stream: bool, instruction: str | None = None) -> Any:
        """Compute (stream=False: return a WorkspaceEdit) or stream (apply it live) an action."""
        try:
            name, uri, rng = data["action"], data["uri"], data["range"]
            start_pos = T.Position(int(rng["start"]["line"]), int(rng["start"]["character"]))
            end_pos = T.Position(int(rng["end"]["line"]), int(rng["end"]["character"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise JsonRpcInvalidParams(f"action data needs 'action', 'uri' and 'range': {exc}") from None
        doc = self._doc(uri)
        version = data.get("version")
        if version is not None and doc.version is not None and version != doc.version:
            raise JsonRpcContentModified(f"{uri} changed since the action was listed; ask again")
        text = doc.source
        start, end = self._offset(text, start_pos), self._offset(text, end_pos)
        if end < start:
            raise JsonRpcInvalidParams("range end is before its start")
        await self._ready()
        builder = self.host.builder
        try:
            plan = actions.plan(name, text, start, end, start_pos.line,
                                self.settings.max_edit_tokens, instruction,
                                count_tokens=lambda s: len(builder.tokenizer.encode(s)),
                                chat=self.host.chat if name == actions.INSTRUCT else None)
        except actions.ActionError as exc:
            raise JsonRpcInvalidParams(str(exc)) from None
        if uri in self.live:
            raise SparkServerError(f"an edit is already streaming into {uri}; cancel it first")
        self.metrics.edits += 1
        if stream:
            return await self._stream_edit(uri, text, plan)
        region, stats = await self._edit_job(uri, plan)
        self.send_status(f"edit:{name}", stats)
        region = normalize_eol(region, line_ending(text))  # the document's line ending, as streamed edits
        return T.WorkspaceEdit(changes={uri: _text_edits(text, plan.start, plan.end, region, self.enc)})

    async def _edit_job(self, uri: str, plan: actions.EditPlan, on_text=None):
        engine, builder, params_cls = self.host.engine, self.host.builder, self.host.params_cls
        speculative = self.settings.speculative
        budget = self.settings.context_tokens
        limit = completions.context_limit(engine)
        if limit:
            budget = max(16, min(budget, limit - plan.max_tokens - 8))
        self._sched().cancel(uri, "an edit started", kind="completion")  # one generation per document
        job = Job(uri + EDIT_SUFFIX,
                  lambda j: actions.run_plan_steps(engine, builder, j, plan, params_cls, budget,
                                             on_text=(lambda s: j.call_soon(on_text, s)) if on_text else None,
                                             speculative=speculative),
                  asyncio.get_running_loop(), kind="edit", slot=uri)
        try:
            return await run_job(self._sched(), job)
        except Cancelled as exc:
            raise JsonRpcRequestCancelled(f"edit stopped: {exc}") from None
        except actions.ActionError as exc:
            raise JsonRpcInvalidParams(str(exc)) from None

    async def _stream_edit(self, uri: str, text: str, plan: actions.EditPlan) -> dict:
        """Stream the plan's output into the document; returns a summary for the command result."""
        key = uri + EDIT_SUFFIX
        session = live_edits.LiveEdit(uri, text, plan.start, plan.end, _pos(position_at(text, plan.start, self.enc)),
                                      on_user_change=lambda: self._sched().cancel(key, "user typed"), enc=self.enc,
                                      version=self._doc(uri).version)
        versioned = self._client_document_changes()
        self.live[uri] = session
        latest = {"raw": None}
        interval = 1.0 / self.settings.live_edit_hz if self.settings.live_edits else None
        token = f"spark-edit-{next(self._tokens)}"
        progress = bool(getattr(getattr(self.client_capabilities, "window", None), "work_done_progress", False))
        sched = self._sched()
        if progress:
            try:
                await self.work_done_progress.create_async(token)
                self.work_done_progress.begin(token, T.WorkDoneProgressBegin(
                    title=actions.TITLES[plan.action], cancellable=True, message="writing…"))
                fut = self.work_done_progress.tokens.get(token)
                if fut is not None:
                    fut.add_done_callback(
                        lambda f: f.cancelled() and self.cancel_live_edit(session, "progress cancelled"))
            except Exception as exc:
                log.debug("progress unavailable: %s", exc)
                progress = False

        async def flush(region: str, final: bool) -> bool:
            shown = session.frame(region, final)
            edits = session.edits_to(shown)
            if not edits:
                return True
            self.metrics.live_flushes += 1
            text_edits = [T.TextEdit(T.Range(_pos(e.start), _pos(e.end)), e.new_text) for e in edits]
            version = session.version
            if versioned and version is not None:
                # versioned: a client whose document moved on (the user typed) refuses the edit
                # instead of applying it on top of the keystroke
                edit = T.WorkspaceEdit(document_changes=[T.TextDocumentEdit(
                    T.OptionalVersionedTextDocumentIdentifier(uri=uri, version=version), text_edits)])
            else:
                edit = T.WorkspaceEdit(changes={uri: text_edits})
            res = await self.workspace_apply_edit_async(T.ApplyWorkspaceEditParams(
                edit=edit, label=actions.TITLES[plan.action]))
            if not getattr(res, "applied", False):
                session.rejected()
                return False
            session.applied(version)
            return True

        outcome = "done"
        written_final = False
        task = asyncio.ensure_future(self._edit_job(uri, plan, on_text=lambda s: latest.__setitem__("raw", s)))
        try:
            while not task.done():
                await asyncio.wait([task], timeout=interval)
                if session.stopped:  # the user typed or cancelled: nothing more is written
                    sched.cancel(key, session.cancelled or "user typed")  # a job that began after it too
                    break
                if interval is not None and latest["raw"] is not None and not task.done():
                    if not await flush(plan.region_text(latest["raw"], final=False), final=False):
                        sched.cancel(key, "edit rejected by the client")
                        outcome = "rejected"
                        break
            try:
                region, stats = await task
                # a cancel that came after the generation finished still keeps the final write
                # from happening: what was streamed stays, as when the engine is stopped mid-stream
                if session.cancelled is not None:
                    outcome = f"edit stopped: {session.cancelled}"
                elif not session.stopped_by_user:
                    written_final = await flush(region, final=True)
                    outcome = "done" if written_final else "rejected"
                self.send_status(f"edit:{plan.action}", stats)
            except JsonRpcRequestCancelled as exc:
                outcome = "stopped by the user" if session.stopped_by_user else str(exc)
        except asyncio.CancelledError:
            sched.cancel(key, "request cancelled")
            outcome = "cancelled"
            raise
        finally:
            self.live.pop(uri, None)
            if progress:
                try:
                    self.work_done_progress.end(token, T.WorkDoneProgressEnd(message=outcome))
                    self.work_done_progress.tokens.pop(token, None)
                except Exception:
                    pass
        if session.stopped_by_user:
            outcome = "stopped by the user"
        return {"outcome": outcome, "flushes": session.flushes, "complete": written_final}

    def cancel_live_edit(self, session: live_edits.LiveEdit, reason: str) -> bool:
        """The user cancelled a live edit: stop its generation and every edit it has not sent yet
        (its final write too, when the generation has already finished); False if nothing was left
        to stop."""
        hit = session.cancel(reason)
        if self.scheduler is not None and self.live.get(session.uri) is session:
            hit = self.scheduler.cancel(session.uri + EDIT_SUFFIX, reason) or hit
        return hit


class SparkServerError(JsonRpcException):
    """A server-side failure the client should show (model not loaded, an edit already running)."""

    CODE = -32001


def _pos(p) -> T.Position:
    return T.Position(line=p.line, character=p.character)


def _range_json(r: T.Range) -> dict:
    return {"start": {"line": r.start.line, "character": r.start.character},
            "end": {"line": r.end.line, "character": r.end.character}}


def _text_edits(text: str, start: int, end: int, region: str, enc: str = "utf-16") -> list[T.TextEdit]:
    """Minimal TextEdits turning text[start:end] into `region` (positions in the current text)."""
    out = []
    for e in minimal_edits(text[start:end], region, base=start):
        out.append(T.TextEdit(T.Range(_pos(position_at(text, e.start, enc)), _pos(position_at(text, e.end, enc))),
                              e.new_text))
    return out


def create_server(model_dir: str | None = None) -> SparkServer:
    ls = SparkServer(model_dir)

    @ls.feature(T.INITIALIZE)
    def initialize(ls: SparkServer, params: T.InitializeParams):
        try:
            ls.apply_settings(params.initialization_options, "initializationOptions")
        except SettingsError as exc:
            ls.log(f"initializationOptions: {exc}; using defaults for the rest", T.MessageType.Error)

    @ls.feature(T.INITIALIZED)
    def initialized(ls: SparkServer, params: T.InitializedParams):
        ls._sched()
        ls.start_loading()

    @ls.feature(T.SHUTDOWN)
    def shutdown(ls: SparkServer, params: Any):
        if ls.scheduler is not None:
            ls.scheduler.shutdown()

    @ls.feature(T.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: SparkServer, params: T.DidChangeTextDocumentParams):
        ls.on_did_change(params)

    @ls.feature(T.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: SparkServer, params: T.DidCloseTextDocumentParams):
        uri = params.text_document.uri
        ls.typing.forget(uri)
        ls.inflight.pop(uri, None)
        if ls.scheduler is not None:
            ls.scheduler.cancel(uri, "document closed")
            ls.scheduler.cancel(uri + EDIT_SUFFIX, "document closed")
        if ls.host.builder is not None:
            ls.host.builder.forget(uri)

    @ls.feature(T.WORKSPACE_DID_CHANGE_CONFIGURATION)
    def did_change_configuration(ls: SparkServer, params: T.DidChangeConfigurationParams):
        try:
            ls.apply_settings(params.settings, "workspace/didChangeConfiguration")
            ls.log("settings updated")
        except SettingsError as exc:
            ls.log(f"workspace/didChangeConfiguration: {exc}", T.MessageType.Error)
            ls.window_show_message(T.ShowMessageParams(type=T.MessageType.Error, message=f"spark-lsp: {exc}"))

    @ls.feature(T.TEXT_DOCUMENT_INLINE_COMPLETION, T.InlineCompletionOptions())
    async def inline_completion(ls: SparkServer, params: T.InlineCompletionParams):
        try:
            return await ls.inline_completion(params)
        except asyncio.CancelledError:  # wherever it waited: debounce, model load or the engine
            ls.metrics.cancelled += 1
            raise

    @ls.feature(T.TEXT_DOCUMENT_CODE_ACTION, T.CodeActionOptions(
        code_action_kinds=[T.CodeActionKind.RefactorRewrite, T.CodeActionKind.RefactorExtract],
        resolve_provider=True))
    def code_action(ls: SparkServer, params: T.CodeActionParams):
        return ls.code_actions(params)

    @ls.feature(T.CODE_ACTION_RESOLVE)
    async def code_action_resolve(ls: SparkServer, params: T.CodeAction):
        return await ls.resolve_action(params)

    @ls.command(CMD_APPLY)
    async def apply_action(ls: SparkServer, data: Any):
        if not isinstance(data, dict):
            raise JsonRpcInvalidParams(f"{CMD_APPLY} takes the action's data object")
        if ls.settings.live_edits:
            return await ls.run_edit(data, stream=True)
        edit = await ls.run_edit(data, stream=False)
        res = await ls.workspace_apply_edit_async(T.ApplyWorkspaceEditParams(edit=edit))
        return {"outcome": "done" if res.applied else "rejected", "flushes": 1, "complete": bool(res.applied)}

    @ls.command(CMD_INSTRUCT)
    async def edit_with_instruction(ls: SparkServer, *args: Any):
        if len(args) != 3 or not isinstance(args[0], str) or not isinstance(args[1], dict) \
                or not isinstance(args[2], str):
            raise JsonRpcInvalidParams(f"{CMD_INSTRUCT} takes [uri, range, instruction text]")
        if not args[2].strip():
            raise JsonRpcInvalidParams(f"{CMD_INSTRUCT}: the instruction is empty")
        data = {"action": actions.INSTRUCT, "uri": args[0], "range": args[1]}
        return await apply_action_with(ls, data, args[2])

    async def apply_action_with(ls: SparkServer, data: dict, instruction: str):
        if ls.settings.live_edits:
            return await ls.run_edit(data, stream=True, instruction=instruction)
        edit = await ls.run_edit(data, stream=False, instruction=instruction)
        res = await ls.workspace_apply_edit_async(T.ApplyWorkspaceEditParams(edit=edit))
        return {"outcome": "done" if res.applied else "rejected", "flushes": 1, "complete": bool(res.applied)}

    @ls.command(CMD_CANCEL)
    def cancel(ls: SparkServer, *args: Any):
        uris = [a for a in args if isinstance(a, str)] or list(ls.workspace.text_documents)
        n = 0
        for uri in uris:
            if ls.scheduler is not None:
                n += ls.scheduler.cancel(uri, "cancelled by command")
            session = ls.live.get(uri)
            if session is not None:  # also when its generation has finished and its final write not yet come
                n += ls.cancel_live_edit(session, "cancelled by command")
            elif ls.scheduler is not None:
                n += ls.scheduler.cancel(uri + EDIT_SUFFIX, "cancelled by command")
        return {"cancelled": n}

    @ls.command(CMD_TOGGLE)
    def toggle(ls: SparkServer, *args: Any):
        if args and not isinstance(args[0], bool):
            raise JsonRpcInvalidParams(f"{CMD_TOGGLE} takes an optional boolean")
        ls.enabled = args[0] if args else not ls.enabled
        ls.log(f"inline completions {'on' if ls.enabled else 'off'}")
        return {"enabled": ls.enabled}

    @ls.command(CMD_CONFIGURE)
    def configure(ls: SparkServer, *args: Any):
        if len(args) != 1:
            raise JsonRpcInvalidParams(f"{CMD_CONFIGURE} takes one settings object")
        try:
            ls.apply_settings(args[0], CMD_CONFIGURE)
        except SettingsError as exc:
            raise JsonRpcInvalidParams(str(exc)) from None
        return to_json(ls.settings)

    @ls.command(CMD_ACCEPTED)
    def accepted(ls: SparkServer, *args: Any):
        ls.metrics.accepted += 1
        if args and isinstance(args[0], int) and not isinstance(args[0], bool) and args[0] >= 0:
            ls.metrics.accepted_chars += args[0]
        return None

    @ls.command(CMD_STATUS)
    def status(ls: SparkServer, *args: Any):
        return server_metrics(ls)

    @ls.feature(METRICS_METHOD)
    def metrics(ls: SparkServer, params: Any):
        return server_metrics(ls)

    return ls


def server_metrics(ls: SparkServer) -> dict:
    lat = list(ls.scheduler.cancel_latencies_ms) if ls.scheduler is not None else []
    return {"model": ls.host.name if ls.host.loaded else None, "loaded": ls.host.loaded,
            "loadError": ls.host.error, "enabled": ls.enabled, "chatModel": ls.host.chat is not None,
            "settings": to_json(ls.settings),
            **ls.metrics.snapshot(lat)}
