"""The engine service on Ray Serve: engine replicas behind one WebSocket ingress.

(No ``from __future__ import annotations`` here: FastAPI must see the real ``WebSocket`` class in
the ingress signature to recognise its parameter.)

``spark-lsp engine serve --ray [--replicas N]`` joins the Ray cluster found by
``ray.init(address="auto")`` (or starts a local one) and deploys two deployments:

- ``EngineShard0`` … ``EngineShard{N-1}``: N one-replica deployments of ``EngineReplica``, each
  loading the model; ``generate`` streams one generation.  Serve health-checks and restarts them.
- ``EngineIngress`` (FastAPI ingress): the same WebSocket protocol as the daemon
  (``engine.service.connection``), with token and origin checks; each ``generate`` is sent to a
  shard through its ``DeploymentHandle``.

With ``--tls-cert`` / ``--tls-key`` Serve's HTTP proxy serves ``wss://`` (``deploy``).

Routing by slot key: the ingress places each document (slot key) on a shard once, by rendezvous
hashing with bounded loads (``placement.Shards``), and sends every request for it there, to the replica
that holds its KV prefix; a shard that failed is avoided for a few seconds, and only its
documents move.  Both of
Serve's own mechanisms were tried first, on one deployment with N replicas: model multiplexing
(slot key as the multiplexed model id) broke affinity, because its id-to-replica map reaches the
routers asynchronously, so a document's concurrent or closely following requests landed on
different replicas; a custom ``RequestRouter`` (alpha API) ranking replicas by the same hash
stalled under concurrent requests (Serve's router hands the replica it found to whichever pending
request is first, then backs off for ~10 s).  One deployment per shard keeps Serve's replica
management, health checks and restarts, and makes placement deterministic.

Each replica holds ``slots`` KV slots (enough for the documents placed on it, about documents /
replicas: fewer and documents evict each other's prefixes) and runs ONNX Runtime with the
cluster's CPUs shared out among the replicas (``replica_threads``), so replicas do not
oversubscribe the cores they share.

A replica that dies mid-generation: the ingress starts the generation again on another replica
from the prompt plus the tokens already delivered (greedy decoding continues identically), so the
client loses nothing but the cache; after ``RETRIES`` failures the generation ends with
``finish_reason`` ``error`` (code ``unavailable``).

A generation's first ``tokens`` message carries its early stats (``protocol.EARLY_STATS``) as
the daemon's does: the replica sends them with its first token.  After a restart they still
describe one generation: its prompt, the prefix reuse of the attempt that made its first token,
and the time to that token from the generation's start; its ``done`` repeats them.
"""

import asyncio
import hmac
import http
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from ray import serve
from ray.serve.handle import DeploymentHandle
from websockets.asyncio.server import serve as ws_serve
from websockets.exceptions import ConnectionClosed

from ..config import ModelError
from ..params import GenerationParams
from ..tokenizer import Tokenizer
from . import protocol as P
from . import rundir, tls
from .address import is_loopback
from .connection import Connection
from .daemon import INTERACTIVE_PREFILL_CHUNK, read_token_file, warn_cleartext
from .launch import DaemonError, resolve_models
from .local import describe
from .options import DEFAULT_SPINNING, SPINNING
from .placement import Shards

log = logging.getLogger(__name__)

#: KV slots per replica (documents whose prefix each replica keeps warm), unless told otherwise.
SLOTS = 16
#: Times a generation is restarted on another replica before it fails.
RETRIES = 3
APP_NAME = "spark-lsp-engine"
#: Replicas of the WebSocket ingress (None: one per engine shard).  Serve's proxy spreads the
#: editors' connections over them, so relaying tokens is not one process's work.
INGRESS_REPLICAS: int | None = None


@serve.deployment(max_ongoing_requests=64, health_check_period_s=2, health_check_timeout_s=10)
class EngineReplica:
    """One copy of the engine; every generation it runs streams from a worker thread."""

    def __init__(
        self,
        model_dir: str,
        threads: int | None = None,
        slots: int = SLOTS,
        precision: str = "fp32",
        spinning: bool | None = SPINNING[DEFAULT_SPINNING],
    ) -> None:
        from ..engine import Engine  # ONNX Runtime loads in the replica process only

        # spinning: the daemon's default (off), for the same reason: a replica hands every
        # token to its event loop (Serve's streaming), which needs a core between steps
        self.engine = Engine.load(
            model_dir, slots=slots, threads=threads, precision=precision, spinning=spinning
        )
        self.engine.prefill_chunk = min(self.engine.prefill_chunk, INTERACTIVE_PREFILL_CHUNK)
        self.engine.tokenizer.byte_index()  # token-healed prompts need it: built now
        self.where = f"{os.uname().nodename}:{os.getpid()}"
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="spark-replica-gen")

    def describe(self) -> dict[str, Any]:
        return {**describe(self.engine), "replica": self.where}

    async def generate(self, request: dict[str, Any]):
        params = P.params_from_json(request.get("params"))
        try:
            gen = self.engine.generate(request["prompt"], params, slot=request.get("slot"))
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


class RayModels:
    """The models backend of a Connection in the ingress: generations run on engine replicas."""

    def __init__(
        self,
        shards: Shards,
        tokenizer: Tokenizer,
        info: dict[str, Any],
        direct: str | None = None,
    ) -> None:
        self.shards = shards
        self.tok = tokenizer
        self.info = {k: v for k, v in info.items() if k != "replica"}
        self.name = info["name"]
        self.direct = direct  # this ingress replica's own endpoint, offered in ``hello``

    def describe(self) -> list[dict[str, Any]]:
        return [self.info]

    def capabilities(self) -> dict[str, Any]:
        """Capabilities ``hello`` adds to the protocol's own: ``direct``, the URL of this
        ingress replica's own WebSocket endpoint, on a connection that came through Serve's
        proxy."""
        return {"direct": self.direct} if self.direct else {}

    def status(self) -> list[dict[str, Any]]:
        return [
            {**self.info, "shards": len(self.shards.handles), "down": sorted(self.shards.down())}
        ]

    def tokenizer(self, name: str | None) -> Tokenizer:
        self._check(name)
        return self.tok

    def _check(self, name: str | None) -> None:
        if name not in (None, self.name):
            raise KeyError(name)

    def encode(self, name: str | None, prompt: str | list[int]) -> list[int]:
        self._check(name)
        ids = self.tok.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.info["vocab_size"]]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{self.info['vocab_size'] - 1})"
            )
        if not ids:
            if self.info.get("bos_id") is None:
                raise ValueError("prompt is empty and the model has no bos_token_id to start from")
            ids = [self.info["bos_id"]]
        if len(ids) >= self.info["context"]:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the context is {self.info['context']} tokens"
            )
        return ids

    def start(
        self, name: str | None, ids: list[int], params: GenerationParams, slot: str | None, sink
    ) -> "RayRun":
        run = RayRun(self.shards, ids, params, slot, sink)
        run.task = asyncio.ensure_future(run.work())
        return run

    def close(self) -> None:
        pass


class RayRun:
    """One generation on the replicas, restarted on another replica if its replica dies."""

    def __init__(
        self, shards: Shards, ids: list[int], params: GenerationParams, slot: str | None, sink
    ) -> None:
        self.shards = shards
        self.ids = ids
        self.params = params
        self.slot = slot
        self.sink = sink
        self.task: asyncio.Future | None = None
        self.response = None
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.response is not None:
            self.response.cancel()
        if self.task is not None:
            self.task.cancel()

    def _early(
        self, stats: dict[str, Any] | None, failures: int, first_ms: float
    ) -> dict[str, Any] | None:
        """The early stats sent with the generation's first token: those of the attempt that
        made it (its replica's prefix reuse), with the time to it counted from the generation's
        start when earlier attempts failed (the client waited for them too).  A restart after
        the first token keeps these (they went out already) and ``done`` repeats them."""
        if stats is None:
            return None
        early = {**stats, "prompt_tokens": len(self.ids)}
        if failures:
            early["ttft_ms"] = first_ms
        return early

    async def work(self) -> None:
        delivered: list[int] = []
        t0 = time.perf_counter()
        first_ms = None
        early: dict[str, Any] | None = None  # the stats its first tokens message carried
        failures = 0
        last_error = ""

        def so_far() -> dict[str, Any]:
            """The stats of a generation that ends early: its first tokens' and how many came
            (the client keeps ``done``'s stats, as after a daemon's cancelled generation)."""
            return {**(early or {}), "new_tokens": len(delivered)}

        while True:
            params = self.params
            if delivered:  # restarted after a replica died: continue after what was delivered
                if len(delivered) >= params.max_new_tokens:
                    self.sink.finish(
                        "length",
                        {
                            **(early or {}),
                            "prompt_tokens": len(self.ids),
                            "new_tokens": len(delivered),
                            "restarts": failures,
                        },
                        None,
                    )
                    return
                params = replace(
                    params, max_new_tokens=params.max_new_tokens - len(delivered), healed_prefix=""
                )
            req = {
                "prompt": [*self.ids, *delivered],
                "params": P.params_to_json(params),
                "slot": self.slot,
            }
            shard = self.shards.pick(self.slot)
            try:
                self.response = self.shards.handles[shard].options(stream=True).generate.remote(req)
                async for item in self.response:
                    if "done" in item:
                        stats = dict(item.get("stats", {}))
                        if failures:  # restarted: the whole generation as the client saw it
                            stats["prompt_tokens"] = len(self.ids)
                            stats["new_tokens"] = len(delivered)
                            stats["ttft_ms"] = first_ms or stats.get("ttft_ms", 0.0)
                            stats.update(early or {})  # as its first tokens message said
                            stats["total_ms"] = (time.perf_counter() - t0) * 1e3
                            stats["restarts"] = failures
                        stats["replica"] = item.get("replica", "")
                        err = item.get("error")
                        self.sink.finish(
                            item["done"], stats, (err["code"], err["message"]) if err else None
                        )
                        return
                    for token_id, text in item["tokens"]:
                        await self.sink.acredit()
                        first = None
                        if first_ms is None:
                            first_ms = (time.perf_counter() - t0) * 1e3
                            early = first = self._early(item.get("stats"), failures, first_ms)
                        delivered.append(token_id)
                        self.sink.chunk(token_id, text, first)
                raise RuntimeError("the replica's stream ended without a result")
            except asyncio.CancelledError:
                self.sink.finish("cancelled", so_far(), None)
                return
            except Exception as e:  # a replica died or is unreachable: try another
                if self.cancelled:
                    self.sink.finish("cancelled", so_far(), None)
                    return
                failures += 1
                self.shards.mark_down(shard)
                last_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning(
                    "engine replica failed (%s); attempt %d of %d", last_error, failures, RETRIES
                )
                if failures > RETRIES:
                    self.sink.finish(
                        "error",
                        so_far(),
                        (
                            P.UNAVAILABLE,
                            f"no engine replica could finish the generation: {last_error}",
                        ),
                    )
                    return
                await asyncio.sleep(0.2 * failures)


def direct_bind(host: str | None, driver_ip: str | None) -> str | None:
    """Where an ingress replica's direct endpoint listens, given the address Serve's proxy was
    asked to bind (``host``; None: no direct endpoint): a loopback address only on the node
    whose loopback that is (the driver's: elsewhere no client could reach it), any other
    address as the node's own (the address Ray knows it by, as every node's proxy binds the
    address it was given)."""
    if host is None:
        return None
    here = ray.util.get_node_ip_address()
    if is_loopback(host):
        return host if driver_ip in (None, here) else None
    return here


app = FastAPI()


@serve.deployment(max_ongoing_requests=1000)
@serve.ingress(app)
class EngineIngress:
    """The WebSocket endpoint: the engine protocol, generations sent to EngineReplica.

    Clients reach it through Serve's proxy (the deployment's URL), which relays every WebSocket
    message as a Ray call in one process on the head node.  Each ingress replica also serves the
    same protocol on a socket of its own (``direct_host``, a free port), which it names in the
    ``hello`` of connections that came through the proxy (capability ``direct``): a client that
    moves there (``EngineClient.connect``, ``SyncEngineClient.open``) has its tokens written by
    the ingress itself, and keeps the proxy's routing of its connection (the replica the proxy
    chose), Serve's placement, health checks and restarts.  Same token, origins and TLS."""

    def __init__(
        self,
        shards: list[DeploymentHandle],
        model_dir: str,
        token: str,
        origins: list[str],
        direct: dict[str, Any] | None = None,
    ) -> None:
        self.shards = Shards(list(shards))
        self.tokenizer = Tokenizer.load(model_dir)
        self.token = token
        self.origins = set(origins)
        self.info: dict[str, Any] | None = None
        # the direct endpoint: where it listens (None: not on this node), its TLS files
        direct = direct or {}
        self.direct_host = direct_bind(direct.get("host"), direct.get("driver_ip"))
        self.direct_tls = (direct.get("tls_cert"), direct.get("tls_key"))
        self.direct_url: str | None = None
        self._direct_lock = asyncio.Lock()
        self._direct_server: Any = None
        self._direct_conns: set[Connection] = set()

    def _refusal(self, headers: Any) -> tuple[http.HTTPStatus, str] | None:
        """Why a connection with these HTTP headers (names in any case) is refused, with the
        HTTP status that says so (None: it is not)."""
        auth = headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self.token.encode()
        ):
            return http.HTTPStatus.UNAUTHORIZED, "a valid engine token is required"
        origin = headers.get("origin")
        if origin is not None and origin not in self.origins:
            return http.HTTPStatus.FORBIDDEN, f"origin {origin!r} is not allowed"
        return None

    async def _models(self, direct: str | None) -> RayModels:
        if self.info is None:
            self.info = await self.shards.handles[0].describe.remote()
        return RayModels(self.shards, self.tokenizer, self.info, direct)

    @app.websocket("/")
    async def connect(self, ws: WebSocket) -> None:
        refused = self._refusal(ws.headers)
        if refused is not None:
            return await self._deny(ws, refused[1])
        models = await self._models(await self._open_direct())
        await ws.accept()
        conn = Connection(
            models,
            ws.send_text,
            peer=f"{ws.client.host}:{ws.client.port}" if ws.client else "?",
        )
        try:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                raw = msg.get("text") if msg.get("text") is not None else msg.get("bytes", b"")
                await conn.handle(raw)
        except WebSocketDisconnect:
            pass
        finally:
            await conn.close(drain_s=1.0)

    @staticmethod
    async def _deny(ws: WebSocket, why: str) -> None:
        """Refuse before accepting (Serve's proxy answers the upgrade with HTTP 403)."""
        log.warning("engine ingress: refused a connection: %s", why)
        await ws.close(code=1008)

    # -- the direct endpoint -----------------------------------------------------------------
    async def _open_direct(self) -> str | None:
        """This replica's own endpoint's URL, listening from the first connection on (on the
        replica's event loop, as the proxy's connections); None where it has none or could
        not listen (the proxy serves on: logged once)."""
        if self.direct_host is None:
            return None
        async with self._direct_lock:
            if self.direct_url is None and self.direct_host is not None:
                try:
                    ctx = tls.server_context_for(*self.direct_tls)
                    self._direct_server = await ws_serve(
                        self._serve_direct,
                        self.direct_host,
                        0,
                        process_request=self._authorise_direct,
                        ssl=ctx,
                        **P.SOCKET_OPTIONS,
                    )
                except (OSError, ValueError) as e:
                    log.warning("engine ingress: no direct endpoint (%s): the proxy serves", e)
                    self.direct_host = None
                    return None
                port = self._direct_server.sockets[0].getsockname()[1]
                host = f"[{self.direct_host}]" if ":" in self.direct_host else self.direct_host
                self.direct_url = f"{'wss' if ctx is not None else 'ws'}://{host}:{port}/"
                log.info("engine ingress: direct endpoint on %s", self.direct_url)
        return self.direct_url

    def _authorise_direct(self, conn: Any, request: Any) -> Any:
        """The proxy path's checks before the upgrade: HTTP 401 / 403 as the daemon answers."""
        refused = self._refusal(request.headers)
        if refused is None:
            return None
        log.warning("engine ingress: refused a direct connection: %s", refused[1])
        return conn.respond(refused[0], refused[1] + "\n")

    async def _serve_direct(self, ws: Any) -> None:
        """One direct connection: the same protocol as through the proxy."""
        addr = ws.remote_address
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        conn = Connection(await self._models(None), ws.send, peer=f"{peer} (direct)")
        self._direct_conns.add(conn)
        try:
            async for raw in ws:
                await conn.handle(raw)
        except ConnectionClosed:
            pass
        finally:
            self._direct_conns.discard(conn)
            await conn.close(drain_s=1.0)

    async def __del__(self) -> None:
        """Serve stops this replica (a redeploy, fewer replicas, shutdown), which it does once the
        proxy's connections to it have ended: those on its direct endpoint, which Serve does not
        see, get their generations' last messages (cancelled), then a close (1001, going away),
        as the daemon's clients do when it stops; they reconnect through the proxy."""
        for conn in list(self._direct_conns):
            await conn.close(drain_s=1.0)
        if self._direct_server is not None:
            self._direct_server.close()
            await self._direct_server.wait_closed()


def replica_threads(replicas: int) -> int:
    """Intra-op threads per replica: the cluster's CPUs shared out among the replicas, so that
    replicas running at once do not oversubscribe the cores (on one 2-core machine: 1 replica
    gets 2 threads, 2 replicas 1 each)."""
    cpus = int(ray.cluster_resources().get("CPU", 1))
    return max(1, cpus // max(1, replicas))


def build_app(
    model_dir: str,
    *,
    replicas: int,
    token: str,
    origins: list[str],
    num_cpus: float = 0.5,
    threads: int | None = 1,
    slots: int = SLOTS,
    precision: str = "fp32",
    spinning: bool | None = SPINNING[DEFAULT_SPINNING],
    direct: dict[str, Any] | None = None,
):
    """The application: ``replicas`` engine shards and their ingress (``direct``: the ingress
    replicas' own endpoints, ``EngineIngress``; None: through Serve's proxy only)."""
    shards = [
        EngineReplica.options(
            name=f"EngineShard{i}", num_replicas=1, ray_actor_options={"num_cpus": num_cpus}
        ).bind(model_dir, threads, slots, precision, spinning)
        for i in range(replicas)
    ]
    return EngineIngress.options(
        num_replicas=INGRESS_REPLICAS or replicas, ray_actor_options={"num_cpus": 0.1}
    ).bind(shards, model_dir, token, origins, direct)


def deploy(
    model_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    replicas: int = 2,
    token: str,
    origins: list[str] = (),
    num_cpus: float = 0.5,
    threads: int | None = None,
    slots: int = SLOTS,
    precision: str = "fp32",
    spinning: bool | None = SPINNING[DEFAULT_SPINNING],
    tls_cert: str | None = None,
    tls_key: str | None = None,
    direct: bool = True,
) -> str:
    """Deploy on the current Ray cluster (``ray.init`` first); returns the WebSocket URL.
    ``threads``: intra-op threads per replica (None: ``replica_threads``); ``slots``: KV slots
    per replica, enough for the documents each serves (about documents / replicas).

    ``tls_cert`` / ``tls_key`` (PEM files, as the daemon's): Serve's HTTP proxy (uvicorn) serves
    ``wss://`` with them.  Each node's proxy reads them from its own disk, so on a cluster they
    must be at the same path on every node.  A proxy already running keeps its options (Serve
    cannot change them once started): a DaemonError when its TLS is not the one asked for.

    ``direct``: each ingress replica also listens on a port of its own (``EngineIngress``), on
    ``host`` if that is a loopback address (and the replica on this node), else on its node's
    address; clients that move there skip Serve's proxy.  False where only the proxy's port
    can be reached (a firewall): clients then stay on the proxy."""
    proxy: dict[str, Any] = {"host": host, "port": port}
    if tls_cert and tls_key:
        proxy["ssl_certfile"] = str(Path(tls_cert).expanduser().resolve())
        proxy["ssl_keyfile"] = str(Path(tls_key).expanduser().resolve())
    serve.start(http_options=proxy)
    _check_proxy_tls(proxy.get("ssl_certfile"))
    serve.run(
        build_app(
            model_dir,
            replicas=replicas,
            token=token,
            origins=list(origins),
            num_cpus=num_cpus,
            threads=threads or replica_threads(replicas),
            slots=slots,
            precision=precision,
            spinning=spinning,
            direct={
                "host": host,
                "driver_ip": ray.util.get_node_ip_address(),
                "tls_cert": proxy.get("ssl_certfile"),
                "tls_key": proxy.get("ssl_keyfile"),
            }
            if direct
            else None,
        ),
        name=APP_NAME,
        route_prefix="/",
        blocking=False,
    )
    return f"{'wss' if 'ssl_certfile' in proxy else 'ws'}://{host}:{port}/"


def _check_proxy_tls(cert: str | None) -> None:
    """Refuse to deploy behind a Serve proxy that serves TLS other than asked (``cert``: the
    certificate file, None for none): one already running on the cluster kept its options, and
    the URL announced would not be the one it serves."""
    try:  # Serve has no public view of its options: a later Ray without this skips the check
        from ray.serve.context import _get_global_client

        running = _get_global_client().http_config
    except (ImportError, AttributeError):
        return
    serving = running.ssl_certfile or None
    if serving != cert:
        raise DaemonError(
            "Serve's HTTP proxy already runs on this cluster "
            + (f"with TLS (certificate {serving})" if serving else "without TLS")
            + ", and Serve cannot change that while it runs: "
            + ("pass the same --tls-cert/--tls-key" if serving else "serve without --tls-cert")
            + ", or restart Serve (serve shutdown)"
        )


def main_args(args) -> int:
    """``spark-lsp engine serve --ray``: deploy, write the record, wait for SIGTERM, shut down."""
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    host, port = args.ws
    try:
        if not is_loopback(host) and not args.allow_remote:
            raise DaemonError(f"--ws {host}:{port} is not a loopback address: pass --allow-remote")
        if len(args.model) > 1:
            raise DaemonError("--ray serves one model per application; start one per model")
        # checked here as the daemon checks them (both or neither, readable, matching), before
        # Ray starts: Serve's proxy would only log a bad pair in its own actor's log
        secure = tls.server_context_for(args.tls_cert, args.tls_key) is not None
        if not secure and not is_loopback(host):
            warn_cleartext(host, port, to_stderr=logging.getLogger().level > logging.WARNING)
        token = read_token_file(args.token_file) if args.token_file else rundir.new_token()
        folders = resolve_models(args.model)
    except (DaemonError, OSError, ValueError) as e:
        print(f"spark-lsp engine serve --ray: {e}", file=sys.stderr)
        return 2
    try:
        ray.init(address="auto")
        log.info("joined the Ray cluster")
    except (ConnectionError, RuntimeError, ValueError):
        ray.init(num_cpus=max(2, os.cpu_count() or 2))
        log.info("no Ray cluster found: started a local one")
    if not port:  # Serve's proxy needs a port number: take a free one
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
    try:
        url = deploy(
            str(folders[0]),
            host=host,
            port=port,
            replicas=args.replicas,
            token=token,
            origins=args.allow_origin,
            threads=args.threads,
            slots=args.slots,
            precision=args.precision,
            spinning=SPINNING[args.spinning],
            tls_cert=args.tls_cert if secure else None,
            tls_key=args.tls_key if secure else None,
            direct=args.direct,
        )
    except DaemonError as e:  # Serve runs with other options: it and its apps are left alone
        print(f"spark-lsp engine serve --ray: {e}", file=sys.stderr)
        ray.shutdown()
        return 2
    key = rundir.model_key(folders)
    # as the daemon's: the record names the certificate, which the user's own clients pin
    extra = {"tls_cert": str(Path(args.tls_cert).expanduser().resolve())} if secure else {}
    path = rundir.write_record(key, url, token, [str(f) for f in folders], ray=True, **extra)
    print(
        f"engine service (Ray Serve, {args.replicas} replicas) on {url} (token in {path})",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        rundir.remove_record(key, os.getpid())
        serve.shutdown()
        ray.shutdown()
    return 0
