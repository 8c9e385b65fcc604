"""The user's running engine services: list them, ask each whether it answers, stop them.

What `spark-lsp engine list` and `spark-lsp engine stop` do.  Everything starts from the records
the daemons (and `engine serve --ray`) leave in the user's private runtime dir
(``engine.service.rundir``): a detached daemon that `engine: auto` started is otherwise only a
process id to hunt for, and it lives until it has had no client for its idle time.

A record names a process id, and process ids are reused: a stop signals the process only while
it is still the one that wrote the record (its start time, which the record keeps, is the
process's own), so a stale record never gets an unrelated process of the user killed.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ModelError, model_name
from ..hub import served_name
from . import rundir, tls
from .client_core import EngineUnavailable

#: Seconds a liveness check may take to connect and answer before a service counts as silent.
CHECK_TIMEOUT_S = 3.0
#: Seconds `stop` waits for a service to exit after SIGTERM (it cancels its generations first).
STOP_TIMEOUT_S = 15.0


class ManageError(RuntimeError):
    """What the user asked cannot be done as asked (no such service, several match)."""


@dataclass
class Service:
    """One running engine service, from its record (and, once checked, its own answer)."""

    key: str
    pid: int
    url: str
    models: list[str]
    ray: bool = False
    since: float | None = None  # when it wrote its record (time.time())
    record: dict[str, Any] = field(default_factory=dict, repr=False)
    # from check(): whether it answered, in how long, what it said
    answers: bool | None = None
    answer_ms: float | None = None
    status: dict[str, Any] | None = None
    problem: str = ""

    @property
    def names(self) -> list[str]:
        """Its models' names: from its record's folders, else (a service elsewhere) as it
        answered."""
        return [model_name(m) for m in self.models] or [
            str(m.get("name")) for m in (self.status or {}).get("models", [])
        ]

    @property
    def label(self) -> str:
        """Its models' names, or its key when its record names none: what messages call it."""
        return ", ".join(self.names) or self.key

    @property
    def tls(self) -> bool:
        return self.url.startswith("wss://")

    def as_json(self) -> dict[str, Any]:
        """Everything but the token (a listing is safe to paste into a bug report)."""
        return {
            "key": self.key,
            "pid": self.pid,
            "url": self.url,
            "models": self.models,
            "ray": self.ray,
            "tls": self.tls,
            "since": self.since,
            "answers": self.answers,
            "answer_ms": self.answer_ms,
            "status": self.status,
            "problem": self.problem or None,
        }


def services() -> list[Service]:
    """The user's live services, oldest first (records of exited processes are removed)."""
    out = []
    for path in sorted(rundir.runtime_dir().glob("engine-*.json")):
        key = path.stem.removeprefix("engine-")
        rec = rundir.read_record(key)
        if rec is None:
            continue
        models = rec.get("models")
        out.append(
            Service(
                key=key,
                pid=rec["pid"],
                url=rec["url"],
                models=[str(m) for m in models] if isinstance(models, list) else [],
                ray=bool(rec.get("ray")),
                since=rec.get("since") if isinstance(rec.get("since"), (int, float)) else None,
                record=rec,
            )
        )
    out.sort(key=lambda s: (s.since is None, s.since or 0.0, s.key))
    return out


def remote(url: str, timeout: float = CHECK_TIMEOUT_S) -> Service:
    """The service at ``url``, not necessarily one of the user's (a team's daemon, a Ray
    deployment), checked as the language server would connect to it: the token from the user's
    record for that URL or $SPARK_LSP_ENGINE_TOKEN, its certificate verified against the trust
    store and $SPARK_LSP_ENGINE_CA."""
    svc = Service(key="", pid=0, url=url, models=[], record={"token": rundir.token_for(url)})
    return check(svc, timeout, cafile=os.environ.get(tls.CA_ENV) or None)


def check(svc: Service, timeout: float = CHECK_TIMEOUT_S, cafile: str | None = None) -> Service:
    """Connect as a client would (the record's token, its pinned certificate; ``cafile``: a CA
    bundle to trust besides the system's) and ask for the service's status: ``answers``,
    ``answer_ms`` (connect, handshake and status), ``status`` (its models, with their cached KV
    slots), or ``problem``."""
    from .sync_client import SyncEngineClient  # the WebSocket client only when checking

    t0 = time.perf_counter()
    try:
        client = SyncEngineClient.open(
            svc.url,
            svc.record.get("token"),
            direct=False,  # the service itself, not a Ray ingress replica's socket
            client="spark-lsp engine list",
            open_timeout=timeout,
            cafile=cafile,
            pinned_cert=svc.record.get("tls_cert"),
            cancel_flags=False,
        )
    except EngineUnavailable as e:
        svc.answers, svc.problem = False, str(e)
        return svc
    try:
        reply = client.status(timeout)
        svc.answers = True
        svc.answer_ms = (time.perf_counter() - t0) * 1e3
        svc.status = {"models": reply.get("models", [])}
    except Exception as e:  # no answer in time, or the connection went away
        svc.answers, svc.problem = False, f"no status answer ({type(e).__name__}: {e})"
    finally:
        client.close()
    return svc


def select(found: Sequence[Service], wanted: Sequence[str], every: bool) -> list[Service]:
    """The services ``wanted`` names (a model's folder name or path, a key, a pid or a URL), or
    all of them with ``every``; with neither, the only one (several: an error that lists them)."""
    if every:
        return list(found)
    if not wanted:
        if len(found) > 1:
            running = "; ".join(f"{s.label} (pid {s.pid})" for s in found)
            raise ManageError(
                f"several engine services run ({running}): name one (model, key, pid or URL) "
                "or pass --all"
            )
        return list(found)
    chosen: list[Service] = []
    for want in wanted:
        hits = [s for s in found if _matches(s, want)]
        if not hits:
            raise ManageError(f"no running engine service matches {want!r}")
        chosen += [s for s in hits if s not in chosen]
    return chosen


def _matches(svc: Service, want: str) -> bool:
    if want in (svc.key, str(svc.pid), svc.url, svc.url.rstrip("/")):
        return True
    path = str(Path(want).expanduser().resolve()) if os.sep in want or want == "." else None
    return (
        want in svc.names
        or (path is not None and path in {str(Path(m).resolve()) for m in svc.models})
        or _repository_name(want) in svc.names
    )


def _repository_name(want: str) -> str | None:
    """The name a daemon gives the Hub model a catalogue name or ``hf:ORG/REPO[:FILE]`` (what it
    was started with) resolves to; None for anything else."""
    try:
        return served_name(want)
    except ModelError:
        return None


def stop(
    svc: Service,
    *,
    timeout: float = STOP_TIMEOUT_S,
    force: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Ask ``svc`` to stop (SIGTERM: it cancels its generations, delivers their last messages and
    removes its record) and wait up to ``timeout`` s; with ``force``, SIGKILL one that did not
    exit by then.  Returns what happened, in words; raises ManageError where it could not."""
    return stop_process(
        svc.pid,
        svc.record.get("started"),
        lambda: rundir.remove_record(svc.key, svc.pid),
        timeout=timeout,
        force=force,
        sleep=sleep,
    )


def stop_process(
    pid: int,
    started: Any,
    forget: Callable[[], None],
    *,
    timeout: float = STOP_TIMEOUT_S,
    force: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """`stop` for any process that left a record (a daemon, the language servers' session host):
    ``started`` its start time from the record, ``forget`` removes the record where the process
    cannot (it is gone, or killed)."""
    if not _same_process(pid, started):
        forget()
        return f"pid {pid} is no longer that service (its record was stale): record removed"
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return "already stopped"
    except PermissionError as e:
        raise ManageError(f"cannot signal pid {pid}: {e}") from None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _same_process(pid, started):
            return "stopped"
        sleep(0.05)
    if not force:
        raise ManageError(
            f"pid {pid} did not stop within {timeout:g} s of SIGTERM "
            "(--force kills it; its log is in the runtime dir)"
        )
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "stopped"
    for _ in range(100):  # SIGKILL cannot be refused: wait for the kernel to end it
        if not rundir.pid_alive(pid):
            break
        sleep(0.02)
    forget()  # it had no chance to remove its own
    return f"killed (did not stop within {timeout:g} s of SIGTERM)"


def _same_process(pid: int, started: Any) -> bool:
    """Whether ``pid`` still runs and is the process that wrote the record (same start time;
    a record without one, from an older daemon, is trusted while the pid lives)."""
    if not rundir.pid_alive(pid):
        return False
    if not isinstance(started, int):
        return True
    return rundir.process_start(pid) == started


def describe(svc: Service, now: float | None = None) -> str:
    """One line: models, where, pid, how long it has run, and (once checked) whether it answers."""
    said = {m.get("name"): m.get("precision") for m in (svc.status or {}).get("models", [])}
    names = [f"{n} ({said[n]})" if said.get(n) else n for n in svc.names]
    parts = [", ".join(names) or "?", svc.url] + ([f"pid {svc.pid}"] if svc.pid else [])
    if svc.ray:
        parts.append("Ray Serve")
    if svc.since is not None:
        parts.append(f"up {duration((now or time.time()) - svc.since)}")
    if svc.answers:
        said = f"answers in {svc.answer_ms:.0f} ms"
        models = (svc.status or {}).get("models", [])
        if any("cached_slots" in m for m in models):  # a daemon (Ray's ingress does not count)
            said += f", {sum(int(m.get('cached_slots', 0)) for m in models)} cached document(s)"
        parts.append(said)
    elif svc.answers is False:
        parts.append(f"NOT ANSWERING: {svc.problem}")
    return "  ".join(parts)


def duration(s: float) -> str:
    s = max(0, int(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"
