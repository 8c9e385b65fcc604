"""FIM prompts as text, for servers that tokenise the prompt themselves.

llama.cpp's ``/infill`` and Ollama (with a model whose template knows ``.Suffix``) lay out a FIM
prompt on the server; vLLM, SGLang, TGI and LM Studio only take a text prompt, so the model's FIM
layout is applied here. The families and their layouts are engine.fim's (``STYLES``, the one FIM
table of the project: ``FimStyle.render``); this module picks one for a remote model: from the
``fimTemplate`` setting, else from the ``fimFormat`` setting, else from the model's name
(``qwen2.5-coder:1.5b`` -> ``qwen``). A custom layout is a string with ``{prefix}`` and
``{suffix}`` (and optionally ``{path}``) fields.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.fim import STYLES, FimStyle

from .base import FileChunk

#: model-name patterns -> family (first match wins; matched case-insensitively)
_FAMILY_PATTERNS = (
    (r"qwen[\d.]*-?coder|qwen.*coder", "qwen"),
    (r"deepseek-?coder", "deepseek"),
    (r"starcoder", "starcoder"),
    (r"codegemma", "codegemma"),
    (r"codellama|code-llama", "codellama"),
    (r"codestral", "codestral"),
)


@dataclass(frozen=True)
class Template:
    """A FIM layout as text: ``render(prefix, suffix, extra, path)`` and the strings that end a middle."""

    name: str
    _render: Callable[[str, str, Sequence[FileChunk], str], str]
    stop: tuple[str, ...]

    def render(
        self, prefix: str, suffix: str, extra: Sequence[FileChunk] = (), path: str = ""
    ) -> str:
        return self._render(prefix, suffix, tuple(extra), path)


def _style(style: FimStyle) -> Template:
    if style.prefix.startswith("▁"):
        # SentencePiece spellings (CodeLlama's "▁<PRE>"): as text, "<PRE> {prefix} <SUF>{suffix}
        # <MID>", the published layout (the "▁" is the space around the tokens)
        style = dataclasses.replace(
            style,
            prefix=style.prefix[1:] + " ",
            suffix=" " + style.suffix[1:],
            middle=" " + style.middle[1:] if style.middle else None,
        )

    def render(p: str, s: str, extra: Sequence[FileChunk], path: str) -> str:
        files = [(c.path, c.text) for c in extra]
        return style.render(
            p, s, files=files, repo="workspace" if files else None, path=path or None
        )

    stops = tuple(dict.fromkeys(t.removeprefix("▁") for t in style.stops))
    return Template(style.name, render, stops)


def _custom(layout: str) -> Template:
    if "{prefix}" not in layout or "{suffix}" not in layout:
        raise ValueError(
            "a custom FIM template needs both {prefix} and {suffix}, e.g. "
            "'<PRE>{prefix}<SUF>{suffix}<MID>'"
        )

    def render(p: str, s: str, extra: Sequence[FileChunk], path: str) -> str:
        # plain replacement, not str.format: code is full of braces
        return layout.replace("{path}", path).replace("{suffix}", s).replace("{prefix}", p)

    return Template("custom", render, ())


def family_of(model: str | None) -> str | None:
    """The FIM family a model name suggests (``qwen2.5-coder:1.5b`` -> ``qwen``), or None."""
    if not model:
        return None
    low = model.lower()
    for pattern, family in _FAMILY_PATTERNS:
        if re.search(pattern, low):
            return family
    return None


def resolve(
    setting: str | None, model: str | None, fim_format: str | None = None
) -> Template | None:
    """The template for the ``fimTemplate`` setting (a family name or a custom layout with
    ``{prefix}`` and ``{suffix}``; None/``auto``: the ``fimFormat`` setting's family, else the one
    the model name suggests); None when no family is known (then the server lays out the prompt,
    e.g. through a ``suffix`` parameter)."""
    if setting in (None, "", "auto"):
        family = fim_format if fim_format not in (None, "", "auto") else family_of(model)
        return _style(STYLES[family]) if family in STYLES else None
    if setting in STYLES:
        return _style(STYLES[setting])
    return _custom(setting)
