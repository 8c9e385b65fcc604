"""Models from the Hub (engine.hub, `spark-lsp models`) against a local fake Hub (tests/fake_hub.py)
that speaks what the installed huggingface_hub asks: only the engine's files are fetched, an
interrupted download resumes with a Range request, and a pulled model is used offline."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import graph_cache_dir, random_ids
from fake_hub import FakeHub
from gguf_files import write_gguf

from engine import Engine, ModelError
from engine import hub as H
from engine.config import load_config, model_name

REPO, GGUF_REPO = "test-org/tiny-qwen2", "test-org/tiny-qwen2-GGUF"
JUNK = {
    "README.md": b"# tiny\n",
    "pytorch_model.bin": b"\0" * 4096,
    "onnx/model.onnx": b"\0" * 1024,
}


@pytest.fixture(scope="module")
def gguf_files(tiny_qwen2, tmp_path_factory):
    d = tmp_path_factory.mktemp("hub_gguf")
    return {
        "tiny-qwen2-q8_0.gguf": write_gguf(tiny_qwen2, d / "q8.gguf", qtype="Q8_0").read_bytes(),
        "tiny-qwen2-f32.gguf": write_gguf(tiny_qwen2, d / "f32.gguf").read_bytes(),
    }


@pytest.fixture
def hub(tiny_qwen2, gguf_files, tmp_path, monkeypatch):
    with FakeHub() as fake:
        fake.add_folder(REPO, tiny_qwen2, extra=JUNK)
        fake.add_repo(GGUF_REPO, {**gguf_files, "README.md": b"gguf"})
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield fake


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "spark_lsp.cli", "models", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


def test_specs_parse():
    assert H.parse_spec("hf:Org/Repo") == H.HubSpec("Org/Repo")
    assert H.parse_spec("hf:Org/Repo@v1.0:model-Q8_0.gguf") == H.HubSpec(
        "Org/Repo", "v1.0", "model-Q8_0.gguf"
    )
    assert H.parse_spec("Org/Repo@abc") == H.HubSpec("Org/Repo", "abc")
    assert H.parse_spec("qwen2.5-coder-0.5b") == H.HubSpec("Qwen/Qwen2.5-Coder-0.5B")
    assert H.parse_spec("./some/folder") is None and H.parse_spec("/abs/model.gguf") is None
    with pytest.raises(ModelError, match="expected hf:ORG/REPO"):
        H.parse_spec("hf:not a repo")


def test_pull_fetches_only_the_engine_files_and_loads(hub, tiny_qwen2, tmp_path_factory):
    calls = []
    folder = H.resolve_model(
        f"hf:{REPO}", progress=lambda done, total, what: calls.append((done, total))
    )
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        p.name for p in tiny_qwen2.iterdir() if p.is_file() and H.wanted(p.name)
    )
    fetched = {p.rsplit("/", 1)[-1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p}
    assert "model.safetensors" in fetched and not fetched & {
        "README.md",
        "pytorch_model.bin",
        "model.onnx",
    }
    assert calls and calls[-1][0] == calls[-1][1] == sum(p.stat().st_size for p in folder.iterdir())
    assert all(b[0] >= a[0] for a, b in zip(calls, calls[1:]))
    cache = graph_cache_dir(tmp_path_factory)
    a, b = (
        Engine.load(folder, wafer=False, cache_dir=cache),
        Engine.load(tiny_qwen2, wafer=False, cache_dir=cache),
    )
    ids = random_ids(a, 24, seed=1)
    np.testing.assert_array_equal(a.forward_logits(ids), b.forward_logits(ids))
    # shown and chosen by the repository's name, not by the snapshot's commit hash
    assert folder.parent.name == "snapshots"
    assert a.name == a.tokenizer.name == "tiny-qwen2"


def test_a_remote_engines_client_fetches_no_weights_until_asked(hub, monkeypatch):
    """`weights=False` (a language server whose engine is a daemon elsewhere): the configuration
    and tokenizer alone, listed as such; a later full resolve fetches the weights into the same
    snapshot."""
    folder = H.resolve_model(f"hf:{REPO}", progress=lambda *a: None, weights=False)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "tokenizer.json"} <= names and not any(
        ".safetensors" in n for n in names
    )
    fetched = [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert fetched and not any(".safetensors" in p for p in fetched)
    [m] = H.list_models()
    assert not m.weights
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="models pull"):
        H.resolve_model(f"hf:{REPO}")  # offline, the weights cannot come: says how to get them
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert H.resolve_model(f"hf:{REPO}", progress=lambda *a: None) == folder
    assert (folder / "model.safetensors").is_file() and H.list_models()[0].weights


def test_tune_takes_a_hub_model(hub, tmp_path):
    """`spark-lsp tune --model hf:ORG/REPO` (or a catalogue name): the downloaded folder's
    decision, as the server looks it up for that model."""
    from engine.lab.tune import choose_precision

    choice = choose_precision(f"hf:{REPO}", measure=False, log_fn=lambda s: None)
    assert choice.precision in ("fp32", "int8", "int4", "int8-rowq")
    assert "no stored decision" in choice.reason


def test_wafer_plans_a_hub_model_or_a_gguf_from_its_config_alone(
    hub, tiny_qwen2, gguf_files, tmp_path
):
    """`spark-lsp wafer --model NAME`: the config.json alone is fetched (no weights); a GGUF
    file's header gives the same shape."""
    from dataclasses import replace

    from engine.projection.placement import load_shape

    want = replace(load_shape(tiny_qwen2), name="tiny-qwen2")
    assert load_shape(f"hf:{REPO}") == want
    fetched = [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert fetched and all(p.endswith("/config.json") for p in fetched)
    gguf = tmp_path / "tiny-qwen2.gguf"
    gguf.write_bytes(gguf_files["tiny-qwen2-q8_0.gguf"])
    assert load_shape(gguf) == want


def test_model_names():
    snap = Path("/c/hub/models--Qwen--Qwen2.5-Coder-0.5B/snapshots/1d3f0e2c9b")
    assert model_name(snap) == "Qwen2.5-Coder-0.5B"
    assert model_name(snap / "qwen2.5-coder-0.5b-q4_k_m.gguf") == "qwen2.5-coder-0.5b-q4_k_m"
    assert model_name("/models/my-model") == "my-model"
    assert model_name("/models/snapshots/abc") == "abc"  # not in a Hub cache's layout


def test_interrupted_download_resumes(hub, tiny_qwen2, monkeypatch):
    """A connection dropped mid-file is resumed with a Range request for the rest (huggingface_hub
    retries within the pull); the file is complete and correct."""
    from huggingface_hub import constants

    # the client writes whole read chunks (10 MB): smaller ones make this 0.7 MB file span several
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 << 10)
    data = (tiny_qwen2 / "model.safetensors").read_bytes()
    half = len(data) // 2
    hub.script["model.safetensors"] = [("cut", half)]
    folder = H.pull(REPO)
    ranges = [h.get("Range") or h.get("range") for h in hub.gets("model.safetensors")]
    assert len(ranges) == 2 and ranges[0] is None, ranges
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= half and resumed_at % (64 << 10) == 0
    assert (
        hashlib.sha256((folder / "model.safetensors").read_bytes()).digest()
        == hashlib.sha256(data).digest()
    )


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("spark-lsp models:")]


def test_failed_download_is_one_clear_line_and_leaves_nothing_half_done(hub, monkeypatch):
    hub.script["model.safetensors"] = [("error", 503)] * 20
    first = _cli("pull", REPO)
    assert first.returncode == 2
    assert len(_error_lines(first)) == 1 and "download failed" in _error_lines(first)[0]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="not downloaded yet"):
        H.resolve_model(f"hf:{REPO}")  # the partial snapshot is not taken for a model
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.script["model.safetensors"] = []
    second = _cli("pull", REPO)
    assert second.returncode == 0, second.stderr
    assert (Path(second.stdout.strip()) / "model.safetensors").is_file()


def test_offline_after_pull(hub, tmp_path):
    folder = Path(_cli("pull", REPO).stdout.strip())
    n = len(hub.requests)
    # no request at all when the model is cached, even with the Hub reachable
    assert H.resolve_model(f"hf:{REPO}") == folder and len(hub.requests) == n
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        assert H.resolve_model(f"hf:{REPO}") == folder
        with pytest.raises(ModelError, match="not downloaded yet and HF_HUB_OFFLINE is set"):
            H.resolve_model(f"hf:{GGUF_REPO}:Q8_0")
        info = H.model_info(f"hf:{REPO}")
        assert info.config == load_config(folder)
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    assert len(hub.requests) == n
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_lsp.cli",
            "generate",
            "--model",
            f"hf:{REPO}",
            "--prompt",
            "def f(x):",
            "--max-new-tokens",
            "4",
            "--no-wafer",
            "--precision",
            "fp32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "SPARK_LSP_CACHE": str(tmp_path / "c")},
    )
    assert gen.returncode == 0, gen.stderr
    assert len(hub.requests) == n


def test_gguf_repository_by_quantisation_tag(hub, gguf_files, tmp_path_factory):
    path = H.resolve_model(f"hf:{GGUF_REPO}:Q8_0")
    assert path.name == "tiny-qwen2-q8_0.gguf" and path.read_bytes() == gguf_files[path.name]
    # without a tag: llama.cpp's preference order (Q4_K_M, then Q8_0, ...)
    assert H.resolve_model(f"hf:{GGUF_REPO}").name == "tiny-qwen2-q8_0.gguf"
    eng = Engine.load(
        path, wafer=False, cache_dir=graph_cache_dir(tmp_path_factory), precision="auto"
    )
    assert eng.precision == "int8"
    with pytest.raises(ModelError, match="no .gguf file matches 'Q5_K_M'"):
        H.resolve_model(f"hf:{GGUF_REPO}:Q5_K_M")


def test_info_reads_only_the_config_or_the_gguf_header(hub, tiny_qwen2):
    out = _cli("info", REPO, "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    fetched = [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]
    assert fetched == [f"/{REPO}/resolve/main/config.json"] or all(
        p.endswith("config.json") for p in fetched
    )
    params, memory, kv = H.estimate(load_config(tiny_qwen2))
    assert (
        info["parameters"] == params
        and info["memory_bytes"] == memory
        and info["kv_bytes_per_token"] == kv
    )
    assert memory["int4"] < memory["int8"] < memory["fp32"]
    assert H.list_models() == []  # info downloads nothing into the cache
    text = _cli("info", f"hf:{GGUF_REPO}:Q8_0")
    assert text.returncode == 0, text.stderr
    assert "qwen2" in text.stdout and "int8 in the engine by default" in text.stdout
    ranged = [h.get("Range") or h.get("range") for h in hub.gets("tiny-qwen2-q8_0.gguf")]
    assert ranged and all(r and r.startswith("bytes=0-") for r in ranged)


def test_list_and_rm(hub):
    assert _cli("pull", REPO).returncode == 0
    assert _cli("pull", f"hf:{GGUF_REPO}:Q8_0").returncode == 0
    listed = json.loads(_cli("list", "--json").stdout)
    by_repo = {m["repo"]: m for m in listed["models"]}
    assert (
        by_repo[REPO]["architecture"] == "Qwen2ForCausalLM"
        and by_repo[GGUF_REPO]["precision"] == "int8"
    )
    assert {r["name"] for r in listed["catalogue"]} >= {
        "qwen2.5-coder-0.5b",
        "starcoder2-3b",
        "codegemma-2b",
    }
    assert "qwen2.5-coder-1.5b" in _cli("list").stdout
    rm = _cli("rm", REPO)
    assert rm.returncode == 0 and "removed" in rm.stdout
    assert {m["repo"] for m in json.loads(_cli("list", "--json").stdout)["models"]} == {GGUF_REPO}
    again = _cli("rm", REPO)
    assert again.returncode == 2 and "not in the model cache" in again.stderr


def test_token_is_sent_and_errors_are_one_line(hub):
    out = _cli("pull", REPO, env={"HF_TOKEN": "hf_secret_test_token"})
    assert out.returncode == 0, out.stderr
    assert any(
        h.get("authorization") == "Bearer hf_secret_test_token"
        or h.get("Authorization") == "Bearer hf_secret_test_token"
        for _, _, h in hub.requests
    )
    missing = _cli("pull", "test-org/nope")
    assert missing.returncode == 2
    assert len(_error_lines(missing)) == 1 and "repository not found" in missing.stderr


def test_unreachable_hub_is_named(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _cli(
        "pull",
        "qwen2.5-coder-0.5b",
        env={"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_CACHE": str(tmp_path / "c")},
    )
    assert out.returncode == 2
    assert len(_error_lines(out)) == 1 and "cannot reach the Hub at http://127.0.0.1" in out.stderr


def test_a_hub_spec_pinned_to_the_snapshot_it_resolved_to(tmp_path):
    snap = tmp_path / "models--test-org--tiny-qwen2" / "snapshots" / ("c" * 40)
    assert H.pinned_spec("hf:test-org/tiny-qwen2", snap) == f"hf:test-org/tiny-qwen2@{'c' * 40}"
    assert (
        H.pinned_spec("hf:test-org/tiny-qwen2-GGUF:Q8_0", snap / "q" / "m-q8_0.gguf")
        == f"hf:test-org/tiny-qwen2-GGUF@{'c' * 40}:q/m-q8_0.gguf"
    )
    entry = H.CATALOGUE["qwen2.5-coder-0.5b"]
    assert H.pinned_spec("qwen2.5-coder-0.5b", snap).startswith(f"hf:{entry.repo}@")
    assert H.pinned_spec(str(tmp_path), tmp_path) is None  # a local folder
    assert H.pinned_spec("hf:test-org/x", tmp_path / "elsewhere") is None
    pinned = H.parse_spec(H.pinned_spec("hf:o/r:Q8_0", snap / "m.gguf"))
    assert pinned == H.HubSpec("o/r", "c" * 40, "m.gguf")


def test_a_daemon_names_a_hub_gguf_by_its_file_not_its_blob(hub):
    """The Hub cache links a snapshot's file to a blob named by its hash: what a daemon is given
    (``launch.resolve_models``) keeps the file's name, which names the model."""
    from engine.service.launch import resolve_models

    [path] = resolve_models([f"hf:{GGUF_REPO}:Q8_0"])
    assert path.is_absolute() and path.name == "tiny-qwen2-q8_0.gguf"
    assert model_name(path) == "tiny-qwen2-q8_0"
    assert H.served_name(f"hf:{GGUF_REPO}:tiny-qwen2-q8_0.gguf") == model_name(path)
