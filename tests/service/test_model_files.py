"""A served model's prompt files (configuration, tokenizer, chat template) sent to a client:
``model_files`` over a real socket, the client's checks and its cache (engine.service.model_files).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import Engine
from engine.config import ModelError
from engine.service import model_files as MF
from engine.service import protocol as P
from engine.service.client_core import EngineRequestError
from engine.service.local import LocalModels
from engine.service.server import EngineServer
from engine.service.sync_client import SyncEngineClient
from engine.source import PROMPT_FILES, model_config, open_model, prompt_files

TOKEN = "t" * 32
TEXT = 'def greet(name):\n    return f"hello {name}!"  # ünïcode ✓\n'


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPARK_LSP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "served"


def serve(*engines):
    return EngineServer(LocalModels(list(engines)), token=TOKEN).open()


def test_a_client_gets_a_folder_models_files_in_chunks_and_caches_them(
    tiny_llama, cache, monkeypatch
):
    """The files arrive in chunks (a 1,000-character chunk here, so the tokenizer takes many),
    are exactly the folder's, are named by the digest ``hello`` announced, and load the same
    tokenizer and configuration; a second client finds them cached and asks for nothing."""
    monkeypatch.setattr(MF, "CHUNK_CHARS", 1000)
    eng = Engine.load(model_dir=tiny_llama)
    srv = serve(eng)
    try:
        client = SyncEngineClient.open(srv.url, TOKEN)
        try:
            info = client.hello["models"][0]
            sent = []
            real = client._apply
            monkeypatch.setattr(client, "_apply", lambda m: sent.append(m["type"]) or real(m))
            closing, files = client.model_files()
            assert closing["model"] == info["name"] == "tiny_llama"
            assert closing["digest"] == info["files"] == MF.files_digest(files)
            assert sent.count("model_file") > len(files) > 1  # chunked
            for name, text in files.items():
                assert text == (tiny_llama / name).read_text(encoding="utf-8")
            folder = MF.fetch(info["files"], lambda: files)
            assert folder == cache / info["files"]
            here, there = open_model(folder).tokenizer, eng.tokenizer
            assert here.encode(TEXT) == there.encode(TEXT)
            assert (here.eos_ids, here.bos_id, here.pad_id) == (
                there.eos_ids,
                there.bos_id,
                there.pad_id,
            )
            assert model_config(folder) == eng.config
            # cached: nothing is downloaded again
            assert MF.fetch(info["files"], lambda: pytest.fail("downloaded again")) == folder
        finally:
            client.close()
    finally:
        srv.close()


def test_a_gguf_models_files_load_the_tokenizer_and_configuration_of_the_file(
    tiny_llama, tmp_path, cache
):
    """A GGUF file holds no tokenizer.json: the service makes the files a folder would hold from
    its header, and they load what the file itself loads (vocabulary, special tokens, config,
    chat template)."""
    import tiny_models
    from gguf_files import write_gguf

    chat_model = tiny_models.copy_model(tiny_llama, tmp_path / "tiny-chat")
    cfg = json.loads((chat_model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    (chat_model / "tokenizer_config.json").write_text(json.dumps(cfg))
    gguf = write_gguf(chat_model, tmp_path / "tiny.gguf", qtype="Q8_0")
    src = open_model(gguf)
    files = prompt_files(gguf, src.tokenizer)
    assert set(files) <= set(PROMPT_FILES) and "tokenizer.json" in files
    folder = MF.fetch(MF.files_digest(files), lambda: files)
    got = open_model(folder)
    assert got.tokenizer.encode(TEXT) == src.tokenizer.encode(TEXT)
    assert got.tokenizer.decode(src.tokenizer.encode(TEXT)) == TEXT
    assert got.tokenizer.eos_ids == src.tokenizer.eos_ids
    assert (got.tokenizer.bos_id, got.tokenizer.pad_id) == (
        src.tokenizer.bos_id,
        src.tokenizer.pad_id,
    )
    assert got.tokenizer.vocab_size == src.tokenizer.vocab_size
    assert got.config == src.config
    assert src.tokenizer.chat["chat_template"] == cfg["chat_template"]
    assert src.tokenizer.chat["eos_token"] == src.tokenizer.id_to_token(
        sorted(src.tokenizer.eos_ids)[0]
    )
    assert got.tokenizer.chat == src.tokenizer.chat
    assert prompt_files(gguf) == files  # made the same way without a loaded tokenizer


def test_requests_the_service_cannot_answer_get_error_codes(tiny_llama, cache):
    eng = Engine.load(model_dir=tiny_llama)
    srv = serve(eng)
    try:
        client = SyncEngineClient.open(srv.url, TOKEN)
        try:
            with pytest.raises(EngineRequestError, match="unknown_model.*no model 'nope'"):
                client.model_files("nope")
            # the model's files changed on disk since the service loaded it: not sent
            srv.models.files._digests[str(eng.model_dir)] = "0" * 64
            with pytest.raises(EngineRequestError, match="unavailable.*changed on disk"):
                client.model_files()
            # the connection goes on serving
            assert client.status()["generations"] == 0
        finally:
            client.close()
    finally:
        srv.close()


def test_a_malformed_request_is_refused():
    for msg, code in (
        ({"type": "model_files"}, P.BAD_MESSAGE),
        ({"type": "model_files", "id": "f1", "model": 7}, P.BAD_MESSAGE),
    ):
        with pytest.raises(P.ProtocolError) as e:
            P.parse(msg)
        assert e.value.code == code
    assert P.parse({"type": "model_files", "id": "f1"}) == P.ModelFiles("f1", None)


@pytest.mark.parametrize(
    "chunk",
    [
        {"name": "../../.bashrc", "data": "x"},  # a path outside the cache
        {"name": "model.safetensors", "data": "x"},  # not a prompt file
        {"name": "tokenizer.json", "data": 7},
    ],
)
def test_a_client_refuses_files_that_are_not_a_models_prompt_files(chunk):
    with pytest.raises(MF.ModelFilesError):
        MF.Receiver().add({"type": "model_file", "id": "f1", **chunk})


def test_a_client_refuses_too_much_and_files_that_do_not_match_their_digest(monkeypatch, cache):
    monkeypatch.setattr(MF, "MAX_TOTAL_CHARS", 10)
    r = MF.Receiver()
    r.add({"name": "config.json", "data": "{}"})
    with pytest.raises(MF.ModelFilesError, match="more than 10"):
        r.add({"name": "tokenizer.json", "data": "x" * 9})
    r = MF.Receiver()
    r.add({"name": "config.json", "data": "{}"})
    good = MF.files_digest({"config.json": "{}"})
    assert r.finish({"files": ["config.json"], "digest": good}) == {"config.json": "{}"}
    with pytest.raises(MF.ModelFilesError, match="digest"):
        r.finish({"files": ["config.json"], "digest": "0" * 64})
    with pytest.raises(MF.ModelFilesError, match="digest"):
        r.finish({"files": ["config.json", "tokenizer.json"], "digest": good})
    # the cache takes nothing that is not what was named, and leaves nothing behind
    with pytest.raises(MF.ModelFilesError):
        MF.fetch("1" * 64, lambda: {"config.json": "{}"})
    with pytest.raises(MF.ModelFilesError):
        MF.fetch("../x", lambda: {"config.json": "{}"})
    assert not cache.exists() or list(cache.iterdir()) == []


def test_a_download_that_fails_leaves_no_folder(cache):
    files = {"config.json": json.dumps({"a": 1})}
    digest = MF.files_digest(files)

    def broken():
        raise ModelError("lost")

    with pytest.raises(ModelError):
        MF.fetch(digest, broken)
    assert MF.cached(digest) is None
    assert MF.fetch(digest, lambda: files) == cache / digest
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary left


def test_each_model_of_a_service_has_its_own_files(tiny_llama, tiny_qwen2, cache):
    """A daemon with two models: ``model`` chooses whose files come (unset: the first's), each
    named by the digest ``hello`` gave it."""
    srv = serve(Engine.load(model_dir=tiny_llama), Engine.load(model_dir=tiny_qwen2))
    try:
        client = SyncEngineClient.open(srv.url, TOKEN)
        try:
            digests = {m["name"]: m["files"] for m in client.hello["models"]}
            assert len(set(digests.values())) == 2
            for name, folder in (("tiny_llama", tiny_llama), ("tiny_qwen2", tiny_qwen2)):
                closing, files = client.model_files(name)
                assert closing["model"] == name and closing["digest"] == digests[name]
                assert files["tokenizer.json"] == (folder / "tokenizer.json").read_text()
            assert client.model_files()[0]["model"] == "tiny_llama"
        finally:
            client.close()
    finally:
        srv.close()


def test_the_server_model_takes_the_daemons_model_by_its_name(
    tiny_llama, tiny_qwen2, cache, monkeypatch
):
    """`engine: ws://…`: `model` chooses among the daemon's models by the name the daemon gives
    them (its tokenizer then comes from the daemon); unset, the daemon's first. No in-process
    fallback then: this machine does not have that model."""
    from engine import GenerationParams
    from engine.cancel import CancelToken
    from spark_lsp.backends import engine_ws

    srv = serve(Engine.load(model_dir=tiny_llama), Engine.load(model_dir=tiny_qwen2))
    monkeypatch.setenv(engine_ws.TOKEN_ENV, TOKEN)
    local = open_model(tiny_qwen2).tokenizer
    try:
        for spec, name in (("/elsewhere/tiny_qwen2", "tiny_qwen2"), (None, "tiny_llama")):
            model = engine_ws.EngineServiceModel(srv.url, spec, fallback=lambda: pytest.fail())
            try:
                assert model.name == name and model.model_dir.parent == cache
                assert model._fallback is None
                if name == "tiny_qwen2":
                    assert model.tokenizer.encode(TEXT) == local.encode(TEXT)
                    assert model.config == model_config(tiny_qwen2)
                ids = model.tokenizer.encode("def f(x):\n")
                params = GenerationParams(max_new_tokens=3, ignore_eos=True)
                pieces = list(model.generate(ids, params, "doc", cancel=CancelToken()))
                assert pieces
            finally:
                model.close()
    finally:
        srv.close()


def test_folders_unused_for_a_month_are_removed_by_the_next_download(cache):
    import os
    import time

    old_files, new_files = {"config.json": "{}"}, {"config.json": '{"a": 1}'}
    old = MF.fetch(MF.files_digest(old_files), lambda: old_files)
    month_ago = time.time() - (MF.UNUSED_DAYS + 1) * 86400
    os.utime(old, (month_ago, month_ago))
    stale_tmp = cache / ".abc-123"
    stale_tmp.mkdir()
    os.utime(stale_tmp, (month_ago, month_ago))
    mine = cache / "not-a-digest"
    mine.mkdir()
    os.utime(mine, (month_ago, month_ago))
    # used since: kept
    used = MF.fetch(MF.files_digest(old_files), lambda: pytest.fail("cached"))
    assert used == old and old.stat().st_mtime > month_ago
    os.utime(old, (month_ago, month_ago))
    new = MF.fetch(MF.files_digest(new_files), lambda: new_files)
    assert new.is_dir() and not old.exists() and not stale_tmp.exists()
    assert mine.exists()  # not the cache's


async def test_the_asyncio_connection_reads_the_files_off_its_event_loop(tiny_llama, cache):
    """The Ray ingress's connection (asyncio) makes the files on a worker thread and answers as
    the daemon does: the chunks and the closing message, or an error with the request's id."""
    import asyncio

    from engine.service.connection import Connection

    sent: list[dict] = []

    async def send(text: str) -> None:
        sent.append(json.loads(text))

    conn = Connection(LocalModels([Engine.load(model_dir=tiny_llama)]), send)
    try:
        await conn.handle(json.dumps({"type": "hello", "protocol": 1}))
        await conn.handle(json.dumps({"type": "model_files", "id": "f1"}))
        await conn.handle(json.dumps({"type": "model_files", "id": "f2", "model": "nope"}))
        for _ in range(500):
            ends = {m["id"]: m for m in sent if m["type"] in ("model_files", "error")}
            if {"f1", "f2"} <= set(ends):
                break
            await asyncio.sleep(0.01)
        assert ends["f2"]["type"] == "error" and ends["f2"]["code"] == P.UNKNOWN_MODEL
        receiver = MF.Receiver()
        for m in sent:
            if m["type"] == "model_file":
                receiver.add(m)
        files = receiver.finish(ends["f1"])
        assert files["tokenizer.json"] == (tiny_llama / "tokenizer.json").read_text()
    finally:
        await conn.close()


async def test_a_client_asking_again_and_again_without_reading_is_no_longer_read(tiny_llama, cache):
    """Each `model_files` waiting to be answered counts as an undelivered reply, and one is
    answered at a time: a client that sends request after request and reads nothing stops being
    read after CONTROL_WINDOW of them, with at most one set of files being read, rather than
    having the service read and hold the tokenizer once per request. Once it reads, every
    request is answered, in order."""
    import asyncio
    import threading

    from engine.service.connection import CONTROL_WINDOW, Connection

    reading = asyncio.Event()
    sent: list[dict] = []

    async def send(text: str) -> None:  # a client that reads nothing until `reading` is set
        msg = json.loads(text)
        if msg["type"] != "hello":
            await reading.wait()
        sent.append(msg)

    conn = Connection(LocalModels([Engine.load(model_dir=tiny_llama)]), send)
    busy, most, lock = [0], [0], threading.Lock()
    file_parts = conn._file_parts

    def counted(msg):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            return file_parts(msg)
        finally:
            with lock:
                busy[0] -= 1

    conn._file_parts = counted
    try:
        await conn.handle(json.dumps({"type": "hello", "protocol": 1}))
        handled = 0
        for i in range(3 * CONTROL_WINDOW):
            try:
                await asyncio.wait_for(
                    conn.handle(json.dumps({"type": "model_files", "id": f"f{i}"})), 2
                )
            except asyncio.TimeoutError:
                break
            handled += 1
        assert handled <= CONTROL_WINDOW, handled  # then the server stopped reading
        assert most[0] == 1
        reading.set()
        for _ in range(1000):
            ends = [m["id"] for m in sent if m["type"] == "model_files"]
            if len(ends) == handled:
                break
            await asyncio.sleep(0.01)
        assert ends == [f"f{i}" for i in range(handled)]
        assert not [m for m in sent if m["type"] == "error"]
    finally:
        await conn.close()
