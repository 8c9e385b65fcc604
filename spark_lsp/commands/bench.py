"""`spark-lsp bench`: speed measurements — engine, edits, lsp, wafer, or all of them; profile.

Each benchmark lives in its own module, imported only when run (torch etc. load lazily):

    engine -> engine.lab.bench          edits -> engine.lab.bench_edits
    lsp    -> spark_lsp.bench.lsp       wafer -> engine.lab.bench_wafer
    profile -> engine.lab.bench_profile (a diagnosis, not part of ``all``)
    robustness -> spark_lsp.bench.robustness (fuzz, load, lifecycle, faults; not part of ``all``)
    service -> spark_lsp.bench.service (in-process vs WebSocket vs HTTP+SSE, Ray; not part of ``all``)

A benchmark module exposes ``main(argv: list[str]) -> int`` and parses its own options
(``spark-lsp bench wafer --help`` shows them), so building the CLI's parser imports none of them.
``all`` runs every benchmark that is installed with its defaults.

``--plot FILE`` (every benchmark): the drawing is ``spark_lsp.bench.plot``; this dispatcher checks
matplotlib before the run and hands the modules a ``plot(results, FILE)`` callable
(``main(argv, plot=...)``), so the engine-side modules never import ``spark_lsp``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import sys

MODULES = {
    "engine": "engine.lab.bench",
    "edits": "engine.lab.bench_edits",
    "lsp": "spark_lsp.bench.lsp",
    "wafer": "engine.lab.bench_wafer",
}
#: Run like the benchmarks, but not by ``all``: a diagnosis, and the two that start servers of
#: their own (daemons, a Ray cluster, fault scenarios).
DIAGNOSES = {
    "profile": "engine.lab.bench_profile",
    "robustness": "spark_lsp.bench.robustness",
    "service": "spark_lsp.bench.service",
}
HELP = {
    "engine": "decode/prefill speed, TTFT cold vs reused prefix, cancel latency; vs transformers and onnxruntime-genai",
    "edits": "streamed code-action edits (speculative edits vs plain decoding)",
    "lsp": "end-to-end language-server latency (keystroke to completion)",
    "service": "the engine in-process vs over the persistent WebSocket vs HTTP+SSE; K editors on Ray replicas",
    "wafer": "partitioned-weight emitter and the wafer performance model",
    "profile": "a decode step's time per ONNX operator: ours (dense, partitioned) and onnxruntime-genai",
    "robustness": "fuzz, load, lifecycle and fault scenarios against a real server: held/tried, memory",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure speed (engine, edits, lsp, service, wafer, all; profile)",
        description=__doc__.splitlines()[0],
    )
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    for name in ("engine", "edits", "lsp", "service", "wafer", "profile", "robustness"):
        # Options belong to the module (imported lazily): pass every argument through untouched.
        q = bsub.add_parser(name, help=HELP[name], add_help=False, prefix_chars="\0")
        q.add_argument("argv", nargs="*")
        q.set_defaults(func=run, bench_name=name)
    a = bsub.add_parser("all", help="every installed benchmark, with its defaults")
    a.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="model folder for every benchmark (a synthetic-* name: the engine benchmark only)",
    )
    a.add_argument(
        "--json", action="store_true", help="one JSON object with every benchmark's results"
    )
    a.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the headline figures into a PNG (needs matplotlib)",
    )
    a.set_defaults(func=_run_all)


def _plotter(name: str, wanted: bool):
    """(plot callable or None, error exit code or 0): matplotlib is checked before a long run."""
    if not wanted:
        return None, 0
    from spark_lsp.bench import plot as bench_plot

    try:
        bench_plot.require()
    except RuntimeError as e:
        print(f"spark-lsp bench {name}: {e}", file=sys.stderr)
        return None, 2
    return bench_plot.plotter(name), 0


def _module_path(name: str) -> str:
    return MODULES.get(name) or DIAGNOSES[name]


def _load(name: str):
    """The benchmark module, or None when it is not installed (yet)."""
    path = _module_path(name)
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name and path.startswith(e.name):
            return None
        raise


def run(args: argparse.Namespace) -> int:
    """Delegate ``bench <name> ARGS...`` to the module's ``main(argv)``."""
    name = args.bench_name
    mod = _load(name)
    if mod is None or not hasattr(mod, "main"):
        print(
            f"spark-lsp bench {name}: error: not available in this installation "
            f"({_module_path(name)}.main is missing)",
            file=sys.stderr,
        )
        return 2
    argv = list(args.argv)
    wanted = any(a == "--plot" or a.startswith("--plot=") for a in argv)
    plot, rc = _plotter(name, wanted)
    if rc:
        return rc
    return int((mod.main(argv, plot=plot) if wanted else mod.main(argv)) or 0)


def _run_all(args: argparse.Namespace) -> int:
    """Run every installed benchmark; with --json or --plot, collect their JSON results."""
    collect = bool(args.json or args.plot)
    results: dict = {"model": args.model}
    rc = 0
    for name in MODULES:
        if not collect:
            print(f"\n=== bench {name} ===", flush=True)
        mod = _load(name)
        if mod is None or not hasattr(mod, "main"):
            print(
                f"(skipped: {MODULES[name]} is not available yet)",
                file=sys.stderr if collect else sys.stdout,
                flush=True,
            )
            continue
        # Every benchmark takes --model DIR; synthetic model names are known to the engine bench only.
        synthetic = bool(args.model) and args.model.startswith("synthetic-")
        argv = ["--model", args.model] if args.model and (name == "engine" or not synthetic) else []
        if collect:
            print(f"bench {name} ...", file=sys.stderr, flush=True)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = int(mod.main([*argv, "--json"]) or 0)
            try:
                results[name] = json.loads(buf.getvalue())
            except ValueError:
                results[name] = {
                    "error": f"bench {name} printed no JSON",
                    "output": buf.getvalue()[-2000:],
                }
        else:
            code = int(mod.main(argv) or 0)
        if code:
            print(
                f"(bench {name} exited with {code})",
                file=sys.stderr if collect else sys.stdout,
                flush=True,
            )
            rc = rc or code
    if args.plot:
        from spark_lsp.bench.plot import draw, panels

        try:
            print(f"plot: {draw(results, args.plot)}", file=sys.stderr)
        except RuntimeError as e:
            print(f"spark-lsp bench all: --plot: {e}", file=sys.stderr)
            rc = rc or 2
        if not args.json:
            for name, labels, values, title, _ in panels(results):
                print(
                    f"{name:7s} {title}: "
                    + ", ".join(f"{l} {v:,.2f}" for l, v in zip(labels, values))
                )
    if args.json:
        print(json.dumps(results, indent=2))
    return rc
