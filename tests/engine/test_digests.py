"""Weight digests are remembered between processes by file identity (engine.weights.file_digest):
a second start hashes nothing, any write to a file makes it hashed again, and a damaged or
unwritable record only costs a hash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import weights

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPARK_LSP_CACHE", str(root))
    monkeypatch.setattr(weights, "_DIGESTS", {})  # a fresh process's memory
    return root


def _no_hashing(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("hashed again")

    monkeypatch.setattr(weights.hashlib, "blake2b", refuse)


def test_a_digest_is_kept_for_the_next_process(cache, tmp_path, monkeypatch):
    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(1 << 16))
    d = weights.file_digest(f)
    record = json.loads((cache / weights.DIGESTS_FILE).read_text())
    assert record[str(f.resolve())]["digest"] == d
    # another process reads it back without hashing the file
    code = (
        "import sys, hashlib; from engine import weights; "
        "hashlib.blake2b = None; weights.hashlib = hashlib; "
        f"print(weights.file_digest(__import__('pathlib').Path({str(f)!r})))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == d
    monkeypatch.setattr(weights, "_DIGESTS", {})
    _no_hashing(monkeypatch)
    assert weights.file_digest(f) == d


def test_a_rewritten_file_is_hashed_again_even_with_its_old_mtime(cache, tmp_path, monkeypatch):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"a" * 4096)
    d = weights.file_digest(f)
    st = f.stat()
    f.write_bytes(b"b" * 4096)  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # modification time put back
    monkeypatch.setattr(weights, "_DIGESTS", {})
    d2 = weights.file_digest(f)
    assert d2 != d
    assert d2 == weights.file_digest(f)


def test_a_damaged_record_or_unwritable_cache_only_costs_a_hash(cache, tmp_path, monkeypatch):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(4096))
    cache.mkdir(parents=True)
    (cache / weights.DIGESTS_FILE).write_text("{not json")
    d = weights.file_digest(f)
    assert json.loads((cache / weights.DIGESTS_FILE).read_text())[str(f.resolve())]["digest"] == d
    (cache / weights.DIGESTS_FILE).write_text(json.dumps({str(f.resolve()): "garbage"}))
    monkeypatch.setattr(weights, "_DIGESTS", {})
    assert weights.file_digest(f) == d
    # a cache path that cannot be a folder: the digest is still right, nothing raised
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a folder")
    monkeypatch.setenv("SPARK_LSP_CACHE", str(blocked / "sub"))
    monkeypatch.setattr(weights, "_DIGESTS", {})
    assert weights.file_digest(f) == d


def test_the_record_keeps_the_latest_files(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "DIGESTS_KEPT", 3)
    files = []
    for i in range(5):
        f = tmp_path / f"f{i}"
        f.write_bytes(bytes([i]) * 100)
        weights.file_digest(f)
        files.append(str(f.resolve()))
    assert list(json.loads((cache / weights.DIGESTS_FILE).read_text())) == files[-3:]


def test_threads_asking_at_once_hash_a_file_once(cache, tmp_path, monkeypatch):
    """Engine.load hashes the weights on a thread of its own while another may ask too (the
    precision rule): the second waits for the first's digest instead of hashing again."""
    import hashlib
    import threading

    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(1 << 20))
    calls, real = [], hashlib.blake2b

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(weights.hashlib, "blake2b", counting)
    got: list[str] = []
    threads = [
        threading.Thread(target=lambda: got.append(weights.file_digest(f))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(got)) == 1 and len(got) == 4
