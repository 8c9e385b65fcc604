"""`spark-lsp eval`: FIM line-completion quality and bits per byte of a model on Python files.

At ``--n`` sampled cursors the model completes the rest of the line from the text before the
cursor and the text after the line; the first line is compared with the real one (exact
match, edit similarity), with median TTFT and decode tokens/s (``--line-start``: cursors at
column 0 of indented lines, the whole line to write).  Prompts are token-healed as
the server's are (``--no-heal``: not); ``--served`` scores the suggestion after the server's
post-processing (what an editor would show) instead of the raw line.  Bits per byte is scored on
the files themselves.  Errors print one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="line-completion quality and bits per byte on files",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "--model",
        metavar="MODEL",
        default=None,
        help="Hugging Face model folder (default: the bundled model)",
    )
    p.add_argument(
        "--files",
        action="append",
        required=True,
        metavar="GLOB",
        help="files to evaluate on: a glob (** allowed) or @LIST (one path per line); repeatable",
    )
    p.add_argument(
        "--n", type=int, default=200, metavar="N", help="completion positions (default 200)"
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the sampled positions")
    p.add_argument(
        "--order",
        choices=["auto", "spm", "psm"],
        default="auto",
        help="FIM prompt order (auto: SPM where the model was trained on it)",
    )
    p.add_argument(
        "--no-heal",
        dest="heal",
        action="store_false",
        help="no token healing: the prompt ends with the partial word's own tokens",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--line-start",
        action="store_true",
        help="cursors at column 0 of indented lines (the model writes the whole line, indentation too)",
    )
    where.add_argument(
        "--after-indent",
        action="store_true",
        help="cursors right after the indentation of indented lines (the model writes the rest)",
    )
    where.add_argument(
        "--mid-line",
        action="store_true",
        help="cursors inside a line with its rest kept after a hidden span (the model fills the span)",
    )
    p.add_argument(
        "--context",
        choices=["none", "neighbours"],
        default="none",
        help="neighbours: also complete every cursor with chunks of the other files of its "
        "folder in the prompt (the server's ring buffer, in the model's repository "
        "format) and report both",
    )
    p.add_argument(
        "--context-tokens",
        type=int,
        default=512,
        metavar="N",
        help="token budget of the neighbours' chunks (default 512)",
    )
    p.add_argument(
        "--served",
        action="store_true",
        help="score the suggestion after the server's post-processing, not the raw line",
    )
    p.add_argument("--max-new-tokens", type=int, default=48, metavar="N")
    p.add_argument(
        "--bpb-max-bytes",
        type=int,
        default=400_000,
        metavar="B",
        help="score bits per byte on at most this many bytes (0 = all)",
    )
    p.add_argument(
        "--threads", type=int, default=None, metavar="N", help="ONNX Runtime intra-op threads"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (with every sample)")
    p.set_defaults(func=run)


def served(pos, raw: str) -> str:
    """The suggestion the server would show for raw output at an eval cursor (a Python file, the
    rest of the line not yet typed): its post-processing, multi-line where it would choose that."""
    from spark_lsp import postprocess
    from spark_lsp.completions import context_at

    ctx = context_at(pos.prefix + pos.suffix, len(pos.prefix), python=True)
    return postprocess.clean(raw, ctx, postprocess.choose_multiline(ctx))


def neighbours_context(files, tokenizer, budget: int):
    """`context(position)` for `evaluate`: the server's ring buffer (`spark_lsp.neighbours`) fed
    with the head and the middle of every other file of the position's folder, selected within
    `budget` tokens as the server selects them."""
    from pathlib import Path

    from spark_lsp.neighbours import Neighbours

    texts = {Path(f): Path(f).read_text(encoding="utf-8", errors="replace") for f in files}

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    def context(pos) -> list[tuple[str, str]]:
        here = Path(pos.file)
        ring = Neighbours()
        for path, text in sorted(texts.items()):
            if path != here and path.parent == here.parent:
                ring.observe(str(path), path.name, text, 0)
                ring.observe(str(path), path.name, text, text.count("\n") // 2)
        return ring.select(str(here), budget, count)

    return context


def run(args: argparse.Namespace) -> int:
    from engine import Engine, ModelError
    from engine.hub import resolve_model
    from engine.lab.evaluate import evaluate, resolve_files

    def fail(msg: str) -> int:
        print(f"spark-lsp eval: error: {msg}", file=sys.stderr)
        return 2

    if args.n < 1:
        return fail(f"--n must be >= 1, got {args.n}")
    if args.max_new_tokens < 1:
        return fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.context_tokens < 0:
        return fail(f"--context-tokens must be >= 0, got {args.context_tokens}")
    if args.bpb_max_bytes < 0:
        return fail(f"--bpb-max-bytes must be >= 0 (0 = all), got {args.bpb_max_bytes}")
    if args.threads is not None and args.threads < 1:
        return fail(f"--threads must be >= 1, got {args.threads}")
    try:
        files = resolve_files(args.files)
        eng = Engine.load(resolve_model(args.model), threads=args.threads)
        spm = None if args.order == "auto" else args.order == "spm"
        context = (
            neighbours_context(files, eng.tokenizer, args.context_tokens)
            if args.context == "neighbours"
            else None
        )
        res = evaluate(
            eng,
            files,
            n=args.n,
            seed=args.seed,
            spm=spm,
            max_new_tokens=args.max_new_tokens,
            bpb_max_bytes=args.bpb_max_bytes or None,
            heal=args.heal,
            line_start=args.line_start,
            mid_line=args.mid_line,
            after_indent=args.after_indent,
            finish=served if args.served else None,
            context=context,
        )
    except (ModelError, ValueError, OSError) as e:
        return fail(str(e))
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    dec = res["decode_tok_s_median"]
    print(
        f"model {res['model']}: {res['files']} files, {res['n']} positions (seed {res['seed']}"
        f"{', at line starts' if res['line_start'] else ''}{', mid-line' if res['mid_line'] else ''}"
        f"{', after the indentation' if res['after_indent'] else ''}"
        f"{'' if res['heal'] else ', no token healing'}"
        f"{', as served' if args.served else ''})"
    )
    print(f"  exact match      {res['exact_match']:.1%}")
    print(f"  edit similarity  {res['edit_similarity']:.3f}")
    print(f"  TTFT median      {res['ttft_ms_median']:.1f} ms")
    print(
        f"  decode median    {dec:.0f} tok/s"
        if dec
        else "  decode median    n/a (completions too short)"
    )
    print(
        f"  bits per byte    {res['bits_per_byte']:.3f}  ({res['bpb_bytes']} bytes, window {res['bpb_window']})"
    )
    if "context" in res:
        w, wo = res["context"]["with"], res["context"]["without"]
        print(
            f"  with the other files of each folder in the prompt (--context neighbours, "
            f"median prompt {w['prompt_tokens_median']:.0f} tokens):"
        )
        print(f"    exact match      {wo['exact_match']:.1%} -> {w['exact_match']:.1%}")
        print(f"    edit similarity  {wo['edit_similarity']:.3f} -> {w['edit_similarity']:.3f}")
        print(
            f"    TTFT median      {wo['ttft_ms_median']:.1f} -> {w['ttft_ms_median']:.1f} ms (cold prefill)"
        )
    print(
        "  confidence gate  (shown: a non-empty suggestion whose line has at least that probability)"
    )
    print("    threshold  coverage  exact match  edit similarity")
    for row in res["gate"]:
        em = "-" if row["exact_match"] is None else f"{row['exact_match']:.1%}"
        es = "-" if row["edit_similarity"] is None else f"{row['edit_similarity']:.3f}"
        print(f"    {row['threshold']:9g}  {row['coverage']:8.1%}  {em:>11}  {es:>15}")
    return 0
