"""The engine daemon: load models once, serve them over WebSocket until SIGTERM.

``python -m engine.service.daemon [options]`` (``spark-lsp engine serve`` is the same command).
The daemon binds loopback unless told otherwise, generates a random token and writes its URL and
token to a 0600 record in the user's runtime dir (``engine.service.rundir``).  A client shares
one daemon per model with ``engine.service.launch.join_or_start``: it reads the record, or starts
a detached daemon and waits for its record.

With a certificate and its key (``--tls-cert`` / ``--tls-key``, ``engine.service.tls``) it serves
``wss://``.  Serving other machines without them is allowed (a TLS-terminating proxy may sit in
front) but warned about: the token and the prompts would cross the network in clear text.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import ssl
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import cancel_flags, rundir, tls
from .address import is_loopback
from .launch import DaemonError, resolve_models
from .local import LocalModels
from .options import DEFAULT_SLOTS, DEFAULT_SPINNING, SPINNING, add_arguments
from .server import EngineServer

log = logging.getLogger(__name__)

#: Prompt tokens per prefill run in a daemon (the language server's in-process engine uses the same).
INTERACTIVE_PREFILL_CHUNK = 256


def load_engines(
    folders: Sequence[Path],
    *,
    slots: int = DEFAULT_SLOTS,
    precision: str = "fp32",
    threads: int | None = None,
    spinning: bool | None = SPINNING[DEFAULT_SPINNING],
) -> list[Any]:
    """The daemon's engines. ``spinning`` defaults to off (the in-process engine's default is
    auto): between two steps a generation's thread writes its token and the connection's thread
    reads cancels, and ONNX Runtime threads that spin between steps hold the cores those threads
    need on a small machine."""
    from ..engine import Engine  # lazily: ONNX Runtime loads only when a daemon really starts

    engines = []
    for folder in folders:
        t0 = time.perf_counter()
        eng = Engine.load(
            folder, slots=slots, precision=precision, threads=threads, spinning=spinning
        )
        # a cancel waits for the prefill run in flight: interactive clients need short runs
        eng.prefill_chunk = min(eng.prefill_chunk, INTERACTIVE_PREFILL_CHUNK)
        eng.tokenizer.byte_index()  # token-healed prompts need it: built now, not in a request
        log.info("engine: loaded %s in %.1f s", eng.name, time.perf_counter() - t0)
        engines.append(eng)
    return engines


def read_token_file(path: str) -> str:
    try:
        token = Path(path).expanduser().read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise DaemonError(f"--token-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if len(token) < 16:
        raise DaemonError(f"{path}: a token needs at least 16 characters")
    return token


def run(
    models: Any,
    folders: Sequence[Path],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str,
    origins: Sequence[str] = (),
    idle_exit_s: float | None = None,
    record: bool = True,
    announce=None,
    stop: threading.Event | None = None,
    ssl_context: ssl.SSLContext | None = None,
    tls_cert: str | None = None,
) -> None:
    """Serve ``models`` until SIGTERM/SIGINT (or ``stop`` is set, or ``idle_exit_s`` passes with
    no client); every generation in flight is cancelled and its ``done`` delivered before exit.
    The server runs on its own threads; this one waits for the end.  ``ssl_context``
    (``tls.server_context``): serve ``wss://`` (the record gets that URL, and ``tls_cert``, the
    certificate's file, which the user's own clients pin: ``launch.join_or_start``'s callers
    connect to the bind address, which the certificate need not name)."""
    flags_dir = rundir.runtime_dir()  # clients on this machine get shared cancel flags there
    cancel_flags.sweep(flags_dir)
    server = EngineServer(
        models, token=token, origins=origins, ssl_context=ssl_context, flags_dir=flags_dir
    ).open(host, port)
    key = rundir.model_key(folders)
    extra = {"tls_cert": str(Path(tls_cert).expanduser().resolve())} if tls_cert else {}
    path = (
        rundir.write_record(key, server.url, token, [str(f) for f in folders], **extra)
        if record
        else None
    )
    log.info(
        "engine: serving %s on %s%s",
        [m["name"] for m in models.describe()],
        server.url,
        f" (record {path})" if path else "",
    )
    if announce is not None:
        announce(server, path)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    try:
        last = time.monotonic()
        while not stop.wait(min(0.5, idle_exit_s or 0.5)):
            if idle_exit_s is None:
                continue
            if server.connections:
                last = time.monotonic()
            elif time.monotonic() - last >= idle_exit_s:
                log.info("engine: no client for %.0f s, exiting", idle_exit_s)
                break
        log.info("engine: stopping (%d connection(s))", len(server.connections))
    finally:
        if path is not None:
            rundir.remove_record(key, os.getpid())
        server.close()
        models.close()
        log.info("engine: stopped")


# -- command line ---------------------------------------------------------------------------------
def warn_cleartext(host: str, port: int, *, to_stderr: bool) -> None:
    """Say that a daemon serving other machines without TLS sends the token and the code in
    clear text (not refused: a TLS-terminating proxy in front of it is a valid setup).  The
    warning goes to the log, and to stderr as well where the log does not show it there (a log
    file, or a level above WARNING)."""
    msg = (
        f"serving {host}:{port} to other machines without TLS: the token and every prompt (the "
        "users' code) cross the network unencrypted; pass --tls-cert and --tls-key, or put a "
        "TLS-terminating proxy in front of the daemon"
    )
    log.warning("engine: %s", msg)
    if to_stderr:
        print(f"spark-lsp engine serve: warning: {msg}", file=sys.stderr, flush=True)


def main_args(args: argparse.Namespace) -> int:
    handler = (
        logging.FileHandler(args.log_file) if args.log_file else logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(args.log_level)
    logging.getLogger("websockets").setLevel(logging.WARNING)
    host, port = args.ws
    try:
        if not is_loopback(host) and not args.allow_remote:
            raise DaemonError(
                f"--ws {host}:{port} is not a loopback address: pass --allow-remote "
                "(and give clients the token) to serve other machines"
            )
        ssl_context = tls.server_context_for(args.tls_cert, args.tls_key)
        if ssl_context is None and not is_loopback(host):
            warn_cleartext(
                host,
                port,
                to_stderr=bool(args.log_file) or logging.getLogger().level > logging.WARNING,
            )
        token = read_token_file(args.token_file) if args.token_file else rundir.new_token()
        folders = resolve_models(args.model)
        models = LocalModels(
            load_engines(
                folders,
                slots=args.slots,
                precision=args.precision,
                threads=args.threads,
                spinning=SPINNING[args.spinning],
            )
        )
    except (DaemonError, OSError, ValueError) as e:
        print(f"spark-lsp engine serve: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a model that cannot load
        print(f"spark-lsp engine serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 1

    def announce(server: EngineServer, path: Path | None) -> None:
        print(f"engine service on {server.url} (token in {path})", file=sys.stderr, flush=True)

    sys.setswitchinterval(0.0005)  # a cancel or a socket read waits at most this for the GIL
    # The loaded models are tens of thousands of long-lived objects: out of the collector's
    # reach, a full collection no longer stops every thread (a cancel, a token) for tens of ms.
    gc.collect()
    gc.freeze()
    run(
        models,
        folders,
        host=host,
        port=port,
        token=token,
        origins=args.allow_origin,
        idle_exit_s=args.idle_exit,
        announce=announce,
        ssl_context=ssl_context,
        tls_cert=args.tls_cert if ssl_context is not None else None,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.service.daemon", description=__doc__.splitlines()[0]
    )
    add_arguments(p)
    return main_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
