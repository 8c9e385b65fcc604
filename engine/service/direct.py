"""WebSocket connections (``websockets``' threaded implementation) that hand every received
message to a callback on the thread that read it.

``websockets.sync`` reads each socket on its own thread and queues the messages for another
thread's ``recv()``: a hand-over between two threads for every message.  Here the reading
thread calls ``on_message(raw)`` itself (``raw``: the message's bytes), so a ``cancel`` reaches
the generation, or a token the consumer's queue, without waiting for another thread to be
scheduled.  Messages that arrive before ``attach`` are kept and handed over by it.

Whatever the protocol has to send at one time leaves in one socket write (``send_batch`` sends
several messages so): on loopback each write wakes the peer's reading thread, which on a busy
machine may take the writer's core before its next write, so a generation's last tokens and its
``done`` written separately reach the client up to a scheduling slice apart.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from websockets.frames import CONT, DATA_OPCODES, Frame
from websockets.sync.client import ClientConnection
from websockets.sync.server import ServerConnection


class _Direct:
    """The part shared by the server and client connections below."""

    #: whether the reading thread waits until the first write (the client's opening request)
    reads_after_first_write = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._attach_lock = threading.Lock()
        self._on_message: Callable[[bytes], None] | None = None
        self._on_close: Callable[[], None] | None = None
        self._early: list[bytes] = []
        self._parts: list[bytes] = []  # the frames of a fragmented message so far
        self._ended = False
        self._may_read = threading.Event()  # the reading thread waits for it
        if not self.reads_after_first_write:
            self._may_read.set()
        super().__init__(*args, **kwargs)

    def attach(
        self, on_message: Callable[[bytes], None], on_close: Callable[[], None] | None = None
    ) -> None:
        """Hand every message to ``on_message`` from now on (and those that came before), and
        call ``on_close`` once the socket has closed (at once if it has)."""
        with self._attach_lock:
            early, self._early = self._early, []
            for raw in early:
                on_message(raw)
            self._on_message = on_message
            self._on_close = on_close
            ended = self._ended
        if ended and on_close is not None:
            on_close()

    def send_batch(self, messages: Sequence[str]) -> None:
        """Send text ``messages`` in this order with one socket write (``send``'s errors)."""
        with self.send_context():
            for text in messages:
                self.protocol.send_text(text.encode())

    def send_data(self) -> None:
        """Write what the protocol has to send (called with ``protocol_mutex`` held, as the
        library's): its frames joined into one ``sendall``, then the end of the stream if the
        protocol asks for it.  On an ``ssl.SSLSocket`` (wss://) ``sendall`` returns once all of
        it is encrypted and handed to the kernel, so nothing waits in the TLS layer where
        ``ThreadConnection._credit``'s wait on the descriptor would not see it; the end of the
        stream is a TCP shutdown, as the library's own (no TLS close_notify)."""
        pending: list[bytes] = []
        for data in self.protocol.data_to_send():
            if data:
                pending.append(data)
                continue
            self._write_joined(pending)
            pending = []
            try:
                self.socket.shutdown(socket.SHUT_WR)
            except OSError:  # the socket is already closed
                pass
        self._write_joined(pending)
        if not self._may_read.is_set():  # a client's opening request is out: it may read now
            self._may_read.set()

    def _write_joined(self, chunks: list[bytes]) -> None:
        if not chunks:
            return
        if self.close_deadline is not None:
            self.socket.settimeout(self.close_deadline.timeout())
        self.socket.sendall(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def process_event(self, event: Any) -> None:
        if not isinstance(event, Frame) or event.opcode not in DATA_OPCODES:
            return super().process_event(event)  # the handshake, pings and pongs, close
        if event.opcode is not CONT:
            self._parts = []
        self._parts.append(bytes(event.data))
        if not event.fin:
            return  # the protocol bounds a message's size over its frames (max_size)
        raw = b"".join(self._parts)
        self._parts = []
        on_message = self._on_message
        if on_message is None:
            with self._attach_lock:
                if self._on_message is None:
                    self._early.append(raw)
                    return
                on_message = self._on_message
        on_message(raw)

    def close_socket(self) -> None:
        """Shut the socket down before the library closes it.  ``websockets`` (15 and later) only
        closes it and wakes its reading thread through a second socket the thread polls; but over
        TLS that thread may already sit in a blocking read (the socket turned readable with a TLS
        record that holds no data, such as a TLS 1.3 session ticket), which a close does not end.
        A ``wss://`` handshake that timed out then held ``connect`` for minutes, waiting for that
        thread.  A shutdown ends the read at once."""
        try:
            self.socket.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected, or closed already
            pass
        self._may_read.set()
        super().close_socket()

    def recv_events(self) -> None:
        self._may_read.wait()
        try:
            super().recv_events()
        finally:
            with self._attach_lock:
                self._ended = True
                on_close = self._on_close
            if on_close is not None:
                on_close()


class DirectServerConnection(_Direct, ServerConnection):
    """A server-side connection whose messages go to ``attach``'s callback."""


class DirectClientConnection(_Direct, ClientConnection):
    """A client-side connection whose messages go to ``attach``'s callback.

    Its reading thread starts reading once the opening request is written.  Over TLS 1.3 a
    server sends session tickets just after the TLS handshake; a thread reading them while
    another writes the request uses one OpenSSL connection from two threads at once, which it
    does not support: about one connect in a few hundred stalled until its timeout (the request
    never left), and with many tickets the process's heap was corrupted.  Until the response
    comes, nothing else writes; the tickets are read before it (they come first)."""

    reads_after_first_write = True
