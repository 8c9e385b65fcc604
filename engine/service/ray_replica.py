"""One engine replica of the Ray Serve application (``engine.service.ray_app``): a Serve
deployment holding one copy of the engine.  The ingress (``engine.service.ray_ingress``) sends
it generations on the replica's own socket: the engine protocol, served as the daemon serves it
(``EngineServer``), one persistent connection per ingress replica carrying all of its
generations.  ``generate``, a Serve method streaming one generation's tokens in batches, is the
way in where the ingress cannot use the socket (none offered: ``direct`` off, where only
Serve's ports can be reached; or it cannot connect).

Why a socket beside Serve's handles: a token through a Serve streaming call crosses the
replica's event loop, Ray's object transfer and the ingress's router, each a thread hand-over
that waits for a core while the engines keep the cores busy; through the socket, the thread
that ran the decode step writes the token, and the ingress's event loop reads it."""

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray import serve

from ..config import ModelError
from ..hub import resolve_model
from ..params import GenerationParams
from . import protocol as P
from . import tls
from .address import is_loopback
from .daemon import INTERACTIVE_PREFILL_CHUNK
from .local import LocalModels, LocalRun, Sink, describe, slot_key
from .options import DEFAULT_SPINNING, SPINNING
from .placement import Documents
from .server import EngineServer

log = logging.getLogger(__name__)

#: KV slots per replica (documents whose prefix each replica keeps warm), unless told otherwise.
SLOTS = 16
#: Generations at once on one ingress's connection to a replica's socket (each of the
#: ingress's clients is held to the protocol's own limit already).
SOCKET_GENERATIONS = 1024
#: Seconds a stopping replica lets the generations on its socket finish.
DRAIN_S = 10.0


def direct_bind(host: str | None, driver_ip: str | None) -> str | None:
    """Where a replica's own socket listens (an ingress replica's direct endpoint, an engine
    replica's socket to the ingress), given the address Serve's proxy was asked to bind
    (``host``; None: no sockets of their own): a loopback address only on the node whose
    loopback that is (the driver's: elsewhere no client could reach it), any other address as
    the node's own (the address Ray knows it by, as every node's proxy binds the address it was
    given)."""
    if host is None:
        return None
    here = ray.util.get_node_ip_address()
    if is_loopback(host):
        return host if driver_ip in (None, here) else None
    return here


class ReplicaModels(LocalModels):
    """The replica's engine as its socket serves it, each generation's document counted in the
    replica's load (``placement.Documents``) as ``EngineReplica.generate`` counts it."""

    def __init__(self, engine: Any, use: Callable[[str], None]) -> None:
        super().__init__([engine], offer_files=False)  # the ingress serves the model's files
        self.use = use

    def start(
        self,
        name: str | None,
        ids: list[int],
        params: GenerationParams,
        slot: str | None,
        sink: Sink,
    ) -> LocalRun:
        if slot is not None:
            self.use(slot)
        return super().start(name, ids, params, slot, sink)


@serve.deployment(max_ongoing_requests=64, health_check_period_s=2, health_check_timeout_s=10)
class EngineReplica:
    """One copy of the engine, serving the ingress on its own socket (``_open_socket``) and
    through Serve (``generate``); its load (``load``, ``claim``) places the documents."""

    def __init__(
        self,
        model: str,
        threads: int | None = None,
        slots: int = SLOTS,
        precision: str = "fp32",
        spinning: bool | None = SPINNING[DEFAULT_SPINNING],
        token: str | None = None,
        direct: dict[str, Any] | None = None,
    ) -> None:
        from ..engine import Engine  # ONNX Runtime loads in the replica process only

        # spinning: the daemon's default (off), for the same reason: the threads that read the
        # replica's socket and write its tokens need a core between steps
        # `model`: a path, or a Hub model (pinned: ray_app.deploy) downloaded on this node
        self.engine = Engine.load(
            resolve_model(model),
            slots=slots,
            threads=threads,
            precision=precision,
            spinning=spinning,
        )
        self.engine.prefill_chunk = min(self.engine.prefill_chunk, INTERACTIVE_PREFILL_CHUNK)
        self.engine.tokenizer.byte_index()  # token-healed prompts need it: built now
        self.where = f"{os.uname().nodename}:{os.getpid()}"
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="spark-replica-gen")
        self.documents = Documents()  # this replica's load, as every ingress places by it
        self.server = self._open_socket(token, direct or {})

    def _open_socket(self, token: str | None, direct: dict[str, Any]) -> EngineServer | None:
        """The replica's own socket (the engine protocol, the app's token and TLS files), where
        the ingress replicas' direct endpoints listen (``direct_bind``); None where they do not
        (``direct`` off) or it cannot listen (logged: ``generate`` serves)."""
        host = direct_bind(direct.get("host"), direct.get("driver_ip"))
        if host is None or not token:
            return None
        try:
            ctx = tls.server_context_for(direct.get("tls_cert"), direct.get("tls_key"))
            models = ReplicaModels(self.engine, self.documents.use)
            server = EngineServer(
                models, token=token, ssl_context=ctx, max_generations=SOCKET_GENERATIONS
            )
            return server.open(host, 0)
        except (OSError, ValueError) as e:
            log.warning("engine replica: no socket (%s): generations come through Serve", e)
            return None

    async def load(self) -> int:
        """Documents this replica served recently (``placement.Documents``)."""
        return self.documents.load()

    async def claim(self, key: str, cap: int) -> bool:
        """Take document ``key`` if this replica has fewer than ``cap`` documents (the share the
        ingress computed): ``placement.Documents.claim``."""
        return self.documents.claim(key, cap)

    def describe(self) -> dict[str, Any]:
        """The model, this replica (host:pid) and its socket's URL (None: none)."""
        return {
            **describe(self.engine),
            "replica": self.where,
            "socket": self.server.url if self.server is not None else None,
        }

    def __del__(self) -> None:
        """Serve stops this replica (a redeploy, fewer replicas, shutdown), which it does once
        no Serve request runs on it: the generations on its socket, which Serve does not see,
        get up to ``DRAIN_S`` to finish (suggestions take well under a second), as Serve's own
        graceful shutdown gives its requests; any still running then are cancelled (their
        ``done`` says so), and the ingresses' connections close."""
        server, self.server = getattr(self, "server", None), None
        if server is None:
            return
        deadline = time.monotonic() + DRAIN_S
        while server.generations() and time.monotonic() < deadline:
            time.sleep(0.02)
        server.close(drain_s=1.0)

    async def generate(self, request: dict[str, Any]):
        params = P.params_from_json(request.get("params"))
        if request.get("slot"):
            self.documents.use(request["slot"])
        try:
            slot = slot_key(request.get("slot") or None)  # as its socket's generations
            gen = self.engine.generate(request["prompt"], params, slot=slot)
        except (ValueError, ModelError) as e:
            yield {"done": "error", "stats": {}, "error": {"code": P.BAD_PROMPT, "message": str(e)}}
            return
        # The generation runs on a worker thread that queues each token here; every item this
        # stream yields carries all the tokens ready by then, so a caller that falls behind (many
        # editors on few cores) gets one Ray message for several tokens instead of one each.
        # The first token comes with the generation's early stats (protocol.EARLY_STATS), which
        # the ingress sends with its first ``tokens`` message, as the daemon does.
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue = asyncio.Queue()

        def produce() -> None:
            try:
                early: dict[str, Any] | None = None
                for chunk in gen:
                    if early is None:
                        early = P.early_stats(gen.stats)
                        item = (int(chunk.token_id), chunk.text, early)
                    else:
                        item = (int(chunk.token_id), chunk.text, None)
                    loop.call_soon_threadsafe(ready.put_nowait, item)
                end: BaseException | None = None
            except BaseException as e:  # raised again on the event loop
                end = e
            loop.call_soon_threadsafe(ready.put_nowait, end)

        worker = loop.run_in_executor(self.pool, produce)
        try:
            while True:
                items = [await ready.get()]
                while not ready.empty():
                    items.append(ready.get_nowait())
                tokens = [x for x in items if isinstance(x, tuple)]
                if tokens:
                    out: dict[str, Any] = {"tokens": [[t, text] for t, text, _ in tokens]}
                    if tokens[0][2] is not None:
                        out["stats"] = tokens[0][2]
                    yield out
                if len(tokens) < len(items):  # the end (None) or the generation's error
                    end = items[-1]
                    if end is not None:
                        raise end
                    break
        except BaseException:  # the caller cancelled (or went away): stop within one step
            gen.cancel()
            raise
        await worker
        yield {
            "done": gen.finish_reason or "cancelled",
            "stats": dict(gen.stats),
            "replica": self.where,
        }
