"""Measuring the precision decision: fp32 against the quantised precisions, on the model itself.

:func:`choose_precision` loads the model once per candidate precision, measures decode tok/s
(alternating rounds, so every engine sees the same machine load) and teacher-forced greedy
agreement with fp32 on real code, and picks by :func:`pick_precision`.  The decision is stored
with :func:`engine.precision.store_decision` under the key ``Engine.load(precision="auto")``
reads, so the measurement is paid once per model and machine and loading never measures.

Entry points: ``spark-lsp tune`` (the command) and :func:`measure_and_store` (for a background
job in a server: it measures only when no trustworthy decision is stored).
"""

from __future__ import annotations

import statistics
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import precision as store
from .. import runtime
from ..config import load_config, model_name, model_path
from ..engine import Engine
from ..generate import GenerationParams
from ..linears import PRECISIONS, make_linear
from ..precision import PrecisionChoice
from .evaluate import resolve_files
from .models import resolve_model

#: choose_precision takes int8-rowq over a faster qualifier when it is at least this fast relative
#: to it: its multi-token passes (prefill, speculative verification) are cheaper than fused
#: MatMulNBits', which cannot verify drafts at all. (On a wafer grid int8/int4 run MeshLinearQ,
#: which quantises each row itself and verifies too; the preference then only breaks near-ties.)
ROWQ_PREFERENCE = 0.9
#: Among the other qualifiers, one with higher greedy agreement is taken over a faster one when it
#: is at least this fast relative to it: close decode speeds swap places from run to run, while
#: the agreement difference is stable.
AGREEMENT_PREFERENCE = 0.85
CANDIDATES = ("int8", "int8-rowq", "int4")


def load_engine(model_dir: str | Path | None, linear: Any, **kw: Any) -> Engine:
    """``Engine.load`` with an explicit linear emitter (e.g. ``make_linear("int8")``); ``kw`` are
    ``Engine.load``'s options (threads, cache_dir, slots, max_context, spinning, ...)."""
    return Engine.load(model_dir, linear=linear, **kw)


def eval_prompts(
    tokenizer, count: int = 8, length: int = 192, seed: int = 0, files: Sequence[Path] | None = None
) -> list[list[int]]:
    """Token windows of real Python source, fixed by ``seed``: ``files`` (e.g. a model's held-out
    files), else this Python's standard library.  Real code gives a meaningful agreement figure;
    random tokens would not (their logits are nearly flat).
    """
    if files is None:
        lib = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in lib.glob("*.py") if p.stat().st_size > 8000]
    files = sorted(Path(f) for f in files if Path(f).is_file() and Path(f).stat().st_size > 2000)
    if not files:
        raise RuntimeError("no Python sources found to build evaluation prompts from")
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = []
    for f in rng.permutation(len(files)):
        if len(prompts) >= count:
            break
        ids = tokenizer.encode(files[f].read_text(encoding="utf-8", errors="replace"))
        if len(ids) < length + 64:
            continue
        start = int(rng.integers(0, len(ids) - length - 64))
        prompts.append(ids[start : start + length])
    return prompts


def heldout_files(folder: Path, minimum: int = 4) -> list[Path] | None:
    """The files a model folder's ``heldout_files.txt`` lists (code it was not trained on), when at
    least ``minimum`` of them exist on this machine; else None."""
    try:  # an @list, read as `spark-lsp eval --files @list` reads it
        listed = resolve_files([f"@{Path(folder) / 'heldout_files.txt'}"])
    except ValueError:  # no list, or an empty one
        return None
    files = [p for p in listed if p.is_file()]
    return files if len(files) >= minimum else None


def greedy_agreement(
    ref, test, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64
) -> dict[str, Any]:
    """How often ``test`` picks the same greedy token as ``ref`` (both engines on the same tokenizer).

    ``teacher_forced``: ``ref`` generates greedily; ``test`` reads the same sequence and we count the
    positions where its argmax equals ``ref``'s token (the standard per-token agreement, not
    penalising one early flip twice).  ``free_running``: both generate; the fraction of tokens
    generated before the first divergence.
    """
    nv = min(ref.sample_vocab, test.sample_vocab)
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    agree = total = same_prefix = gen_total = 0
    per_prompt = []
    for p in prompts:
        p = list(p)
        r = ref.generate(p, params)
        r.result()
        t = test.generate(p, params)
        t.result()
        logits = test.forward_logits(p + r.tokens[:-1])[len(p) - 1 :]
        picks = logits[:, :nv].argmax(-1)
        a = int((picks == np.asarray(r.tokens)).sum())
        agree += a
        total += len(r.tokens)
        k = 0
        for x, y in zip(r.tokens, t.tokens):
            if x != y:
                break
            k += 1
        same_prefix += k
        gen_total += len(r.tokens)
        per_prompt.append({"tokens": len(r.tokens), "teacher_forced": a, "identical_prefix": k})
    return {
        "teacher_forced": agree / max(total, 1),
        "free_running": same_prefix / max(gen_total, 1),
        "tokens": total,
        "prompts": len(prompts),
        "per_prompt": per_prompt,
    }


def decode_speed(eng, prompt: Sequence[int], new_tokens: int = 64, repeats: int = 3) -> float:
    """Median decode tok/s of a cold greedy generation (eos ignored), as ``spark-lsp bench`` counts it."""
    params = GenerationParams(max_new_tokens=new_tokens, ignore_eos=True)
    rates = []
    for _ in range(repeats + 1):
        eng.reset()
        g = eng.generate(list(prompt), params)
        g.result()
        rates.append(g.stats["decode_tok_s"])
    return float(statistics.median(rates[1:] or rates))  # the first run warms the session up


def compare_decode(
    engines: dict[str, Any],
    prompt: Sequence[int],
    new_tokens: int = 64,
    rounds: int = 5,
    settle_s: float = 0.1,
) -> dict[str, float]:
    """Median decode tok/s per engine, measured in alternating rounds (one generation per engine per
    round) so that every engine sees the same machine load; a warm-up round is not counted.  Each
    run starts ``settle_s`` after the last: the spinning threads of the engine before it stay
    awake for a while and would slow it."""
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds + 1):
        for name, eng in engines.items():
            time.sleep(settle_s)
            rate = decode_speed(eng, prompt, new_tokens, repeats=0)
            if r:
                rates[name].append(rate)
    return {name: float(statistics.median(v)) for name, v in rates.items()}


def pick_precision(
    speeds: dict[str, float],
    agreement: dict[str, float],
    min_agreement: float = 0.95,
    min_speedup: float = 1.15,
) -> str:
    """The rule of :func:`choose_precision` on measured decode tok/s (``speeds``, with "fp32") and
    agreement with fp32 per candidate."""
    good = [
        c
        for c in agreement
        if agreement[c] >= min_agreement and speeds[c] >= min_speedup * speeds["fp32"]
    ]
    if not good:
        return "fp32"
    fastest = max(good, key=lambda c: speeds[c])
    best = max(
        (c for c in good if speeds[c] >= AGREEMENT_PREFERENCE * speeds[fastest]),
        key=lambda c: agreement[c],
    )
    if "int8-rowq" in good and speeds["int8-rowq"] >= ROWQ_PREFERENCE * speeds[best]:
        best = "int8-rowq"  # as fast within noise; cheaper multi-token passes
    return best


def choose_precision(
    model_dir: str | Path | None,
    *,
    candidates: Sequence[str] = CANDIDATES,
    wafer: bool = True,
    grid: tuple[int, int] | None = None,
    threads: int | None = None,
    cache_dir: str | Path | None = None,
    min_agreement: float = 0.95,
    min_speedup: float = 1.15,
    prompts: int = 16,
    new_tokens: int = 48,
    remeasure: bool = False,
    measure: bool = True,
    log_fn: Callable[[str], None] = print,
) -> PrecisionChoice:
    """The precision decision for this model and machine: stored, else measured and stored.

    A candidate qualifies when its teacher-forced greedy agreement with fp32 is at least
    ``min_agreement`` on real-code prompts and its decode is at least ``min_speedup`` times fp32's
    (quantising must pay for its accuracy cost).  Among qualifiers the fastest wins — except that
    the most faithful one within :data:`AGREEMENT_PREFERENCE` of its speed is taken, and int8-rowq
    within :data:`ROWQ_PREFERENCE` of that; otherwise fp32.

    ``remeasure=True`` measures even when a decision is stored; ``measure=False`` never measures
    (what ``Engine.load(precision="auto")`` would load: the stored decision, else the static rule).
    A decision measured while the CPU was contended is used, but measured again at the first call
    that finds the CPU calm: under load fp32 falls out of cache and every speed ratio skews.
    """
    folder = model_path(resolve_model(model_dir))  # a name or hf: spec downloaded first
    bad = [c for c in candidates if c not in PRECISIONS or c == "fp32"]
    if bad:
        raise ValueError(
            f"candidates: {bad[0]!r} is not a quantised precision; expected some of {PRECISIONS[1:]}"
        )
    key = store.decision_key(folder, wafer=wafer, grid=grid, threads=threads)
    if not measure:
        return store.resolve(
            folder,
            load_config(folder),
            wafer=wafer,
            grid=grid,
            threads=threads,
            cache_dir=cache_dir,
        )
    stored = None if remeasure else store.read_decision(key, cache_dir)
    if stored is not None:
        if not (stored.contended and not runtime.cpu_contended()):
            return stored
        log_fn(
            f"precision decision for {model_name(folder)} was measured under load; measuring again"
        )
    choice = _measure(
        folder,
        candidates,
        wafer=wafer,
        grid=grid,
        threads=threads,
        cache_dir=cache_dir,
        min_agreement=min_agreement,
        min_speedup=min_speedup,
        prompts=prompts,
        new_tokens=new_tokens,
        log_fn=log_fn,
    )
    try:
        store.store_decision(key, choice, cache_dir, model=model_name(folder))
    except OSError as e:  # a read-only cache only costs a re-measurement next time
        log_fn(f"could not store the precision decision: {e}")
    return choice


def measure_and_store(
    model_dir: str | Path | None,
    *,
    wafer: bool = True,
    grid: tuple[int, int] | None = None,
    threads: int | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
    log_fn: Callable[[str], None] = print,
) -> PrecisionChoice:
    """Make sure a trustworthy decision is stored for this model and machine; return it.

    Measures (tens of seconds on a small model, loading one engine per candidate) unless a
    decision measured on a calm CPU is already stored, or always with ``force``.  Meant for
    ``spark-lsp tune`` and for a low-priority job in a server that is already serving: the
    decision applies from the next ``Engine.load(precision="auto")``.
    """
    return choose_precision(
        model_dir,
        wafer=wafer,
        grid=grid,
        threads=threads,
        cache_dir=cache_dir,
        remeasure=force,
        log_fn=log_fn,
    )


def _measure(
    folder: Path,
    candidates: Sequence[str],
    *,
    wafer: bool,
    grid,
    threads,
    cache_dir,
    min_agreement: float,
    min_speedup: float,
    prompts: int,
    new_tokens: int,
    log_fn: Callable[[str], None],
) -> PrecisionChoice:
    contended = runtime.cpu_contended()
    # steady thread mode: the automatic one can flip between runs and skew single ratios
    engines = {
        c: load_engine(
            folder,
            make_linear(c, wafer, grid),
            threads=threads,
            cache_dir=cache_dir,
            spinning=False,
        )
        for c in ("fp32", *candidates)
    }
    # agreement on code the model did not train on where the folder names some (its own text
    # would flatter every precision alike), else on this Python's standard library
    ps = eval_prompts(engines["fp32"].tokenizer, count=prompts, files=heldout_files(folder))
    speeds = compare_decode(engines, ps[0], new_tokens)
    agreement, speedup = {}, {}
    for c in candidates:
        agreement[c] = greedy_agreement(engines["fp32"], engines[c], ps, new_tokens)[
            "teacher_forced"
        ]
        speedup[c] = speeds[c] / speeds["fp32"]
    best = pick_precision(speeds, agreement, min_agreement, min_speedup)
    if best != "fp32":
        why = f"{best}: {speedup[best]:.2f}x fp32 decode, {agreement[best]:.1%} greedy agreement"
    else:
        why = (
            f"no quantised candidate was both faster (>= {min_speedup:.2f}x) and in agreement "
            f"(>= {min_agreement:.0%})"
        )
    contended = contended or runtime.cpu_contended()
    log_fn(
        f"precision for {folder.name}: {why} (decode tok/s: "
        + ", ".join(f"{k} {v:.0f}" for k, v in speeds.items())
        + ")"
    )
    return PrecisionChoice(
        best,
        speeds,
        agreement,
        speedup,
        f"measured: {why}",
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        contended=contended,
    )
