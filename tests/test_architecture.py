"""The import layers of pyproject.toml hold (import-linter), and the check bites.

``lint-imports`` runs in CI (.ci/run) as well; running it here makes a plain ``pytest`` fail on an
upward import or an import cycle too.  The ``core-stays-core`` contract lists the runtime core's
modules one by one, so a test checks that the list names every one of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("lab", "projection", "service", "train")  # engine's packages above the core
LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
    "--no-logo",
    "--no-cache",
]


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(LINT, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_import_layers_hold():
    res = lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_the_core_contract_names_every_core_module():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    listed = next(c for c in config["contracts"] if c["id"] == "core-stays-core")["source_modules"]
    core = {"engine"} | {
        f"engine.{p.stem}" for p in (ROOT / "engine").glob("*.py") if p.stem != "__init__"
    }
    core |= {
        f"engine.{p.name}"
        for p in (ROOT / "engine").iterdir()
        if (p / "__init__.py").is_file() and p.name not in ROOMS
    }
    assert sorted(core) == sorted(listed), (
        "add new core modules to core-stays-core in pyproject.toml"
    )


@pytest.fixture
def copy_of_the_tree(tmp_path) -> Path:
    for name in ("engine", "spark_lsp"):
        shutil.copytree(
            ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("models", "__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "module, line, broken",
    [
        ("engine/graph.py", "from engine.lab import bench", "The runtime core never imports"),
        ("engine/runtime.py", "import spark_lsp.settings", "the engine never imports spark_lsp"),
        (
            "engine/projection/chips.py",
            "from engine.lab import tune",
            "sit above the wafer projection",
        ),
        ("engine/generate.py", "from . import engine", "No import cycle"),
        ("spark_lsp/settings.py", "from . import status", "No import cycle"),
        (
            "spark_lsp/inline.py",
            "from spark_lsp.bench import lsp",
            "The language server runs none of the benchmarks",
        ),
    ],
)
def test_a_violation_breaks_the_check(copy_of_the_tree, module, line, broken):
    path = copy_of_the_tree / module
    path.write_text(path.read_text() + f"\n{line}  # an injected violation\n")
    res = lint(copy_of_the_tree)
    assert res.returncode == 1, res.stdout + res.stderr
    assert broken in res.stdout.split("Broken contracts")[-1], res.stdout
