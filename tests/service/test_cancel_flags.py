"""Cancel flags shared in memory between a client and a daemon on the same machine
(engine.service.cancel_flags): the file, the engine watching a word, and the protocol around it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from websockets.sync.client import connect

from engine import Engine, GenerationParams
from engine.service import protocol as P
from engine.service.cancel_flags import COUNT, CancelFlags, sweep
from engine.service.local import LocalModels
from engine.service.server import EngineServer
from engine.service.sync_client import SyncEngineClient

TOKEN = "f" * 32
PROMPT = "def fibonacci(n):\n"
LONG = GenerationParams(max_new_tokens=1500, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return Engine.load(slots=4)


@pytest.fixture
def server(engine, tmp_path):
    srv = EngineServer(LocalModels([engine]), token=TOKEN, flags_dir=tmp_path / "run").open(
        "127.0.0.1", 0
    )
    yield srv
    srv.close(0.5)


def _flag_files(srv) -> list:
    return sorted(srv.flags_dir.glob("cancel-*"))


def _named(path) -> bool:
    """Whether a flags file can still be opened by its name: a file in the runtime directory, or
    a memfd's /proc name (while the daemon keeps its descriptor; the number may be reused)."""
    if str(path).startswith("/proc/"):
        try:
            return os.readlink(path).startswith("/memfd:cancel-")
        except OSError:
            return False
    return Path(path).exists()


MEMFD = hasattr(os, "memfd_create")
KINDS = [pytest.param(True, id="memfd", marks=pytest.mark.skipif(not MEMFD, reason="no memfd"))]
KINDS.append(pytest.param(False, id="file"))


# -- the file --------------------------------------------------------------------------------------
@pytest.mark.parametrize("memfd", KINDS)
def test_a_word_set_by_one_side_is_seen_by_the_other(tmp_path, memfd):
    mine = CancelFlags.create(tmp_path, memfd=memfd)
    assert stat.S_IMODE(mine.path.stat().st_mode) == 0o600
    assert str(mine.path).startswith("/proc/" if memfd else str(tmp_path))
    theirs = CancelFlags.open(str(mine.path), mine.count)
    word = mine.word(7)
    i = None
    while i != 7:  # the client hands out free words in order
        i = theirs.arm()
    theirs.trip(7)
    assert word.value == 1
    theirs.release(7)
    while theirs.arm() != 7:
        pass
    assert word.value == 0  # arming zeroes it for its next generation
    with pytest.raises(IndexError):
        mine.word(mine.count)
    theirs.close()
    mine.close()
    assert not _named(mine.path)


@pytest.mark.skipif(not MEMFD, reason="no memfd")
def test_a_client_cannot_truncate_the_daemons_memfd(tmp_path):
    """A client that truncates the shared file (a bug) would make the daemon's next read of a
    mapped word fault (SIGBUS: every editor's engine gone); the memfd's size is sealed."""
    daemon = CancelFlags.create(tmp_path, count=8)
    word = daemon.word(7)
    fd = os.open(str(daemon.path), os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 20)
    finally:
        os.close(fd)
    client = CancelFlags.open(str(daemon.path), 8)
    client.trip(7)
    assert word.value == 1  # still mapped, still shared
    client.close()
    del word
    daemon.close()


@pytest.mark.skipif(not MEMFD, reason="no memfd")
def test_the_memfds_descriptor_is_closed_once(tmp_path):
    """Its number may be reused as soon as it is closed (by the next connection's socket): a
    second close, from `unlink` and `close` alike, must not close that."""
    daemon = CancelFlags.create(tmp_path, count=8)
    keep = int(str(daemon.path).rsplit("/", 1)[1])
    daemon.unlink()
    other = os.open(os.devnull, os.O_RDONLY)
    os.dup2(other, keep)  # another file now has the number
    try:
        daemon.unlink()
        daemon.close()
        os.fstat(keep)  # still open
    finally:
        os.close(keep)
        os.close(other)


@pytest.mark.skipif(not MEMFD, reason="no memfd")
def test_an_unsealed_memfd_is_refused(tmp_path):
    fd = os.memfd_create("cancel-x", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 32)
        os.fchmod(fd, 0o600)
        with pytest.raises(ValueError, match="sealed"):
            CancelFlags.open(f"/proc/{os.getpid()}/fd/{fd}", 8)
    finally:
        os.close(fd)


def test_all_words_in_use_means_no_flag(tmp_path):
    daemon = CancelFlags.create(tmp_path, count=2)
    flags = CancelFlags.open(str(daemon.path), 2)  # the client hands the words out
    assert flags.arm() == 0 and flags.arm() == 1 and flags.arm() is None
    flags.release(1)
    assert flags.arm() == 1
    assert daemon.arm() is None  # the daemon's side has none to give
    flags.close()
    daemon.close()


def test_a_file_others_can_read_or_of_the_wrong_size_is_refused(tmp_path):
    flags = CancelFlags.create(tmp_path, count=8, memfd=False)
    os.chmod(flags.path, 0o644)
    with pytest.raises(ValueError, match="other users"):
        CancelFlags.open(str(flags.path), 8)
    os.chmod(flags.path, 0o600)
    with pytest.raises(ValueError, match="bytes"):
        CancelFlags.open(str(flags.path), 9)
    with pytest.raises(ValueError, match="count"):
        CancelFlags.open(str(flags.path), "8")
    link = tmp_path / "link"
    link.symlink_to(flags.path)
    with pytest.raises(OSError):
        CancelFlags.open(str(link), 8)
    flags.close()


def test_sweep_removes_the_files_of_daemons_gone(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"cancel-{gone.pid}-0123456789abcdef"
    stale.write_bytes(b"\0" * 16)
    live = CancelFlags.create(tmp_path, memfd=False)  # this process's own
    other = tmp_path / f"cancel-{os.getppid()}-fedcba9876543210"  # a live process's
    other.write_bytes(b"\0" * 16)
    sweep(tmp_path)
    assert not stale.exists() and live.path.exists() and other.exists()
    live.close()


# -- the engine ------------------------------------------------------------------------------------
def test_a_set_stop_flag_cancels_a_generation_between_and_inside_its_runs(engine, tmp_path):
    flags = CancelFlags.create(tmp_path)
    word = flags.word(0)
    word.value = 1
    gen = engine.generate(PROMPT, LONG, slot="flag-before", stop_flag=word)
    assert gen.result() == "" and gen.finish_reason == "cancelled"

    word.value = 0
    gen = engine.generate(PROMPT, LONG, slot="flag-during", stop_flag=word)
    for i, _ in enumerate(gen):
        if i == 3:
            word.value = 1  # as another process would: no token, no message
    assert gen.finish_reason == "cancelled" and gen.cancelled and len(gen.tokens) == 4
    # the slot is left consistent: the next generation on it gives what a fresh one gives
    short = GenerationParams(max_new_tokens=12, ignore_eos=True)
    again = engine.generate(PROMPT, short, slot="flag-during").result()
    assert again == engine.generate(PROMPT, short, slot="flag-fresh").result()
    del word
    flags.close()


# -- the protocol ----------------------------------------------------------------------------------
def test_a_client_on_this_machine_stops_a_generation_by_the_flag_alone(server):
    c = SyncEngineClient(server.url, TOKEN)
    try:
        offer = c.hello["capabilities"]["cancel_flags"]
        assert offer["count"] == COUNT and _named(offer["path"])
        # a sealed memfd where the system has them, not a file in the runtime directory
        assert offer["path"].startswith("/proc/") == MEMFD and len(_flag_files(server)) == (
            not MEMFD
        )
        gen = c.generate(PROMPT, LONG, slot="a")
        assert gen._flag is not None
        next(iter(gen))
        assert not _named(offer["path"])  # named a word, so mapped: the name is removed
        for i, _ in enumerate(gen):
            if i == 2:
                break
        tripped = time.perf_counter()
        c._trip(gen)  # the flag only: no cancel message is sent
        gen.result()
        assert gen.finish_reason == "cancelled" and len(gen.tokens) < 200
        # sharing the machine, the daemon says when its engine stopped, on this clock
        assert tripped < gen.stats["ended_at"] < time.perf_counter()
        assert gen._flag is None  # its word is free again, and zeroed for the next one
        nxt = c.generate(PROMPT, GenerationParams(max_new_tokens=8, ignore_eos=True), slot="a")
        assert nxt.result() and nxt.finish_reason == "length"
        # cancel() sets the flag and sends the message: one done, nothing after it
        third = c.generate(PROMPT, LONG, slot="a")
        next(iter(third))
        third.cancel()
        third.result()
        assert third.finish_reason == "cancelled"
    finally:
        c.close()
    deadline = time.monotonic() + 10
    while _flag_files(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _flag_files(server)  # removed with the connection


def test_flags_are_offered_only_when_asked_and_kept(server, engine):
    c = SyncEngineClient(server.url, TOKEN, cancel_flags=False)
    try:
        assert "cancel_flags" not in c.hello["capabilities"] and c._flags is None
        gen = c.generate(PROMPT, LONG, slot="b")
        next(iter(gen))
        gen.cancel()  # by message, as before
        gen.result()
        assert gen.finish_reason == "cancelled" and "ended_at" not in gen.stats
    finally:
        c.close()
    assert not _flag_files(server)


def test_a_server_without_a_flags_dir_offers_none(engine):
    srv = EngineServer(LocalModels([engine]), token=TOKEN).open("127.0.0.1", 0)
    try:
        c = SyncEngineClient(srv.url, TOKEN)
        assert "cancel_flags" not in c.hello["capabilities"] and c._flags is None
        c.close()
    finally:
        srv.close(0.5)


def test_a_flag_the_connection_does_not_have_is_an_error(server):
    with connect(
        server.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, proxy=None
    ) as ws:

        def ask(msg: dict) -> dict:
            ws.send(P.encode(msg))
            return P.decode(ws.recv(30))

        assert "cancel_flags" not in ask({"type": "hello"})["capabilities"]
        gen = {"type": "generate", "id": "g1", "prompt": PROMPT, "cancel_flag": 0}
        reply = ask(gen)
        assert reply["type"] == "error" and reply["code"] == P.BAD_MESSAGE and reply["id"] == "g1"
        assert "no shared cancel flag" in reply["message"]
        for bad in (-1, True, "0", 1.5):
            reply = ask({**gen, "id": "g2", "cancel_flag": bad})
            assert reply["code"] == P.BAD_MESSAGE and "cancel_flag" in reply["message"]
    with connect(
        server.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, proxy=None
    ) as ws:
        ws.send(P.encode({"type": "hello", "cancel_flags": True}))
        count = P.decode(ws.recv(30))["capabilities"]["cancel_flags"]["count"]
        ws.send(P.encode({"type": "generate", "id": "g3", "prompt": PROMPT, "cancel_flag": count}))
        reply = P.decode(ws.recv(30))
        assert reply["code"] == P.BAD_MESSAGE and f"it has {count}" in reply["message"]


def test_a_steer_successor_is_stopped_by_its_chains_flag(server, engine):
    """The daemon binds a steer's successor to the flag of the generation it continues; the
    client frees the word only when the chain's last generation ends."""
    c = SyncEngineClient(server.url, TOKEN)
    try:
        gen = c.generate(PROMPT, LONG, slot="steer")
        first = next(iter(gen))
        flag = gen._flag
        event = gen.steer(first.text + "\u00a7zz", timeout=30)
        assert event["outcome"] == P.STOPPED
        gen.result()
        succ = gen.successor
        assert gen.finish_reason == "steered" and succ is not None
        assert succ._flag == flag and gen._flag is None
        next(iter(succ))
        c._trip(succ)  # the flag alone stops the successor
        succ.result()
        assert succ.finish_reason == "cancelled" and succ._flag is None
    finally:
        c.close()


def test_concurrent_cancels_never_trip_another_generations_flag(server):
    """A cancel racing its generation's end must not set the word a new generation reuses."""
    c = SyncEngineClient(server.url, TOKEN)
    short = GenerationParams(max_new_tokens=2, ignore_eos=True)
    try:
        wrong = []

        def cancel_late(g):
            g.result()
            g.cancel()  # after its end: must do nothing

        for _ in range(30):
            g = c.generate(PROMPT, short, slot="race")
            t = threading.Thread(target=cancel_late, args=(g,))
            t.start()
            nxt = c.generate(PROMPT, short, slot="race2")
            t.join()
            nxt.result()
            if nxt.finish_reason != "length":
                wrong.append(nxt.finish_reason)
        assert not wrong
    finally:
        c.close()


def test_a_cancel_right_after_an_unread_steer_goes_by_message(server):
    """A flag would overtake a steer still on its way (the engine would stop before the server
    reads the typed text): while the server has not answered a steer, cancel sets no flag."""
    c = SyncEngineClient(server.url, TOKEN)
    try:
        gen = c.generate(PROMPT, LONG, slot="unread")
        next(iter(gen))
        word = c._flags._words
        gen._unread_steers.add("t-on-its-way")
        c._trip(gen)
        assert word[gen._flag] == 0
        gen._unread_steers.clear()  # answered
        c._trip(gen)
        assert word[gen._flag] == 1
        gen.result()
        assert gen.finish_reason == "cancelled"
    finally:
        c.close()
