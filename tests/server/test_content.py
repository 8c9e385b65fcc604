"""Content checks with the bundled model (skipped when it is not installed): the suggestions and
edits must make sense, not only follow the protocol."""

from __future__ import annotations

import pytest

from spark_lsp.rpc_client import LspClient, server_cmd


def _bundled():
    try:
        from engine.models import default_model_dir

        return default_model_dir()
    except Exception:
        return None


MODEL = _bundled()
pytestmark = [
    pytest.mark.skipif(MODEL is None, reason="no bundled model installed"),
    pytest.mark.slow,
]

SRC = '''import os


def add(a, b):
    """Return the sum of a and b."""
    return a


def read_lines(path):
    with open(path) as f:
        return f.read().splitlines()


def count_words(text):
    words = text.split()
    return len(words)
'''
URI = "file:///content/sample.py"


@pytest.fixture(scope="module", params=["fp32", "int8", "int4"])
def client(request):
    """The server on the bundled model at each precision it ships with (they decode apart)."""
    c = LspClient(server_cmd(str(MODEL)))
    # every suggestion: these tests judge them
    c.initialize({"liveEdits": False, "minConfidence": 0, "precision": request.param})
    assert c.wait_ready()["engine"]["precision"] == request.param
    c.open(URI, SRC)
    yield c
    c.shutdown()


def test_completes_an_obvious_line(client):
    off = SRC.index("    return a\n") + len("    return a")
    items = client.inline(URI, off, trigger=1).result(120)["items"]
    assert items, "no suggestion"
    assert any("b" in it["insertText"] and "\n" not in it["insertText"] for it in items), items


def test_typing_through_real_suggestion(client):
    text = SRC.replace("        return f.read().splitlines()\n", "        return f.\n")
    uri = URI + ".tt"
    client.open(uri, text)
    off = text.index("        return f.") + len("        return f.")
    items = client.inline(uri, off).result(120)["items"]
    assert items and len(items[0]["insertText"]) >= 2, items
    sug = items[0]["insertText"]
    before = client.call("spark/metrics", {})
    off = client.type_text(uri, off, sug[0])
    again = client.inline(uri, off).result(60)["items"]
    after = client.call("spark/metrics", {})
    assert again and again[0]["insertText"] == sug[1:]
    assert after["modelCalls"] == before["modelCalls"]


def test_docstring_action_writes_a_docstring(client):
    line = SRC.splitlines().index("def count_words(text):")
    pos = {"line": line + 1, "character": 4}
    acts = client.call(
        "textDocument/codeAction",
        {
            "textDocument": {"uri": URI},
            "range": {"start": pos, "end": pos},
            "context": {"diagnostics": []},
        },
    )
    act = next(a for a in acts if (a.get("data") or {}).get("action") == "docstring")
    edit = client.call("codeAction/resolve", act, 120)["edit"]["changes"][URI]
    assert len(edit) == 1 and edit[0]["range"]["start"]["line"] == line + 1
    new = edit[0]["newText"]
    assert new.startswith('    """') and new.rstrip().endswith('"""') and len(new.strip('" \n')) > 5
