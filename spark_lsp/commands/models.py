"""`spark-lsp models`: the curated catalogue, downloads from the Hugging Face Hub, and local models.

    spark-lsp models list                 # downloaded models, then the catalogue
    spark-lsp models pull qwen2.5-coder-0.5b
    spark-lsp models pull Qwen/Qwen2.5-Coder-1.5B@main
    spark-lsp models pull hf:ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF:Q8_0
    spark-lsp models info starcoder2-3b   # memory per precision, from config.json alone
    spark-lsp models rm qwen2.5-coder-0.5b

Downloads are resumable (run `pull` again after an interruption), honour HF_TOKEN (gated or
private repositories), HF_ENDPOINT (a mirror) and HF_HUB_OFFLINE=1 (cache only).  Errors print one
line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list, download, inspect and remove models",
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmds = p.add_subparsers(dest="models_command", metavar="ACTION")
    cmds.required = True
    ls = cmds.add_parser("list", help="downloaded models and the catalogue")
    ls.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    ls.set_defaults(func=run_list)
    pull = cmds.add_parser(
        "pull", help="download a model (catalogue NAME, ORG/REPO[@REV] or hf:ORG/REPO[:FILE])"
    )
    pull.add_argument("model", metavar="MODEL")
    pull.set_defaults(func=run_pull)
    rm = cmds.add_parser("rm", help="delete a downloaded model from the cache")
    rm.add_argument("model", metavar="MODEL")
    rm.set_defaults(func=run_rm)
    info = cmds.add_parser(
        "info", help="architecture, size and memory per precision (before pulling)"
    )
    info.add_argument(
        "model", metavar="MODEL", help="catalogue name, ORG/REPO, hf:…, a folder or a .gguf file"
    )
    info.add_argument("--json", action="store_true", help="one JSON object")
    info.set_defaults(func=run_info)


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _fail(e: Exception) -> int:
    print(f"spark-lsp models: {e}", file=sys.stderr)
    return 2


def run_list(args) -> int:
    from engine.config import ModelError
    from engine.hub import cache_dir, catalogue_rows, list_models

    try:
        local = list_models()
    except (ModelError, OSError) as e:
        return _fail(e)
    if args.json:
        print(
            json.dumps(
                {
                    "cache": str(cache_dir()),
                    "models": [
                        {
                            "repo": m.repo,
                            "revision": m.revision,
                            "path": str(m.path),
                            "size": m.size,
                            "architecture": m.architecture,
                            "precision": m.precision,
                            "files": m.files,
                            "weights": m.weights,
                        }
                        for m in local
                    ],
                    "catalogue": catalogue_rows(),
                },
                indent=2,
            )
        )
        return 0
    if local:
        print(f"Downloaded ({cache_dir()}):")
        print(
            _table(
                [["REPOSITORY", "SIZE", "ARCHITECTURE", "PRECISION", "PATH"]]
                + [
                    [
                        m.repo,
                        _size(m.size),
                        m.architecture,
                        m.precision if m.weights else "no weights (tokenizer only)",
                        str(m.path),
                    ]
                    for m in local
                ]
            )
        )
    else:
        print(f"No downloaded models in {cache_dir()}.")
    print("\nCatalogue (spark-lsp models pull NAME; spark-lsp serve --model NAME):")
    rows = catalogue_rows()
    print(
        _table(
            [["NAME", "PARAMS", "ARCH", "FIM", "REPOSITORY"]]
            + [
                [r["name"], r["parameters"], r["architecture"], r["fim"], r["repository"]]
                for r in rows
            ]
        )
    )
    return 0


def run_pull(args) -> int:
    from engine.config import ModelError
    from engine.hub import pull

    try:
        path = pull(args.model)
    except ModelError as e:
        return _fail(e)
    print(path)
    return 0


def run_rm(args) -> int:
    from engine.config import ModelError
    from engine.hub import remove

    try:
        for folder in remove(args.model):
            print(f"removed {folder}")
    except ModelError as e:
        return _fail(e)
    return 0


def run_info(args) -> int:
    from engine.config import ModelError
    from engine.hub import model_info

    try:
        info = model_info(args.model)
    except ModelError as e:
        return _fail(e)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    c = info.config
    print(
        f"{info.name}: {c.architecture}, {info.parameters / 1e9:.2f}B parameters, "
        f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, vocabulary {c.vocab_size}, "
        f"context {c.max_position_embeddings}"
    )
    if info.file_size is not None:
        print(f"file: {_size(info.file_size)} ({info.file_precision} in the engine by default)")
    print("memory for the weights in the engine:")
    for precision, n in info.memory.items():
        print(f"  {precision:5} {_size(n)}")
    print(
        f"KV cache: {_size(info.kv_bytes_per_token)} per token in float32 "
        f"({_size(info.kv_bytes_per_token * min(c.max_position_embeddings, 8192))} per slot at "
        f"{min(c.max_position_embeddings, 8192)} tokens); half that in float16, the cache the "
        "engine gives int8 and int4 weights"
    )
    return 0
