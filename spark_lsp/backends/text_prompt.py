"""Prompt windows for backends that tokenise on their side: the same anchored prefix and suffix
windows as for the engine (`spark_lsp.prompt.PromptBuilder`), counted in estimated tokens.

The anchoring matters as much remotely: llama.cpp's ``cache_prompt`` (and vLLM's prefix caching)
reuse the KV cache of the longest common prompt prefix, which only lasts while the window's start
stays put. Tokens are estimated from UTF-8 bytes (code averages 3-4 bytes a token); a remote
server's true count is only known after a round trip, which a keystroke cannot afford.
"""

from __future__ import annotations

from ..prompt import PromptBuilder

BYTES_PER_TOKEN = 3.5


class EstimatedTokens:
    """A stand-in tokenizer that only counts: ``encode(text)`` has one entry per estimated token."""

    def encode(self, text: str) -> list[int]:
        n = len(text.encode("utf-8"))
        return [0] * (int(n / BYTES_PER_TOKEN + 0.999) if n else 0)

    def token_to_id(self, token: str) -> None:
        return None


class _TextFim:
    """The FIM part of PromptBuilder for text prompts: the server lays out the tokens."""

    stop_ids: frozenset[int] = frozenset()
    supports_spm = False
    name = "text"
    #: no middle token and no style: the backend lays the text out, so no anchored PSM prompt
    middle_id = None
    style = None

    def build(self, prefix: str, suffix: str, spm: bool = False, context=None) -> list[int]:
        return []

    def layout(self, p: list[int], s: list[int], spm: bool = False, context=None) -> list[int]:
        return []

    def context_ids(self, files):
        """Other files go to the server as text (`TextPrompt.extra`), not as ids."""
        return None


class TextPromptBuilder(PromptBuilder):
    """`PromptBuilder` whose prompts are texts (`Prompt.prefix`, `Prompt.suffix`; `ids` is empty)."""

    def __init__(self) -> None:
        super().__init__(EstimatedTokens(), fim=_TextFim(), heal=False)
