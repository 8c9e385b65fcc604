"""`spark-lsp generate`: run the engine on one prompt from the command line and stream the text.

Useful to check a model folder before pointing the language server at it. Errors (a bad folder, a
prompt longer than the context, an out-of-range parameter) print one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_grid(text: str) -> tuple[int, int]:
    """``RxC`` → (rows, cols) of the emulated PE grid."""
    try:
        r, c = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected RxC with positive integers, e.g. 4x4"
        ) from None
    if r <= 0 or c <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: rows and columns must be positive")
    return r, c


def add_engine_args(p: argparse.ArgumentParser, *, model_help: str) -> None:
    """Options shared by the commands that load an engine (generate, bench engine)."""
    p.add_argument("--model", metavar="MODEL", default=None, help=model_help)
    p.add_argument(
        "--grid",
        type=parse_grid,
        default=None,
        metavar="RxC",
        help="emulated PE grid each weight matmul is partitioned over (default: the wafer default)",
    )
    p.add_argument(
        "--no-wafer",
        action="store_true",
        help="plain MatMuls instead of the partitioned wafer emitter",
    )
    p.add_argument(
        "--threads", type=int, default=None, metavar="N", help="ONNX Runtime intra-op threads"
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "fp32", "int8", "int4", "int8-rowq"),
        help="weight precision; auto (default) = the decision `spark-lsp tune` stored for this "
        "model and machine, else a static rule (int8 on large models where the CPU has int8 arithmetic)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a prompt with a model folder",
        description=__doc__.splitlines()[0],
    )
    add_engine_args(
        p,
        model_help="model folder, .gguf file, catalogue name or hf:ORG/REPO[:FILE] "
        "(default: the bundled model)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    src.add_argument(
        "--prompt-file", metavar="FILE", help="read the prompt from FILE ('-' for stdin)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)"
    )
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1.0 = off")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="S",
        help="stop string (repeatable); the text ends before it",
    )
    p.add_argument(
        "--max-time", type=float, default=None, metavar="SECONDS", help="stop after this long"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (tokens, text, stats) instead of streaming the text",
    )
    p.set_defaults(func=run)


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"--prompt-file {args.prompt_file}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompt-file {args.prompt_file}: cannot read: {e}") from None


def fail(command: str, message: str, code: int = 2) -> int:
    print(f"spark-lsp {command}: error: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    from engine import Engine, GenerationParams, ModelError
    from engine.hub import resolve_model

    gen = None
    try:
        prompt = _read_prompt(args)
        params = GenerationParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
            max_time_s=args.max_time,
        )
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads={args.threads} must be a positive integer")
        from spark_lsp.preparation import print_steps, reporting

        with reporting(print_steps("spark-lsp generate")):  # a first load builds the graph: say so
            eng = Engine.load(
                resolve_model(args.model),
                grid=args.grid,
                wafer=not args.no_wafer,
                threads=args.threads,
                precision=args.precision,
            )
        gen = eng.generate(prompt, params)
        out = sys.stdout
        for chunk in gen:
            if not args.json and chunk.text:
                out.write(chunk.text)
                out.flush()
    except (ModelError, ValueError, OSError) as e:
        return fail("generate", str(e))
    except KeyboardInterrupt:
        if gen is not None:
            gen.cancel()
        raise
    except Exception as e:  # an engine bug: still one line, unless debugging
        if os.environ.get("SPARK_LSP_DEBUG"):
            raise
        return fail(
            "generate",
            f"internal error: {type(e).__name__}: {e} (set SPARK_LSP_DEBUG=1 for a traceback)",
            1,
        )

    if args.json:
        st = gen.stats
        print(
            json.dumps(
                {
                    "model": str(eng.model_dir),
                    "text": gen.text,
                    "tokens": list(gen.tokens),
                    "finish_reason": gen.finish_reason,
                    "prompt_tokens": st["prompt_tokens"],
                    "reused_tokens": st["reused_tokens"],
                    "new_tokens": st["new_tokens"],
                    "ttft_ms": round(st["ttft_ms"], 3),
                    "decode_tok_s": round(st["decode_tok_s"], 2),
                    "total_ms": round(st["total_ms"], 3),
                },
                ensure_ascii=False,
            )
        )
    elif sys.stdout.isatty() and not gen.text.endswith("\n"):
        print()
    return 0
