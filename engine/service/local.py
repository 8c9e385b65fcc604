"""Models served from this process: loaded ``Engine`` objects, each generation in its own thread.

A generation iterates in a worker thread (the engine's lock is held per step, so generations on
different slots interleave) and hands every chunk to a :class:`Sink`, which (in the daemon)
writes it to the client's socket from that thread.  Before each chunk the sink's ``credit``
blocks the thread while the client is behind, so a slow reader holds the generation instead of
growing a queue.  Worker threads are kept (:class:`Workers`) and reused by the next generation:
starting a thread for every request would put a thread start on every request's way to its
first token.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..cancel import CancelToken
from ..config import ModelError
from .model_files import ServedFiles

if TYPE_CHECKING:
    from ..engine import Engine
    from ..generate import Generation, GenerationParams
    from ..tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where a running generation delivers its output (callable from any thread)."""

    def chunk(self, token_id: int, text: str, stats: dict[str, Any] | None = None) -> None:
        """One chunk; the first carries the generation's stats so far (prompt and reused
        tokens, TTFT), which a client needs before the end to report them."""
        ...

    def finish(
        self, finish_reason: str, stats: dict[str, Any], error: tuple[str, str] | None
    ) -> None: ...

    def credit(self, stop: threading.Event, timeout: float) -> bool:
        """Wait up to ``timeout`` s for room to deliver one chunk; False if there is none yet."""
        ...


def describe(engine: Engine) -> dict[str, Any]:
    """One model's entry in the ``hello`` reply."""
    tok = engine.tokenizer
    fim = getattr(tok, "fim", None)
    return {
        "name": engine.name,
        "context": int(engine.context),
        "vocab_size": int(engine.config.vocab_size),
        "eos_ids": sorted(int(i) for i in engine.eos_ids),
        "bos_id": engine.config.bos_token_id,
        "fim": fim is not None,
        "precision": getattr(engine, "precision", "fp32"),
        "slots": int(engine.slots),
    }


class Workers:
    """Threads that run generations, one generation per thread at a time.

    A submitted job goes to an idle thread, or to a new one when none is idle (generations wait
    for the client and for the engine's lock, so a fixed-size pool could starve one client behind
    another's slow reader).  A thread idle for ``idle_s`` exits.  The threads are daemons, like
    the per-generation threads they replace (``concurrent.futures`` workers are joined at exit
    and never retire).
    """

    def __init__(self, name: str = "spark-engine-gen", idle_s: float = 60.0) -> None:
        self.name = name
        self.idle_s = idle_s
        self._cond = threading.Condition()
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._idle = 0
        self.threads = 0  # alive (for tests and status)

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._jobs.append(job)
            if self._idle >= len(self._jobs):
                self._cond.notify()
                return
            self.threads += 1
        threading.Thread(target=self._loop, name=self.name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while not self._jobs:
                    if not self._cond.wait(self.idle_s) and not self._jobs:
                        self._idle -= 1
                        self.threads -= 1
                        return
                self._idle -= 1
                job = self._jobs.popleft()
            try:
                job()
            except BaseException:  # a job reports its own errors; the thread must survive
                log.exception("engine worker job failed")


class LocalRun:
    """A generation running on a worker thread; ``cancel()`` stops it within one decode step.

    The worker itself creates the ``Generation`` (``start(cancel_token, stop_flag)``), so the engine's TTFT
    counts from when the engine takes the request, as in-process, and the hand-over to the worker
    is part of the service's own overhead."""

    def __init__(self, start: Callable[[CancelToken, Any], Generation], sink: Sink) -> None:
        self._start = start  # (cancel token, the client's shared cancel flag or None)
        self.gen: Generation | None = None
        self.sink = sink
        self.stop_flag = getattr(sink, "stop_flag", None)  # a daemon sink's, for its client
        self._stop = threading.Event()
        self._token = CancelToken()

    def cancel(self) -> None:
        self._stop.set()
        self._token.cancel("generation cancelled")

    def work(self) -> None:
        error = None
        try:
            self.gen = self._start(self._token, self.stop_flag)
            first = True
            for chunk in self.gen:
                while not self._stop.is_set() and not self.sink.credit(self._stop, 0.05):
                    pass
                if self._stop.is_set():
                    self.gen.cancel()  # the next step ends the iteration with 'cancelled'
                    continue
                # the sink reads the stats at once (on this thread): no copy
                self.sink.chunk(int(chunk.token_id), chunk.text, self.gen.stats if first else None)
                first = False
        except ModelError as e:
            error = ("engine_error", str(e))
        except Exception as e:  # an engine failure ends this generation, never the service
            log.exception("generation failed")
            error = ("engine_error", f"{type(e).__name__}: {e}")
        ended = time.perf_counter()
        gen = self.gen
        reason = (gen.finish_reason if gen is not None else None) or "cancelled"
        if error is not None:
            reason = "error"
        stats = dict(gen.stats) if gen is not None else {}
        if self.stop_flag is not None:
            # the client shares our memory, so our clock too: when the engine stopped
            stats["ended_at"] = ended
        self.sink.finish(reason, stats, error)


def slot_key(slot: str | None) -> tuple[str, str] | None:
    """The engine's KV slot of a client's slot key, in the service's own namespace of slots
    (apart from other callers of the same engine: the SSE endpoint keeps ``("sse", key)``)."""
    return ("service", slot) if slot is not None else None


class LocalModels:
    """The models of a daemon (or a test): ``Engine`` objects by name; the first is the default.
    ``offer_files``: take the digest of each model's prompt files, which ``hello`` then names
    and ``prompt_files`` sends (``engine.service.model_files``)."""

    def __init__(self, engines: Sequence[Engine], offer_files: bool = True) -> None:
        if not engines:
            raise ValueError("at least one engine is needed")
        self.engines: dict[str, Engine] = {}
        for eng in engines:
            if eng.name in self.engines:
                raise ValueError(f"two models are named {eng.name!r}")
            self.engines[eng.name] = eng
        self.default = next(iter(self.engines))
        self.workers = Workers()
        self.files = ServedFiles()  # the models' prompt files, for clients elsewhere
        if offer_files:
            for eng in self.engines.values():
                self.files.offer(eng.model_dir, eng.tokenizer)

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for eng in self.engines.values():
            info = describe(eng)
            digest = self.files.digest(eng.model_dir)
            if digest is not None:
                info["files"] = digest
            out.append(info)
        return out

    def prompt_files(self, name: str | None) -> tuple[str, dict[str, str], str]:
        """(name, prompt files, digest) of a model (``engine.service.model_files``)."""
        eng = self.get(name)
        return (eng.name, *self.files.read(eng.model_dir, eng.tokenizer))

    def get(self, name: str | None) -> Engine:
        eng = self.engines.get(name or self.default)
        if eng is None:
            raise KeyError(name)
        return eng

    def tokenizer(self, name: str | None) -> Tokenizer:
        return self.get(name).tokenizer

    def encode(self, name: str | None, prompt: str | list[int]) -> list[int]:
        """Checked token ids of a prompt (ValueError / ModelError when it cannot run)."""
        return self.get(name).encode_prompt(prompt)

    def start(
        self,
        name: str | None,
        ids: list[int],
        params: GenerationParams,
        slot: str | None,
        sink: Sink,
    ) -> LocalRun:
        eng = self.get(name)
        key = slot_key(slot)
        run = LocalRun(
            lambda token, flag: eng.generate(ids, params, slot=key, cancel=token, stop_flag=flag),
            sink,
        )
        self.workers.submit(run.work)
        return run

    def status(self) -> list[dict[str, Any]]:
        out = []
        for eng in self.engines.values():
            d = describe(eng)
            d["cached_slots"] = len(eng.cached_slots())
            out.append(d)
        return out

    def close(self) -> None:
        """Nothing to release beyond the engines (their sessions close with the process)."""
