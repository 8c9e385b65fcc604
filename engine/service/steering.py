"""Steering: text the user typed while a generation streams, judged against what it generated.

Typed text that is a prefix of the generated text is typing-through: the generation goes on.
Typed text that runs past the generated text (and agrees with all of it) waits for more tokens.
Typed text that disagrees with the generated text stops the generation; its successor's prompt is
the original prompt, the generated tokens that the typed text agrees with (their KV is reused
from the slot), and the rest of the typed text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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
