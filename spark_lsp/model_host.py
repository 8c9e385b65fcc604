"""Loads the engine once, off the event loop, and lets requests wait for it.

The model loads in a background thread after `initialized` so the editor gets its capabilities at
once; requests that need the model await `ready()` and get a clear error if loading failed or takes
longer than the `loadTimeoutS` setting.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable

from .prompt import PromptBuilder

log = logging.getLogger(__name__)


class ModelNotReady(RuntimeError):
    """The model is still loading (after the timeout) or failed to load."""


INTERACTIVE_PREFILL_CHUNK = 256


def warm_up(engine: Any, params_cls: Any) -> None:
    """One short generation so ONNX Runtime's first-run setup is not paid by the first suggestion
    (a cold first run also takes far longer to cancel)."""
    text = "def add(a, b):\n    return a + b\n\n\n" * 8
    ids = engine.tokenizer.encode(text)[:120]
    for n in (len(ids), 1):  # a prefill, then a one-token step on top of it
        for _ in engine.generate(ids[:n] if n > 1 else ids + ids[-1:], params_cls(max_new_tokens=3),
                                 slot="__warm_up__"):
            pass


class ModelHost:
    def __init__(self) -> None:
        self.engine: Any = None
        self.builder: PromptBuilder | None = None
        self.params_cls: Any = None
        self.chat: Any = None           # ChatTemplate of a chat model, else None
        self.model_dir: str | None = None
        self.error: str | None = None
        self.load_s: float | None = None
        self._event: asyncio.Event | None = None
        self._loading = False
        self._generation = 0

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    @property
    def started(self) -> bool:
        """A load has begun (the client sent `initialized`)."""
        return self._event is not None

    @property
    def name(self) -> str:
        return str(getattr(self.engine, "name", None) or self.model_dir or "model")

    def expect(self) -> None:
        """A load is about to start: requests from now on wait for it (call on the event loop)."""
        if self._event is None or self._event.is_set():
            self._event = asyncio.Event()
        self._loading = True

    def start(self, loop: asyncio.AbstractEventLoop, model_dir: str | None,
              on_done: Callable[[bool, str], None] | None = None, precision: str = "auto") -> None:
        """Begin loading `model_dir` (None: the bundled default) in a background thread.

        `precision` 'auto' loads the decision `spark-lsp tune` stored for this model and machine,
        else the engine's static rule (engine.precision); loading never measures."""
        self._generation += 1
        gen = self._generation
        self.expect()
        self.error = None
        self.model_dir = model_dir
        event = self._event

        def work() -> None:
            t0 = time.perf_counter()
            try:
                from engine import Engine, GenerationParams

                eng = Engine.load(model_dir=model_dir, slots=4, precision=precision)
                if isinstance(getattr(eng, "prefill_chunk", None), int):
                    # a cancel waits for the prefill run in flight: keep runs short (on this
                    # 2-core CPU 256-token runs also prefill faster than 1,024-token ones)
                    eng.prefill_chunk = min(eng.prefill_chunk, INTERACTIVE_PREFILL_CHUNK)
                warm_up(eng, GenerationParams)
                builder = PromptBuilder(eng.tokenizer)
                from .chat import load_chat_template
                chat = load_chat_template(getattr(eng, "model_dir", model_dir), str(getattr(eng, "name", "")),
                                          builder.fim is not None)
                ok, msg = True, ""
            except BaseException as exc:  # report, never crash the server
                log.exception("model load failed")
                eng, builder, chat, ok = None, None, None, False
                msg = f"cannot load model {model_dir or '(bundled default)'}: {exc}"

            def finish() -> None:
                if gen != self._generation:
                    return  # a newer load superseded this one
                self._loading = False
                if ok:
                    self.engine, self.builder, self.params_cls = eng, builder, GenerationParams
                    self.chat = chat
                    self.load_s = time.perf_counter() - t0
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

    async def ready(self, timeout: float) -> None:
        """Wait until the model is loaded; raise ModelNotReady on failure or timeout."""
        if self.engine is not None and not self._loading:
            return
        if self._event is None:
            raise ModelNotReady("the model is not loaded (the client has not sent 'initialized' yet)")
        try:
            await asyncio.wait_for(asyncio.shield(self._event.wait()), timeout)
        except asyncio.TimeoutError:
            raise ModelNotReady(f"the model is still loading after {timeout:g} s "
                                "(raise the 'loadTimeoutS' setting)") from None
        if self.error:
            raise ModelNotReady(self.error)
