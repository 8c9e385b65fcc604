"""`spark-lsp` console entry point: a thin argparse dispatcher over spark_lsp.commands.*.

Each subcommand lives in its own module and imports the engine lazily, so `spark-lsp --help`
and `spark-lsp serve` start fast and torch/transformers are never imported at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

import importlib
import sys

from . import __version__

# Subcommand modules, in the order `--help` lists them.
COMMANDS = (
    "serve",
    "demo",
    "editor",
    "models",
    "engine",
    "generate",
    "eval",
    "tune",
    "wafer",
    "bench",
)


DESCRIPTION = (
    "AI inline completions and code-action edits for VS Code and Neovim, from a local model."
)
EPILOG = """first steps:
  spark-lsp demo                 see it work in the terminal (bundled demo model)
  spark-lsp editor vscode        install the VS Code extension
  spark-lsp editor neovim        print the Neovim setup for this installation
  spark-lsp serve --model DIR    the server an editor starts, on a model of your own
  spark-lsp COMMAND --help       the options of one command"""


def version() -> str:
    """This installation's version (the package metadata, else the source tree's)."""
    from importlib import metadata  # not on the bridge's way (`serve --shared` imports little)

    try:
        return metadata.version("spark-lsp")
    except metadata.PackageNotFoundError:
        return __version__


def build_parser() -> argparse.ArgumentParser:
    import argparse  # here, not on `serve --shared`'s way (see main)

    parser = argparse.ArgumentParser(
        prog="spark-lsp",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"spark-lsp {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"spark_lsp.commands.{name}").register(sub)
    return parser


def foreign_engine() -> str | None:
    """Why the importable ``engine`` package is not spark-lsp's own (None when it is).

    spark-lsp installs its runtime as the top-level package ``engine``; another distribution
    with a package of that name, earlier on the path or installed over it, would otherwise fail
    with an obscure import error inside whichever command runs first.
    """
    import importlib.util

    spec = importlib.util.find_spec("engine")
    if spec is None:
        return "the 'engine' package is not installed (reinstall spark-lsp)"
    engine = importlib.import_module("engine")  # cheap: its public names load lazily
    if getattr(engine, "DISTRIBUTION", None) != "spark-lsp":
        where = spec.origin or ", ".join(spec.submodule_search_locations or []) or "?"
        return (
            f"the 'engine' package imported from {where} is not spark-lsp's engine "
            "(another installed package uses the name 'engine'); install spark-lsp in its own "
            "virtual environment, e.g. `pipx install spark-lsp`, or uninstall the other package"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["serve"] and "--help" not in args and "-h" not in args:
        from . import bridge

        if bridge.wants_bridge(args[1:]):  # `serve --stdio --shared`: nothing else is imported
            return bridge.argv_main(args[1:])
    problem = foreign_engine()
    if problem:
        print(f"spark-lsp: error: {problem}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
