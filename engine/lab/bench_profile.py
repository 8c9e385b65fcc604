"""`spark-lsp bench profile`: where a decode step's time goes, per ONNX operator, in our engine
(dense and partitioned graphs) and in onnxruntime-genai, on the same weights in the same run.

Each runner decodes with ONNX Runtime's profiler on; every decode step (one ``model_run``) is
split into its nodes' kernel times, summed per operator type and averaged over the steps.  The
prompt length is a prime no model dimension is likely to equal, so the prefill runs are told
apart by their shapes.  The gap between a step's wall time inside ORT (``model_run``) and the sum
of its kernels is the executor's per-node overhead.  Profiling itself slows every node by a few
microseconds, so compare the columns with each other, not with ``bench engine``.

A second table per runner splits the step by node role (a node's name with its layer number as
``#``: ``layers.#.gate_up/...`` is that linear in every layer): time, and for the operators that
read weights (:data:`WEIGHT_OPS`) the bytes of their inputs (at a decode step, the weights and
one activation row), the rate they were read at and its share of the DRAM read bandwidth the
bench measures at the end with the same thread count.  That tells a linear that streams near the
memory's speed from one that pays fixed costs (small linears: the thread pool's hand-over, the
activation's quantisation) and from the nodes that read no weights at all (attention).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import ModelError, load_config
from ..engine import Engine
from ..generate import GenerationParams
from ..runtime import physical_cores
from ..tokenizer import Tokenizer
from ..weights import weights_digest
from .bandwidth import read_bandwidth
from .models import bench_root, resolve_model
from .peers import GenaiPeer, PeerUnavailable

#: Prompt length: a prime, so that a dimension equal to it marks a prefill run.
PROMPT_TOKENS = 61


#: Operators whose inputs at a decode step are, but for one activation row, weights: their input
#: bytes are what the node streams from memory.
WEIGHT_OPS = frozenset(
    {"MeshLinearQ", "MeshLinear", "MatMulNBits", "MatMul", "Gemm", "FusedMatMul", "MatMulInteger"}
)
#: Bytes per element of the type names in ORT's profile (``input_type_shape``).
_ITEM_BYTES = {"float": 4, "float16": 2, "bfloat16": 2, "double": 8, "int64": 8, "int32": 4}


def _input_bytes(shapes: list) -> int:
    total = 0
    for shape in shapes:
        for type_name, dims in shape.items():
            n = _ITEM_BYTES.get(type_name, 1)
            for d in dims:
                n *= int(d)
            total += n
    return total


def _group(node_name: str) -> str:
    """The node's name with its layer numbers as ``#``: one row for a role in every layer."""
    return re.sub(r"\d+", "#", node_name)


Node = tuple[float, float, str, list, str]  # start, duration (us), op, input shapes, node name


def _events(file: str) -> tuple[list[tuple[float, float]], list[Node]]:
    """The runs (start, duration) and node kernel events of one ORT profile file, by start."""
    runs: list[tuple[float, float]] = []
    nodes: list[Node] = []
    for ev in json.loads(Path(file).read_text()):
        if ev.get("cat") == "Session" and ev.get("name") == "model_run":
            runs.append((ev["ts"], ev["dur"]))
        elif ev.get("cat") == "Node" and str(ev.get("name", "")).endswith("_kernel_time"):
            args = ev.get("args", {})
            nodes.append(
                (
                    ev["ts"],
                    ev["dur"],
                    args.get("op_name", "?"),
                    args.get("input_type_shape", []),
                    ev["name"][: -len("_kernel_time")],
                )
            )
    return sorted(runs), sorted(nodes)


def _runs_with_nodes(runs: list[tuple[float, float]], nodes: list[Node]):
    """Each run (start, duration) with the node events that started inside it (one file's)."""
    j = 0
    for ts, dur in runs:
        while j < len(nodes) and nodes[j][0] < ts:
            j += 1
        inside = []
        while j < len(nodes) and nodes[j][0] <= ts + dur:
            inside.append(nodes[j])
            j += 1
        yield dur, inside


def step_profile(files: list[str], prompt_tokens: int = PROMPT_TOKENS) -> dict[str, Any]:
    """Per-operator kernel time of the decode steps recorded in ORT profile ``files``, and per
    node role (``layers.#.gate_up/...``): time, and for the weight-reading operators the bytes
    their inputs hold and the rate they were read at."""
    # each session writes its own file, timed from when that session's profiling began: a run's
    # nodes are matched within its file (the engine's sessions start at different moments, and
    # which one a step runs on follows the machine's load)
    per_file = [_events(f) for f in files]
    per_op: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    per_group: dict[str, float] = defaultdict(float)
    group_op: dict[str, str] = {}
    group_bytes: dict[str, tuple[str, int]] = {}  # node -> (its group, its input bytes)
    steps, step_us, kernel_us = 0, [], []
    matched = (run for runs, nodes in per_file for run in _runs_with_nodes(runs, nodes))
    for dur, inside in matched:
        if not inside or any(
            prompt_tokens in dims
            for *_, shapes, _ in inside
            for shape in shapes
            for dims in shape.values()
        ):
            continue  # a prefill run (or one with no node events)
        steps += 1
        step_us.append(dur)
        kernel_us.append(sum(n[1] for n in inside))
        seen: dict[str, int] = defaultdict(int)
        for _, d, op, shapes, name in inside:
            per_op[op] += d
            seen[op] += 1
            g = _group(name)
            per_group[g] += d
            if op in WEIGHT_OPS and name not in group_bytes:  # a node's inputs: the same each step
                group_bytes[name] = (g, _input_bytes(shapes))
            group_op[g] = op
        for op, c in seen.items():
            count[op] = max(count[op], c)
    if not steps:
        raise ValueError("the profile holds no decode step")
    ops = {
        op: {"us_per_step": round(t / steps, 1), "nodes": count[op]}
        for op, t in sorted(per_op.items(), key=lambda kv: -kv[1])
    }
    mb: dict[str, float] = defaultdict(float)
    members: dict[str, int] = defaultdict(int)
    for g, b in group_bytes.values():
        mb[g] += b / 1e6
        members[g] += 1
    groups = {}
    for g, t in sorted(per_group.items(), key=lambda kv: -kv[1]):
        us = t / steps
        row: dict[str, Any] = {"op": group_op[g], "us_per_step": round(us, 1)}
        if g in mb:
            row.update(nodes=members[g], mb_per_step=round(mb[g], 4))
            # MB/us = 1,000 GB/s; four significant digits: a tiny model's small linear reads a few
            # KB a step, which a fixed three decimals rounded to 0 on a slow machine
            row["gb_s"] = float(f"{mb[g] / us * 1e3:.4g}") if us else None
        groups[g] = row
    return {
        "steps": steps,
        "nodes": sum(count.values()),
        "ops": ops,
        "groups": groups,
        "step_us": round(statistics.fmean(step_us), 1),
        "kernel_us": round(statistics.fmean(kernel_us), 1),
    }


class _Ours:
    """Our engine with the profiler on; ``round()`` decodes once, ``end()`` returns the files."""

    def __init__(
        self,
        model: Path,
        wafer: bool,
        prefix: str,
        prompt: list[int],
        tokens: int,
        threads: int | None,
        precision: str = "fp32",
    ) -> None:
        self.eng = Engine.load(
            model, wafer=wafer, threads=threads, spinning=True, profile=prefix, precision=precision
        )
        self.prompt, self.params = prompt, GenerationParams(max_new_tokens=tokens, ignore_eos=True)

    def round(self) -> float:
        self.eng.reset()
        gen = self.eng.generate(self.prompt, self.params)
        gen.result()
        return gen.stats["decode_tok_s"]

    def end(self) -> list[str]:
        return self.eng.end_profiling()


class _Genai:
    """onnxruntime-genai's generator with the profiler on (same interface as :class:`_Ours`)."""

    def __init__(
        self,
        model: Path,
        prefix: str,
        prompt: list[int],
        tokens: int,
        threads: int,
        log: Callable[[str], None],
    ) -> None:
        self.peer = GenaiPeer(
            model, threads, weights_digest(model), bench_root(), log, profile=prefix
        )
        self.prompt, self.tokens = prompt, tokens

    def round(self) -> float:
        out, _, span = self.peer.timed(self.prompt, self.tokens)
        return (len(out) - 1) / span if span else 0.0

    def end(self) -> list[str]:
        return self.peer.end_profiling()


def bench_profile(args, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Load every runner, decode in alternating rounds (same machine load for all), profile each."""
    if args.tokens < 2 or args.rounds < 1:
        raise ValueError("--tokens must be at least 2 and --rounds at least 1")
    model = resolve_model(args.model)
    threads = args.threads or physical_cores()
    vocab = min(load_config(model).vocab_size, Tokenizer.load(model).vocab_size)
    prompt = [
        (7 + 31 * i) % (vocab - 16) + 16 for i in range(PROMPT_TOKENS)
    ]  # past the special tokens
    res: dict[str, Any] = {
        "model": str(model),
        "threads": threads,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "runners": {},
    }
    with tempfile.TemporaryDirectory(prefix="spark-profile-") as tmp:
        makers: dict[str, Callable[[str], Any]] = {
            "ours, dense": lambda p: _Ours(
                model, False, p, prompt, args.tokens, threads, args.precision
            ),
            "ours, partitioned": lambda p: _Ours(
                model, True, p, prompt, args.tokens, threads, args.precision
            ),
        }
        if not args.no_peers:
            makers["onnxruntime-genai"] = lambda p: _Genai(
                model, p, prompt, args.tokens, threads, log
            )
        runners = {}
        for k, (name, make) in enumerate(makers.items()):
            try:
                runners[name] = make(str(Path(tmp) / f"r{k}"))
            except PeerUnavailable as e:
                res["runners"][name] = {"skipped": str(e)}
        rates: dict[str, list[float]] = {n: [] for n in runners}
        for r in range(args.rounds):
            log(f"round {r + 1}/{args.rounds}")
            for name in list(runners) if r % 2 == 0 else list(runners)[::-1]:
                rates[name].append(runners[name].round())
        for name, runner in runners.items():
            res["runners"][name] = {
                "decode_tok_s_profiled": round(statistics.median(rates[name]), 1),
                **step_profile(runner.end()),
            }
    # what the weight-reading nodes' rates compare with: DRAM read bandwidth at this thread count
    res["dram_read_gb_s"] = round(read_bandwidth(threads) / 1e9, 1)
    return res


def format_result(res: dict[str, Any]) -> str:
    ran = {n: r for n, r in res["runners"].items() if "skipped" not in r}
    names = list(ran)
    ops = sorted(
        {op for r in ran.values() for op in r["ops"]},
        key=lambda op: -max(r["ops"].get(op, {}).get("us_per_step", 0) for r in ran.values()),
    )
    w = 24
    lines = [
        f"decode step profile, {res['model']}, {res['threads']} thread(s), {res['rounds']} x "
        f"{res['tokens']} tokens (mean us per decode step; nodes of that type)",
        f"{'operator':<34}" + "".join(f"{n:>{w}}" for n in names),
    ]
    for op in ops:
        cells = []
        for n in names:
            o = ran[n]["ops"].get(op)
            cells.append(
                f"{o['us_per_step']:>{w - 6}.1f} ({o['nodes']:>2})" if o else f"{'-':>{w}}"
            )
        lines.append(f"{op:<34}" + "".join(cells))
    lines.append(
        f"{'all kernels':<34}"
        + "".join(f"{ran[n]['kernel_us']:>{w - 6}.1f} ({ran[n]['nodes']:>2})" for n in names)
    )
    lines.append(
        f"{'whole step (model_run)':<34}" + "".join(f"{ran[n]['step_us']:>{w}.1f}" for n in names)
    )
    lines.append(
        f"{'executor overhead (step - kernels)':<34}"
        + "".join(f"{ran[n]['step_us'] - ran[n]['kernel_us']:>{w}.1f}" for n in names)
    )
    lines.append(
        f"{'decode tok/s while profiled':<34}"
        + "".join(f"{ran[n]['decode_tok_s_profiled']:>{w},.0f}" for n in names)
    )
    bw = res.get("dram_read_gb_s")
    for n in names:
        groups = ran[n].get("groups", {})
        lines += [
            "",
            f"{n}: per node role (mean us per decode step; the weight-reading ones: MB of "
            f"inputs, read at GB/s, as a share of DRAM read bandwidth {bw} GB/s)",
            f"{'role':<44}{'operator':>18}{'us':>10}{'nodes':>6}{'MB':>9}{'GB/s':>8}{'share':>7}",
        ]
        for g, row in groups.items():
            line = f"{g[:43]:<44}{row['op'][:17]:>18}{row['us_per_step']:>10.1f}"
            if "mb_per_step" in row:
                share = f"{row['gb_s'] / bw:.0%}" if bw and row["gb_s"] else "-"
                line += (
                    f"{row['nodes']:>6}{row['mb_per_step']:>9.2f}{row['gb_s'] or 0:>8.1f}{share:>7}"
                )
            lines.append(line)
    for n, r in res["runners"].items():
        if "skipped" in r:
            lines.append(f"{n}: skipped ({r['skipped']})")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="model folder or a synthetic model name, e.g. synthetic-qwen2.5-coder-0.5b "
        "(default: the bundled model)",
    )
    p.add_argument(
        "--tokens", type=int, default=96, metavar="N", help="new tokens per round (default 96)"
    )
    p.add_argument(
        "--rounds", type=int, default=4, metavar="N", help="generations per runner (default 4)"
    )
    p.add_argument(
        "--threads", type=int, default=None, metavar="N", help="intra-op threads (default: cores)"
    )
    p.add_argument("--no-peers", action="store_true", help="profile our engine only")
    p.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "int8", "int8-rowq", "int4"),
        help="our engine's weights (default fp32; the peer runs fp32)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(argv: list[str] | None = None, plot=None) -> int:
    p = argparse.ArgumentParser(prog="spark-lsp bench profile", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)  # (no --plot: a profile is a table)
    log = (
        (lambda s: print(s, file=sys.stderr, flush=True))
        if args.json
        else (lambda s: print(s, flush=True))
    )
    t0 = time.perf_counter()
    try:
        res = bench_profile(args, log)
    except (ModelError, ValueError, OSError) as e:
        print(f"spark-lsp bench profile: error: {e}", file=sys.stderr)
        return 2
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res, indent=2) if args.json else format_result(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
