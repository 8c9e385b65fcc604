"""Cancel flags shared in memory between a client and a daemon on the same machine.

A ``cancel`` message reaches a generation only once the daemon's reading thread runs, and while a
generation decodes, the engine's threads hold the cores: on a small machine that wake-up, not the
engine, is most of a cancel's latency.  So a client on the same machine may ask for a page of
flags (``hello`` with ``cancel_flags: true``).  The daemon makes a file of ``COUNT`` 32-bit words,
maps it, and names it in its ``hello`` reply; the client maps it too.  On Linux the file is a
sealed memfd (``/proc/<daemon>/fd/<n>``, mode 0600; only this user's processes may open another
process's descriptors): its size is sealed, so a client that truncates it (a bug) cannot make the
daemon's reads of a mapped word fault and take every other editor's engine down with it.
Elsewhere it is a file in the daemon's runtime directory (mode 0600, like its record).  A
``generate`` may then name a word (``cancel_flag``); the client zeroes the word before it sends
the request and sets it to cancel, before it sends the ``cancel`` message as usual.  The
engine's ops look at the word between their tasks and the generation between its steps
(``engine.runtime.Interrupt``'s ``watch``), so the engine stops without any of the daemon's
threads having to wake.  The message still follows and keeps the protocol's state machine as it
is: the word only makes the stop sooner.

The client owns the words' use: a word is its generation's (and its steer successors') until that
chain's last ``done``; the daemon only reads them.  The file's name is removed (a memfd's
descriptor closed) once the client has named a word (it has mapped the file by then), else when
the connection closes (a runtime-directory file left by a crash, when the next daemon in that
directory starts).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import re
import secrets
import stat
import threading
from collections import deque
from pathlib import Path

#: Words per connection: more generations than one connection may run at once.
COUNT = 1024
WORD = 4
PREFIX = "cancel-"
#: A memfd's seals: its size can change no more, nor its seals.
SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
_PROC_FD = re.compile(r"/proc/\d+/fd/\d+")


class CancelFlags:
    """A mapped file of ``count`` int32 words: ``word(i)`` for the engine, ``arm``/``trip`` for
    the client."""

    def __init__(
        self, path: Path, fd: int, count: int, owner: bool, keep_fd: int | None = None
    ) -> None:
        self.path = path
        self.count = count
        self._owner = owner
        self._keep_fd = keep_fd  # a memfd's descriptor, open while its /proc name must resolve
        self._lock = threading.Lock()
        try:
            self._map = mmap.mmap(fd, count * WORD)
        finally:
            os.close(fd)
        self._words = (ctypes.c_int32 * count).from_buffer(self._map)
        # the client hands the words out; the daemon only reads those it is told of
        self._free: deque[int] = deque() if owner else deque(range(count))
        self._named = owner  # the file still has its name (the daemon's side)

    @classmethod
    def create(cls, directory: Path, count: int = COUNT, memfd: bool | None = None) -> CancelFlags:
        """A new zeroed, sealed memfd where the system has them (``memfd`` None), else a file in
        ``directory`` (the daemon's side; removed by ``close``)."""
        if memfd is None:
            memfd = hasattr(os, "memfd_create") and bool(SEALS)
        if memfd:
            return cls._create_memfd(count)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, count * WORD)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd, count, owner=True)

    @classmethod
    def _create_memfd(cls, count: int) -> CancelFlags:
        fd = os.memfd_create(f"{PREFIX}{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, count * WORD)
            os.fchmod(fd, 0o600)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
            keep = os.dup(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(Path(f"/proc/{os.getpid()}/fd/{keep}"), fd, count, owner=True, keep_fd=keep)

    @classmethod
    def open(cls, path: str, count: int) -> CancelFlags:
        """The daemon's file (the client's side). OSError/ValueError unless it is a regular file
        of this user, private to it, of ``count`` words; a daemon's memfd must have its size
        sealed (then neither side can make the other's mapped reads fault)."""
        if not isinstance(count, int) or not 0 < count <= 1 << 16:
            raise ValueError(f"bad cancel flag count {count!r}")
        memfd = _PROC_FD.fullmatch(path) is not None
        # a /proc/<pid>/fd/<n> name is a link the kernel resolves to the daemon's descriptor
        fd = os.open(path, os.O_RDWR | (0 if memfd else os.O_NOFOLLOW))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ValueError(f"{path}: not a regular file of this user")
            if st.st_mode & 0o077:
                raise ValueError(f"{path}: readable by other users")
            if st.st_size < count * WORD:
                raise ValueError(f"{path}: {st.st_size} bytes, {count * WORD} expected")
            if memfd and fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
                raise ValueError(f"{path}: its size is not sealed")
        except BaseException:
            os.close(fd)
            raise
        return cls(Path(path), fd, count, owner=False)

    # -- the daemon's side ---------------------------------------------------------------------
    def word(self, i: int) -> ctypes.c_int32:
        """Word ``i`` (a view into the shared page), for ``Engine.generate(stop_flag=...)``."""
        if not 0 <= i < self.count:
            raise IndexError(i)
        return ctypes.c_int32.from_buffer(self._map, i * WORD)

    def unlink(self) -> None:
        """Remove the file's name (the daemon's side, once the client has mapped it): nothing is
        left behind, and nobody else can open it any more."""
        with self._lock:  # once: a second close of a memfd's number could close a reused one
            if not (self._owner and self._named):
                return
            self._named = False
            keep, self._keep_fd = self._keep_fd, None
        if keep is not None:
            os.close(keep)
        else:
            self.path.unlink(missing_ok=True)

    # -- the client's side ---------------------------------------------------------------------
    def arm(self) -> int | None:
        """A free word, zeroed, for a new generation (None when all are in use)."""
        if not self._free:
            return None
        i = self._free.popleft()
        self._words[i] = 0
        return i

    def trip(self, i: int) -> None:
        self._words[i] = 1

    def release(self, i: int) -> None:
        """Word ``i`` is free again (its generation chain has ended)."""
        self._free.append(i)

    def close(self) -> None:
        """Unmap (the daemon's side also removes the file). Views from ``word`` still held keep
        the mapping alive until they go."""
        words, self._words = self._words, None
        del words
        try:
            self._map.close()
        except BufferError:  # a generation still holds a word: the mapping goes with it
            pass
        self.unlink()


def sweep(directory: Path) -> None:
    """Remove the flag files of daemons that are no longer running (a crash leaves them)."""
    try:
        entries = list(directory.glob(f"{PREFIX}*"))
    except OSError:
        return
    for p in entries:
        try:
            pid = int(p.name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
        except PermissionError:  # another user's process with that pid: not ours to judge
            pass
