"""The Ray Serve application's WebSocket ingress (``engine.service.ray_app``): the engine
protocol over Serve's proxy and over each ingress replica's own socket (``direct``), every
generation sent to the engine shard that holds its document's KV prefix
(``engine.service.placement``), on that replica's own socket (``ReplicaSockets``; else through
Serve's handle), and restarted on another if that replica dies.

(No ``from __future__ import annotations`` here: FastAPI must see the real ``WebSocket`` class in
the ingress signature to recognise its parameter.)
"""

import asyncio
import contextlib
import hmac
import http
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from ray import serve
from ray.serve.handle import DeploymentHandle
from websockets.asyncio.server import serve as ws_serve
from websockets.exceptions import ConnectionClosed

from ..config import ModelError
from ..hub import resolve_model
from ..params import GenerationParams
from ..source import open_model
from ..tokenizer import Tokenizer
from . import protocol as P
from . import tls
from .client import EngineClient
from .client_core import DISCONNECTED, EngineUnavailable
from .connection import Connection
from .model_files import ServedFiles
from .placement import Shards
from .ray_replica import direct_bind
from .server import bearer, peer_name

log = logging.getLogger(__name__)

#: Times a generation is restarted on another replica before it fails.
RETRIES = 3


class RayModels:
    """The models backend of a Connection in the ingress: generations run on engine replicas."""

    def __init__(
        self,
        shards: Shards,
        tokenizer: Tokenizer,
        info: dict[str, Any],
        direct: str | None = None,
        sockets: "ReplicaSockets | None" = None,
        files: Callable[[], tuple[dict[str, str], str]] | None = None,
    ) -> None:
        self.shards = shards
        self.sockets = sockets
        self.tok = tokenizer
        self.info = {k: v for k, v in info.items() if k != "replica"}
        self.name = info["name"]
        self.direct = direct  # this ingress replica's own endpoint, offered in ``hello``
        self._files = files  # the model's prompt files, when the ingress offers them

    def describe(self) -> list[dict[str, Any]]:
        return [self.info]

    def capabilities(self) -> dict[str, Any]:
        """Capabilities ``hello`` adds to the protocol's own: ``direct``, the URL of this
        ingress replica's own WebSocket endpoint, on a connection that came through Serve's
        proxy."""
        return {"direct": self.direct} if self.direct else {}

    def status(self) -> list[dict[str, Any]]:
        return [
            {
                **self.info,
                "shards": len(self.shards.handles),
                "down": sorted(self.shards.down()),
                "sockets": self.sockets.connected() if self.sockets is not None else 0,
            }
        ]

    def tokenizer(self, name: str | None) -> Tokenizer:
        self._check(name)
        return self.tok

    def prompt_files(self, name: str | None) -> tuple[str, dict[str, str], str]:
        """(name, prompt files, digest) of the model, read where this ingress runs."""
        self._check(name)
        if self._files is None:
            raise ModelError(f"{self.name}: this service does not offer its model files")
        return (self.name, *self._files())

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
        run = RayRun(self.shards, ids, params, slot, sink, self.sockets)
        run.task = asyncio.ensure_future(run.work())
        return run

    def close(self) -> None:
        pass


class ReplicaBoard:
    """The placement board (``placement.Shards``) over the engine replicas themselves: each
    counts the documents it served recently (``EngineReplica.load``) and takes a new one only
    while it is under the share the ingress computed (``EngineReplica.claim``), so the ingress
    replicas balance on the same counts.  A replica that does not answer in ``TIMEOUT_S`` is
    left out of the placement; its generations' own failures mark it down."""

    TIMEOUT_S = 2.0

    def __init__(self, handles: list[DeploymentHandle]) -> None:
        self.handles = handles

    async def _ask(self, response: Any) -> Any:
        try:
            return await asyncio.wait_for(response, self.TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a dead or stuck replica: its generations' failures mark it down
            log.info("engine ingress: a replica did not answer a placement (%s)", e)
            return None

    async def loads(self, up: list[int]) -> dict[int, int]:
        got = await asyncio.gather(*(self._ask(self.handles[i].load.remote()) for i in up))
        return {i: n for i, n in zip(up, got) if isinstance(n, int)}

    async def claim(self, i: int, key: str, cap: int) -> bool:
        return bool(await self._ask(self.handles[i].claim.remote(key, cap)))

    def used(self, i: int, key: str) -> None:
        """Nothing to do: the replica counts the document when its generation starts."""


class ReplicaSockets:
    """The ingress's connections to the engine replicas' own sockets (``EngineReplica``): one
    persistent engine-protocol connection per replica, opened on its first generation (the
    replica names its socket in ``describe``) and again after it closed (a replica that died
    and was started again listens on a new port).  A replica that offers none, or cannot be
    reached, is asked again after ``RETRY_S``; meanwhile its generations go through Serve."""

    OPEN_S = 2.0
    RETRY_S = 5.0
    #: Pings on each connection this often, and the longest wait for a pong: a replica whose
    #: node leaves the network without closing the socket has its generations restarted
    #: elsewhere within two of these (the protocol's own pings allow 80 s).
    KEEPALIVE_S = 5.0

    def __init__(
        self, handles: list[DeploymentHandle], token: str, cert: str | None = None
    ) -> None:
        self.handles = handles
        self.token = token
        self.cert = cert  # the app's TLS certificate, which the replicas serve (pinned)
        self._open: dict[int, tuple[EngineClient, str]] = {}
        self._opening: dict[int, asyncio.Future] = {}
        self._none_until: dict[int, float] = {}

    async def get(self, i: int) -> tuple[EngineClient, str] | None:
        """Replica ``i``'s connection and its name (host:pid); None: go through Serve."""
        got = self._open.get(i)
        if got is not None and not got[0].closed:
            return got
        if time.monotonic() < self._none_until.get(i, 0.0):
            return None
        opening = self._opening.get(i)
        if opening is None:
            opening = self._opening[i] = asyncio.ensure_future(self._connect(i))
            opening.add_done_callback(lambda _: self._opening.pop(i, None))
        return await asyncio.shield(opening)

    async def _connect(self, i: int) -> tuple[EngineClient, str] | None:
        try:
            info = await asyncio.wait_for(self.handles[i].describe.remote(), self.OPEN_S)
            url = info.get("socket")
            if url:
                client = await EngineClient.connect(
                    url,
                    self.token,
                    client="spark-ray-ingress",
                    open_timeout=self.OPEN_S,
                    pinned_cert=self.cert if url.startswith("wss:") else None,
                    direct=False,
                    keepalive_s=self.KEEPALIVE_S,
                )
                self._open[i] = (client, str(info.get("replica", "")))
                return self._open[i]
        except asyncio.CancelledError:
            raise
        except Exception as e:  # through Serve for a while; a dead replica fails there too
            log.info("engine ingress: replica %d's socket not used (%s)", i, e)
        self._none_until[i] = time.monotonic() + self.RETRY_S
        return None

    def connected(self) -> int:
        """Replicas this ingress replica has an open connection to."""
        return sum(1 for client, _ in self._open.values() if not client.closed)

    async def close(self) -> None:
        for client, _ in list(self._open.values()):
            await client.close()
        self._open.clear()


class RayRun:
    """One generation on the replicas, restarted on another replica if its replica dies."""

    def __init__(
        self,
        shards: Shards,
        ids: list[int],
        params: GenerationParams,
        slot: str | None,
        sink,
        sockets: "ReplicaSockets | None" = None,
    ) -> None:
        self.shards = shards
        self.sockets = sockets
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

    async def _stream(
        self, shard: int, prompt: list[int], params: GenerationParams
    ) -> AsyncIterator[dict[str, Any]]:
        """The generation on ``shard``, as ``EngineReplica.generate``'s items (batches of
        ``tokens``, the first with the early stats, then ``done``): on the replica's socket
        where the ingress has a connection to it, else through Serve's handle."""
        self.response = None
        sock = await self.sockets.get(shard) if self.sockets is not None else None
        if sock is None:
            return self._through_serve(shard, prompt, params)
        return self._through_socket(*sock, prompt, params)

    async def _through_serve(
        self, shard: int, prompt: list[int], params: GenerationParams
    ) -> AsyncIterator[dict[str, Any]]:
        req = {"prompt": prompt, "params": P.params_to_json(params), "slot": self.slot}
        self.response = self.shards.handles[shard].options(stream=True).generate.remote(req)
        async for item in self.response:
            yield item

    async def _through_socket(
        self, client: EngineClient, where: str, prompt: list[int], params: GenerationParams
    ) -> AsyncIterator[dict[str, Any]]:
        """A lost connection (the replica died) raises, as a failed Serve call does; anything
        else the replica says (an error included) ends the items with ``done``.  A piece of
        several tokens (the replica batches them while its socket is behind) carries its text
        on its first token: a steer then keeps the tokens of the pieces it spells whole, never
        a token whose text it does not spell (``steering.successor_prompt``)."""
        gen = await client.generate(prompt, params, slot=self.slot)
        try:
            first = True  # the first item carries the early stats
            async for piece in gen:
                if piece.ids:
                    item: dict[str, Any] = {
                        "tokens": [
                            [t, piece.text if k == 0 else ""] for k, t in enumerate(piece.ids)
                        ]
                    }
                    if first:
                        item["stats"], first = dict(gen.stats), False
                    yield item
            if gen.error is not None and gen.error.get("code") == DISCONNECTED:
                raise EngineUnavailable(gen.error.get("message", "the replica's socket closed"))
            yield {
                "done": gen.finish_reason or "error",
                "stats": dict(gen.stats),
                "replica": where,
                "error": gen.error,
            }
        finally:
            if not gen.done:  # cancelled (or the ingress stops): the replica stops it too
                with contextlib.suppress(EngineUnavailable):
                    await gen.cancel()

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
            prompt = [*self.ids, *delivered]
            try:
                shard = await self.shards.pick(self.slot)
            except asyncio.CancelledError:
                self.sink.finish("cancelled", so_far(), None)
                return
            try:
                stream = await self._stream(shard, prompt, params)
                async with contextlib.aclosing(stream):
                    async for item in stream:
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
        model: str,
        token: str,
        origins: list[str],
        direct: dict[str, Any] | None = None,
    ) -> None:
        self.shards = Shards(list(shards), ReplicaBoard(list(shards)))
        # the engine replicas' own sockets, where they listen: beside the direct endpoints
        self.sockets = (
            ReplicaSockets(list(shards), token, direct.get("tls_cert")) if direct else None
        )
        # a folder's, or a GGUF file's (of a Hub model, fetched on this node without weights)
        self.model_dir = resolve_model(model, weights=False)
        self.tokenizer = open_model(self.model_dir).tokenizer
        self.served = ServedFiles()  # its prompt files, offered to clients (``hello``'s files)
        self.served.offer(self.model_dir, self.tokenizer)
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
        given = bearer(headers)
        if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
            return http.HTTPStatus.UNAUTHORIZED, "a valid engine token is required"
        origin = headers.get("origin")
        if origin is not None and origin not in self.origins:
            return http.HTTPStatus.FORBIDDEN, f"origin {origin!r} is not allowed"
        return None

    async def _models(self, direct: str | None) -> RayModels:
        if self.info is None:
            info = await self.shards.handles[0].describe.remote()
            digest = self.served.digest(self.model_dir)
            self.info = {**info, "files": digest} if digest is not None else info
        return RayModels(
            self.shards,
            self.tokenizer,
            self.info,
            direct,
            self.sockets,
            lambda: self.served.read(self.model_dir, self.tokenizer),
        )

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
        conn = Connection(await self._models(None), ws.send, peer=f"{peer_name(ws)} (direct)")
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
        if self.sockets is not None:
            await self.sockets.close()
