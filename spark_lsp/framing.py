"""LSP message framing: `Content-Length` headers around JSON bodies, read leniently from the editor
over stdio and strictly from network connections, and the check that a parsed body is one
JSON-RPC message. Shared by the stdio reader (spark_lsp.protocol) and the network transports."""

from __future__ import annotations

import re
from typing import Any

MAX_BODY = 128 * 1024 * 1024  # bytes in one message: a 10 MB file JSON-escaped fits many times over
MAX_HEADER = 64 * 1024  # bytes in one header block

_HTTP_REQUEST = re.compile(rb"^[A-Z]{3,10} \S+ HTTP/\d", re.MULTILINE)


class FramingError(ValueError):
    """The byte stream is not LSP at all (e.g. an HTTP request): the connection must be closed."""


class Framer:
    """Splits a byte stream into message bodies by their `Content-Length` headers.

    A header block without a usable length is skipped and a body longer than `max_body` is
    discarded (each reported as a problem string); the stream resynchronises at the next header
    block, so a clumsy client loses one message, not the connection. With `strict` (network
    connections), a stream that starts like an HTTP request raises FramingError: a web page can
    POST to a TCP port, and such a request must not be read as LSP."""

    def __init__(self, max_body: int = MAX_BODY, strict: bool = False) -> None:
        self.max_body = max_body
        self.strict = strict
        self._buf = bytearray()
        self._skip = 0
        self._started = False

    def feed(self, data: bytes) -> list[bytes | str]:
        """Bodies complete so far (bytes) and problems (str), in stream order."""
        out: list[bytes | str] = []
        self._buf += data
        while True:
            if self._skip:
                n = min(self._skip, len(self._buf))
                del self._buf[:n]
                self._skip -= n
                if self._skip:
                    return out
            head_end = self._buf.find(b"\r\n\r\n")
            if head_end < 0:
                if self.strict and not self._started and _HTTP_REQUEST.match(bytes(self._buf[:64])):
                    raise FramingError("an HTTP request, not LSP")
                if len(self._buf) > MAX_HEADER:
                    if self.strict:
                        raise FramingError(f"a header block longer than {MAX_HEADER} bytes")
                    out.append(f"dropped {len(self._buf) - 3} bytes with no header block end")
                    del self._buf[:-3]
                return out
            head = bytes(self._buf[:head_end])
            if self.strict and _HTTP_REQUEST.search(head):
                raise FramingError("an HTTP request, not LSP")
            length = _content_length(head)
            if isinstance(length, str):
                out.append(length)
                del self._buf[: head_end + 4]
                continue
            if length > self.max_body:
                out.append(f"message of {length} bytes skipped (at most {self.max_body})")
                del self._buf[: head_end + 4]
                self._skip = length
                continue
            end = head_end + 4 + length
            if len(self._buf) < end:
                return out
            out.append(bytes(self._buf[head_end + 4 : end]))
            del self._buf[:end]
            self._started = True


_LENGTH = re.compile(rb"content-length[ \t]*:[ \t]*([^\r\n]*)", re.IGNORECASE)


def _content_length(head: bytes) -> int | str:
    """The Content-Length of a header block, or a problem string. The header is found anywhere in
    the block (the last one wins), so leftovers of a broken message glued in front of it do not
    hide the next message."""
    found = _LENGTH.findall(head)
    if not found:
        return "header block without Content-Length skipped"
    v = found[-1].strip()
    if not v.isdigit():
        return f"header block with an invalid Content-Length {v[:40]!r} skipped"
    return int(v)


def not_a_message(message: Any) -> str | None:
    """Why a parsed JSON value is not a single JSON-RPC message, or None when it is one. LSP has no
    batches: an array is refused whole."""
    if isinstance(message, list):
        return "a batch (JSON array); LSP takes one message at a time"
    if isinstance(message, dict):
        if not ("method" in message or "id" in message):
            return "a JSON object without 'method' or 'id'"
        return None
    if message is None or isinstance(message, (str, int, float, bool)):
        return f"a JSON {type(message).__name__}, not an object"
    return None
