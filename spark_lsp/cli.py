"""`spark-lsp` console entry point: a thin argparse dispatcher over spark_lsp.commands.*.

Each subcommand lives in its own module and imports the engine lazily, so `spark-lsp --help`
and `spark-lsp serve` start fast and torch/transformers are never imported at run time.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `--help` lists them.
COMMANDS = ("serve", "engine", "generate", "eval", "tune", "wafer", "bench", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spark-lsp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"spark_lsp.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
