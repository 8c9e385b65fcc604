"""Per-precision diagnostics: where a decode step's time goes, how far multi-token passes stray
from single steps, greedy agreement with fp32 and ``spark-lsp eval`` figures, per precision.

``python -m engine.lab.precisions --profile fp32,int8`` (ONNX Runtime's profiler, per op type),
``--consistency 9`` (a 9-token verification pass against 9 single steps), ``--agreement 16``,
``--eval GLOB``; with no option it measures and prints the precision decision like
``spark-lsp tune``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ..linears import make_linear
from ..runtime import session_options
from .bench_profile import step_profile
from .evaluate import evaluate, resolve_files
from .models import resolve_model
from .tune import choose_precision, eval_prompts, greedy_agreement, load_engine


def batch_consistency(
    eng, width: int = 9, positions: int = 30, files: Sequence[Path] | None = None
) -> np.ndarray:
    """Per-row max |logits(one ``width``-token pass) - logits(single steps)| / max(|logits|, 1) at
    ``positions`` places in real code: how much a speculative verification pass can differ from
    plain decoding on this engine (float noise ~1e-7; a flipped int8 activation code ~1e-3)."""
    rt = eng.runtime
    ids = [t for p in eval_prompts(eng.tokenizer, count=2, length=300, files=files) for t in p]
    step = max(1, (len(ids) - width - 40) // positions)
    rel = []
    kv_a, kv_b = rt.new_kv(), rt.new_kv()
    for start in range(40, len(ids) - width, step)[:positions]:
        rt.forward(kv_a, ids[:start], 0)
        rt.forward(kv_b, ids[:start], 0)
        single = np.stack([rt.decode(kv_a, ids[start + i], start + i).copy() for i in range(width)])
        batch = rt.forward(kv_b, ids[start : start + width], start, num_logits=width)
        rel.extend(
            (np.abs(batch - single).max(1) / np.maximum(np.abs(single).max(1), 1.0)).tolist()
        )
    return np.asarray(rel)


def op_profile(eng, steps: int = 64, prompt_len: int = 61, verify: int = 0) -> dict[str, Any]:
    """Where a decode step's time goes: ONNX Runtime's own profiler over ``steps`` single-token runs
    (``verify > 0``: runs of ``verify`` tokens, like a speculative verification pass).

    Opens a second, profiling session on the engine's cached graph (same options and the same
    shared past/present KV binding as the runtime).  Returns per-op-type microseconds per run,
    sorted, the kernel total and the wall time per run (the prompt's run left out: ``prompt_len``
    is a prime, see ``engine.lab.bench_profile.step_profile``).
    """
    rt = eng.runtime
    so = session_options(
        rt.threads,
        custom_ops=rt.custom_ops,
        profile=str(Path(os.environ.get("TMPDIR", "/tmp")) / f"spark-ort-profile-{os.getpid()}"),
    )
    sess = ort.InferenceSession(str(eng.graph_path), so, providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    for i in range(rt.num_layers):  # one buffer bound as past and present, as the runtime does
        for t in ("key", "value"):
            v = ort.OrtValue.ortvalue_from_shape_and_type(
                [1, rt.kv_heads, rt.max_len, rt.head_dim], rt.kv_dtype
            )
            binding.bind_ortvalue_input(f"past.{i}.{t}", v)
            binding.bind_ortvalue_output(f"present.{i}.{t}", v)
    rng = np.random.default_rng(0)
    n = max(1, verify)
    ids = rng.integers(0, eng.sample_vocab, prompt_len + steps * n)

    names = {i.name for i in sess.get_inputs()}

    def run(tokens, pos):
        k = len(tokens)
        bound = rt.bind_tokens(binding, tokens)  # noqa: F841 - read in place by the run below
        feeds = {
            "seqlens_k": np.array([pos + k - 1], np.int32),
            "total_sequence_length": np.array(pos + k, np.int32),
            "num_logits": np.array([k], np.int64),
            "logits_from": np.array([0], np.int64),
        }
        for name, arr in feeds.items():
            if name in names:
                binding.bind_cpu_input(name, arr)
        binding.bind_output("logits")
        sess.run_with_iobinding(binding)

    run(ids[:prompt_len], 0)
    pos = prompt_len
    t0 = time.perf_counter()
    for _ in range(steps):
        run(ids[pos : pos + n], pos)
        pos += n
    wall = (time.perf_counter() - t0) / steps * 1e6
    path = sess.end_profiling()
    try:
        prof = step_profile([path], prompt_tokens=prompt_len)  # the runs after the prompt's
    finally:
        Path(path).unlink(missing_ok=True)
    return {
        "per_op_us": {op: o["us_per_step"] for op, o in prof["ops"].items()},
        "kernel_us": prof["kernel_us"],
        "wall_us": wall,
        "tokens_per_run": n,
        "runs": prof["steps"],
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.lab.precisions``: per-precision diagnostics, or the precision choice."""
    ap = argparse.ArgumentParser(prog="python -m engine.lab.precisions", description=main.__doc__)
    ap.add_argument(
        "--model", default=None, help="model folder or 'synthetic-8m' (default: the bundled model)"
    )
    ap.add_argument(
        "--profile", default=None, metavar="P1,P2", help="profile these precisions (e.g. fp32,int8)"
    )
    ap.add_argument(
        "--verify", type=int, default=0, help="with --profile: tokens per run (a verification pass)"
    )
    ap.add_argument("--no-wafer", dest="wafer", action="store_false")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--remeasure", action="store_true", help="ignore a stored precision decision")
    ap.add_argument(
        "--eval",
        dest="eval_files",
        action="append",
        metavar="GLOB",
        help="with --precisions: `spark-lsp eval` (FIM line exact match, bits/byte) on these files "
        "(glob or @list.txt) for every precision; with --agreement: where prompts come from",
    )
    ap.add_argument("--eval-n", type=int, default=200, help="completion positions for --eval")
    ap.add_argument(
        "--eval-bpb-bytes", type=int, default=100_000, help="bytes scored for bits/byte in --eval"
    )
    ap.add_argument(
        "--agreement",
        type=int,
        default=0,
        metavar="N",
        help="with --precisions: greedy agreement with fp32 over N real-code prompts x 64 tokens",
    )
    ap.add_argument(
        "--precisions",
        default="fp32,int8,int8-rowq,int4",
        help="precisions for --eval / --agreement / --consistency",
    )
    ap.add_argument(
        "--consistency",
        type=int,
        default=0,
        metavar="WIDTH",
        help="with --precisions: how far WIDTH-token passes stray from single decode steps "
        "(relative logit difference per row, over real-code positions)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    folder = resolve_model(args.model)
    files = None
    if args.eval_files:
        files = resolve_files(args.eval_files)
    if args.eval_files and not (args.agreement or args.consistency):
        rows = {}
        for p in [s.strip() for s in args.precisions.split(",") if s.strip()]:
            eng = load_engine(folder, make_linear(p, wafer=args.wafer), threads=args.threads)
            r = evaluate(eng, files, n=args.eval_n, bpb_max_bytes=args.eval_bpb_bytes)
            rows[p] = {
                k: r.get(k)
                for k in (
                    "exact_match",
                    "edit_similarity",
                    "bits_per_byte",
                    "decode_tok_s_median",
                    "n",
                )
            }
            print(
                f"{p:10s} "
                + "  ".join(
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in rows[p].items()
                ),
                flush=True,
            )
        if args.json:
            print(json.dumps(rows, indent=2))
        return 0
    if args.consistency:
        out = {}
        for p in [s.strip() for s in args.precisions.split(",") if s.strip()]:
            eng = load_engine(folder, make_linear(p, wafer=args.wafer), threads=args.threads)
            rel = batch_consistency(eng, args.consistency, files=files)
            out[p] = {
                "rows": int(rel.size),
                "median": float(np.median(rel)),
                "p99": float(np.percentile(rel, 99)),
                "max": float(rel.max()),
                "rows_over_1e-4": int((rel > 1e-4).sum()),
            }
            print(
                f"{p:10s} {args.consistency}-token pass vs single steps, relative logit difference per row: "
                + ", ".join(f"{k} {v:.2g}" for k, v in out[p].items()),
                flush=True,
            )
        if args.json:
            print(json.dumps(out, indent=2))
        return 0
    if args.agreement:
        names = [s.strip() for s in args.precisions.split(",") if s.strip() and s.strip() != "fp32"]
        ref = load_engine(folder, make_linear("fp32", wafer=args.wafer), threads=args.threads)
        prompts = eval_prompts(ref.tokenizer, count=args.agreement, files=files)
        out = {}
        for p in names:
            eng = load_engine(folder, make_linear(p, wafer=args.wafer), threads=args.threads)
            r = greedy_agreement(ref, eng, prompts, max_new_tokens=64)
            out[p] = {k: r[k] for k in ("teacher_forced", "free_running", "tokens", "prompts")}
            print(
                f"{p:10s} teacher-forced {r['teacher_forced']:.4f}  free-running {r['free_running']:.4f}  "
                f"over {r['tokens']} tokens / {r['prompts']} prompts",
                flush=True,
            )
        if args.json:
            print(json.dumps(out, indent=2))
        return 0
    if args.profile:
        out = {}
        for p in [s.strip() for s in args.profile.split(",") if s.strip()]:
            eng = load_engine(folder, make_linear(p, wafer=args.wafer), threads=args.threads)
            out[p] = op_profile(eng, verify=args.verify)
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            for p, r in out.items():
                top = ", ".join(f"{op} {us:.0f}" for op, us in list(r["per_op_us"].items())[:8])
                print(
                    f"{p:10s} kernels {r['kernel_us']:7.0f} us/run (wall {r['wall_us']:.0f}): {top}"
                )
        return 0
    choice = choose_precision(
        folder,
        wafer=args.wafer,
        threads=args.threads,
        remeasure=args.remeasure,
        log_fn=lambda s: print(s, flush=True),
    )
    print(
        json.dumps(choice.to_dict(), indent=2)
        if args.json
        else f"{choice.precision}: {choice.reason}{' (stored decision)' if choice.cached else ''}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
