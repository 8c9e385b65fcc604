"""Loading a model asks the kernel to read the graph's weight files into the page cache, so the
first tokens of a cold start do not each wait on a disk read (engine.runtime.prefetch)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time

import pytest

from engine import Engine
from engine import runtime as rt


def _resident(path) -> float:
    """Share of the file's pages in the page cache (mincore over a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            pytest.skip(f"mmap failed: errno {ctypes.get_errno()}")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
            return sum(v & 1 for v in vec) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"),
    reason="page-cache advice and mincore are Linux's",
)
def test_prefetch_reads_an_evicted_file_into_the_page_cache(tmp_path):
    path = tmp_path / "model.onnx.data"
    path.write_bytes(os.urandom(3 * rt.PREFETCH_WINDOW + 12345))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _resident(path) > 0.5:
        pytest.skip("this filesystem keeps the file in memory (tmpfs): nothing to read ahead")
    t = rt.prefetch([path, tmp_path / "missing.data"])  # a missing file is passed over
    assert t is not None
    t.join(10)
    deadline = time.monotonic() + 10
    while _resident(path) < 0.99 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _resident(path) >= 0.99


def test_loading_prefetches_the_graph_files(tiny_llama, tmp_path, monkeypatch):
    seen = []
    real = rt.prefetch
    monkeypatch.setattr(rt, "prefetch", lambda paths: seen.append(list(paths)) or real(paths))
    eng = Engine.load(tiny_llama, wafer=False, cache_dir=tmp_path / "graphs")
    names = {p.name for paths in seen for p in paths}
    assert {"model.onnx", "model.onnx.data"} <= names
    assert all(p.parent == eng.graph_path.parent for paths in seen for p in paths)
