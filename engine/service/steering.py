"""Steering: text the user typed while a generation streams, judged against what it generated.
The daemon's connection applies it to its generations; :class:`SteeredGeneration` gives a
generation of this process the same semantics.

Typed text that is a prefix of the generated text is typing-through: the generation goes on.
Typed text that runs past the generated text (and agrees with all of it) waits for more tokens.
Typed text that disagrees with the generated text stops the generation; its successor's prompt is
the original prompt, the generated tokens that the typed text agrees with (their KV is reused
from the slot), and the rest of the typed text.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

MATCH = "match"
PENDING = "pending"
DIVERGED = "diverged"


def judge(typed: str, generated: str) -> str:
    """MATCH: ``typed`` is a prefix of ``generated``; PENDING: ``generated`` is a proper prefix of
    ``typed``; DIVERGED: they disagree at some character."""
    if generated.startswith(typed):
        return MATCH
    if typed.startswith(generated):
        return PENDING
    return DIVERGED


def common_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Stream:
    """What a generation has emitted so far: its token ids and the text length after each."""

    ids: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    text: str = ""

    def push(self, token_id: int, text: str) -> None:
        self.ids.append(token_id)
        self.text += text
        self.ends.append(len(self.text))


def successor_prompt(
    prompt: list[int],
    stream: Stream,
    typed: str,
    encode: Callable[[str], list[int]],
    healed_prefix: str = "",
) -> list[int]:
    """The prompt that continues after ``typed``: ``prompt`` + the longest run of generated tokens
    whose text ``typed`` spells + the tokens of the rest of ``typed``.

    With token healing (``healed_prefix``), generated tokens are kept only once visible text was
    emitted (the healed prefix is then spelled by them); otherwise the healed prefix is typed again
    in front of ``typed``.
    """
    m = common_chars(typed, stream.text)
    k = 0
    for i, end in enumerate(stream.ends):
        if end > m:
            break
        if healed_prefix and end == 0:
            continue
        k = i + 1
    if k == 0:
        rest = healed_prefix + typed
    else:
        rest = typed[stream.ends[k - 1] :]
    return [*prompt, *stream.ids[:k], *(encode(rest) if rest else [])]


@dataclass(frozen=True, slots=True)
class Piece:
    """A chunk of a steerable generation's output.  ``at`` None: ``text`` follows the output so
    far; ``at`` = n: a steer rewrote the output, which is now its first n characters + ``text``
    (the typed text; the successor's chunks follow it)."""

    token_id: int
    text: str
    at: int | None = None
    logprob: float | None = None


class SteeredGeneration:
    """A generation of this process that takes steers with the engine service's semantics (the
    daemon's connection judges them the same way, see docs/engine-protocol.md, "Steering").

    ``steer(text)`` (any thread) adds to the text typed since the output began.  At every step,
    typed text that is a prefix of the output lets the generation go on; typed text that
    disagrees with it (or runs past the end of a finished generation) stops it, and a successor
    starts from ``successor_prompt`` (the slot's KV of the agreeing part is reused) with the same
    parameters: the iterator then yields a :class:`Piece` with ``at`` that puts the output back to
    the typed text, and goes on with the successor's chunks.  ``start(ids, params)`` starts one
    engine generation (an iterable of chunks with ``token_id`` and ``text``, with ``cancel()``,
    ``finish_reason`` and ``stats``).
    """

    def __init__(
        self,
        start: Callable[[list[int], Any], Any],
        prompt: list[int],
        params: Any,
        encode: Callable[[str], list[int]],
    ) -> None:
        self._start = start
        self._encode = encode
        self.prompt = list(prompt)
        self.params = params
        self._gen = start(self.prompt, params)
        self._stream = Stream()
        self._lock = threading.Lock()
        self._inbox = ""  # typed, not yet taken by the iterating thread
        self.typed = ""  # everything typed, relative to the start of the output
        self._base = 0  # characters of `typed` the current generation's prompt holds
        self.text = ""  # the output: generated text, typed text where a steer rewrote it
        self.successors = 0
        self._cancelled = False
        self.finish_reason: str | None = None
        self.stats: dict = {}

    def steer(self, text: str) -> None:
        with self._lock:
            self._inbox += text

    def cancel(self) -> None:
        """Stop (a successor that a steer would start never starts)."""
        self._cancelled = True
        self._gen.cancel()

    def stop(self) -> None:
        """The output is complete: stop generating more."""
        self.cancel()

    def __iter__(self) -> SteeredGeneration:
        return self

    def __next__(self) -> Piece:
        self._take()
        if self._diverged():
            return self._succeed()
        try:
            chunk = next(self._gen)
        except StopIteration:
            self._take()
            pending = self.typed[self._base :]
            if pending and not self._cancelled and judge(pending, self._stream.text) != MATCH:
                return self._succeed()  # typed past the end of a finished generation
            self.finish_reason = self._gen.finish_reason
            self.stats = {**dict(self._gen.stats or {}), "steered": self.successors}
            raise
        self._stream.push(chunk.token_id, chunk.text)
        self.text += chunk.text
        if self._diverged():
            return self._succeed()
        return Piece(chunk.token_id, chunk.text, None, getattr(chunk, "logprob", None))

    def _take(self) -> None:
        with self._lock:
            self.typed += self._inbox
            self._inbox = ""

    def _diverged(self) -> bool:
        pending = self.typed[self._base :]
        return bool(pending) and judge(pending, self._stream.text) == DIVERGED

    def _succeed(self) -> Piece:
        """Stop the current generation and start its successor after the typed text."""
        self._gen.cancel()
        for _ in self._gen:  # the engine finishes the step in flight and releases the slot
            pass
        if self._cancelled:
            self.finish_reason = "cancelled"
            self.stats = dict(self._gen.stats or {})
            raise StopIteration
        healed = getattr(self.params, "healed_prefix", "") or ""
        ids = successor_prompt(
            self.prompt, self._stream, self.typed[self._base :], self._encode, healed
        )
        if healed:
            self.params = replace(self.params, healed_prefix="")
        self.prompt, self._base = ids, len(self.typed)
        self._stream = Stream()
        self.successors += 1
        self._gen = self._start(ids, self.params)
        if self._cancelled:  # cancelled while it started
            self._gen.cancel()
        at = common_chars(self.typed, self.text)
        self.text = self.typed
        return Piece(-1, self.typed[at:], at)
