"""`--model hf:ORG/REPO`: the server downloads the model on first use from a (fake, local) Hub and
reports the download to the editor through the loading progress ($/progress reports with byte
counts and percentages); a missing repository is a clear error in the editor, not a crash."""

from __future__ import annotations

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
            steps = [r for r in reports if isinstance(r, T.WorkDoneProgressReport)]
            assert any("hf:test-org/tiny-llama" in (b.message or "") for b in begin)
            assert steps and all("downloading" in (s.message or "") for s in steps)
            assert steps[-1].percentage == 100
            assert [s.percentage for s in steps] == sorted(s.percentage for s in steps)
            assert (await ed.metrics())["model"]
            assert any(p.endswith("/model.safetensors") for m, p, _ in hub.requests if m == "GET")
        finally:
            await client.shutdown_session()
            await client.stop()
