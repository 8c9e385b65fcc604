"""The engine service (`spark-lsp engine serve`, `engine.service`) as the server's `Model`.

Setting / flag `engine`: `local` (the in-process engine), `auto` (join the user's daemon for this
model, starting a detached one when none runs: N editor windows then share one model and one KV
cache pool) or `ws://HOST:PORT` / `wss://HOST:PORT` (a given daemon or Ray Serve deployment; a
`wss://` server's certificate is verified against the system's trust store and the CA bundle
named by $SPARK_LSP_ENGINE_CA).  The server keeps the model's tokenizer and builds prompts
itself, as with the in-process engine; the daemon receives token ids, so typing-through, prefix
reuse (the slot is the document), supersede and cancel behave as in-process.  A given daemon
sends its model's configuration and tokenizer (`engine.service.model_files`, cached by digest):
this machine needs neither the model nor the Hub, and `model` (unset: the daemon's first)
chooses among the daemon's models.

When the daemon goes away: the stream in flight ends with a `BackendError` (the editor is told
once, through `on_health`), the next request reconnects (`auto` starts a new daemon), and after
`MAX_FAILURES` failed connections in a row the server loads the engine in-process and goes on
with it (only where this machine can run that model: the bundled one, a Hub model, or a
folder or file that is here).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.cancel import CancelToken
from engine.config import ModelError, model_name
from engine.hub import served_name
from engine.models import default_model_dir
from engine.service import launch, model_files, rundir, tls
from engine.service.client_core import EngineRequestError, EngineUnavailable
from engine.service.model_files import ModelFilesError
from engine.service.steering import MATCH, Piece, common_chars, judge
from engine.service.sync_client import SyncEngineClient
from engine.source import open_model
from engine.tokenizer import Tokenizer

from .base import BackendError, Chunk

log = logging.getLogger(__name__)

#: How long one `next()` waits for text before handing the engine thread to other documents.
POLL_S = 0.01
#: Failed connections in a row before the server falls back to the in-process engine.
MAX_FAILURES = 3
#: Environment variable with the token of a `ws://` daemon not found in the user's records.
TOKEN_ENV = rundir.TOKEN_ENV
#: Environment variable naming a CA bundle (PEM) to trust for a `wss://` daemon's certificate,
#: besides the system's trust store (a team's private CA, or a self-signed certificate).
CA_ENV = tls.CA_ENV


_TOKENIZERS: weakref.WeakValueDictionary[str, Tokenizer] = weakref.WeakValueDictionary()
_CONFIGS: dict[str, Any] = {}  # a model's configuration by path (a few hundred bytes each)
_TOKENIZERS_LOCK = threading.Lock()


class ModelChanged(EngineUnavailable):
    """The daemon now serves other files for the model (`EngineServiceModel.on_changed`): this
    model's requests fail until the server has loaded the model again."""


def shared_model(folder: Path) -> tuple[Tokenizer, Any]:
    """The tokenizer and configuration of `folder` (a model folder or a GGUF file), read once
    (a GGUF's header parsed once for both) and the tokenizer kept while any session uses it: a
    session host's sessions on one daemon model then hold one copy (~40 MB at a 150k-token
    vocabulary) where each would load its own. It is read-only once loaded, as the in-process
    engine's, which its sessions share the same way."""
    key = str(Path(folder).resolve())
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None or key not in _CONFIGS:
            src = open_model(folder)
            tok, _CONFIGS[key] = src.tokenizer, src.config
            _TOKENIZERS[key] = tok
        return tok, _CONFIGS[key]


def wanted_name(spec: str | None) -> str | None:
    """The name of the model setting `model` names, as a daemon names what it serves (None: not
    set, the daemon's first model)."""
    if not spec:
        return None
    return served_name(spec) or model_name(Path(spec).expanduser().resolve())


class EngineServiceModel:
    """A `model_host.Model` whose generations run in the engine service."""

    kind = "engine-service"
    steerable = True  # the daemon steers its generations (EngineStream.steer)

    def __init__(
        self,
        target: str,
        model_dir: str | None,
        *,
        fallback: Callable[[], Any] | None = None,
        precision: str | None = None,
    ) -> None:
        if target != "auto" and not target.startswith(("ws://", "wss://")):
            raise BackendError(
                f"setting 'engine' must be local, auto or a ws:// or wss:// URL, got {target!r}"
            )
        self.target = target
        self.precision = precision  # of a daemon `auto` starts (one already running is joined)
        self.spec = model_dir
        self.files_digest: str | None = None  # of the prompt files the daemon sent, if it did
        if target == "auto":  # the daemon this server starts loads the folder resolved here
            self._use(launch.resolve_models([model_dir])[0])
        else:  # a daemon elsewhere: its model's files come from it, on connecting
            self.model_dir: Path | None = None
            self.name = wanted_name(model_dir)
            self.tokenizer: Tokenizer | None = None
            self.config: Any = None
        self.context: int | None = None
        self.needs_tuning = False
        self.on_health: Callable[[bool, str], None] | None = None
        #: Told (once) when a given daemon serves other files for the model than it did: the
        #: server reloads, taking the new tokenizer (its prompts would be in the old one's ids).
        self.on_changed: Callable[[str], None] | None = None
        self._fallback = fallback
        self._local: Any = None  # the in-process model after MAX_FAILURES failures
        self._client: SyncEngineClient | None = None
        self._failures = 0
        self._down = False
        self._lock = threading.Lock()
        self.url = ""
        self._connect()
        if not self._runs_here():
            # an in-process engine would be another model (or none), whose vocabulary this
            # server's prompts are not in
            self._fallback = None

    def _runs_here(self) -> bool:
        """Whether this machine can run the daemon's model itself (the fallback): the bundled
        model, a Hub model (downloaded then), or a folder or file that is here."""
        if self.spec is None:
            return self.name == model_name(default_model_dir())
        return served_name(self.spec) is not None or Path(self.spec).expanduser().exists()

    def _use(self, folder: Path, name: str | None = None) -> None:
        self.model_dir = folder
        self.name = name or model_name(folder)
        self.tokenizer, self.config = shared_model(folder)

    # -- connection ----------------------------------------------------------------------------
    def _connect(self) -> SyncEngineClient:
        if self.target == "auto":
            try:
                rec = launch.join_or_start(str(self.model_dir), precision=self.precision)
            except launch.DaemonError as exc:
                raise EngineUnavailable(str(exc)) from None
            url, token = rec["url"], rec["token"]
            pinned = rec.get("tls_cert")  # a wss daemon of this user: its own certificate
        else:
            url, token = self.target, rundir.token_for(self.target)
            pinned = None  # a URL given by the user: verified by its host name
        client = SyncEngineClient.open(  # on Ray Serve: the ingress replica's own socket
            url,
            token,
            client="spark-lsp",
            cafile=os.environ.get(CA_ENV) or None,
            pinned_cert=pinned,
        )
        try:
            models = client.hello["models"]
            info = next((m for m in models if m.get("name") == self.name), None)
            if info is None:
                info = models[0]
                if self.name is not None:
                    log.warning(
                        "engine service at %s has no model %s; using %s",
                        url,
                        self.name,
                        info.get("name"),
                    )
            if self.tokenizer is None:
                self._take_model(client, info)
            elif self.files_digest is not None and info.get("files") not in (
                None,
                self.files_digest,
            ):
                why = (
                    f"the engine service at {url} now serves {info.get('name')} with other "
                    "files (a new tokenizer or configuration): reloading the model"
                )
                changed, self.on_changed = self.on_changed, None  # told once
                if changed is not None:
                    changed(why)
                raise ModelChanged(why)
            if int(info.get("vocab_size", -1)) != int(self.config.vocab_size):
                raise EngineUnavailable(
                    f"the engine service at {url} serves {info.get('name')} whose vocabulary "
                    f"differs from {self.model_dir} (set 'model' to the daemon's model)"
                )
        except BaseException:
            client.close()
            raise
        self.context = int(info["context"])
        self.url = client.url
        self._client = client
        log.info("generating with the engine service at %s (%s)", url, info.get("name"))
        return client

    def _take_model(self, client: SyncEngineClient, info: dict[str, Any]) -> None:
        """Read the model's configuration and tokenizer from the daemon (its prompt files,
        cached here by their digest), or where it does not send them (an older service), from
        the Hub or disk as `model` names it."""
        digest = info.get("files")
        if digest is None:
            self._use(launch.resolve_models([self.spec], weights=False)[0])
            return
        try:
            folder = model_files.fetch(digest, lambda: client.model_files(info.get("name"))[1])
            self._use(folder, info.get("name"))
        except (EngineRequestError, ModelFilesError, ModelError, TimeoutError) as exc:
            raise EngineUnavailable(
                f"cannot read {info.get('name')}'s tokenizer from the engine service: {exc}"
            ) from None
        self.files_digest = digest

    def _ensure(self) -> SyncEngineClient | None:
        """A live client (reconnecting if needed); None once the server fell back to local."""
        with self._lock:
            if self._local is not None:
                return None
            if self._client is not None and not self._client.closed:
                return self._client
            if self._client is not None:
                self._client.close()
                self._client = None
            try:
                client = self._connect()
            except ModelChanged as exc:  # not a failure: the server loads the model again
                raise BackendError(str(exc)) from None
            except EngineUnavailable as exc:
                self._failures += 1
                if self._failures >= MAX_FAILURES and self._fallback is not None:
                    self._local = self._fallback()
                    self._health(
                        False,
                        f"the engine service is unavailable ({exc}); "
                        "using an in-process engine from now on",
                    )
                    return None
                self._health(False, f"the engine service is unavailable: {exc}")
                raise BackendError(f"the engine service is unavailable: {exc}") from None
            if self._down:  # failed connections or a lost one told the editor: untell it
                self._health(True, f"the engine service at {self.url} answers again")
            self._failures = 0
            return client

    def _lost(self, reason: str) -> None:
        self._health(False, f"lost the engine service ({reason}); reconnecting")

    def _health(self, up: bool, message: str) -> None:
        """Tell the editor once per run of failures, and once when the service answers again."""
        if up == (not self._down):
            return
        self._down = not up
        if self.on_health is not None:
            try:
                self.on_health(up, message)
            except Exception:  # a closed editor connection must not break generation
                log.debug("on_health failed", exc_info=True)
        else:
            (log.info if up else log.warning)("%s", message)

    # -- the Model seam ------------------------------------------------------------------------
    def generate(
        self,
        ids: list[int],
        params: Any,
        slot: str,
        *,
        cancel: CancelToken,
        speculative: bool = False,
        draft: str | None = None,
        text: Any = None,
        steerable: bool = False,
    ):
        client = self._ensure()
        if client is None:
            return self._local.generate(
                ids,
                params,
                slot,
                cancel=cancel,
                speculative=speculative,
                draft=draft,
                text=text,
                steerable=steerable,
            )
        try:
            gen = client.generate(list(ids), params, slot=slot)
        except EngineUnavailable as exc:
            self._lost(str(exc))
            raise BackendError(f"the engine service connection was lost: {exc}") from None
        return EngineStream(self, gen, cancel, (list(ids), params, slot))

    @property
    def where(self) -> str:
        if self._local is not None:
            return "in-process (the engine service did not answer)"
        return f"engine service {self.url or self.target}"

    def status(self) -> dict:
        if self._local is not None:
            return {**self._local.status(), "engine": "local (fallback)"}
        client = self._client
        return {
            "name": self.name,
            "context": self.context,
            "engine": self.url or self.target,  # where it is connected (a direct endpoint)
            "target": self.target,  # the setting: auto, or the URL it was given
            "connected": client is not None and not client.closed,
            "failures": self._failures,
        }

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


class EngineStream:
    """One generation in the engine service, read by the scheduler's engine thread: `next()`
    waits at most POLL_S for text, a cancel of its token reaches the daemon at once.

    `steer(text)` sends typed text to the daemon as `steer` messages, one at a time (the next
    once the daemon has committed the last, so the client always knows which typed text a
    successor's prompt holds). When a steer stops the generation, the stream goes on with the
    successor the daemon started: a chunk with `at` first puts the output back to the typed
    text (model_host.Stream.steer)."""

    def __init__(
        self,
        model: EngineServiceModel,
        gen: Any,
        cancel: CancelToken,
        request: tuple[list[int], Any, str] | None = None,
    ) -> None:
        self._model = model
        self._gen = gen
        self._request = request  # (prompt ids, params, slot), for a successor started here
        self.finish_reason: str | None = None
        self._stats: dict | None = None  # the generation's whole stats, once it has ended
        self.text = ""
        self._t0 = time.perf_counter()
        self._lock = threading.RLock()  # a steer's future may complete as it is sent
        self._typed = ""  # typed text sent to the daemon, relative to the start of the output
        self._unsent = ""  # typed, waiting for the steer in flight to be committed
        self._in_flight: Any = None  # the Future of the steer the daemon has not committed yet
        self._stopping = False  # a steer stopped the generation: its successor comes next
        self._late = False  # a steer came after the daemon's generation had ended
        self._cancelled = False  # cancel() was called: nothing the engine makes after is shown
        cancel.on_cancel(lambda _reason: self.cancel())

    @property
    def stats(self) -> dict:
        """The generation's stats: while it streams, those its first tokens brought (prompt and
        reused tokens, TTFT); all of them once it has ended."""
        return self._stats if self._stats is not None else dict(self._gen.stats or {})

    def __iter__(self) -> EngineStream:
        return self

    def __next__(self) -> Any:
        try:
            item = self._gen.poll(POLL_S)
        except StopIteration:
            piece = self._follow()
            if piece is not None:
                return piece
            self._end()
            raise
        if item is None or self._cancelled:
            # cancelled: what the daemon made before the cancel reached it (a steer's successor
            # that started meanwhile included) is not shown, as an in-process stream makes none
            return Chunk("")
        self.text += item.text
        return Chunk(item.text)

    # -- steering ------------------------------------------------------------------------------
    def steer(self, text: str) -> None:
        with self._lock:
            self._unsent += text
            self._send()

    def _send(self) -> None:
        """Send what was typed, if no steer is in flight (call with the lock held)."""
        if self._in_flight is not None or self._stopping or not self._unsent:
            return
        piece, self._unsent = self._unsent, ""
        self._typed += piece
        fut = self._in_flight = self._gen.steer_nowait(piece)
        fut.add_done_callback(self._committed)

    def _committed(self, fut: Any) -> None:
        try:
            event = fut.result()
        except Exception:  # the connection is gone: the stream ends with its error
            event = {}
        with self._lock:
            if fut is not self._in_flight:
                return
            self._in_flight = None
            if event.get("state") == "committed" and event.get("outcome") == "stopped":
                self._stopping = True  # hold what follows for the successor
            elif event.get("state") == "failed":
                self._late = True  # judged here once the output read so far ends (_follow)
            else:
                self._send()

    def _follow(self) -> Piece | None:
        """The generation ended: go on with the successor a steer started, if there is one."""
        g = self._gen
        fut = self._in_flight
        if fut is not None:  # its outcome decides what follows
            try:
                fut.result(5.0)
            except Exception:
                pass
            self._committed(fut)
        successor = g.successor if g.finish_reason != "error" else None
        if successor is None:
            return self._succeed_here()
        with self._lock:
            self._gen = successor
            self._in_flight, self._stopping = None, False
            at = common_chars(self._typed, self.text)
            self.text = self._typed
            self._send()
        return Piece(-1, self._typed[at:], at)

    def _succeed_here(self) -> Piece | None:
        """The daemon's generation ended before the user's typing reached it (it runs ahead of
        what the editor shows): typed text the output does not spell starts the successor here,
        as the daemon would have (the prompt, then the typed text; the slot's KV is reused)."""
        with self._lock:
            typed = self._typed + self._unsent
            if not (self._late or self._unsent) or self._request is None:
                return None
            if not typed or judge(typed, self.text) == MATCH or _errored(self._gen):
                return None
            client = self._model._ensure()
            if client is None or self._gen.cancelled:
                return None
            ids, params, slot = self._request  # the first request: typed is relative to its output
            healed = getattr(params, "healed_prefix", "") or ""
            ids = ids + list(self._model.tokenizer.encode(healed + typed))
            params = replace(params, healed_prefix="") if healed else params
            try:
                self._gen = client.generate(ids, params, slot=slot)
            except EngineUnavailable:
                return None
            self._typed, self._unsent, self._late = typed, "", False
            at = common_chars(typed, self.text)
            self.text = typed
        return Piece(-1, typed[at:], at)

    def _end(self) -> None:
        g = self._gen
        self.finish_reason = g.finish_reason or "cancelled"
        self._stats = dict(g.stats or {})
        if g.finish_reason == "error":
            err = g.error or {}
            if err.get("code") == "disconnected":
                self._model._lost(err.get("message", "disconnected"))
                raise BackendError(
                    f"the engine service connection was lost: {err.get('message', '')}"
                )
            raise BackendError(
                f"the engine service failed: {err.get('code')}: {err.get('message')}"
            )

    def cancel(self) -> None:
        # the daemon cancels a successor too (an id that a steer stopped names its successor)
        self._cancelled = True
        self._gen.cancel()

    def abandon(self, on_stopped: Callable[..., None]) -> None:
        """The stream was cancelled and will not be read any more: the daemon stops the
        generation on its own, and ``on_stopped(at)`` runs when its ``done`` arrives (or the
        connection is lost), on the client's reading thread; ``at`` is when the engine stopped
        (the ``ended_at`` a daemon on this machine reports, on this process's clock), else None."""
        gen = self._gen
        gen.on_done(lambda: on_stopped(_ended_at(gen)))

    def stop(self) -> None:
        """The output is complete (the caller used it): stop generating more."""
        self._gen.cancel()


def _ended_at(gen: Any) -> float | None:
    at = (getattr(gen, "stats", None) or {}).get("ended_at")
    return float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None


def _errored(gen: Any) -> bool:
    """A generation that ended in an error (a lost connection): nothing follows it."""
    return getattr(gen, "finish_reason", None) == "error"


def load(
    target: str,
    model_dir: str | None,
    fallback: Callable[[], Any],
    precision: str | None = None,
    progress: Any = None,
) -> Any:
    """The model for `engine` = `target`: the engine service (a daemon that `auto` starts loads
    the model at `precision`), or (after MAX_FAILURES failed connections, a second apart) the
    in-process engine that `fallback` loads.  For `auto`, a catalogue name or hf: spec is
    resolved (and downloaded, `progress` hearing the bytes) here first: this server builds the
    prompts with the model's tokenizer, and the daemon it starts loads the same folder.  A daemon
    at a given URL holds the model: its configuration and tokenizer come from it (`model` only
    chooses among its models), so this machine needs neither the model nor the Hub."""
    spec = str(launch.resolve_models([model_dir], progress)[0]) if target == "auto" else model_dir
    for attempt in range(1, MAX_FAILURES + 1):
        try:
            return EngineServiceModel(target, spec, fallback=fallback, precision=precision)
        except EngineUnavailable as exc:
            log.warning(
                "engine service %s: %s (attempt %d of %d)", target, exc, attempt, MAX_FAILURES
            )
            if attempt < MAX_FAILURES:
                time.sleep(1.0)
    log.warning("the engine service %s is unavailable: using an in-process engine", target)
    model = fallback()
    model.notice = (
        f"The engine service at {target} is unavailable; generating in this process with "
        f"{model.name} until the server restarts"
    )
    return model
