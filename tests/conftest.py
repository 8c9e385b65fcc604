"""Shared fixtures: tiny model folders built once per test session (see tests/tiny_models.py).

Fixtures (session-scoped, each a ``pathlib.Path`` to a HF model folder; treat them as read-only —
copy with ``tiny_models.copy_model`` before corrupting):

- ``tiny_models``  dict ``{"llama": Path, "qwen2": Path, "mistral": Path}``
- ``tiny_llama``   fp32, tied embeddings
- ``tiny_qwen2``   fp32, q/k/v biases, untied
- ``tiny_mistral`` fp32, GQA 8 heads / 2 kv heads, untied

Set ``SPARK_LSP_TINY_MODELS=/some/dir`` to keep the built folders between sessions (debugging).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so tests can `import tiny_models`

import tiny_models as _tm  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> Path:
    keep = os.environ.get("SPARK_LSP_TINY_MODELS")
    return Path(keep) if keep else tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_models(tiny_models_dir) -> dict[str, Path]:
    paths = {a: tiny_models_dir / f"tiny_{a}" for a in _tm.ARCHS}
    if all(
        (p / "model.safetensors").is_file() and (p / "tokenizer.json").is_file()
        for p in paths.values()
    ):
        return paths
    _tm.require_reference()
    return _tm.build_all(tiny_models_dir)


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models) -> Path:
    return tiny_models["qwen2"]


@pytest.fixture(scope="session")
def tiny_mistral(tiny_models) -> Path:
    return tiny_models["mistral"]


try:  # property tests: a fixed seed and a bounded number of examples, so CI is fast and repeatable
    from hypothesis import HealthCheck
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile(
        "ci",
        derandomize=True,
        max_examples=60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    _hyp_settings.register_profile(
        "long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    _hyp_settings.load_profile(os.environ.get("SPARK_LSP_HYPOTHESIS", "ci"))
except ImportError:  # the test extra installs it; without it only the property tests are skipped
    pass
