"""spark-lsp inference engine: model folder -> ONNX decoder -> ONNX Runtime, with KV cache reuse.

The public names are imported lazily so that ``import engine.config`` (e.g. from a CLI parser)
does not load ONNX Runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: Marks this package as spark-lsp's engine: the top-level name ``engine`` is generic, and
#: ``spark_lsp.cli`` checks this before anything else so that another package of the same name
#: gives one clear error instead of an import failure deep inside a command.
DISTRIBUTION = "spark-lsp"

__all__ = [
    "CancelToken",
    "Cancelled",
    "Chunk",
    "Engine",
    "Generation",
    "GenerationParams",
    "ModelError",
]

_WHERE = {
    "CancelToken": "cancel",
    "Cancelled": "cancel",
    "Engine": "engine",
    "Generation": "generate",
    "GenerationParams": "params",
    "Chunk": "generate",
    "ModelError": "config",
}

if TYPE_CHECKING:
    from .cancel import Cancelled, CancelToken
    from .config import ModelError
    from .engine import Engine
    from .generate import Chunk, Generation
    from .params import GenerationParams


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
