"""The language server end to end with its engine in the engine service (setting `engine`).

A real `spark-lsp serve` over stdio (pytest-lsp, as tests/server does) on the tiny model, its
engine a real daemon (`engine.service.daemon`) in another process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_hub import FakeHub
from lsprotocol import types as T
from service_support import editor_client, run_dir  # noqa: F401 (run_dir: a fixture)

from engine.service import manage, rundir

_editor = editor_client()
SAMPLE, start_editor = _editor.SAMPLE, _editor.start_editor

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
URI = "file:///work/sample.py"


def start_daemon(model: Path, *args: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.service.daemon", "--model", str(model), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    key = rundir.model_key([model])
    for _ in range(2400):
        rec = rundir.read_record(key)
        if rec is not None and rec["pid"] == proc.pid:
            return proc, rec
        assert proc.poll() is None
        time.sleep(0.05)
    raise AssertionError("no daemon record")


def free_url() -> tuple[int, str]:
    """A free loopback port and the ws:// URL of a daemon there (started again at the same one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return port, f"ws://127.0.0.1:{port}"


def stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(600):
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # not our child (started by a server): wait for it to go
            if not rundir.pid_alive(pid):
                return
        time.sleep(0.05)


def engine_libraries(pid: int) -> list[str]:
    """ONNX Runtime's shared libraries mapped into process `pid` (none in a thin client)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if "onnxruntime" in line.split()[-1]})


async def suggestions(ed, offsets: list[int]) -> list[list[str]]:
    out = []
    for off in offsets:
        res = await ed.inline(URI, off)
        out.append([i.insert_text for i in res.items])
    return out


async def close(clients, pids=()) -> None:
    """Shut the editors' servers down, then stop the daemons they used."""
    for client in clients:
        await client.shutdown_session()
        await client.stop()
    for pid in pids:
        stop(pid)


OFFSETS = [SAMPLE.index(s) + len(s) for s in ("total = add(", "out.append(", "def scale(")]


async def test_completions_over_a_daemon_are_those_of_the_local_engine(tiny_llama, run_dir):
    proc, rec = start_daemon(tiny_llama)
    try:
        local, led = await start_editor(tiny_llama)
        led.open(URI, SAMPLE)
        expected = await suggestions(led, OFFSETS)
        assert led.status[-1]["engine"] == "in-process"
        local_libraries = engine_libraries(local._server.pid)
        await local.shutdown_session()
        await local.stop()

        client, ed = await start_editor(tiny_llama, {"engine": rec["url"]})
        try:
            ed.open(URI, SAMPLE)
            assert await suggestions(ed, OFFSETS) == expected
            assert ed.status[-1]["engine"] == f"engine service {rec['url']}"
            # a thin client: the engine runtime is the daemon's, never loaded in the server
            assert engine_libraries(client._server.pid) == []
            assert local_libraries != []  # what the check finds in an in-process server
            # typing-through and cancel work as in-process
            await ed.command("spark.configure", {"maxTokens": 300, "maxLines": 200})
            off = ed.type(URI, OFFSETS[0], "")
            mid, fut = ed.start_inline(URI, off, T.InlineCompletionTriggerKind.Invoked)
            await asyncio.sleep(0.01)
            ed.client.protocol.notify("$/cancelRequest", T.CancelParams(id=mid))
            try:
                await fut
            except Exception:
                pass
            assert isinstance(await ed.inline(URI, off), T.InlineCompletionList)
        finally:
            await client.shutdown_session()
            await client.stop()
    finally:
        stop(proc.pid)


async def test_auto_starts_one_daemon_that_two_servers_share_and_survives_its_death(
    tiny_llama, run_dir
):
    key = rundir.model_key([tiny_llama])
    a, ea = await start_editor(tiny_llama, {"engine": "auto"})
    b, eb = await start_editor(tiny_llama, {"engine": "auto"})
    pids = []
    try:
        rec = rundir.read_record(key)
        assert rec is not None  # the first server started it, the second joined it
        pids.append(rec["pid"])
        ea.open(URI, SAMPLE)
        eb.open(URI, SAMPLE)
        first = await suggestions(ea, OFFSETS[:1])
        assert await suggestions(eb, OFFSETS[:1]) == first
        assert rundir.read_record(key)["pid"] == rec["pid"]

        os.kill(rec["pid"], signal.SIGKILL)  # the daemon dies
        for _ in range(100):
            if not rundir.pid_alive(rec["pid"]):
                break
            await asyncio.sleep(0.05)
        answers = []
        for _ in range(4):  # the first request may fail (the editor is told), then a new daemon
            try:
                answers.append(await suggestions(ea, OFFSETS[:1]))
            except Exception as exc:  # noqa: BLE001 - the one failure the server reports
                answers.append(exc)
            if answers[-1] == first:
                break
        assert answers[-1] == first, answers
        health = [s for s in ea.status if s.get("kind") == "health"]
        if health:  # a request failed on the dead daemon: the status bar was told, then untold
            assert health[0]["error"] and health[-1]["error"] is None, health
        new = rundir.read_record(key)
        assert new is not None and new["pid"] != rec["pid"]
        pids.append(new["pid"])
    finally:
        await close((a, b), pids)


async def test_auto_with_a_hub_model_downloads_it_here_and_its_daemon_serves_it(
    tiny_llama, run_dir, tmp_path, monkeypatch
):
    """`--model hf:ORG/REPO` (or a catalogue name) with `engine: auto`: the server resolves the
    name (downloading into the Hub cache, with the editor's progress reports), stays thin, and
    the daemon it starts serves that folder, which both name by its repository."""
    with FakeHub() as hub:
        hub.add_folder("test-org/tiny-llama", tiny_llama)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        client, ed = await start_editor("hf:test-org/tiny-llama", {"engine": "auto"})
        pids = []
        try:
            downloads = [
                r
                for rs in client.progress_reports.values()
                for r in rs
                if isinstance(r, T.WorkDoneProgressReport)
                and (r.message or "").startswith("downloading")
            ]
            assert downloads and downloads[-1].percentage == 100
            snapshots = list((tmp_path / "hub").glob("models--test-org--tiny-llama/snapshots/*"))
            assert len(snapshots) == 1
            rec = rundir.read_record(rundir.model_key([snapshots[0].resolve()]))
            assert rec is not None  # the daemon serves the downloaded folder
            pids.append(rec["pid"])
            ed.open(URI, SAMPLE)
            assert isinstance(await ed.inline(URI, OFFSETS[0]), T.InlineCompletionList)
            metrics = await ed.metrics()
            assert metrics["model"] == "tiny-llama"
            assert metrics["engine"]["connected"] and metrics["engine"]["engine"] == rec["url"]
            assert engine_libraries(client._server.pid) == []  # resolving loaded no runtime
        finally:
            await close([client], pids)


def start_hub_daemon(spec: str, hub_cache: Path) -> tuple[subprocess.Popen, dict]:
    """A daemon started with a Hub model (`--model hf:…`, downloaded into `hub_cache`), once
    its record is written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.service.daemon", "--model", spec],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_CACHE": str(hub_cache)},
    )
    repo = "models--" + spec.removeprefix("hf:").replace("/", "--")
    for _ in range(2400):
        snaps = list(hub_cache.glob(f"{repo}/snapshots/*"))
        rec = rundir.read_record(rundir.model_key(snaps)) if snaps else None
        if rec is not None and rec["pid"] == proc.pid:
            return proc, rec
        assert proc.poll() is None
        time.sleep(0.05)
    raise AssertionError("no daemon record")


async def test_a_given_daemon_sends_its_models_tokenizer_so_this_machine_needs_no_model(
    tiny_llama, run_dir, tmp_path, monkeypatch
):
    """`engine: ws://…` to a daemon serving a Hub model: the language server has neither the
    model nor the Hub (offline, an empty Hub cache), and gets the model's configuration and
    tokenizer from the daemon, cached by their digest; `model` names it as the daemon does, or
    is left unset (the daemon's model).  Suggestions are the in-process engine's."""
    local, led = await start_editor(tiny_llama)
    try:
        led.open(URI, SAMPLE)
        expected = await suggestions(led, OFFSETS)
    finally:
        await local.shutdown_session()
        await local.stop()
    with FakeHub() as hub:
        hub.add_folder("test-org/tiny-llama", tiny_llama)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        proc, rec = start_hub_daemon("hf:test-org/tiny-llama", tmp_path / "daemon-hub")
    try:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "editor-hub"))
        monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path / "editor-cache"))
        for model in ("hf:test-org/tiny-llama", None):
            client, ed = await start_editor(model, {"engine": rec["url"]})
            try:
                ed.open(URI, SAMPLE)
                assert await suggestions(ed, OFFSETS) == expected
                metrics = await ed.metrics()
                assert metrics["model"] == "tiny-llama" and metrics["engine"]["connected"]
                assert engine_libraries(client._server.pid) == []
            finally:
                await close([client])
        assert not (tmp_path / "editor-hub").exists() or not any(
            (tmp_path / "editor-hub").iterdir()
        )
        [folder] = (tmp_path / "editor-cache" / "served").iterdir()
        assert (folder / "tokenizer.json").read_bytes() == (
            tiny_llama / "tokenizer.json"
        ).read_bytes()
    finally:
        stop(proc.pid)


async def test_auto_with_a_gguf_model_suggests_what_it_does_in_process(
    tiny_llama, run_dir, tmp_path
):
    """`--model FILE.gguf` with `engine: auto`: the server reads the file's tokenizer and
    configuration (no runtime: it stays thin) and its daemon suggests what the in-process engine
    does with that file."""
    from gguf_files import write_gguf

    gguf = write_gguf(tiny_llama, tmp_path / "tiny-llama-q8_0.gguf", qtype="Q8_0")
    local, led = await start_editor(gguf)
    try:
        led.open(URI, SAMPLE)
        expected = await suggestions(led, OFFSETS)
    finally:
        await local.shutdown_session()
        await local.stop()
    client, ed = await start_editor(gguf, {"engine": "auto"})
    pids = []
    try:
        rec = rundir.read_record(rundir.model_key([gguf.resolve()]))
        assert rec is not None
        pids.append(rec["pid"])
        ed.open(URI, SAMPLE)
        assert await suggestions(ed, OFFSETS) == expected
        assert engine_libraries(client._server.pid) == []
        metrics = await ed.metrics()
        assert metrics["model"] == "tiny-llama-q8_0" and metrics["engine"]["connected"]
        # the same daemon as a given one, with no model here: it sends the tokenizer it made
        # from the file's header, which suggests the same
        remote, red = await start_editor(None, {"engine": rec["url"]})
        try:
            red.open(URI, SAMPLE)
            assert await suggestions(red, OFFSETS) == expected
            assert (await red.metrics())["model"] == "tiny-llama-q8_0"
        finally:
            await close([remote])
    finally:
        await close([client], pids)


def test_engine_serve_takes_a_hub_model(tiny_llama, run_dir, tmp_path, monkeypatch):
    """`spark-lsp engine serve --model hf:ORG/REPO` downloads and serves it, named by its
    repository; a name the Hub does not have is one line on stderr."""
    with FakeHub() as hub:
        hub.add_folder("test-org/tiny-llama", tiny_llama)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        proc, rec = start_hub_daemon("hf:test-org/tiny-llama", tmp_path / "hub")
        try:
            snaps = list((tmp_path / "hub").glob("models--test-org--tiny-llama/snapshots/*"))
            [svc] = [s for s in manage.services() if s.pid == proc.pid]
            assert svc.names == ["tiny-llama"] and svc.models == [str(snaps[0].resolve())]
        finally:
            stop(proc.pid)
        bad = subprocess.run(
            [sys.executable, "-m", "engine.service.daemon", "--model", "hf:test-org/missing"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert bad.returncode != 0
        assert "test-org/missing" in bad.stderr and "Traceback" not in bad.stderr


async def test_a_daemon_back_with_another_model_has_the_server_reload_it(
    tiny_llama, tiny_qwen2, run_dir
):
    """The daemon at the URL the server uses is replaced by one serving another model (other
    files): the server does not go on with the old tokenizer's ids but loads the model again,
    taking the new daemon's files, and suggests from it."""
    port, url = free_url()
    first, _ = start_daemon(tiny_llama, "--ws", f"127.0.0.1:{port}")
    pids = [first.pid]
    client, ed = await start_editor(None, {"engine": url})
    try:
        ed.open(URI, SAMPLE)
        assert isinstance(await ed.inline(URI, OFFSETS[0]), T.InlineCompletionList)
        assert (await ed.metrics())["model"] == "tiny_llama"
        stop(first.pid)
        second, _ = start_daemon(tiny_qwen2, "--ws", f"127.0.0.1:{port}")
        pids.append(second.pid)
        for _ in range(100):
            with contextlib.suppress(Exception):  # the requests while it reconnects and reloads
                await ed.inline(URI, OFFSETS[1])
            if (await ed.metrics())["model"] == "tiny_qwen2":
                break
            await asyncio.sleep(0.2)
        metrics = await ed.metrics()
        assert metrics["model"] == "tiny_qwen2" and metrics["engine"]["connected"], metrics
        assert isinstance(await ed.inline(URI, OFFSETS[2]), T.InlineCompletionList)
        # a warning says why; the service answered all along, so no "unavailable" was shown
        said = [m.message for m in client.messages]
        assert [m for m in said if "now serves tiny_qwen2" in m] and not [
            m for m in said if "unavailable" in m
        ], said
        told = [s for s in ed.status if s.get("kind") == "health"]
        assert not told or told[-1]["error"] is None, told
    finally:
        await close([client], pids)


async def test_a_daemon_gone_and_back_is_shown_in_the_editors_status(tiny_llama, run_dir):
    """The editor's status bar learns that the engine service stopped answering (a `spark/status`
    of kind "health" with the reason) and, once a daemon answers at the URL again, that it
    does (the same, `error` null); the request that found it gone failed with the reason."""
    port, url = free_url()
    first, _ = start_daemon(tiny_llama, "--ws", f"127.0.0.1:{port}")
    pids = [first.pid]
    client, ed = await start_editor(tiny_llama, {"engine": url})

    async def health() -> list[dict]:
        await ed.metrics()  # a round trip: notifications sent before its answer have arrived
        return [s for s in ed.status if s.get("kind") == "health"]

    try:
        ed.open(URI, SAMPLE)
        expected = await suggestions(ed, OFFSETS[:1])
        assert await health() == []
        stop(first.pid)
        with pytest.raises(Exception, match="engine service"):
            await ed.inline(URI, OFFSETS[0])
        told = await health()
        assert len(told) == 1 and told[0]["engine"] == f"engine service {url}", told
        assert "unavailable" in told[0]["error"], told
        second, _ = start_daemon(tiny_llama, "--ws", f"127.0.0.1:{port}")
        pids.append(second.pid)
        assert await suggestions(ed, OFFSETS[:1]) == expected
        told = await health()
        assert len(told) == 2 and told[1]["error"] is None, told
    finally:
        await close([client], pids)


async def test_unreachable_engine_falls_back_to_the_local_engine(tiny_llama, run_dir):
    client, ed = await start_editor(tiny_llama, {"engine": "ws://127.0.0.1:9"})
    try:
        ed.open(URI, SAMPLE)
        res = await ed.inline(URI, OFFSETS[0])
        assert isinstance(res, T.InlineCompletionList)
        m = await ed.metrics()
        assert m["loaded"]
        # the editor is told, once, where the model runs instead
        told = [x.message for x in client.messages if "engine service" in x.message]
        assert len(told) == 1 and "ws://127.0.0.1:9 is unavailable" in told[0], told
    finally:
        await client.shutdown_session()
        await client.stop()


def test_servers_of_one_process_on_one_daemon_model_share_its_tokenizer(tiny_llama):
    """A session host's sessions with `engine: auto` build prompts with one copy of the model's
    tokenizer (~40 MB at a 150k vocabulary), freed when no session holds it."""
    import gc
    import weakref

    from spark_lsp.backends.engine_ws import shared_model

    def shared_tokenizer(folder):
        return shared_model(folder)[0]

    from engine.config import load_config

    a = shared_tokenizer(tiny_llama)
    assert shared_tokenizer(tiny_llama.parent / "." / tiny_llama.name) is a
    assert shared_model(tiny_llama)[1] == load_config(tiny_llama)
    assert a.encode("def f(x):\n") == shared_tokenizer(tiny_llama).encode("def f(x):\n")
    gone = weakref.ref(a)
    del a
    gc.collect()
    assert gone() is None
