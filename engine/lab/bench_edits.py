"""`spark-lsp bench edits`: speculative vs plain greedy decoding on rewrite edits and fresh text.

Every task is run both ways on the same engine, alternating, cold (no prefix reuse), eos ignored,
so both produce the same number of tokens; the outputs must be identical token for token.

* **edit** tasks keep most of the original text: the original function is in the prompt, a
  changed header follows (renamed argument, type hints, an extra parameter, a renamed copy) and
  the model writes the body.  The draft is the original body — what a code action rewriting that
  function passes as ``draft``.  ``fim-rewrite`` is the server's "Rewrite selection" shape: the
  selection is cut out of a fill-in-the-middle prompt and is the draft (the model does not see it,
  so acceptance measures how well the model predicts the original).
* **fresh** tasks continue code that the prompt does not contain; the draft comes from n-gram
  prompt lookup, and the policy must keep speed at least ~plain.

Speed is ``decode tok/s = (N - 1) / (T_N - T_1)`` (time from the first to the last token, as in
``spark-lsp bench engine``), median over ``--repeats``; ``ratio`` = speculative / plain.
``cpu_ratio`` compares the process CPU time of the whole generations (prefill included) instead:
on a machine shared with other jobs it is the steadier of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ModelError
from ..fim import FimFormat, heal
from ..generate import GenerationParams
from ..linears import make_linear
from ..speculative import generate as spec_generate
from .bench_report import plot_results
from .models import resolve_model
from .tune import choose_precision, load_engine

MOVING_AVG = '''def moving_average(values, window):
    """Return the averages of every run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''

MERGE = '''def merge_counts(first, second):
    """Add the counts of `second` to a copy of `first`."""
    merged = dict(first)
    for key, count in second.items():
        if count < 0:
            raise ValueError("counts must not be negative: %r" % (key,))
        merged[key] = merged.get(key, 0) + count
    return merged
'''

READ_CONFIG = '''def read_config(path):
    """Parse a simple `key = value` file, ignoring blank lines and comments."""
    settings = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError("%s:%d: expected key = value" % (path, lineno))
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings
'''

STACK = '''class Stack:
    """A last-in, first-out stack."""

    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty stack")
        return self._items.pop()

    def peek(self):
        if not self._items:
            raise IndexError("peek at an empty stack")
        return self._items[-1]

    def __len__(self):
        return len(self._items)
'''


def _body(src: str) -> str:
    """Everything after the first line (the header the edit changes)."""
    return src.split("\n", 1)[1]


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "edit" | "fresh"
    prefix: str  # the prompt (text before the generated text)
    draft: str | None = None  # the original text being rewritten (edits)
    suffix: str | None = None  # text after the cursor: a fill-in-the-middle prompt when set
    new_tokens: int = 128

    def prompt(self, engine) -> tuple[list[int], str]:
        """(prompt ids, healed text): the FIM layout of the model's tokenizer when ``suffix`` is
        set, and the prompt's final line break healed as a code action's is
        (``engine.fim.heal(newline=True)``: the output's first token spells it)."""
        fim = FimFormat.detect(engine.tokenizer) if self.suffix is not None else None
        if fim is None:  # left to right (also a model without FIM tokens)
            return heal(
                engine.tokenizer,
                self.prefix,
                engine.tokenizer.encode(self.prefix),
                keep=1,
                newline=True,
            )
        return fim.build_healed(self.prefix, self.suffix, newline=True)

    def max_new_tokens(self, engine) -> int:
        if self.draft is None:
            return self.new_tokens
        return min(self.new_tokens, len(engine.tokenizer.encode(self.draft)) + 8)


TASKS: tuple[Task, ...] = (
    Task(
        "rename-arg",
        "edit",
        MOVING_AVG + "\n\n" + "def moving_average(samples, window):\n",
        _body(MOVING_AVG),
    ),
    Task(
        "type-hints",
        "edit",
        MERGE
        + "\n\n"
        + "def merge_counts(first: dict[str, int], second: dict[str, int]) -> dict[str, int]:\n",
        _body(MERGE),
    ),
    Task(
        "add-param",
        "edit",
        READ_CONFIG + "\n\n" + 'def read_config(path, encoding="utf-8"):\n',
        _body(READ_CONFIG),
    ),
    Task("rename-class", "edit", STACK + "\n\n" + "class LifoStack:\n", _body(STACK)),
    Task(
        "fim-rewrite",
        "edit",
        "import os\nimport sys\n\n\n",
        READ_CONFIG,
        suffix="\n\ndef main(argv):\n    settings = read_config(argv[1])\n    print(settings)\n",
    ),
    Task(
        "fresh-function", "fresh", "import os\n\n\ndef find_python_files(root):\n", new_tokens=128
    ),
    Task("fresh-class", "fresh", "import threading\n\n\nclass RateLimiter:\n", new_tokens=128),
    Task(
        "fresh-fim",
        "fresh",
        "import json\n\n\ndef load_records(path):\n    ",
        suffix="\n\n\ndef save_records(path, records):\n"
        "    with open(path, 'w') as f:\n        json.dump(records, f)\n",
        new_tokens=128,
    ),
)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def run_task(eng, task: Task, repeats: int) -> dict[str, Any]:
    """Plain and speculative runs of one task, alternated; medians, acceptance, identity."""
    ids, healed = task.prompt(eng)
    params = GenerationParams(
        max_new_tokens=task.max_new_tokens(eng), ignore_eos=True, healed_prefix=healed
    )
    plain_rates, spec_rates, plain_ms, spec_ms, stats = [], [], [], [], []
    plain_cpu, spec_cpu = [], []
    identical = True
    ref_tokens = None
    divergence = None
    for r in range(repeats + 1):  # round 0 warms both paths up and is not counted
        eng.reset()
        c0 = time.process_time()
        g = eng.generate(ids, params)
        g.result()
        c1 = time.process_time()
        eng.reset()
        s = spec_generate(eng, ids, params, draft=task.draft)
        s.result()
        c2 = time.process_time()
        ref_tokens = g.tokens
        if s.tokens != g.tokens and divergence is None:
            divergence = _divergence(eng, ids, g.tokens, s.tokens)
        identical = identical and s.tokens == g.tokens and s.text == g.text
        if r:
            plain_rates.append(g.stats["decode_tok_s"])
            spec_rates.append(s.stats["decode_tok_s"])
            plain_ms.append(g.stats["total_ms"])
            spec_ms.append(s.stats["total_ms"])
            plain_cpu.append(c1 - c0)
            spec_cpu.append(c2 - c1)
            stats.append(s.stats)
    plain, spec = _median(plain_rates), _median(spec_rates)
    return {
        "task": task.name,
        "kind": task.kind,
        "prompt_tokens": len(ids),
        "new_tokens": len(ref_tokens or []),
        "plain_tok_s": plain,
        "spec_tok_s": spec,
        "ratio": spec / plain if plain else 0.0,
        "plain_total_ms": _median(plain_ms),
        "spec_total_ms": _median(spec_ms),
        "plain_cpu_ms": _median(plain_cpu) * 1e3,
        "spec_cpu_ms": _median(spec_cpu) * 1e3,
        "cpu_ratio": _median(plain_cpu) / _median(spec_cpu) if _median(spec_cpu) else 0.0,
        "acceptance": _median([s["acceptance"] for s in stats]),
        "tokens_per_run": _median([s["tokens_per_run"] for s in stats]),
        "drafted": int(_median([s["drafted_tokens"] for s in stats])),
        "identical": identical,
        "first_divergence": divergence,
    }


def _divergence(eng, ids: list[int], plain: list[int], spec: list[int]) -> dict[str, Any]:
    """Where the outputs first differ and the top-2 logit margin there (a near-tie shows ~1e-6:
    two kernels summing in a different order, not a wrong draft acceptance)."""
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    row = eng.forward_logits(list(ids) + list(plain[:i]))[-1][: eng.sample_vocab]
    top = np.sort(row)[-2:]
    return {
        "index": i,
        "plain": plain[i] if i < len(plain) else None,
        "spec": spec[i] if i < len(spec) else None,
        "top2_margin": float(top[1] - top[0]),
    }


def bench_edits(
    model=None,
    *,
    precision: str = "fp32",
    wafer: bool = True,
    threads: int | None = None,
    repeats: int = 3,
    tasks: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Load the model (``precision``: one of ``engine.linears.PRECISIONS`` or 'auto') and run the tasks."""
    folder = resolve_model(model)
    chosen = None
    if precision == "auto":
        chosen = choose_precision(folder, wafer=wafer, threads=threads)
        precision = chosen.precision
    t0 = time.perf_counter()
    eng = load_engine(folder, make_linear(precision, wafer=wafer), threads=threads)
    log(
        f"loaded {eng.name} ({precision}, {'wafer-tiled' if wafer else 'dense'}) in {time.perf_counter() - t0:.1f} s"
    )
    selected = [t for t in TASKS if tasks is None or t.name in tasks]
    if tasks:
        unknown = set(tasks) - {t.name for t in TASKS}
        if unknown:
            raise ValueError(
                f"--tasks: unknown task(s) {sorted(unknown)}; known: {[t.name for t in TASKS]}"
            )
    rows = []
    for task in selected:
        row = run_task(eng, task, repeats)
        rows.append(row)
        log(
            f"  {row['task']:15s} plain {row['plain_tok_s']:7.0f} tok/s  speculative {row['spec_tok_s']:7.0f} tok/s  "
            f"x{row['ratio']:.2f}  acceptance {row['acceptance']:.2f}  identical {row['identical']}"
        )
    summary = {}
    for kind in ("edit", "fresh"):
        rs = [r["ratio"] for r in rows if r["kind"] == kind]
        cs = [r["cpu_ratio"] for r in rows if r["kind"] == kind]
        if rs:
            summary[kind] = {
                "median_ratio": _median(rs),
                "min_ratio": min(rs),
                "median_cpu_ratio": _median(cs),
                "min_cpu_ratio": min(cs),
                "tasks": len(rs),
            }
    return {
        "model": eng.name,
        "precision": precision,
        "load_avg": _loadavg(),
        "wafer": wafer,
        "threads": eng.runtime.threads,
        "repeats": repeats,
        "precision_choice": chosen.to_dict() if chosen else None,
        "tasks": rows,
        "summary": summary,
        "all_identical": all(r["identical"] for r in rows),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def format_table(res: dict[str, Any]) -> str:
    head = (
        f"spark-lsp bench edits — {res['model']} ({res['precision']}, {'wafer' if res['wafer'] else 'dense'}, "
        f"{res['threads']} threads, median of {res['repeats']}, load average {res.get('load_avg')})"
    )
    lines = [
        head,
        "",
        f"{'task':15s} {'kind':5s} {'tokens':>6s} {'plain tok/s':>11s} {'spec tok/s':>10s} {'ratio':>6s} "
        f"{'cpu x':>6s} {'accept':>6s} {'tok/run':>7s} identical",
    ]
    for r in res["tasks"]:
        d = r.get("first_divergence")
        ident = (
            "yes"
            if r["identical"]
            else f"NO (token {d['index']}, top-2 margin {d['top2_margin']:.1e})"
            if d
            else "NO"
        )
        lines.append(
            f"{r['task']:15s} {r['kind']:5s} {r['new_tokens']:6d} {r['plain_tok_s']:11.0f} {r['spec_tok_s']:10.0f} "
            f"{r['ratio']:6.2f} {r['cpu_ratio']:6.2f} {r['acceptance']:6.2f} {r['tokens_per_run']:7.2f} {ident}"
        )
    for kind, s in res["summary"].items():
        lines.append(
            f"{kind}: median ratio {s['median_ratio']:.2f}, worst {s['min_ratio']:.2f}; by CPU time "
            f"{s['median_cpu_ratio']:.2f}, worst {s['min_cpu_ratio']:.2f} ({s['tasks']} tasks)"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="model folder or 'synthetic-8m' (default: the bundled model)",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "int8", "int8-rowq", "int4", "auto"),
        help="weights to run (auto: the stored decision, measured if missing; see spark-lsp tune)",
    )
    p.add_argument(
        "--no-wafer",
        dest="wafer",
        action="store_false",
        help="dense MatMuls instead of wafer tiles",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="intra-op threads (default: physical cores)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per task and mode (median)")
    p.add_argument("--tasks", default=None, help="comma-separated task names (default: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also draw the headline figures into a PNG (spark-lsp bench; needs matplotlib)",
    )


def run(args: argparse.Namespace, plot: Callable[[dict, str], Any] | None = None) -> int:
    """``plot``: draws the results for ``--plot FILE`` (see ``engine.lab.bench.run``)."""
    if args.plot and plot is None:
        return plot_results(None, {}, args.plot, "edits")
    if args.repeats < 1:
        print("spark-lsp bench edits: error: --repeats must be >= 1", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print("spark-lsp bench edits: error: --threads must be >= 1", file=sys.stderr)
        return 2
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    log = (
        (lambda s: print(s, file=sys.stderr, flush=True))
        if args.json
        else (lambda s: print(s, flush=True))
    )
    try:
        res = bench_edits(
            args.model,
            precision=args.precision,
            wafer=args.wafer,
            threads=args.threads,
            repeats=args.repeats,
            tasks=tasks,
            log=log,
        )
    except (ModelError, ValueError, OSError) as e:
        print(f"spark-lsp bench edits: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=2) if args.json else "\n" + format_table(res))
    return plot_results(plot, res, args.plot, "edits") or (0 if res["all_identical"] else 1)


def main(argv: list[str] | None = None, plot: Callable[[dict, str], Any] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spark-lsp bench edits", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv), plot=plot)
