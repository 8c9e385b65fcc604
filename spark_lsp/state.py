"""The server's shared state and the jobs every feature needs: settings, model loading, the engine
thread, metrics and the status notification. Free of any LSP library (the editor is an `Editor`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlparse

from .backends import BackendError, BackendUnavailable, RemoteBackend
from .editor import Editor
from .errors import ServerError
from .live_edits import LiveEdit
from .model_host import ModelHost, ModelNotReady
from .neighbours import Neighbours
from .precision_job import PrecisionJob
from .scheduler import Scheduler
from .settings import Settings, SettingsError, to_json, update
from .status import Metrics, WaferProjector, status_payload

log = logging.getLogger("spark_lsp")

EDIT_SUFFIX = "#edit"  # scheduler key of a document's code-action edit


def edit_key(uri: str) -> str:
    """The scheduler key of the code-action edit of document `uri` (its completions use `uri`)."""
    return uri + EDIT_SUFFIX


class ServerState:
    """Settings, the model host, the engine thread and the counters, for every service."""

    def __init__(
        self, editor: Editor, model_dir: str | None = None, engine: str | None = None
    ) -> None:
        self.editor = editor
        self.settings = Settings(model=model_dir, engine=engine or "local")
        self.host = ModelHost()
        self.scheduler: Scheduler | None = None  # started at `initialized`
        self.metrics = Metrics()
        self.wafer = WaferProjector()
        self.enabled = True  # inline completions on (spark.toggle)
        self.live: dict[str, LiveEdit] = {}  # documents with an edit streaming into them
        self.tuner = PrecisionJob(self._report_from_thread)
        self.neighbours = Neighbours()  # chunks of the other open/edited files for prompts
        self.root: str | None = None  # workspace folder path: files are named relative to it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loading: asyncio.Future | None = None  # the model load in flight
        # False for a network session: it may not point the server at files (settings.update)
        self.trusted = True
        # in a session host (spark_lsp.session_host): its pid, this session, the shared models
        self.host_info: Callable[[], dict] | None = None
        self._unhealthy = False  # the editor was told the engine service or backend is down

    def observe(self, uri: str, text: str, line: int) -> None:
        """Activity at `line` of a document (open, edit, completion): its chunk may join the
        context other documents' prompts get (`spark_lsp.neighbours`)."""
        if self.settings.neighbour_tokens > 0:
            self.neighbours.observe(uri, document_path(uri, self.root), text, line)

    def sched(self) -> Scheduler:
        """The engine thread, started on first use."""
        if self.scheduler is None:
            self.scheduler = Scheduler()
        return self.scheduler

    def cancel(self, key: str, reason: str, kind: str | None = None) -> bool:
        """Cancel the queued and running job of `key` (see Scheduler.cancel); False if none."""
        return self.scheduler is not None and self.scheduler.cancel(key, reason, kind=kind)

    def edit_running(self, uri: str) -> bool:
        """An edit is streaming into, or being computed for, document `uri`."""
        return uri in self.live or (
            self.scheduler is not None and self.scheduler.busy(edit_key(uri))
        )

    async def ready(self) -> None:
        """Wait for the model (up to the loadTimeoutS setting); ServerError if it is not there."""
        try:
            await self.host.ready(self.settings.load_timeout_s)
        except ModelNotReady as exc:
            raise ServerError(str(exc)) from None

    # -- settings --------------------------------------------------------------------------------
    def apply_settings(self, raw: Any, source: str) -> None:
        """Validate and apply settings (SettingsError names each bad one); reloads the model when
        the model or its precision changed after the first load began."""
        new, warnings = update(self.settings, raw, trusted=self.trusted)
        if new.wafer_chip and new.wafer_chip != self.settings.wafer_chip:
            self.wafer.check_chip(new.wafer_chip)
        for w in warnings:
            self.editor.log(f"{source}: {w}", "warning")
        old, self.settings = self.settings, new
        if _backend_settings(new) != _backend_settings(old) and self.host.started:
            if new.backend == "local":
                what = f"model changed to {new.model or '(bundled default)'} ({new.precision}); reloading"
            else:
                what = f"backend changed to {new.backend} at {new.backend_url or 'its default URL'}"
            self.editor.log(what)
            self.start_loading()

    def settings_json(self) -> dict:
        return to_json(self.settings)

    # -- model -----------------------------------------------------------------------------------
    def start_loading(self) -> None:
        """Load the model in the background, with a progress indicator; requests wait for it."""
        loop = self._loop = asyncio.get_running_loop()
        self.host.expect()  # requests arriving while the progress is being created wait too
        # held here: the event loop keeps only a weak reference to a task
        self._loading = asyncio.ensure_future(self._load(loop))

    async def _load(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.settings.backend != "local":
            self.host.start_remote(self.settings, self._remote_ready)
            return
        name = self.settings.model or "(bundled default)"
        progress = await self.editor.begin_progress("spark-lsp", f"loading model {name}")

        def done(ok: bool, msg: str) -> None:
            if progress is not None:
                progress.end("ready" if ok else "failed")
            if ok:
                self.editor.log(f"model {self.host.name} loaded in {self.host.load_s:.1f} s")
                self._loaded_healthy()
                if self.host.builder is not None and self.host.builder.fim is None:
                    self.editor.show_warning(NO_FIM_MESSAGE.format(name=self.host.name))
                if getattr(self.host.model, "notice", None):  # e.g. the engine service is down
                    self.editor.show_warning(self.host.model.notice)
                if hasattr(self.host.model, "on_health"):  # the engine service: failures told once
                    self.host.model.on_health = lambda up, message: loop.call_soon_threadsafe(
                        self._backend_health, up, message
                    )
                if hasattr(self.host.model, "on_changed"):  # its daemon now serves other files
                    self.host.model.on_changed = lambda why: loop.call_soon_threadsafe(
                        self._model_changed, why
                    )
                self.wafer.get(self.host.model, self.settings)  # start the projection early
                self._maybe_tune()
            else:
                self.editor.log(msg, "error")
                self.editor.show_error(msg)

        self.host.start(
            loop,
            self.settings.model,
            done,
            precision=self.settings.precision,
            progress=_download_reporter(loop, progress),
            fim_format=self.settings.fim_format,
            steps=_step_reporter(loop, progress, self.editor),
            engine=self.settings.engine,
        )

    def _maybe_tune(self) -> None:
        """Measure the precision decision in the background if the model ran the static rule."""
        model = self.host.model
        if getattr(model, "needs_tuning", False) and self.settings.tune_precision:
            self.tuner.start(model.model_dir, model.name)

    def _report_from_thread(self, message: str, level: str) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.editor.log, message, level)
            except RuntimeError:  # the loop closed: the server is gone
                pass

    def _remote_ready(self, ok: bool, msg: str) -> None:
        backend = self.host.model
        if not ok or not isinstance(backend, RemoteBackend):
            self.editor.log(msg, "error")
            self.editor.show_error(msg)
            return
        loop = asyncio.get_running_loop()

        def health(up: bool, message: str) -> None:  # from the engine thread
            loop.call_soon_threadsafe(self._backend_health, up, message)

        backend.on_health = health
        self.editor.log(f"generating with {backend.name} ({backend.kind} backend)")
        self._loaded_healthy()

    def _model_changed(self, why: str) -> None:
        """The engine service's model changed under this server: load it again (as a change of
        the `model` setting does), which takes its new tokenizer. Told once, as a warning (the
        service answers: not an error)."""
        self.editor.log(why, "warning")
        self.editor.show_warning(f"spark-lsp: {why}")
        self.start_loading()

    def _backend_health(self, up: bool, message: str) -> None:
        """A remote backend or the engine service started failing (told once per run of
        failures) or answers again: logged, shown, and sent as a `spark/status` of kind
        "health" (`error` null once it answers) for the editor's status bar."""
        if up:
            self.editor.log(message)
        else:
            self.editor.log(message, "error")
            self.editor.show_error(f"spark-lsp: {message}")
        self._notify_health(None if up else message)

    def _loaded_healthy(self) -> None:
        """A model (re)loaded: an editor told that the last one's engine was down is untold."""
        if self._unhealthy:
            self._notify_health(None)

    def _notify_health(self, error: str | None) -> None:
        self._unhealthy = error is not None
        backend = self.host.model
        payload = {
            "model": self.host.name,
            "kind": "health",
            "engine": getattr(backend, "where", None),
            "error": error,
        }
        if isinstance(backend, RemoteBackend):
            payload["backend"] = backend.status()
        self.editor.notify_status(payload)

    def backend_failed(self, exc: BackendError) -> ServerError:
        """The request's error for a failed backend (the editor was told once, see `_backend_health`)."""
        self.metrics.errors += 1
        if not isinstance(exc, BackendUnavailable):
            log.info("backend request failed: %s", exc)
        return ServerError(str(exc))

    # -- status and metrics ----------------------------------------------------------------------
    def send_status(self, kind: str, stats: dict, record: bool = True) -> None:
        """Count a finished generation (unless `record` is false: counted already) and tell the
        editor's status bar about it."""
        if record:
            self.metrics.record_generation(stats)
        try:
            wafer = self.wafer.get(self.host.model, self.settings)
            where = getattr(self.host.model, "where", None)
            self.editor.notify_status(status_payload(self.host.name, kind, stats, wafer, where))
        except Exception as exc:
            log.debug("status notification failed: %s", exc)

    def metrics_payload(self) -> dict:
        """What `spark/metrics` and `spark.status` answer."""
        lat = list(self.scheduler.cancel_latencies_ms) if self.scheduler is not None else []
        host = self.host
        return {
            "model": host.name if host.loaded else None,
            "loaded": host.loaded,
            "loadError": host.error,
            "engine": host.model.status() if host.model is not None else None,
            "enabled": self.enabled,
            "chatModel": host.chat is not None or bool(getattr(host.model, "supports_chat", False)),
            "backend": host.model.status()
            if isinstance(host.model, RemoteBackend)
            else {"kind": self.settings.backend},
            "settings": to_json(self.settings),
            "sessionHost": self.host_info() if self.host_info is not None else None,
            **self.metrics.snapshot(lat),
        }

    def shutdown(self) -> None:
        self.tuner.stop()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    def wait_stopped(self, timeout: float) -> None:
        """After `shutdown`: wait for the engine thread to leave the model (see Scheduler.join)."""
        if self.scheduler is not None and not self.scheduler.join(timeout):
            log.warning("the engine did not stop within %.0f s", timeout)
        self.host.close()  # a remote backend's connections and I/O thread


def document_path(uri: str, root: str | None) -> str:
    """How a prompt names a document: its path relative to the workspace folder, else its last
    two path components (a `file:` URI), else the URI."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("file", ""):
        return uri
    path = unquote(parsed.path)
    if root and path.startswith(root.rstrip("/") + "/"):
        return path[len(root.rstrip("/")) + 1 :]
    return "/".join(path.rstrip("/").split("/")[-2:])


#: Shown when the loaded model has no fill-in-the-middle tokens (engine.fim finds no family).
NO_FIM_MESSAGE = (
    "spark-lsp: model {name} has no fill-in-the-middle tokens, so inline completions "
    "only see the text before the cursor; use a FIM model for them (e.g. "
    "qwen2.5-coder-0.5b, see `spark-lsp models list`). Code actions still work."
)


def _step_reporter(
    loop: asyncio.AbstractEventLoop, progress, editor: Editor
) -> Callable[[str], None]:
    """What the model load does (from the loading thread), in the editor's progress indicator and
    its log: the first load of a model builds its graph and may compile the native op."""

    def report(line: str) -> None:
        def show() -> None:
            editor.log(f"loading: {line.strip()}")
            if progress is not None and hasattr(progress, "report"):
                progress.report(line.strip())

        try:
            loop.call_soon_threadsafe(show)
        except RuntimeError:
            pass  # the loop closed while loading

    return report


def _download_reporter(
    loop: asyncio.AbstractEventLoop, progress
) -> Callable[[int, int | None, str], None]:
    """A download progress callback (engine.hub.Progress, called from the loading thread) that
    reports to the editor's indicator on the event loop, once per percent, never going back
    (parallel file downloads each report their own bar)."""
    last = [-1]

    def report(done: int, total: int | None, what: str) -> None:
        pct = min(100, done * 100 // total) if total else None
        if (
            progress is None
            or not hasattr(progress, "report")
            or (pct is not None and pct <= last[0])
        ):
            return
        last[0] = pct if pct is not None else last[0]
        msg = f"downloading {what}: {done / 1e6:.1f}" + (
            f" of {total / 1e6:.1f} MB" if total else " MB"
        )
        try:
            loop.call_soon_threadsafe(progress.report, msg, pct)
        except RuntimeError:
            pass  # the loop closed while downloading

    return report


def _backend_settings(s) -> tuple:
    """The settings that choose what generates: a change means a reload or a new backend."""
    return (
        s.backend,
        s.engine,
        s.model,
        s.precision,
        s.fim_format,
        s.backend_url,
        s.backend_model,
        s.backend_api_key_env,
        s.backend_api_key_file,
        s.backend_timeout_s,
        s.fim_template,
    )


__all__ = ["EDIT_SUFFIX", "ServerState", "SettingsError", "edit_key"]
