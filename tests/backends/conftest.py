import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # fakes, gguf_models, llama_servers

from fakes import FakeServer  # noqa: E402


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()
