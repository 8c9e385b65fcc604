"""engine.heap.trim_heap: freed heap memory goes back to the system (glibc), and the tokenizer
gives back what loading it needed for a moment."""

from __future__ import annotations

import ctypes
import os
import platform

import pytest

from engine import tokenizer as tokenizer_module
from engine.heap import trim_heap

MB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_memory_goes_back_to_the_system():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(16384)]  # 64 MB of heap chunks, each resident
    for p in blocks:
        ctypes.memset(p, 1, 4096)
    pin = libc.malloc(64)  # above them: free() alone cannot shrink the heap past it
    for p in blocks:
        libc.free(p)
    before = _rss()
    trim_heap()
    after = _rss()
    libc.free(pin)
    assert before - after > 32 * MB, (before, after)


def test_a_tokenizer_load_and_its_byte_index_trim_the_heap(tiny_models, monkeypatch):
    calls = []
    monkeypatch.setattr(tokenizer_module, "trim_heap", lambda: calls.append(1))
    tok = tokenizer_module.Tokenizer.load(tiny_models["qwen2"])
    assert calls == [1]
    tok.byte_index()
    tok.byte_index()  # built once, trimmed once
    assert calls == [1, 1]
