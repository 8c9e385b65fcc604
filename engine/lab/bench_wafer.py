"""`spark-lsp bench wafer`: what partitioned execution costs on this CPU, and what the layout
would reach on a wafer.

Loads the same model twice — partitioned over the emulated grid (``wafer=True``, the engine's
default) and dense (``wafer=False``) — checks they produce the same greedy tokens, then decodes
in alternating rounds (dense, partitioned, dense, ...) so both see the same machine load, and
reports the median decode tok/s of each and the median of the per-round ratios, plus the ratio
of tokens per CPU-second of the process (robust to other processes stealing the CPU when run
with ``--threads 1``).  Every timed run starts ``engine.lab.bench.SETTLE_S`` after the last, so
threads the other engine left spinning are not counted against it.  Then it plans the model on a
chip with the performance model.

``--precision int8|int4`` compares the quantised engines instead: the partition executed
(``MeshLinearQ``, or the standard-op mesh form with ``--form graph``) against the fused
``MatMulNBits`` form over the same per-tile weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from ..config import ModelError
from ..engine import Engine
from ..generate import GenerationParams
from ..graph import ROLES
from ..projection.chips import ChipError, load_chip
from ..projection.perfmodel import plan, summary
from ..projection.placement import ModelShape, PlacementError
from ..quant import QuantLinear
from ..wafer.partition import DEFAULT_GRID, TiledLinear, parse_grid
from . import bench, bench_report
from .models import resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="model folder, or 'synthetic-8m' (default: the bundled model, else synthetic-8m)",
    )
    p.add_argument(
        "--grid",
        default=None,
        metavar="RxC",
        help="emulated execution grid of the partitioned model (default: the engine's default)",
    )
    p.add_argument(
        "--tokens", type=int, default=64, metavar="N", help="new tokens per round (default 64)"
    )
    p.add_argument(
        "--rounds", type=int, default=9, metavar="N", help="alternating rounds (default 9)"
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=64, metavar="N", help="prompt length (default 64)"
    )
    p.add_argument(
        "--threads", type=int, default=None, metavar="N", help="ONNX Runtime intra-op threads"
    )
    spin = p.add_mutually_exclusive_group()
    spin.add_argument(
        "--spinning",
        dest="spinning",
        action="store_true",
        default=None,
        help="force ORT threads to spin between steps (both engines)",
    )
    spin.add_argument(
        "--no-spinning",
        dest="spinning",
        action="store_false",
        help="never spin; with the default (auto) each generation picks by CPU pressure, "
        "which can flip between rounds and make single rounds swing",
    )
    p.add_argument(
        "--tile",
        default=None,
        metavar="ROLES",
        help="tile only these linears (comma-separated of qkv,o,gate_up,down,lm_head; the rest stay "
        "plain MatMuls): what each part of the partitioning costs (default: all)",
    )
    p.add_argument(
        "--form",
        default=None,
        choices=("op", "graph"),
        help="ONNX form of the partitioned linears: op (the MeshLinear op, the default where it "
        "builds) or graph (standard ops: Split + chained Gemm per mesh line)",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "int8", "int4"),
        help="fp32: partitioned vs dense (default); int8/int4: the partitioned quantised linears "
        "(MeshLinearQ) vs the fused MatMulNBits form, same per-tile weights",
    )
    p.add_argument(
        "--chip", default="wse3", metavar="wse2|wse3|FILE", help="chip for the projection"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also draw the headline figures into a PNG (spark-lsp bench; needs matplotlib)",
    )


def _resolve(spec):
    try:
        return resolve_model(spec)
    except ModelError:
        if spec is None:
            return resolve_model("synthetic-8m")
        raise


def bench_wafer(args, log=print) -> dict:
    for name in ("tokens", "rounds", "prompt_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    grid = parse_grid(args.grid) if args.grid else DEFAULT_GRID
    chip = load_chip(args.chip)
    model = _resolve(args.model)
    t0 = time.perf_counter()
    spinning = getattr(args, "spinning", None)
    tile = getattr(args, "tile", None)
    roles = [r.strip() for r in tile.split(",") if r.strip()] if tile else None
    precision = getattr(args, "precision", "fp32") or "fp32"
    form = getattr(args, "form", None)
    if precision == "fp32":
        base_name = "dense"
        dense = Engine.load(model, wafer=False, threads=args.threads, spinning=spinning)
        tiled = Engine.load(
            model,
            linear=TiledLinear(grid, roles=roles, form=form),
            threads=args.threads,
            spinning=spinning,
        )
    else:  # the same per-tile quantised weights, fused into MatMulNBits vs the partition executed
        if roles is not None:
            raise ValueError(
                "--tile is for --precision fp32 (quantised linears are all tiled or all fused)"
            )
        base_name = "fused"
        bits = int(precision[3:])
        qform = {"op": "op", "graph": "mesh", None: "op"}[form]
        dense = Engine.load(
            model,
            linear=QuantLinear(bits, inner=TiledLinear(grid), form="fused"),
            threads=args.threads,
            spinning=spinning,
        )
        tiled = Engine.load(
            model,
            linear=QuantLinear(bits, inner=TiledLinear(grid), form=qform),
            threads=args.threads,
            spinning=spinning,
        )
    log(
        f"loaded {model} twice in {time.perf_counter() - t0:.1f}s ({base_name}, and tiled over {grid[0]}x{grid[1]}, "
        f"{precision})"
    )
    vocab = dense.sample_vocab
    prompt = [(7 + 31 * i) % vocab for i in range(args.prompt_tokens)]
    params = GenerationParams(max_new_tokens=args.tokens, ignore_eos=True)

    def decode(eng) -> tuple[float, float, list[int]]:
        """(decode tok/s wall clock, tokens per CPU-second of this process, tokens)."""
        time.sleep(bench.SETTLE_S)  # the other engine's spinning threads go back to sleep first
        cpu = time.process_time()
        gen = eng.generate(prompt, params)
        gen.result()
        cpu = time.process_time() - cpu
        return gen.stats["decode_tok_s"], len(gen.tokens) / max(cpu, 1e-9), gen.tokens

    _, _, ref = decode(dense)  # warm-up + reference tokens
    _, _, got = decode(tiled)
    rates = {"dense": [], "partitioned": []}
    cpu_rates = {"dense": [], "partitioned": []}
    ratios = []
    for r in range(args.rounds):
        order = (
            (("dense", dense), ("partitioned", tiled))
            if r % 2 == 0
            else (("partitioned", tiled), ("dense", dense))
        )
        rnd = {}
        for name, eng in order:
            rnd[name], cpu_rate, _ = decode(eng)
            rates[name].append(rnd[name])
            cpu_rates[name].append(cpu_rate)
        ratios.append(rnd["partitioned"] / rnd["dense"])
        log(
            f"round {r + 1}: {base_name} {rnd['dense']:.0f} tok/s, partitioned {rnd['partitioned']:.0f} tok/s"
        )
    med = {k: statistics.median(v) for k, v in rates.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_rates.items()}
    shape = ModelShape.from_config(dense.config, name=dense.name)
    placement, proj = plan(shape, chip, context=min(4096, shape.max_context))
    tiled_roles = list(tiled.linear.roles if precision == "fp32" else ROLES)
    return {
        "model": str(model),
        "precision": precision,
        "baseline": base_name,
        "grid": f"{grid[0]}x{grid[1]}",
        "form": tiled.linear.form,
        "tiled_roles": tiled_roles,
        "threads": dense.runtime.threads,
        "tokens_per_round": args.tokens,
        "rounds": args.rounds,
        "greedy_tokens_identical": got == ref,
        "dense_decode_tok_s": round(med["dense"], 1),
        "partitioned_decode_tok_s": round(med["partitioned"], 1),
        "ratio_of_medians": round(med["partitioned"] / med["dense"], 3),
        "median_round_ratio": round(statistics.median(ratios), 3),
        "cpu_ratio": round(cpu_med["partitioned"] / cpu_med["dense"], 3),
        "load_average": _loadavg(),
        "best_dense_tok_s": round(max(rates["dense"]), 1),
        "best_partitioned_tok_s": round(max(rates["partitioned"]), 1),
        "projection": {k: v for k, v in summary(placement, proj).items() if k != "per_layer"},
    }


def _loadavg() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except (OSError, AttributeError):
        return "n/a"


def format_result(res: dict) -> str:
    p = res["projection"]
    partial = set(res["tiled_roles"]) != set(ROLES)
    base = res.get("baseline", "dense")
    return "\n".join(
        [
            f"partitioned execution ({res['grid']} emulated grid, {res.get('form', 'graph')} form"
            f"{', tiled: ' + ','.join(res['tiled_roles']) if partial else ''}, {res.get('precision', 'fp32')}) "
            f"vs {base}, {res['model']}, "
            f"{res['threads']} thread(s), {res['rounds']} alternating rounds of {res['tokens_per_round']} tokens",
            f"  {'':24}{base:>12}{'partitioned':>14}{'ratio':>8}",
            f"  {'decode tok/s (median)':24}{res['dense_decode_tok_s']:>12,.1f}{res['partitioned_decode_tok_s']:>14,.1f}"
            f"{res['ratio_of_medians']:>8.3f}",
            f"  {'decode tok/s (best)':24}{res['best_dense_tok_s']:>12,.1f}{res['best_partitioned_tok_s']:>14,.1f}"
            f"{res['best_partitioned_tok_s'] / res['best_dense_tok_s']:>8.3f}",
            f"  median per-round ratio {res['median_round_ratio']:.3f}; tokens per CPU-second ratio "
            f"{res['cpu_ratio']:.3f} (load-independent); greedy tokens identical: {res['greedy_tokens_identical']}",
            f"  machine load average during the run: {res['load_average']}",
            f"projection on {p['chip']}: {p['grid']} PEs per layer, {p['wafers']} wafer(s), {p['pes_used']:,} PEs, "
            f"decode {p['decode_tok_s']:,.0f} tok/s, TTFT {p['ttft_ms']:,.2f} ms ({p['prompt_tokens']}-token prompt)",
        ]
    )


def run(args, plot=None) -> int:
    """``plot``: draws the results for ``--plot FILE`` (see ``engine.lab.bench.run``)."""
    if args.plot and plot is None:
        return bench_report.plot_results(None, {}, args.plot, "wafer")
    log = (
        (lambda s: print(s, file=sys.stderr, flush=True))
        if args.json
        else (lambda s: print(s, flush=True))
    )
    try:
        res = bench_wafer(args, log)
    except (
        ModelError,
        ChipError,
        PlacementError,
        ValueError,
    ) as e:  # incl. --form op where it cannot build
        print(f"spark-lsp bench wafer: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=2) if args.json else format_result(res))
    return bench_report.plot_results(plot, res, args.plot, "wafer")


def main(argv: list[str] | None = None, plot=None) -> int:
    p = argparse.ArgumentParser(prog="spark-lsp bench wafer", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv), plot=plot)


if __name__ == "__main__":
    sys.exit(main())
