"""What a speculative verification pass costs, in single decode steps, and the speed-up it implies.

Speculative decoding (``engine.speculative``) runs ``[last token] + k drafted tokens`` through the
decoder in one pass and keeps the drafted tokens the model agrees with.  It pays when that pass
costs little more than one step: a model whose step streams its weights from DRAM reads them
once for all ``k + 1`` rows.  Measured after a prompt of real length, on one KV cache: a single
step and a ``k + 1``-token pass at the same position (the pass's KV is overwritten by the next
round, as rejected drafts are), taking turns, medians; plus the same pass asking for one row of
logits, which tells the LM head's share (``k + 1`` rows x the vocabulary) from the layers'.

With ``k`` drafted tokens each accepted with probability ``a`` (independently), a pass yields
``(1 - a**(k+1)) / (1 - a)`` tokens, so the speed-up over plain decoding is that over the pass
cost in steps.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

#: Acceptance rates the implied speed-up is printed for, besides those given.
DEFAULT_ACCEPTANCE = (0.5, 0.7, 0.8, 0.9)


def expected_tokens(acceptance: float, drafted: int) -> float:
    """Tokens one pass of ``drafted`` tokens yields (the accepted prefix + the model's own)."""
    if acceptance >= 1.0:
        return drafted + 1.0
    return (1.0 - acceptance ** (drafted + 1)) / (1.0 - acceptance)


def measure(eng: Any, prompt: list[int], drafted: int = 8, rounds: int = 15) -> dict[str, Any]:
    """Median ms of a single step, of a ``drafted + 1``-token pass (all rows of logits, as
    verification needs) and of that pass with one row, after ``prompt``; the pass in steps."""
    rt = eng.runtime
    width = drafted + 1
    cap = getattr(eng.linear, "max_verify_tokens", None)
    pos = len(prompt)
    draft = [int(t) for t in prompt[-drafted:]]
    step, full, one = [], [], []
    with eng.lock:
        kv = rt.new_kv()
        chunk = max(1, int(getattr(eng, "prefill_chunk", 256) or 256))
        for i in range(0, pos, chunk):
            rt.forward(kv, prompt[i : i + chunk], i)
        token = int(prompt[-1])
        for _ in range(2):  # warm-up: first runs of a shape set up their kernels
            rt.decode(kv, token, pos)
            rt.forward(kv, [token, *draft], pos, width)
            rt.forward(kv, [token, *draft], pos, 1)
        for r in range(rounds):
            order = (0, 1, 2) if r % 2 == 0 else (2, 1, 0)
            for which in order:
                t0 = time.perf_counter()
                if which == 0:
                    rt.decode(kv, token, pos)
                else:
                    rt.forward(kv, [token, *draft], pos, width if which == 1 else 1)
                (step, full, one)[which].append(time.perf_counter() - t0)
    s, f, o = (statistics.median(x) * 1e3 for x in (step, full, one))
    return {
        "prompt_tokens": pos,
        "drafted": drafted,
        "rounds": rounds,
        "step_ms": s,
        "pass_ms": f,
        "pass_one_row_ms": o,
        "pass_in_steps": f / s,
        "lm_head_rows_ms": f - o,
        "max_verify_tokens": cap,
        "speculates": cap is None or cap >= width,
    }


def implied(res: dict[str, Any], acceptance: tuple[float, ...]) -> dict[str, float]:
    """Speed-up over plain decoding per acceptance rate, for the measured pass cost."""
    return {f"{a:g}": expected_tokens(a, res["drafted"]) / res["pass_in_steps"] for a in acceptance}


def format_rows(rows: dict[str, dict[str, Any]], acceptance: tuple[float, ...]) -> list[str]:
    """One line per precision: the costs, and the implied speed-ups."""
    if not rows:
        return []
    any_row = next(iter(rows.values()))
    lines = [
        "",
        f"speculative verification: one pass of 1 + {any_row['drafted']} drafted tokens against one "
        f"decode step after {any_row['prompt_tokens']} prompt tokens (medians of "
        f"{any_row['rounds']}, taking turns; 'one row': the pass with one row of logits)",
        f"{'precision':<12}{'step ms':>9}{'pass ms':>9}{'in steps':>10}{'one row ms':>12}"
        + "".join(f"{'x at ' + k:>10}" for k in (f"{a:g}" for a in acceptance)),
    ]
    for x, r in rows.items():
        sp = implied(r, acceptance)
        note = "" if r["speculates"] else "  (this emitter does not speculate)"
        lines.append(
            f"{x:<12}{r['step_ms']:>9.1f}{r['pass_ms']:>9.1f}{r['pass_in_steps']:>9.2f}x"
            f"{r['pass_one_row_ms']:>12.1f}" + "".join(f"{v:>9.2f}x" for v in sp.values()) + note
        )
    return lines


def bench_verify_cost(
    model: str | None,
    runners: dict[str, tuple[str, str]],
    prompt_tokens: int,
    threads: int | None,
    wafer: bool = True,
    rounds: int = 15,
    drafted: int = 8,
    seed: int = 0,
    log=print,
) -> dict[str, Any]:
    """``spark-lsp bench engine --verify-cost``: ``measure`` for our engine loaded once per
    runner: name -> (precision, KV cache type), e.g. ``{"int4 kv32": ("int4", "float32")}``."""
    import numpy as np

    from ..engine import Engine
    from ..runtime import physical_cores
    from .models import resolve_model

    folder = resolve_model(model)
    threads = threads or physical_cores()
    rows: dict[str, dict[str, Any]] = {}
    for x, (prec, kv) in runners.items():
        eng = Engine.load(folder, threads=threads, wafer=wafer, precision=prec, kv_cache=kv)
        avoid = set(eng.tokenizer.special_tokens.values()) | set(eng.eos_ids)
        pool = np.array([t for t in range(eng.sample_vocab) if t not in avoid])
        prompt = [int(t) for t in np.random.default_rng(seed).choice(pool, prompt_tokens)]
        rows[x] = measure(eng, prompt, drafted, rounds)
        log(
            f"{x}: step {rows[x]['step_ms']:.1f} ms, pass of {drafted + 1} {rows[x]['pass_ms']:.1f} ms "
            f"= {rows[x]['pass_in_steps']:.2f} steps"
        )
        del eng
    return {"model": str(folder), "threads": threads, "verify_cost": rows}
