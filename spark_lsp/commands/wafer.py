"""`spark-lsp wafer`: how a model lays out on a wafer-scale chip and the speed it would reach.

Plans from a model folder or just its config.json (no weights needed): every transformer layer
gets its own region of PEs, the weights are tiled over it (MeshGEMV layout), the KV cache gets
its share for --context tokens, and the analytic performance model (calibrated to WaferLLM)
projects decode tokens/s and time to first token.

Note: --grid here is the per-layer region size *on the chip* used for the projection.  The grid
of `spark-lsp generate --grid` is different: the small emulated mesh the engine actually
executes the partitioned weights on.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import positive_int


def _grid(text: str) -> tuple[int, int]:
    from engine.wafer.partition import parse_grid

    try:
        return parse_grid(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("--grid ", "")) from None


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction in (0, 1]") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction in (0, 1]")
    return v


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "wafer",
        help="plan a model on a wafer-scale chip and project its speed",
        description="\n\n".join(__doc__.split("\n\n")[:2]),
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        metavar="MODEL",
        help="a model folder, a .gguf file, a catalogue name or hf:ORG/REPO (only its config.json "
        "or GGUF header is read)",
    )
    src.add_argument(
        "--config", metavar="FILE", help="a config.json (any file name; no weights needed)"
    )
    p.add_argument(
        "--chip",
        default="wse3",
        metavar="wse2|wse3|FILE",
        help="built-in chip or a .toml/.json chip spec (default: wse3)",
    )
    p.add_argument(
        "--grid",
        type=_grid,
        default=None,
        metavar="RxC",
        help="PEs per layer region on the chip (default: the size with the fastest projected decode)",
    )
    p.add_argument(
        "--context",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens of KV cache each layer region holds (default: min(4096, the model's context))",
    )
    p.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="prompt length for the TTFT projection (default: min(context, 4096))",
    )
    p.add_argument(
        "--max-wafers",
        type=positive_int,
        default=None,
        metavar="N",
        help="wafers the layout may span (default: the fewest that hold the model)",
    )
    p.add_argument(
        "--budget",
        type=_fraction,
        default=None,
        metavar="F",
        help="fraction of each PE's SRAM the layout may fill (default: 0.8)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--png", metavar="FILE", help="draw the wafer(s): layer regions over an SRAM-fill heat map"
    )
    p.set_defaults(func=run)


def _err(msg: str) -> int:
    print(f"spark-lsp wafer: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from engine.config import ModelError
    from engine.projection.chips import ChipError, load_chip
    from engine.projection.perfmodel import plan, summary
    from engine.projection.placement import PlacementError, load_shape

    try:
        shape = load_shape(args.model or args.config)
        chip = load_chip(args.chip)
        context = args.context or min(4096, shape.max_context)
        placement, proj = plan(
            shape,
            chip,
            grid=args.grid,
            context=context,
            budget=args.budget,
            max_wafers=args.max_wafers,
            prompt_tokens=args.prompt_tokens,
        )
    except (ModelError, ChipError, PlacementError, ValueError) as e:
        return _err(str(e))
    out = summary(placement, proj)
    if args.png:
        from engine.projection.draw import MissingMatplotlib, draw

        try:
            title = (
                f"{shape.name} on {chip.name}: {out['grid']} PEs per layer, {out['wafers']} wafer(s), "
                f"{out['decode_tok_s']:,.0f} tok/s projected"
            )
            out["png"] = str(draw(placement, args.png, title=title))
        except MissingMatplotlib as e:
            return _err(str(e))
        except OSError as e:
            return _err(f"{args.png}: cannot write: {e}")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print_text(out)
    return 0


def _print_text(o: dict) -> None:
    m = o["model"]
    print(f"{m['name']}: {m['params'] / 1e9:.2f}B parameters, {m['layers']} layers, fp16")
    print(f"chip {o['chip']}, {o['grid']} PEs per layer region, context {o['context']} tokens")
    print(
        f"wafers {o['wafers']}, PEs used {o['pes_used']:,}, SRAM utilisation {o['sram_utilization']:.1%} "
        f"(fullest PE {o['peak_sram_fill']:.1%} of SRAM, budget {o['sram_budget']:.0%})"
    )
    print(
        f"projected decode {o['decode_tok_s']:,.0f} tok/s, TTFT {o['ttft_ms']:,.1f} ms "
        f"for a {o['prompt_tokens']}-token prompt"
    )
    layers = o["per_layer"]
    print("layer  wafer  region (row,col rows x cols)  cycles")
    shown = layers if len(layers) <= 4 else layers[:3] + [None] + layers[-1:]
    for r in shown:
        if r is None:
            print(f"  ... {len(layers) - 4} more")
            continue
        g = r["region"]
        print(
            f"{r['layer']:>5}  {g['wafer'] + 1:>5}  {g['row']:>4},{g['col']:<4} {g['rows']} x {g['cols']:<12} {r['cycles']:,.0f}"
        )
    if "png" in o:
        print(f"wrote {o['png']}")
