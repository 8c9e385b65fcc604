"""`spark-lsp tune`: measure which weight precision to load for a model on this machine, and store it.

Loads the model once per precision (fp32, int8, int8-rowq, int4), measures decode speed in
alternating rounds and greedy agreement with fp32 on real code, and stores the decision where
``Engine.load(precision="auto")`` reads it (the language server's default).  Until a model is
tuned, "auto" applies a static rule (see docs/engine.md).  Tuning takes tens of seconds on a small
model and is done once per model and machine; ``--force`` measures again.
"""

from __future__ import annotations

import argparse
import json
import sys

from spark_lsp.commands.generate import fail, parse_grid


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="measure and store the weight precision 'auto' loads for a model",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "--model",
        metavar="MODEL",
        default=None,
        help="a model folder, a catalogue name or hf:ORG/REPO, as serve takes (default: the "
        "bundled model)",
    )
    p.add_argument(
        "--grid",
        type=parse_grid,
        default=None,
        metavar="RxC",
        help="emulated PE grid, as the engine will be loaded (default: the wafer default)",
    )
    p.add_argument("--no-wafer", action="store_true", help="tune the dense (unpartitioned) engine")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="ONNX Runtime intra-op threads (a decision is stored per thread setting; "
        "the server uses the default)",
    )
    p.add_argument(
        "--force", action="store_true", help="measure again even when a decision is stored"
    )
    p.add_argument("--json", action="store_true", help="print the decision as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine import ModelError
    from engine.lab.tune import measure_and_store

    if args.threads is not None and args.threads < 1:
        return fail("tune", f"--threads={args.threads} must be a positive integer")
    log = (
        (lambda s: print(s, file=sys.stderr, flush=True))
        if args.json
        else (lambda s: print(s, flush=True))
    )
    try:
        choice = measure_and_store(
            args.model,
            wafer=not args.no_wafer,
            grid=args.grid,
            threads=args.threads,
            force=args.force,
            log_fn=log,
        )
    except (ModelError, ValueError, OSError) as e:
        return fail("tune", str(e))
    if args.json:
        print(json.dumps(choice.to_dict(), indent=2))
    else:
        print(
            f"{choice.precision}: {choice.reason}" + (" (stored decision)" if choice.cached else "")
        )
    return 0
