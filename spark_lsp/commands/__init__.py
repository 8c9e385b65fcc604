"""One module per CLI subcommand; each exposes ``register(subparsers)`` and keeps heavy imports inside its run function."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse type: an integer above 0 (counts: `wafer --max-wafers`, `engine serve --replicas`)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return v
