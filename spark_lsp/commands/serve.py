"""`spark-lsp serve`: run the language server over stdio (default), TCP or WebSocket."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from engine.service.address import host_port


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the language server (stdio by default)",
        description="Run the spark-lsp language server. Editors start it with --stdio; "
        "TCP and WebSocket bind 127.0.0.1 unless HOST is given.",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--stdio", action="store_true", help="talk LSP over stdin/stdout (default)")
    g.add_argument(
        "--tcp",
        metavar="HOST:PORT",
        type=host_port,
        help="listen for TCP clients (each connection its own session)",
    )
    g.add_argument(
        "--ws",
        metavar="HOST:PORT",
        type=host_port,
        help="listen for WebSocket clients (each its own session; they need the token)",
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="let --tcp/--ws listen on a non-loopback address (reachable from other machines)",
    )
    p.add_argument(
        "--allow-origin",
        metavar="ORIGIN",
        action="append",
        default=[],
        help="a browser Origin (e.g. https://my.editor.example) allowed to open a WebSocket; "
        "browser origins are refused otherwise (repeatable)",
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="the WebSocket token file (default $XDG_RUNTIME_DIR/spark-lsp/token, else "
        "~/.cache/spark-lsp/token; created 0600 on first use)",
    )
    p.add_argument(
        "--max-sessions",
        metavar="N",
        type=int,
        default=4,
        help="network sessions at once (each loads its own model; default 4)",
    )
    p.add_argument(
        "--engine",
        metavar="WHERE",
        default=None,
        help="where the engine runs: local (default), auto (the shared engine daemon for the "
        "model, started when none runs) or ws://HOST:PORT (spark-lsp engine serve)",
    )
    p.add_argument(
        "--shared",
        action="store_true",
        help="with --stdio: be a small bridge to your session host, one process that runs every "
        "editor's session with one copy of each model (started when none runs; "
        "$SPARK_LSP_SHARED=1 does the same). See docs/service.md",
    )
    p.add_argument(
        "--model",
        metavar="MODEL",
        help="model folder, .gguf file, catalogue name (spark-lsp models list) or "
        "hf:ORG/REPO[:FILE.gguf], downloaded on first use (default: the bundled model)",
    )
    p.add_argument("--log-file", metavar="FILE", help="write the server's debug log here")
    p.add_argument(
        "--log-level",
        default=os.environ.get("SPARK_LSP_LOG", "WARNING"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (stderr or --log-file)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from spark_lsp import bridge  # standard library only (cli routes `--shared` to it first)

    shared = getattr(args, "shared", False) or (
        bridge.shared_by_env() and not (args.tcp or args.ws)
    )
    if shared:
        if args.tcp or args.ws:
            print("spark-lsp serve: --shared is for --stdio (an editor's bridge)", file=sys.stderr)
            return 2
        return bridge.main(args.model, args.engine, own_server=lambda why: serve_here(args, why))
    # set by a bridge that found no session host and became this server (bridge.exec_own_server)
    return serve_here(args, os.environ.pop(bridge.ENV_UNSHARED, None))


def serve_here(args, unshared: str | None = None) -> int:
    """The language server in this process. `unshared`: why `--shared` found no session host
    (the bridge then runs this instead), which the editor is told once it has initialised."""
    from spark_lsp.model_host import BadModel, model_argument

    try:
        model = model_argument(args.model)
    except BadModel as exc:
        print(f"spark-lsp serve: {exc}", file=sys.stderr)
        return 2
    from spark_lsp.server import configure_process, create_server

    configure_process(
        logging.FileHandler(args.log_file) if args.log_file else logging.StreamHandler(sys.stderr),
        args.log_level,
    )

    if not (args.tcp or args.ws):
        notice = None
        if unshared:
            notice = (
                f"spark-lsp: --shared found no session host ({unshared}); this window runs "
                "its own server and model"
            )
        return create_server(model, args.engine, notice=notice).start_io()
    return _serve_network(args, lambda: create_server(model, args.engine))


def _serve_network(args, factory) -> int:
    import asyncio

    from spark_lsp import transports

    host, port = args.tcp or args.ws
    try:
        warning = transports.check_bind(host, args.allow_remote)
    except transports.BindError as exc:
        print(f"spark-lsp serve: {exc}", file=sys.stderr)
        return 2
    if warning:
        print(f"spark-lsp serve: {warning}", file=sys.stderr)

    def ready(addrs) -> None:
        where = ", ".join(f"{a[0]}:{a[1]}" for a in addrs)
        print(
            f"spark-lsp serve: listening on {where} ({'WebSocket' if args.ws else 'TCP'})",
            file=sys.stderr,
            flush=True,
        )

    if args.ws:
        path = args.token_file or transports.token_path()
        try:
            token = transports.load_token(path)
        except (OSError, transports.TokenError) as exc:
            print(f"spark-lsp serve: token file {path}: {exc}", file=sys.stderr)
            return 2
        print(
            f"spark-lsp serve: WebSocket clients pass the token in {path} as "
            "ws://HOST:PORT/?token=… or 'Authorization: Bearer …'",
            file=sys.stderr,
        )
        main = transports.serve_ws(
            factory,
            host,
            port,
            token=token,
            allowed_origins=args.allow_origin,
            max_sessions=args.max_sessions,
            ready=ready,
        )
    else:
        main = transports.serve_tcp(
            factory, host, port, max_sessions=args.max_sessions, ready=ready
        )
    try:
        asyncio.run(transports.until_signalled(main))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"spark-lsp serve: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # `python -m spark_lsp.commands.serve ...`: what demo/bench/tests spawn
    _parser = argparse.ArgumentParser(prog="spark-lsp")
    register(_parser.add_subparsers())
    _args = _parser.parse_args(["serve", *sys.argv[1:]])
    sys.exit(run(_args))
