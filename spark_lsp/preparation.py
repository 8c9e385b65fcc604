"""What loading a model does, told as it happens: the first load of a model builds its ONNX graph,
may compile the native wafer op, chooses a precision and may download the model; each takes
seconds, and a user who sees nothing for ten seconds thinks the tool hangs.

The engine reports these steps on its logger (INFO); `reporting` forwards them, with the seconds
since the load began, to a callback: the CLI prints them, the server puts them in the editor's
progress indicator (`$/progress`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ENGINE_LOGGER = "engine"


class _Forward(logging.Handler):
    def __init__(self, report: Callable[[str], None], t0: float) -> None:
        super().__init__(logging.INFO)
        self.report, self.t0 = report, t0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.report(f"{time.perf_counter() - self.t0:5.1f} s  {record.getMessage()}")
        except Exception:  # a report must never break the load
            self.handleError(record)


@contextmanager
def reporting(report: Callable[[str], None] | None) -> Iterator[None]:
    """While the block runs (a model load), the engine's steps go to `report(line)`."""
    if report is None:
        yield
        return
    logger = logging.getLogger(ENGINE_LOGGER)
    handler = _Forward(report, time.perf_counter())
    level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def print_steps(prefix: str = "spark-lsp") -> Callable[[str], None]:
    """A `reporting` callback for the command line: one line on stderr per step."""
    import sys

    def report(line: str) -> None:
        print(f"{prefix}: {line}", file=sys.stderr, flush=True)

    return report
