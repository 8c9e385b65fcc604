"""Engine.load's background work: the weights' digest runs on a thread of its own."""

from __future__ import annotations

import pytest

from engine.config import ModelError
from engine.engine import _in_background


def test_a_background_result_and_error_reach_the_caller():
    assert _in_background(lambda: 41 + 1).result(5) == 42

    def broken():
        raise ModelError("model.safetensors: file not found")

    with pytest.raises(ModelError, match="file not found"):
        _in_background(broken).result(5)
