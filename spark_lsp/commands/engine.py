"""`spark-lsp engine serve|list|stop`: run the shared engine daemon (``engine.service``) for
editors to join, see which of the user's services run, stop them (also the language servers'
session host, `serve --shared`: the other way editors share one engine)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from engine.service import options

from . import positive_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "engine",
        help="run the shared engine service",
        description="The engine as a service: one model, shared by every editor window.",
    )
    sub = p.add_subparsers(dest="engine_command", metavar="ACTION")
    sub.required = True
    s = sub.add_parser(
        "serve",
        help="serve models over a persistent WebSocket (loopback, token-protected)",
        description="Load the models once and serve them to spark-lsp servers (engine "
        "'auto', 'ws://...' or 'wss://...') over one WebSocket each (wss:// with "
        "--tls-cert/--tls-key). The URL and token go to a 0600 file in the user's runtime "
        "dir. SIGTERM stops it cleanly.",
    )
    options.add_arguments(s)
    s.add_argument(
        "--ray",
        action="store_true",
        help="deploy on Ray Serve instead (needs Ray: pip install 'ray[serve]')",
    )
    s.add_argument("--replicas", type=positive_int, default=2, help="engine replicas with --ray")
    s.add_argument(
        "--no-direct",
        dest="direct",
        action="store_false",
        help="with --ray: clients stay on Serve's proxy and the ingress reaches the engine "
        "replicas through Serve's handles (by default each ingress replica also listens on a "
        "port of its own, which clients move to, skipping the proxy, and each engine replica "
        "on one the ingress sends generations to; use this where only Serve's ports can be "
        "reached)",
    )
    s.set_defaults(func=run)
    ls = sub.add_parser(
        "list",
        help="the engine services you run, and whether each answers",
        description="List your running engine services (daemons, also those `engine: auto` "
        "started, `engine serve --ray` deployments, and the session host that `serve --shared` "
        "editors share) from their records in your runtime "
        "dir, and ask each for its status as a client would; or, given URLs, ask those "
        "services (a team's: the token from $SPARK_LSP_ENGINE_TOKEN, a private CA from "
        "$SPARK_LSP_ENGINE_CA) and show the models they serve, by the names `model` takes.",
    )
    ls.add_argument(
        "urls",
        nargs="*",
        metavar="URL",
        help="ws:// or wss:// URLs of services to ask instead of your own",
    )
    ls.add_argument("--json", action="store_true", help="print JSON (without the tokens)")
    ls.set_defaults(func=run_list)
    st = sub.add_parser(
        "stop",
        help="stop engine services (SIGTERM: generations cancelled cleanly)",
        description="Stop one of your engine services, named by model (folder name or path), "
        "key, pid or URL; with no name, the only one running. A stopped daemon cancels its "
        "generations, sends their last messages and removes its record; editors on it "
        "reconnect (`engine: auto` starts a new one).",
    )
    st.add_argument(
        "which",
        nargs="*",
        metavar="MODEL",
        help="a model (its name, folder, or the catalogue name or hf: spec it was served as), "
        "key, pid or URL",
    )
    st.add_argument(
        "--all",
        action="store_true",
        help="stop every engine service you run, and the session host",
    )
    st.add_argument(
        "--session-host",
        action="store_true",
        help="stop the session host of `serve --shared` editors (their sessions end; an editor "
        "that starts its server again starts a new host)",
    )
    st.add_argument(
        "--timeout", type=float, default=15.0, help="seconds to wait for each to exit (15)"
    )
    st.add_argument(
        "--force", action="store_true", help="SIGKILL a service that did not exit in time"
    )
    st.set_defaults(func=run_stop)


def session_host() -> dict[str, Any] | None:
    """The user's session host (`serve --shared`) as `engine list` shows it: its record's pid,
    socket and start, and what it answers (`status`) or why it does not (`problem`); None when
    none runs."""
    from .. import bridge

    record = bridge.read_record()
    if record is None:
        return None
    out: dict[str, Any] = {
        "kind": "session-host",
        "pid": record["pid"],
        "socket": record["socket"],
        "since": record.get("since"),
        "answers": False,
        "status": None,
        "problem": None,
    }
    try:
        out["status"] = bridge.host_status(record)
        out["answers"] = True
    except (bridge.BridgeError, OSError, ValueError) as exc:
        out["problem"] = str(exc) or type(exc).__name__
    return out


def describe_host(host: dict[str, Any]) -> str:
    """One line, as `manage.describe` gives for a daemon: pid, age, sessions, shared models."""
    from engine.config import model_name
    from engine.service import manage

    parts = ["session host (serve --shared)", f"pid {host['pid']}"]
    if isinstance(host.get("since"), (int, float)):
        parts.append(f"up {manage.duration(time.time() - host['since'])}")
    status = host.get("status")
    if status is not None:
        parts.append(f"{status.get('sessions', 0)} session(s)")
        for where, n in sorted((status.get("runs") or {}).items()):
            if not where.startswith("session host"):  # the shared models follow
                parts.append(f"{n} on {where}")
        for m in status.get("models", []):
            parts.append(
                f"{model_name(m.get('model') or '?')} ({m.get('precision')}, "
                f"{m.get('sessions')} session(s))"
            )
    else:
        parts.append(f"NOT ANSWERING: {host.get('problem')}")
    return "  ".join(parts)


def run_list(args) -> int:
    from engine.service import manage

    host = None
    if args.urls:
        found = [manage.remote(url) for url in args.urls]
    else:
        found = [manage.check(svc) for svc in manage.services()]
        host = session_host()
    if args.json:
        listed = [{"kind": "engine", **svc.as_json()} for svc in found]
        print(json.dumps(listed + ([host] if host else []), indent=1))
    elif not found and host is None:
        print("no engine service runs")
    else:
        for svc in found:
            print(manage.describe(svc))
        if host is not None:
            print(describe_host(host))
    return 0 if all(svc.answers for svc in found) and (host is None or host["answers"]) else 1


def stop_session_host(args, *, quiet: bool = False) -> int:
    """`engine stop --session-host` (and `--all`, `quiet` when none runs): SIGTERM the host, as
    a daemon is stopped."""
    from engine.service import manage

    from .. import bridge

    record = bridge.read_record()
    if record is None:
        if not quiet:
            print("no session host runs")
        return 0
    path = os.path.join(bridge.runtime_dir(), bridge.RECORD)

    def forget() -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    try:
        said = manage.stop_process(
            record["pid"], record.get("started"), forget, timeout=args.timeout, force=args.force
        )
    except manage.ManageError as e:
        print(
            f"spark-lsp engine stop: error: session host (pid {record['pid']}): {e}",
            file=sys.stderr,
        )
        return 2
    print(f"session host (pid {record['pid']}): {said}")
    return 0


def run_stop(args) -> int:
    from engine.service import manage

    if args.session_host and not args.all:
        if args.which:
            print("spark-lsp engine stop: error: --session-host takes no MODEL", file=sys.stderr)
            return 2
        return stop_session_host(args)
    try:
        chosen = manage.select(manage.services(), args.which, args.all)
    except manage.ManageError as e:
        print(f"spark-lsp engine stop: error: {e}", file=sys.stderr)
        return 2
    from .. import bridge

    hosted = args.all and bridge.read_record() is not None
    host = stop_session_host(args, quiet=True) if hosted else 0
    if not chosen:
        if not hosted:
            print("no engine service runs")
        return host
    failed = 0
    for svc in chosen:
        try:
            said = manage.stop(svc, timeout=args.timeout, force=args.force)
        except manage.ManageError as e:
            print(
                f"spark-lsp engine stop: error: {svc.label} (pid {svc.pid}): {e}", file=sys.stderr
            )
            failed += 1
            continue
        print(f"{svc.label} on {svc.url} (pid {svc.pid}): {said}")
    return 2 if failed or host else 0


def run(args) -> int:
    if args.ray:
        from engine.service import ray_app

        return ray_app.main_args(args)
    from engine.service import daemon

    return daemon.main_args(args)


if __name__ == "__main__":
    from engine.service.daemon import main

    sys.exit(main())
