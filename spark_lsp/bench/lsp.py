"""`spark-lsp bench lsp`: keystroke-to-suggestion latency from a replayed typing trace.

The server runs as editors run it (a child process over stdio). A real Python file is opened with
one function's body removed; the body is then typed back character by character at about 10
characters a second with a pause after each line, auto-indent inserting the indentation with the
newline. Every keystroke sends `didChange` then `textDocument/inlineCompletion` (Automatic), and a
request still pending when the next key arrives is cancelled with `$/cancelRequest`, as VS Code
does. Latency is request sent -> response received, measured in the client.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from engine.lab.models import SYNTHETIC, synthetic_model

from .. import bridge
from ..model_host import BadModel, model_argument
from ..rpc_client import LspClient, RpcError, server_cmd
from .stats import pct
from .trace import DEFAULT_FILE, keystrokes, pick_function, source_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="DIR",
        help="model folder, a synthetic model name (e.g. synthetic-qwen2.5-coder-0.5b) or anything "
        "the server's model setting takes (default: the bundled model)",
    )
    p.add_argument(
        "--precision",
        default=None,
        metavar="P",
        help="server setting precision: fp32, int8, int8-rowq, int4 or auto (default: the server's)",
    )
    p.add_argument(
        "--file", metavar="PY", help=f"Python file to type into (default: stdlib {DEFAULT_FILE})"
    )
    p.add_argument(
        "--function",
        metavar="NAME",
        help="function whose body is typed (default: a 8-40 line "
        "function in the middle of the file)",
    )
    p.add_argument(
        "--cps", type=float, default=10.0, help="typing speed, characters per second (default 10)"
    )
    p.add_argument(
        "--line-pause", type=float, default=0.6, help="pause after each line, seconds (default 0.6)"
    )
    p.add_argument(
        "--speed", type=float, default=1.0, help="replay this many times faster (tests: 10)"
    )
    p.add_argument(
        "--max-chars", type=int, default=None, help="stop after typing this many characters"
    )
    p.add_argument("--context-tokens", type=int, default=None, help="server setting contextTokens")
    p.add_argument("--max-tokens", type=int, default=None, help="server setting maxTokens")
    p.add_argument(
        "--cancels",
        type=int,
        default=30,
        help="after the replay, cancel this many running suggestions to time cancellation (default 30)",
    )
    p.add_argument(
        "--backend",
        default="local",
        choices=("local", "llamacpp", "ollama", "openai"),
        help="where suggestions are generated (server setting 'backend'; default local)",
    )
    p.add_argument("--backend-url", default=None, metavar="URL", help="server setting backendUrl")
    p.add_argument(
        "--engine",
        default=None,
        metavar="WHERE",
        help="server setting engine: local, auto (the shared daemon) or ws://HOST:PORT",
    )
    p.add_argument(
        "--backend-model", default=None, metavar="NAME", help="server setting backendModel"
    )
    p.add_argument(
        "--fim-template", default=None, metavar="NAME", help="server setting fimTemplate"
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="start the server with an empty cache (its own temporary $SPARK_LSP_CACHE): the start "
        "then builds the model's graph and compiles the native op, as on a fresh install",
    )
    p.add_argument("--answer-ms", type=int, default=None, help="server setting answerMs")
    p.add_argument(
        "--shared",
        action="store_true",
        help="run the server as `serve --stdio --shared` (a bridge to a session host, one of this "
        "run only) instead of `serve --stdio`",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also draw the headline figures into a PNG (needs matplotlib)",
    )


def main(argv: list[str] | None = None, plot=None) -> int:
    p = argparse.ArgumentParser(prog="spark-lsp bench lsp", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv), plot=plot)


def cancel_phase(client, uri: str, n: int) -> list[float]:
    """Start long Invoked suggestions after block openers and cancel each a few ms later, as an
    editor does when the user moves on; returns the client's cancel round trips (ms)."""
    import random

    if n <= 0:
        return []
    client.call(
        "workspace/executeCommand",
        {"command": "spark.configure", "arguments": [{"maxTokens": 128, "maxLines": 40}]},
    )
    text = client.docs[uri].text
    openers = [i + 1 for i, ln in enumerate(text.splitlines()) if ln.rstrip().endswith(":")]
    rng = random.Random(0)
    out = []
    for k in range(n):
        line = openers[k % len(openers)] - 1
        col = len(text.splitlines()[line])
        fut = client.request(
            "textDocument/inlineCompletion",
            {
                "textDocument": {"uri": uri},
                "position": {"line": line, "character": col},
                "context": {"triggerKind": 1},
            },
        )
        time.sleep(rng.uniform(0.005, 0.03))
        t = time.perf_counter()
        client.cancel(fut)
        try:
            fut.result(60)
        except RpcError as exc:
            if exc.code == -32800:
                out.append((fut.received_at - t) * 1e3)
        time.sleep(0.02)
    return out


def _insert_text(item: dict) -> str:
    t = item.get("insertText", "")
    return t if isinstance(t, str) else t.get("value", "")


def run(args, plot=None) -> int:
    """``plot(results, FILE)`` draws ``--plot FILE`` (default: ``spark_lsp.bench.plot``)."""
    if args.plot:
        from . import plot as bench_plot

        plot = bench_plot.plotter_for_run("lsp", plot)
        if plot is None:
            return 2

    path = source_file(args.file)
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as exc:
        print(f"spark-lsp bench lsp: --file {path}: {exc}", file=sys.stderr)
        return 2
    if args.speed <= 0 or args.cps <= 0:
        print("spark-lsp bench lsp: --speed and --cps must be positive", file=sys.stderr)
        return 2
    start, end, _ = pick_function(source, args.function)
    keys = keystrokes(source[start:end])
    if args.max_chars:
        acc, cut = 0, 0
        for cut, k in enumerate(keys):  # noqa: B007 (the index is read after the loop)
            acc += len(k)
            if acc >= args.max_chars:
                break
        keys = keys[: cut + 1]
    # no background measuring skews the run; every suggestion is shown (no confidence gate), so the
    # replay's work (typing-through, model calls) is the same whatever a model's probabilities
    options = {"liveEdits": False, "tunePrecision": False, "minConfidence": 0}
    if args.context_tokens:
        options["contextTokens"] = args.context_tokens
    if args.max_tokens:
        options["maxTokens"] = args.max_tokens
    if args.answer_ms is not None:
        options["answerMs"] = args.answer_ms
    if args.precision:
        options["precision"] = args.precision
    if args.engine:
        options["engine"] = args.engine
    model = args.model
    if model in SYNTHETIC:  # written once into the bench cache, then served as a folder
        model = str(synthetic_model(model))
    try:  # a model that is not there is said here, not by a server that exits at start
        model = model_argument(model)
    except BadModel as exc:
        print(f"spark-lsp bench lsp: error: {exc}", file=sys.stderr)
        return 2
    if args.backend != "local":
        options.update(
            backend=args.backend,
            backendUrl=args.backend_url,
            backendModel=args.backend_model,
            fimTemplate=args.fim_template,
        )

    with (
        tempfile.TemporaryDirectory(prefix="spark-bench-cold-") as cold,
        tempfile.TemporaryDirectory(prefix="spark-") as run_dir,
    ):
        env = {"SPARK_LSP_CACHE": cold} if args.cold else {}
        cmd = server_cmd(model)
        if args.shared:  # what an editor runs: the `spark-lsp` command's `serve --stdio --shared`
            cmd = [sys.executable, "-m", "spark_lsp.cli", "serve", *cmd[3:], "--shared"]
            env["SPARK_LSP_RUN_DIR"] = run_dir  # a host of this run, not the user's
        client = LspClient(cmd, env=env or None)
        try:
            return _replay(args, plot, client, options, path, source, keys)
        finally:
            if args.shared:
                _stop_host(run_dir)


def _stop_host(run_dir: str) -> None:
    """Stop the session host of `run_dir` (the bench's own) and wait for it to go."""
    rec = bridge.read_record(run_dir)
    if rec is not None:
        bridge.stop_host(rec["pid"])


def _replay(args, plot, client, options: dict, path: Path, source: str, keys: list[str]) -> int:
    """Start the server (already spawned as `client`), open the file, take the first suggestion,
    replay `keys`, then time cancellations; print and return the exit status."""
    start, end, fname = pick_function(source, args.function)
    text = source[:start] + source[end:]
    try:
        t0 = time.perf_counter()
        client.initialize(options)
        try:
            info = client.wait_ready()
        except (RuntimeError, TimeoutError) as exc:
            print(f"spark-lsp bench lsp: {exc}", file=sys.stderr)
            return 1
        load_s = time.perf_counter() - t0
        uri = path.resolve().as_uri()
        client.open(uri, text)
        # warm up: the first request prefills the whole prompt (as when a file is opened)
        first = client.inline(uri, start)
        first.result(600)
        first_s = time.perf_counter() - t0
        base = client.call("spark/metrics", {})
        t_warm = time.perf_counter()

        key_dt = 1.0 / (args.cps * args.speed)
        pause = args.line_pause / args.speed
        offset = start
        pending = None
        results = []  # (latency_ms, served_items)
        cancelled = 0
        futures = []
        t_next = time.perf_counter()
        for k in keys:
            now = time.perf_counter()
            if t_next > now:
                time.sleep(t_next - now)
            # as VS Code: the change is synced first, then the stale request cancelled
            offset = client.type_text(uri, offset, k)
            if pending is not None and not pending.done():
                client.cancel(pending)
            pending = client.inline(uri, offset)
            futures.append(pending)
            t_next += key_dt + (pause if "\n" in k else 0.0)
        for f in futures:
            try:
                res = f.result(120)
                items = (res or {}).get("items", [])
                results.append(
                    (f.latency_ms, len(items), len(_insert_text(items[0])) if items else 0)
                )
            except RpcError as exc:
                if exc.code in (-32800, -32801):
                    cancelled += 1
                else:
                    raise
        cancel_rtt = cancel_phase(client, uri, args.cancels)
        final = client.call("spark/metrics", {})
        t_start_replay = t_warm
        engine_ms = [
            p.get("totalMs")
            for t, m, p in client.notifications
            if m == "spark/status"
            and t >= t_start_replay
            and p.get("kind") == "completion"
            and p.get("totalMs") is not None
        ]
    finally:
        client.shutdown()

    lat = [r[0] for r in results]
    cancel_ms = list(final.get("cancelLatencyMs") or [])
    b0, b1 = base.get("backend") or {}, final.get("backend") or {}
    backend = {
        k: b1[k] - b0.get(k, 0)
        for k in ("requests", "cancelled", "tokens", "wasted_tokens")
        if k in b1
    }
    served = {
        k: final[k] - base.get(k, 0)
        for k in (
            "inlineRequests",
            "typingThrough",
            "joinedGeneration",
            "answeredEarly",
            "modelCalls",
            "prefixCacheHits",
            "promptTokens",
            "reusedTokens",
        )
    }
    out = {
        "file": str(path),
        "lines": source.count("\n"),
        "function": fname,
        "model": info.get("model"),
        "keystrokes": len(keys),
        "chars": sum(len(k) for k in keys),
        "cps": args.cps,
        "speed": args.speed,
        "cold": bool(args.cold),
        "load_s": round(load_s, 2),
        "precision": (info.get("engine") or {}).get("precision"),
        "first_suggestion_ms": round(first.latency_ms, 1),
        # `serve` started -> the first suggestion received (model load, warm-up, whole prompt)
        "start_to_first_suggestion_s": round(first_s, 2),
        "answered": len(lat),
        "cancelled_or_superseded": cancelled,
        "with_suggestion": sum(1 for r in results if r[1]),
        # characters of the suggestions shown (answered early ones are short)
        "suggestion_chars_median": statistics.median([r[2] for r in results if r[1]])
        if any(r[1] for r in results)
        else None,
        "latency_ms_median": round(statistics.median(lat), 2) if lat else None,
        "latency_ms_p95": round(pct(lat, 0.95), 2) if lat else None,
        "latency_ms_max": round(max(lat), 2) if lat else None,
        "inline_requests": served["inlineRequests"],
        "typing_through": served["typingThrough"],
        "joined_generation": served["joinedGeneration"],
        "answered_early": served["answeredEarly"],
        "model_calls": served["modelCalls"],
        "prefix_cache_hits": served["prefixCacheHits"],
        "prompt_tokens": served["promptTokens"],
        "reused_prompt_tokens": served["reusedTokens"],
        # $/cancelRequest (or a superseding didChange) -> the engine stopped, measured in the server
        "cancel_latency_ms_median": round(statistics.median(cancel_ms), 3) if cancel_ms else None,
        "cancel_latency_ms_p95": round(pct(cancel_ms, 0.95), 3) if cancel_ms else None,
        "cancels_measured": len(cancel_ms),
        # $/cancelRequest sent -> -32800 received, measured in the client
        "cancel_round_trip_ms_median": round(statistics.median(cancel_rtt), 3)
        if cancel_rtt
        else None,
        "ttft_ms_median": final.get("ttftMsMedian"),
        # engine time of the model calls (prefill + decode), to tell model time from server overhead
        "engine_ms_median": round(statistics.median(engine_ms), 2) if engine_ms else None,
        # requests the backend got, how many were closed before it finished, and the tokens it
        # generated for them that were never shown (waste)
        "shared": bool(getattr(args, "shared", False)),  # through a bridge and a session host
        "backend": b1.get("kind", args.backend),
        "backend_requests": backend.get("requests"),
        "backend_cancelled": backend.get("cancelled"),
        "backend_tokens": backend.get("tokens"),
        "wasted_tokens": backend.get("wasted_tokens"),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"bench lsp: typed {out['chars']} chars of {fname}() into {path.name} ({out['lines']} lines) "
            f"with {out['model']} ({out['backend']} backend), {args.cps:g} chars/s x{args.speed:g}"
        )
        rows = [
            ("start to ready (s)" + (", cold cache" if args.cold else ""), out["load_s"]),
            ("first suggestion, whole prompt (ms)", out["first_suggestion_ms"]),
            ("start to first suggestion (s)", out["start_to_first_suggestion_s"]),
            ("requests answered", out["answered"]),
            ("cancelled / superseded", cancelled),
            ("latency median (ms)", out["latency_ms_median"]),
            ("latency p95 (ms)", out["latency_ms_p95"]),
            ("latency max (ms)", out["latency_ms_max"]),
            ("served by typing-through", out["typing_through"]),
            ("served by joining a running generation", out["joined_generation"]),
            ("answered before the suggestion was finished", out["answered_early"]),
            ("characters per suggestion shown, median", out["suggestion_chars_median"]),
            ("model calls", out["model_calls"]),
            ("model calls reusing the prefix cache", out["prefix_cache_hits"]),
            ("prompt tokens / reused", f"{out['prompt_tokens']} / {out['reused_prompt_tokens']}"),
            (
                "cancel -> engine stopped, median / p95 (ms)",
                f"{out['cancel_latency_ms_median']} / {out['cancel_latency_ms_p95']} ({out['cancels_measured']})",
            ),
            ("cancel round trip in the client, median (ms)", out["cancel_round_trip_ms_median"]),
            ("TTFT median (ms)", out["ttft_ms_median"]),
            ("engine time per model call, median (ms)", out["engine_ms_median"]),
        ]
        if out["backend_requests"] is not None:  # a remote backend: what it was asked and wasted
            rows += [
                (
                    "backend requests / cancelled",
                    f"{out['backend_requests']} / {out['backend_cancelled']}",
                ),
                (
                    "backend tokens / wasted (never shown)",
                    f"{out['backend_tokens']} / {out['wasted_tokens']}",
                ),
            ]
        w = max(len(r[0]) for r in rows)
        for name, val in rows:
            print(f"  {name:<{w}}  {'-' if val is None else val}")
    from engine.lab.bench_report import plot_results

    return plot_results(plot, out, args.plot, "lsp")


if __name__ == "__main__":
    sys.exit(main())
