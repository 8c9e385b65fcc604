"""The seam between the server and the engine: `Model` (what the services need from a loaded
model), `LocalModel` (the in-process engine behind it) and `ModelHost` (loads one in the
background); `model_argument` checks a `--model` the way `serve` and the session host take
it.

Every service reaches the engine through a `Model` and nothing else, so another backend (a remote
llama.cpp, Ollama or OpenAI server, the engine service over WebSocket) is one more class with
these few members:

- `generate(ids, params, slot, cancel=, speculative=, draft=, text=)`: a `Stream` of text chunks,
  stopped within one decode step by its `CancelToken` (see docs/ARCHITECTURE.md, "Cancellation");
  `text` (a `backends.TextPrompt`) is what the ids encode, for a model that tokenises on its side;
- `tokenizer` (the prompt builder counts, heals and finds the FIM tokens with it) and `context`;
- `name`, `config` (the architecture, for the wafer projection; None when unknown) and `status()`.

The model loads in a background thread after `initialized`, so the editor gets its capabilities
at once; requests that need it await `ready()` and get a clear error if loading failed or takes
longer than the `loadTimeoutS` setting.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from engine.cancel import CancelToken
from engine.heap import trim_heap
from engine.service.steering import SteeredGeneration

from . import preparation
from .backends import BackendError, TextPrompt, engine_ws, make_remote
from .backends.text_prompt import TextPromptBuilder
from .chat import load_chat_template
from .precision_job import decision_stored
from .prompt import PromptBuilder
from .settings import Settings

log = logging.getLogger(__name__)

INTERACTIVE_PREFILL_CHUNK = 256


def settle_heap() -> None:
    """Move everything alive now (the server, the model, its tokenizer: tens of thousands of
    long-lived objects) out of the cycle collector's reach, so a full collection, which holds the
    GIL and so every thread, is short and no longer delays a cancel or a token by tens of ms.
    Objects frozen before are unfrozen first, so a model this load replaced can be collected.
    Then the C heap's free pages, what the load and the collection freed, go back to the system
    (a session host's sessions each load their model in turn)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    trim_heap()


class BadModel(ValueError):
    """A --model that is neither a path nor a model name the hub knows."""


def model_argument(model: str | None) -> str | None:
    """`--model` as the server takes it: an existing path made absolute, a catalogue name or
    hf: spec as given, None for the bundled model; BadModel when it is none of these."""
    if model and os.path.exists(os.path.expanduser(model)):
        return os.path.abspath(os.path.expanduser(model))
    if model:
        from engine.config import ModelError
        from engine.hub import parse_spec

        try:
            hub = parse_spec(model)
        except ModelError:
            hub = None
        if hub is None:
            raise BadModel(
                f"--model {model}: not found (expected a model folder, a .gguf file, a "
                "catalogue name or hf:ORG/REPO)"
            )
    return model or None


class ModelNotReady(RuntimeError):
    """The model is still loading (after the timeout) or failed to load."""


class Stream(Protocol):
    """A running generation: iterate for chunks (each with `.text`); when it ends, read
    `finish_reason` ('stop', 'eos', 'length', 'time' or 'cancelled') and `stats`."""

    finish_reason: str | None
    stats: dict

    def __iter__(self) -> Iterator[Any]: ...

    def cancel(self) -> None:
        """Stop this generation only (its caller's token is left alone)."""

    # A steerable stream (Model.generate(..., steerable=True)) also has:
    #
    # def steer(self, text: str) -> None:
    #     """The user typed `text` after what they typed before (all of it relative to the start
    #     of the output); from any thread, returns at once. Typed text that the output spells
    #     lets it go on; typed text that differs stops it and a successor continues after the
    #     typed text (the engine service's `steer`, docs/engine-protocol.md): a chunk with
    #     `at` = n (not None) then says the output is now its first n characters + the chunk's
    #     text (the rest of the typed text), and the successor's chunks follow."""


class Model(Protocol):
    """What the services need from a loaded model."""

    name: str
    context: int | None  # tokens it holds, prompt and new together; None when unknown
    #: where its generations run, as the editor's status shows it ("in-process", "engine
    #: service ws://…", "llamacpp http://…")
    where: str
    tokenizer: Any  # engine.tokenizer.Tokenizer
    config: Any  # engine.config.ModelConfig, or None

    def generate(
        self,
        ids: list[int],
        params: Any,
        slot: str,
        *,
        cancel: CancelToken,
        speculative: bool = False,
        draft: str | None = None,
        text: TextPrompt | None = None,
        steerable: bool = False,
    ) -> Stream:
        """Start a generation of `ids` with `params` (engine.GenerationParams) reusing the KV of
        `slot`; `speculative`: greedy generations may verify drafted tokens (output identical),
        `draft` the text being rewritten; `text`: what `ids` encode (remote backends read it
        instead of the ids); `steerable` (only asked of a model whose `steerable` is True): the
        stream takes `steer(text)`, see `Stream.steer`. Work happens while the stream is
        iterated."""

    def status(self) -> dict:
        """What `spark/metrics` shows about the model (name, context, precision...)."""


class LocalModel:
    """The in-process engine (engine.Engine) as a Model."""

    steerable = True
    where = "in-process"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.model_dir = getattr(engine, "model_dir", None)
        self.needs_tuning = False  # loaded by the static precision rule (see precision_job)
        self.name = str(getattr(engine, "name", None) or "model")
        self.tokenizer = engine.tokenizer
        self.config = getattr(engine, "config", None)
        self.notice: str | None = None  # why it runs here, when the setting asked otherwise
        n = getattr(engine, "context", None) or getattr(
            self.config, "max_position_embeddings", None
        )
        self.context = int(n) if isinstance(n, int) else None
        from engine import speculative  # loads with the engine, not with the server

        self._speculative = speculative

    @classmethod
    def load(
        cls,
        model_dir: str | None,
        precision: str = "auto",
        progress: Any = None,
        slots: int = 4,
        spinning: bool | None = None,
    ) -> LocalModel:
        """Load `model_dir` (None: the bundled default; a folder, a .gguf file, a catalogue name
        or hf:ORG/REPO[:FILE], downloaded on first use with `progress` reports) and warm it up.
        `slots`: documents whose KV prefix the engine keeps (allocated as they are used);
        `spinning`: ONNX Runtime's threads spin between steps (None: while the CPU is calm)."""
        from engine import Engine
        from engine.hub import resolve_model

        path = resolve_model(model_dir, progress=progress)
        eng = Engine.load(model_dir=path, slots=slots, precision=precision, spinning=spinning)
        if isinstance(getattr(eng, "prefill_chunk", None), int):
            # a cancel waits for the prefill run in flight: keep runs short
            eng.prefill_chunk = min(eng.prefill_chunk, INTERACTIVE_PREFILL_CHUNK)
        model = cls(eng)
        model.warm_up()
        # "auto" without a stored decision ran the static rule: the server measures one later
        model.needs_tuning = precision == "auto" and not decision_stored(eng.model_dir)
        return model

    def generate(
        self,
        ids: list[int],
        params: Any,
        slot: str,
        *,
        cancel: CancelToken,
        speculative: bool = False,
        draft: str | None = None,
        text: TextPrompt | None = None,
        steerable: bool = False,
    ) -> Stream:
        def start(ids: list[int], params: Any) -> Any:
            if speculative and getattr(params, "temperature", 0.0) == 0.0:
                return self._speculative.generate(
                    self.engine, ids, params, slot, draft=draft, cancel=cancel
                )
            return self.engine.generate(ids, params, slot=slot, cancel=cancel)

        if steerable:  # steered here, as the engine service steers its generations
            return SteeredGeneration(start, ids, params, self.tokenizer.encode)
        return start(ids, params)

    def warm_up(self) -> None:
        """One short generation so ONNX Runtime's first-run setup is not paid by the first
        suggestion (a cold first run also takes far longer to cancel), the speculative decoder's
        calibration, and meanwhile, on another thread, the vocabulary's byte index, which the
        first token-healed suggestion would otherwise build (a second of Python for a 152k
        vocabulary: it runs while ONNX Runtime, which releases the GIL, does the warm-up)."""
        from engine import GenerationParams

        if callable(getattr(self.tokenizer, "build_byte_index_in_background", None)):
            self.tokenizer.build_byte_index_in_background()
        elif callable(getattr(self.tokenizer, "byte_index", None)):
            self.tokenizer.byte_index()

        ids = self.tokenizer.encode("def add(a, b):\n    return a + b\n\n\n" * 8)[:120]
        for prompt in (ids, ids + ids[-1:]):  # a prefill, then a one-token step on top of it
            for _ in self.engine.generate(
                prompt, GenerationParams(max_new_tokens=3), slot="__warm_up__"
            ):
                pass
        # speculative decoding measures its pass cost and rounding noise once per engine: here,
        # not in the first suggestion
        self._speculative.verify_margin(self.engine, ids)

    def status(self) -> dict:
        return {
            "name": self.name,
            "context": self.context,
            "precision": getattr(self.engine, "precision", None),
            "precisionReason": getattr(self.engine, "precision_reason", ""),
        }


#: KV slots of a model the session host shares: several sessions' documents and edits.
SHARED_SLOTS = 8


class SharedModels:
    """The models of a session host (`spark_lsp.session_host`), one `LocalModel` per model folder
    and precision, shared by every session that configures it: one copy of the weights, one KV
    cache pool and one tokenizer per model in the process.

    Why sessions use the engine directly rather than through an in-process engine daemon: the
    engine serialises its runs step by step under its lock (`Engine.lock`), so several sessions'
    engine threads generate at once, interleaved per decode step, exactly as the daemon's worker
    threads do (`engine.service.local.LocalModels`); and a session then runs the very code of
    `serve --stdio` with `engine: local` (speculative decoding, warm-up, steering through
    `SteeredGeneration`, cancel through the job's token, precision status), with no socket, no
    second protocol and nothing a daemon client leaves out.

    `acquire` returns a `SharedModel` (a `Model`) for one session; its `close()` gives it back,
    and a model nobody holds any more is dropped (its memory returns with the next collection).
    Two sessions asking for the same model at once load it once: the second waits for the first.
    """

    def __init__(self, slots: int = SHARED_SLOTS, spinning: bool | None = False) -> None:
        self.slots = slots
        self.spinning = spinning
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], _SharedEntry] = {}
        self._ids = itertools.count(1)

    def acquire(
        self, model_dir: str | None, precision: str = "auto", progress: Any = None
    ) -> SharedModel:
        """The shared model for `model_dir` at `precision`, loading it if no session holds it."""
        from engine.hub import resolve_model
        from engine.models import default_model_dir

        path = resolve_model(model_dir, progress=progress) or default_model_dir()
        key = (str(Path(path).resolve()), precision)
        with self._lock:
            entry = self._entries.get(key)
            first = entry is None
            if first:
                entry = self._entries[key] = _SharedEntry()
            entry.refs += 1  # held while loading too, so a failed load is not waited on forever
        if first:
            try:
                entry.model = LocalModel.load(
                    path, precision, progress, slots=self.slots, spinning=self.spinning
                )
            except BaseException as exc:
                entry.error = exc
                with self._lock:
                    self._entries.pop(key, None)
                raise
            finally:
                entry.ready.set()
        else:
            entry.ready.wait()
            if entry.error is not None:
                with self._lock:
                    entry.refs -= 1
                raise entry.error
        # the background precision measurement runs once per model, not once per session
        tune = first and entry.model.needs_tuning
        return SharedModel(self, key, entry, next(self._ids), tune)

    def release(self, key: tuple[str, str], entry: _SharedEntry) -> None:
        with self._lock:
            entry.refs -= 1
            if entry.refs <= 0 and self._entries.get(key) is entry:
                del self._entries[key]

    def sessions(self, key: tuple[str, str]) -> int:
        """How many sessions hold the model of `key`."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.refs if entry is not None else 0

    def describe(self) -> list[dict]:
        """The loaded models: folder, precision and how many sessions share each."""
        with self._lock:
            return [
                {"model": k[0], "precision": k[1], "sessions": e.refs}
                for k, e in self._entries.items()
                if e.model is not None
            ]


class _SharedEntry:
    def __init__(self) -> None:
        self.model: LocalModel | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.refs = 0


class SharedModel:
    """One session's use of a model the session host shares (see `SharedModels`): the
    `LocalModel`'s members, with the session's KV slots named apart from other sessions' (two
    editors with the same file open each keep their own prefix) and forgotten when it closes."""

    steerable = True
    where = "session host (one engine for its editors)"

    def __init__(
        self, owner: SharedModels, key: tuple[str, str], entry: _SharedEntry, n: int, tune: bool
    ) -> None:
        self._owner, self._key, self._entry = owner, key, entry
        self.shared: LocalModel = entry.model
        self.engine = self.shared.engine
        self.model_dir = self.shared.model_dir
        self.name = self.shared.name
        self.tokenizer = self.shared.tokenizer
        self.config = self.shared.config
        self.context = self.shared.context
        self.needs_tuning = tune
        self.notice: str | None = None  # this session's (LocalModel.notice)
        self.prefix = f"session-{n}:"
        self._slots: set[str] = set()
        self._closed = False

    def generate(
        self,
        ids: list[int],
        params: Any,
        slot: str,
        *,
        cancel: CancelToken,
        speculative: bool = False,
        draft: str | None = None,
        text: TextPrompt | None = None,
        steerable: bool = False,
    ) -> Stream:
        name = self.prefix + slot
        self._slots.add(name)
        return self.shared.generate(
            ids,
            params,
            name,
            cancel=cancel,
            speculative=speculative,
            draft=draft,
            text=text,
            steerable=steerable,
        )

    def status(self) -> dict:
        return {**self.shared.status(), "sharedBy": self._owner.sessions(self._key)}

    def close(self) -> None:
        """Give the model back: this session's KV slots are freed; the last session's close
        drops the model."""
        if self._closed:
            return
        self._closed = True
        forget = getattr(self.engine, "forget", None)
        if callable(forget):
            forget(self._slots)
        self._owner.release(self._key, self._entry)


#: The session host's models (`SharedModels`) when this process is a session host, else None:
#: then every server loads its own engine, as `serve --stdio` does.
SHARED: SharedModels | None = None


def load_local(model_dir: str | None, precision: str, progress: Any = None) -> Any:
    """The in-process engine for `model_dir`: the session host's shared one, else a new one."""
    if SHARED is not None:
        return SHARED.acquire(model_dir, precision, progress)
    return LocalModel.load(model_dir, precision, progress)


class ModelHost:
    """The one loaded Model, its prompt builder and chat template; loads in the background."""

    def __init__(self) -> None:
        self.model: Model | None = None
        self.builder: PromptBuilder | None = None
        self.params_cls: Any = None  # engine.GenerationParams, once loaded
        self.chat: Any = None  # ChatTemplate of a chat model, else None
        self.model_dir: str | None = None
        self.error: str | None = None
        self.load_s: float | None = None
        self._event: asyncio.Event | None = None
        self._loading = False
        self._generation = 0

    @property
    def loaded(self) -> bool:
        return self.model is not None

    @property
    def started(self) -> bool:
        """A load has begun (the client sent `initialized`)."""
        return self._event is not None

    @property
    def name(self) -> str:
        return str(getattr(self.model, "name", None) or self.model_dir or "model")

    def expect(self) -> None:
        """A load is about to start: requests from now on wait for it (call on the event loop)."""
        if self._event is None or self._event.is_set():
            self._event = asyncio.Event()
        self._loading = True

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        model_dir: str | None,
        on_done: Callable[[bool, str], None] | None = None,
        precision: str = "auto",
        progress: Callable[[int, int | None, str], None] | None = None,
        fim_format: str = "auto",
        steps: Callable[[str], None] | None = None,
        engine: str = "local",
    ) -> None:
        """Begin loading `model_dir` (None: the bundled default) in a background thread.

        `engine`: 'local' runs the engine in this process; 'auto' or a ws:// URL runs it in the
        engine service (`backends.engine_ws`), falling back to this process when unreachable.

        `precision` 'auto' loads the decision `spark-lsp tune` stored for this model and machine,
        else the engine's static rule (engine.precision); loading never measures. `steps(line)`
        hears what the load does (building the graph, compiling the native op), as it happens."""
        self._generation += 1
        gen = self._generation
        self.expect()
        self.error = None
        self.model_dir = model_dir
        event = self._event

        def work() -> None:
            t0 = time.perf_counter()
            try:
                from engine import GenerationParams
                from engine.fim import FimFormat

                with preparation.reporting(steps):  # graph build, op compile, precision
                    if engine == "local":
                        model = load_local(model_dir, precision, progress)
                    else:
                        model = engine_ws.load(
                            engine,
                            model_dir,
                            lambda: load_local(model_dir, precision, progress),
                            precision,
                            progress,
                        )
                fim = (
                    FimFormat.detect(model.tokenizer, fim_format) if fim_format != "auto" else None
                )
                builder = PromptBuilder(model.tokenizer, fim=fim)
                chat = load_chat_template(
                    getattr(model.tokenizer, "chat", None), model.name, builder.fim is not None
                )
                ok, msg = True, ""
            except BaseException as exc:  # report, never crash the server
                log.exception("model load failed")
                model, builder, chat, ok = None, None, None, False
                msg = f"cannot load model {model_dir or '(bundled default)'}: {exc}"

            def finish() -> None:
                if gen != self._generation:  # a newer load (or close) superseded this one
                    if ok and callable(getattr(model, "close", None)):
                        model.close()  # a shared model is given back
                    return
                self._loading = False
                if ok:
                    self._replace(model)
                    self.builder, self.params_cls = builder, GenerationParams
                    self.chat = chat
                    self.load_s = time.perf_counter() - t0
                    settle_heap()
                else:
                    self.error = msg
                event.set()
                if on_done is not None:
                    on_done(ok, msg)

            try:
                loop.call_soon_threadsafe(finish)
            except RuntimeError:
                pass

        threading.Thread(target=work, name="spark-model-load", daemon=True).start()

    def start_remote(
        self, settings: Settings, on_done: Callable[[bool, str], None] | None = None
    ) -> None:
        """Generate with the remote backend the settings name (`spark_lsp.backends`): its client
        is made at once; the server is first contacted by the first request."""
        from engine import GenerationParams

        self._generation += 1
        self.expect()
        self.model_dir = None
        t0 = time.perf_counter()
        try:
            model, ok, msg = make_remote(settings), True, ""
        except BackendError as exc:
            model, ok, msg = None, False, f"cannot use the {settings.backend} backend: {exc}"
        self._loading = False
        self._replace(model)
        self.builder = TextPromptBuilder() if ok else None
        self.params_cls, self.chat = GenerationParams, None
        self.error = None if ok else msg
        self.load_s = time.perf_counter() - t0
        self._event.set()
        if on_done is not None:
            on_done(ok, msg)

    def _replace(self, model: Model | None) -> None:
        old, self.model = self.model, model
        if old is not None and old is not model and callable(getattr(old, "close", None)):
            old.close()  # a remote backend's connections and I/O thread

    def close(self) -> None:
        self._generation += 1  # a load still running is given back when it ends
        self._replace(None)

    async def ready(self, timeout: float) -> None:
        """Wait until the model is loaded; raise ModelNotReady on failure or timeout."""
        if self.model is not None and not self._loading:
            return
        if self._event is None:
            raise ModelNotReady(
                "the model is not loaded (the client has not sent 'initialized' yet)"
            )
        try:
            await asyncio.wait_for(asyncio.shield(self._event.wait()), timeout)
        except asyncio.TimeoutError:
            raise ModelNotReady(
                f"the model is still loading after {timeout:g} s (raise the 'loadTimeoutS' setting)"
            ) from None
        if self.error:
            raise ModelNotReady(self.error)
