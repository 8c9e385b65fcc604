"""Give the C heap's free memory back to the system after a large, short-lived allocation.

glibc keeps what a process frees in its heap for later use, so memory that a load needed only
for a moment stays resident: parsing a 150k-token ``tokenizer.json`` builds tens of MB of JSON
values that the tokenizers library frees once its vocabulary and merges are built, and building
a vocabulary's byte index leaves its temporary lists behind.  Every language server and engine
process loads a tokenizer, so that memory would be counted once per editor window.
``malloc_trim(0)`` returns it; where the C library has no ``malloc_trim`` (musl, macOS,
Windows) this does nothing.
"""

from __future__ import annotations

import ctypes


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``; a no-op elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass
