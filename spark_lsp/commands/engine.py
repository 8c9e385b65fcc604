"""`spark-lsp engine serve`: run the shared engine daemon (``engine.service``) for editors to join."""

from __future__ import annotations

import sys

from engine.service import options


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
    s.add_argument("--replicas", type=int, default=2, help="engine replicas with --ray")
    s.add_argument(
        "--no-direct",
        dest="direct",
        action="store_false",
        help="with --ray: clients stay on Serve's proxy (by default each ingress replica also "
        "listens on a port of its own, which clients move to, skipping the proxy; use this "
        "where only the proxy's port can be reached)",
    )
    s.set_defaults(func=run)


def run(args) -> int:
    if args.ray:
        from engine.service import ray_app

        return ray_app.main_args(args)
    from engine.service import daemon

    return daemon.main_args(args)


if __name__ == "__main__":
    from engine.service.daemon import main

    sys.exit(main())
