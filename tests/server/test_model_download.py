"""`--model hf:ORG/REPO`: the server downloads the model on first use from a (fake, local) Hub and
reports the download to the editor through the loading progress ($/progress reports with byte
counts and percentages); a missing repository is a clear error in the editor, not a crash."""

from __future__ import annotations

import asyncio

from conftest import start_editor
from fake_hub import FakeHub
from lsprotocol import types as T


async def test_hf_model_is_downloaded_with_progress_reports(tiny_llama, tmp_path, monkeypatch):
    with FakeHub() as hub:
        hub.add_folder("test-org/tiny-llama", tiny_llama)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        client, ed = await start_editor("hf:test-org/tiny-llama")
        try:
            reports = [r for rs in client.progress_reports.values() for r in rs]
            begin = [r for r in reports if isinstance(r, T.WorkDoneProgressBegin)]
            steps = [
                r
                for r in reports
                if isinstance(r, T.WorkDoneProgressReport)
                and (r.message or "").startswith("downloading")
            ]
            assert any("hf:test-org/tiny-llama" in (b.message or "") for b in begin)
            assert steps and all("test-org/tiny-llama" in s.message for s in steps)
            assert steps[-1].percentage == 100
            assert [s.percentage for s in steps] == sorted(s.percentage for s in steps)
            assert (await ed.metrics())["model"]
            assert any(p.endswith("/model.safetensors") for m, p, _ in hub.requests if m == "GET")
        finally:
            await client.shutdown_session()
            await client.stop()


async def test_model_without_fim_tokens_is_told_to_the_user(tiny_llama, tmp_path):
    """A model whose tokenizer has no FIM tokens loads; the editor is told inline completions need
    a FIM model (code actions still work)."""
    from tiny_models import copy_model

    folder = copy_model(tiny_llama, tmp_path / "no_fim")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            for i, tok in enumerate(("<fim_prefix>", "<fim_suffix>", "<fim_middle>")):
                text = text.replace(tok, f"<unused_{i}>")
            path.write_text(text, encoding="utf-8")
    client, ed = await start_editor(folder)
    try:
        for _ in range(50):
            if client.messages:
                break
            await asyncio.sleep(0.1)
        warnings = [m for m in client.messages if m.type == T.MessageType.Warning]
        assert len(warnings) == 1 and "no fill-in-the-middle tokens" in warnings[0].message
        assert "Code actions still work" in warnings[0].message
    finally:
        await client.shutdown_session()
        await client.stop()


async def test_server_serves_a_gguf_file(tiny_llama, tmp_path):
    """`--model file.gguf`: the server loads a GGUF file and completes with it."""
    from gguf_files import write_gguf

    path = write_gguf(tiny_llama, tmp_path / "tiny-llama-q8_0.gguf", qtype="Q8_0")
    client, ed = await start_editor(path)
    try:
        metrics = await ed.metrics()
        assert metrics["model"] == "tiny-llama-q8_0"
        uri = "file:///proj/m.py"
        ed.open(uri, "def add(a, b):\n    return ")
        out = await ed.inline(uri, len(ed.text(uri)), T.InlineCompletionTriggerKind.Invoked)
        assert out is not None
    finally:
        await client.shutdown_session()
        await client.stop()
