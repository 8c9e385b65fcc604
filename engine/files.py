"""Write a small JSON record so that a concurrent reader never sees half of it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any, **dumps: Any) -> None:
    """Write ``data`` as JSON to a temporary name beside ``path`` and rename it into place (the
    temporary file is removed if anything fails); OSError propagates to the caller."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, **dumps))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
