"""The engine service on Ray Serve: engine replicas behind one WebSocket ingress; this module
deploys them (``deploy``) and runs ``spark-lsp engine serve --ray`` (``main_args``).

``spark-lsp engine serve --ray [--replicas N]`` joins the Ray cluster found by
``ray.init(address="auto")`` (or starts a local one) and deploys two deployments:

- ``EngineShard0`` … ``EngineShard{N-1}``: N one-replica deployments of ``EngineReplica``
  (``ray_replica``), each loading the model; ``generate`` streams one generation.  Serve
  health-checks and restarts them.
- ``EngineIngress`` (``ray_ingress``, FastAPI ingress): the same WebSocket protocol as the
  daemon (``engine.service.connection``), with token and origin checks, through Serve's proxy
  and on each ingress replica's own socket; each ``generate`` is sent to a shard on the
  shard replica's own socket (the engine protocol, one persistent connection per ingress
  replica, served as the daemon serves it), or through its ``DeploymentHandle`` where there is
  none (``direct`` off) or it cannot be reached.

With ``--tls-cert`` / ``--tls-key`` Serve's HTTP proxy serves ``wss://`` (``deploy``).

Routing by slot key: the ingress places each document (slot key) on a shard once, by rendezvous
hashing with bounded loads (``placement.Shards``) on the loads the replicas themselves report
(so that every ingress replica balances on the same counts), and sends every request for it
there, to the replica that holds its KV prefix; a shard that failed is avoided for a few
seconds, and only its documents move.  Both of
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
oversubscribe the cores they share, and a few left to the ingress.

A replica that dies mid-generation: the ingress starts the generation again on another replica
from the prompt plus the tokens already delivered (greedy decoding continues identically), so the
client loses nothing but the cache; after ``ray_ingress.RETRIES`` failures the generation ends with
``finish_reason`` ``error`` (code ``unavailable``).

A generation's first ``tokens`` message carries its early stats (``protocol.EARLY_STATS``) as
the daemon's does: the replica sends them with its first token.  After a restart they still
describe one generation: its prompt, the prefix reuse of the attempt that made its first token,
and the time to that token from the generation's start; its ``done`` repeats them.
"""

import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import ray
from ray import serve

from ..config import ModelError
from ..hub import pinned_spec
from . import rundir, tls
from .address import is_loopback
from .daemon import read_token_file, warn_cleartext
from .launch import DaemonError, resolve_models
from .options import DEFAULT_SPINNING, SPINNING
from .ray_ingress import EngineIngress
from .ray_replica import SLOTS, EngineReplica

log = logging.getLogger(__name__)

APP_NAME = "spark-lsp-engine"
#: The Hub settings of ``engine serve --ray`` that its replicas download a Hub model with (a
#: mirror, offline mode, the cache's place); not HF_TOKEN, which Ray would show with the
#: replicas' environment: a node that fetches a gated model needs its own.
HUB_ENV = ("HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE")
#: Replicas of the WebSocket ingress (None: one per engine shard).  Serve's proxy spreads the
#: editors' connections over them, so relaying tokens is not one process's work.
INGRESS_REPLICAS: int | None = None


def replica_threads(replicas: int) -> int:
    """Intra-op threads per replica: the cluster's CPUs shared out among the replicas, so that
    replicas running at once do not oversubscribe the cores, less one core in eight (at most one
    per replica) left to the ingress replicas and Serve's proxy, which relay every token: engines
    that keep every core busy leave them waiting for one (on 16 cores, 2 replicas with 8 threads
    each vs 7: request to first token 28 vs 15 ms, p50, with 16 editors).  On one 2-core machine:
    1 replica gets 2 threads, 2 replicas 1 each."""
    cpus = int(ray.cluster_resources().get("CPU", 1))
    replicas = max(1, replicas)
    return max(1, (cpus - min(replicas, cpus // 8)) // replicas)


def build_app(
    model: str,
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
    replica_sockets: bool = True,
    env: dict[str, str] | None = None,
):
    """The application: ``replicas`` engine shards and their ingress (``direct``: the ingress
    replicas' own endpoints, ``EngineIngress``, and the engine replicas' sockets unless
    ``replica_sockets`` is False; None: through Serve's proxy and handles only).  ``env``:
    environment variables of every replica's process."""
    runtime = {"runtime_env": {"env_vars": dict(env)}} if env else {}
    shards = [
        EngineReplica.options(
            name=f"EngineShard{i}",
            num_replicas=1,
            ray_actor_options={"num_cpus": num_cpus, **runtime},
        ).bind(
            model,
            threads,
            slots,
            precision,
            spinning,
            token if replica_sockets else None,
            direct,
        )
        for i in range(replicas)
    ]
    return EngineIngress.options(
        num_replicas=INGRESS_REPLICAS or replicas, ray_actor_options={"num_cpus": 0.1, **runtime}
    ).bind(shards, model, token, origins, direct)


def deploy(
    model: str,
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
    name: str = APP_NAME,
    route_prefix: str = "/",
    replica_sockets: bool = True,
) -> str:
    """Deploy on the current Ray cluster (``ray.init`` first); returns the WebSocket URL.
    ``model``: a folder or ``.gguf`` file, which every node must have at that path, or a Hub
    model (best pinned: ``hub.pinned_spec``), which each replica resolves on its own node (the
    ingress fetching no weights), with the Hub settings of this process (``HUB_ENV``).
    ``threads``: intra-op threads per replica (None: ``replica_threads``); ``slots``: KV slots
    per replica, enough for the documents each serves (about documents / replicas); ``name`` /
    ``route_prefix``: the Serve application's, so that several can run side by side (the
    bench's scale-out comparison).

    ``tls_cert`` / ``tls_key`` (PEM files, as the daemon's): Serve's HTTP proxy (uvicorn) serves
    ``wss://`` with them.  Each node's proxy reads them from its own disk, so on a cluster they
    must be at the same path on every node.  A proxy already running keeps its options (Serve
    cannot change them once started): a DaemonError when its TLS is not the one asked for.

    ``direct``: each ingress replica also listens on a port of its own (``EngineIngress``), on
    ``host`` if that is a loopback address (and the replica on this node), else on its node's
    address; clients that move there skip Serve's proxy.  False where only the proxy's port
    can be reached (a firewall): clients then stay on the proxy, and the ingress sends
    generations through Serve's handles.  ``replica_sockets``: False keeps the ingress on
    Serve's handles with ``direct`` on (what the bench compares the sockets with)."""
    proxy: dict[str, Any] = {"host": host, "port": port}
    if tls_cert and tls_key:
        proxy["ssl_certfile"] = str(Path(tls_cert).expanduser().resolve())
        proxy["ssl_keyfile"] = str(Path(tls_key).expanduser().resolve())
    serve.start(http_options=proxy)
    _check_proxy_tls(proxy.get("ssl_certfile"))
    serve.run(
        build_app(
            model,
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
            replica_sockets=replica_sockets,
            env={k: os.environ[k] for k in HUB_ENV if os.environ.get(k)} or None,
        ),
        name=name,
        route_prefix=route_prefix,
        blocking=False,
    )
    # the ingress's route is "/" under the prefix: "/one/" (Serve hands "/one" to the app as "")
    return (
        f"{'wss' if 'ssl_certfile' in proxy else 'ws'}://{host}:{port}{route_prefix.rstrip('/')}/"
    )


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


def model_source(models: list[str]) -> tuple[list[Path], str]:
    """(the folders of the deployment's record, the model its replicas load) for ``--model``: a
    path as itself; a Hub model resolved here without its weights (the record's folder, by which
    an `auto` client on this machine finds the deployment) and given to the replicas pinned to
    that commit, so each downloads the same files on its own node."""
    folders = resolve_models(models, weights=False)
    pinned = pinned_spec(models[0], folders[0]) if models else None
    return folders, pinned or str(folders[0])


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
        folders, model = model_source(args.model)
    except (DaemonError, ModelError, OSError, ValueError) as e:
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
            model,
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
