"""Wafer projection: what a model's layout would reach on a wafer-scale chip (analytic, no engine).

- :mod:`.chips` — WSE-2 / WSE-3 and custom chip specs
- :mod:`.placement` — layer-pipelined regions, SRAM budget, multi-wafer cuts
- :mod:`.perfmodel` — analytic decode / TTFT projection, calibrated to WaferLLM
- :mod:`.simulator` — discrete mesh simulator of one layer's decode step
- :mod:`.draw` — the wafer picture

Nothing here runs a model, and the engine's runtime core never imports this package; the server's
status-bar figure comes from :func:`project_model`, ``spark-lsp wafer`` plans with
:func:`engine.projection.perfmodel.plan`.
"""

from .chips import ChipError, load_chip
from .perfmodel import project_model
from .placement import PlacementError

__all__ = ["ChipError", "PlacementError", "load_chip", "project_model"]
