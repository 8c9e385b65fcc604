"""One engine thread, at most one job per document, each cancelled through its CancelToken.

Why a dedicated thread: model work on the event loop or pygls' thread pool could stall reading
`$/cancelRequest`. Handlers stay async and await a Job's future; the job runs here.
Why one job per document: a newer request for the same document makes the older one useless, so
submitting cancels it (queued: dropped; running: stopped within one decode step).
Why cooperative steps: a job may be a generator that yields after every decode step; the thread
then takes the running jobs in turn, one step each, so a long streamed edit in one document does
not hold up a suggestion in another (each document keeps its own KV slot in the engine).
Cancellation (docs/ARCHITECTURE.md): a job's CancelToken reaches the engine; a job stopped by it
resolves its future with `Cancelled` (engine.cancel), re-exported here.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.cancel import Cancelled, CancelToken

log = logging.getLogger(__name__)

__all__ = ["Cancelled", "Job", "Scheduler", "run_job"]


class Job:
    """A unit of engine work for one key (document URI), cancelled through its CancelToken.

    `parent`: a token whose cancel cancels the job too (a live edit's session); the job's own
    token is passed to the engine, which stops within one decode step."""

    def __init__(
        self,
        key: str,
        fn: Callable[[Job], Any],
        loop: asyncio.AbstractEventLoop,
        kind: str = "completion",
        slot: str | None = None,
        parent: CancelToken | None = None,
    ):
        self.key = key
        self.slot = slot if slot is not None else key  # engine prefix-cache slot
        self.kind = kind
        self.fn = fn
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        # the awaiting handler may be gone (cancelled); mark the outcome as seen either way
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.t_submit = time.perf_counter()
        self.t_start: float | None = None
        self.t_cancel: float | None = None
        self.t_stopped: float | None = None  # when the engine stopped after a cancel
        # the generation stops on its own after a cancel (a remote engine): the job ends at
        # once, and `t_stopped` is set when the engine says it stopped (`when_stopped`)
        self.stopping = False
        self._stopped_lock = threading.Lock()
        self._on_stopped: Callable[[Job], None] | None = None
        self.token = parent.child() if parent is not None else CancelToken()
        self.token.on_cancel(self._cancelled_at)
        self.steering: Any = None  # a live edit's live_edits.Steering: the user's typing steers it

    def _cancelled_at(self, reason: str) -> None:
        self.t_cancel = time.perf_counter()

    @property
    def cancelled(self) -> bool:
        return self.token.cancelled

    @property
    def reason(self) -> str:
        return self.token.reason

    def cancel(self, reason: str = "cancelled") -> None:
        self.token.cancel(reason)

    def check(self) -> None:
        """Raise Cancelled if the job was cancelled."""
        self.token.check()

    def mark_stopped(self, at: float | None = None) -> None:
        """Called by the job when its generation has actually ended (from any thread); times
        the cancel latency.  ``at``: when the engine stopped, on this process's
        ``time.perf_counter()`` clock, if the engine said so (a daemon on this machine: its
        ``done`` comes later than its stop); now if not."""
        with self._stopped_lock:
            if not self.cancelled or self.t_stopped is not None:
                return
            now = time.perf_counter()
            t_cancel = self.t_cancel if self.t_cancel is not None else now
            # a time outside cancel..now is not this stop's (another clock): not used
            self.t_stopped = at if at is not None and t_cancel <= at <= now else now
            fn, self._on_stopped = self._on_stopped, None
        if fn is not None:
            fn(self)

    def when_stopped(self, fn: Callable[[Job], None]) -> None:
        """Run ``fn(job)`` once ``t_stopped`` is set (now, if it is)."""
        with self._stopped_lock:
            if self.t_stopped is None:
                self._on_stopped = fn
                return
        fn(self)

    def call_soon(self, fn: Callable, *args: Any) -> None:
        """Run fn(*args) on the event loop (from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _resolve(self, result: Any = None, exc: BaseException | None = None) -> None:
        def settle() -> None:
            if self.future.done():
                return
            if exc is not None:
                self.future.set_exception(exc)
            else:
                self.future.set_result(result)

        self.call_soon(settle)


class Scheduler:
    """Jobs over documents on a dedicated engine thread: new jobs start in arrival order, running
    generator jobs advance one decode step each in turn (round-robin across documents)."""

    def __init__(self, name: str = "spark-engine"):
        self._cond = threading.Condition()
        self._queue: collections.OrderedDict[str, Job] = collections.OrderedDict()
        self._active: collections.OrderedDict[str, tuple[Job, Any]] = collections.OrderedDict()
        self._stop = False
        self.cancel_latencies_ms: collections.deque[float] = collections.deque(maxlen=1000)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        """Queue `job`, superseding any queued or running job of the same key."""
        with self._cond:
            old = self._queue.pop(job.key, None)
            if old is not None:
                old.cancel("superseded")
                old._resolve(exc=Cancelled("superseded"))
            running = self._active.get(job.key)
            if running is not None:
                running[0].cancel("superseded")
            self._queue[job.key] = job
            self._cond.notify()
        return job

    def cancel(self, key: str, reason: str = "cancelled", kind: str | None = None) -> bool:
        """Cancel the queued and running job of `key` (only of that kind when given)."""
        hit = False
        with self._cond:
            q = self._queue.get(key)
            if q is not None and (kind is None or q.kind == kind):
                del self._queue[key]
                q.cancel(reason)
                q._resolve(exc=Cancelled(reason))
                hit = True
            r = self._active.get(key)
            if r is not None and (kind is None or r[0].kind == kind):
                r[0].cancel(reason)
                hit = True
        return hit

    def busy(self, key: str | None = None) -> bool:
        with self._cond:
            if key is None:
                return bool(self._active) or bool(self._queue)
            return key in self._active or key in self._queue

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            for job in self._queue.values():
                job.cancel("shutdown")
                job._resolve(exc=Cancelled("shutdown"))
            self._queue.clear()
            for job, _ in self._active.values():
                job.cancel("shutdown")
            self._cond.notify_all()

    def join(self, timeout: float) -> bool:
        """Wait (after `shutdown`) for the engine thread to leave the model; False if it did not
        within `timeout`. A process must not exit while the thread is inside ONNX Runtime: its
        thread pool's destructor then aborts the process."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _finish(self, job: Job, result: Any = None, error: BaseException | None = None) -> None:
        # record before resolving, so whoever awaits the job sees its cancel latency (a job
        # whose remote engine stops on its own: when the engine says it has)
        if job.cancelled and job.t_cancel is not None:
            if job.stopping:
                job.when_stopped(self._record_cancel)
            else:
                job.mark_stopped()
                self._record_cancel(job)
        with self._cond:
            if self._active.get(job.key, (None,))[0] is job:
                del self._active[job.key]
        job._resolve(result, error)

    def _record_cancel(self, job: Job) -> None:
        self.cancel_latencies_ms.append((job.t_stopped - job.t_cancel) * 1e3)

    def _step(self, job: Job, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Run one piece of a job; (done, result). Errors finish the job."""
        try:
            if job.cancelled:
                raise Cancelled(job.reason)
            return False, fn()
        except StopIteration as stop:
            if job.cancelled:
                self._finish(job, error=Cancelled(job.reason))
            else:
                self._finish(job, stop.value)
        except Cancelled as exc:
            self._finish(job, error=exc)
        except BaseException as exc:  # never let a job kill the engine thread
            if getattr(exc, "expected", False):  # an answer for the user (e.g. an edit refused)
                log.info("engine job %s for %s: %s", job.kind, job.key, exc)
            else:
                log.exception("engine job %s for %s failed", job.kind, job.key)
            self._finish(job, error=exc)
        return True, None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._active and not self._stop:
                    self._cond.wait()
                if self._stop:
                    for _job, gen in list(self._active.values()):
                        if inspect.isgenerator(gen):
                            gen.close()
                    return
                started = None
                if self._queue:
                    _, started = self._queue.popitem(last=False)
                    if started.key in self._active:  # its cancelled predecessor still drains
                        self._queue[started.key] = started
                        self._queue.move_to_end(started.key, last=False)
                        started = None
            if started is not None:
                started.t_start = time.perf_counter()
                with self._cond:  # visible to submit()/cancel() while its first piece runs
                    self._active[started.key] = (started, None)
                done, result = self._step(started, lambda: started.fn(started))
                if done:
                    continue
                if inspect.isgenerator(result):
                    with self._cond:
                        self._active[started.key] = (started, result)
                else:
                    if started.cancelled:
                        self._finish(started, error=Cancelled(started.reason))
                    else:
                        self._finish(started, result)
                    continue
            with self._cond:
                if not self._active:
                    continue
                key, (job, gen) = next(iter(self._active.items()))
                self._active.move_to_end(key)  # round-robin: next time another job steps first
            if gen is not None:
                self._step(job, lambda: next(gen))


async def run_job(scheduler: Scheduler, job: Job) -> Any:
    """Submit and await `job`; if the awaiting task is cancelled (pygls `$/cancelRequest`), cancel
    the job so the engine stops within one decode step, then re-raise."""
    scheduler.submit(job)
    try:
        return await asyncio.shield(job.future)
    except asyncio.CancelledError:
        job.cancel("request cancelled")
        raise
