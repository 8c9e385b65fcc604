"""Where the bundled default model lives.

The model folder ships as package data (``engine/models/<name>/``), so it is found next to
this module both in a checkout and in an installed wheel.  ``SPARK_LSP_MODEL`` overrides it
(a path to any Hugging Face model folder), so every command that takes ``--model`` can be
pointed elsewhere without flags.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import ModelError

DEFAULT_MODEL_NAME = "spark-code-mini"
ENV_VAR = "SPARK_LSP_MODEL"


def bundled_model_dir() -> Path:
    """The folder of the model shipped with the package (may be absent in a broken install)."""
    return Path(__file__).resolve().parent / "models" / DEFAULT_MODEL_NAME


def default_model_dir() -> Path:
    """``$SPARK_LSP_MODEL`` if set, else the bundled model; raises ModelError if it is missing."""
    env = os.environ.get(ENV_VAR, "").strip()
    path = Path(env).expanduser() if env else bundled_model_dir()
    if not (path / "config.json").is_file():
        origin = f"${ENV_VAR}={env}" if env else "the bundled default model"
        raise ModelError(f"{path}: no config.json ({origin} is not a model folder)")
    return path
