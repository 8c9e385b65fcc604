"""The installed top-level name ``engine``: a foreign package of that name is one clear error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spark_lsp(*argv: str, path: list[Path]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path))}
    code = "import sys; from spark_lsp.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        env=env,
        cwd=path[0],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_foreign_engine_package_is_named_at_cli_start(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text('"""Some other project\'s engine."""\n')
    res = spark_lsp("--help", path=[tmp_path, ROOT])  # the foreign one shadows ours
    assert res.returncode == 2
    assert res.stderr.startswith("spark-lsp: error: the 'engine' package imported from")
    assert str(tmp_path / "engine") in res.stderr and "Traceback" not in res.stderr


def test_our_engine_passes_the_check():
    res = spark_lsp("--help", path=[ROOT])
    assert res.returncode == 0 and "tune" in res.stdout
