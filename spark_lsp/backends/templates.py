"""FIM prompts as text, for servers that tokenise the prompt themselves.

llama.cpp's ``/infill`` and Ollama (with a model whose template knows ``.Suffix``) lay out a FIM
prompt on the server; vLLM, SGLang, TGI and LM Studio only take a text prompt, so the model's FIM
layout is applied here. The special-token spellings come from ``engine.fim`` (the project's one
FIM table) where it has the family; the text layout of each family is its published one:

* ``starcoder`` (StarCoder2): ``<fim_prefix>P<fim_suffix>S<fim_middle>``; repo-level context as
  ``<repo_name>R<file_sep>path\\ntext`` before it,
* ``spark`` (the bundled model, StarCoder tokens in SPM order): ``<fim_suffix>S<fim_prefix>P<fim_middle>``,
* ``qwen`` (Qwen2.5-Coder, Qwen3-Coder): ``<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>``; repo-level
  ``<|repo_name|>R\\n<|file_sep|>path\\ntext\\n`` ... then ``<|file_sep|>path\\n`` and the FIM part,
* ``deepseek`` (DeepSeek-Coder): ``<｜fim▁begin｜>P<｜fim▁hole｜>S<｜fim▁end｜>``; other files as
  ``# path`` comments before the prefix,
* ``codellama``: ``<PRE> P <SUF>S <MID>``,
* ``codestral`` (Mistral): ``[SUFFIX]S[PREFIX]P``.

A custom layout is a string with ``{prefix}`` and ``{suffix}`` (and optionally ``{path}``) fields,
set with the ``fimTemplate`` setting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from engine.fim import style_tokens

from .base import FileChunk

#: model-name patterns -> family (first match wins; matched case-insensitively)
_FAMILY_PATTERNS = (
    (r"qwen[\d.]*-?coder|qwen.*coder", "qwen"),
    (r"deepseek-?coder", "deepseek"),
    (r"starcoder", "starcoder"),
    (r"codellama|code-llama", "codellama"),
    (r"codestral", "codestral"),
    (r"spark", "spark"),
)
FAMILIES = ("starcoder", "spark", "qwen", "deepseek", "codellama", "codestral")


@dataclass(frozen=True)
class Template:
    """A FIM layout as text: ``render(prefix, suffix, extra, path)`` and the strings that end a middle."""

    name: str
    _render: Callable[[str, str, Sequence[FileChunk], str], str]
    stop: tuple[str, ...]

    def render(self, prefix: str, suffix: str, extra: Sequence[FileChunk] = (), path: str = "") -> str:
        return self._render(prefix, suffix, tuple(extra), path)


def _tokens(style: str) -> tuple[tuple[str, str, str], tuple[str, ...]]:
    found = style_tokens(style)
    if found is None:  # engine.fim lost the style: a programming error, not a user's
        raise LookupError(f"engine.fim has no FIM style {style!r}")
    return found[0], found[1]


def _starcoder(spm: bool) -> Template:
    (pre, suf, mid), stops = _tokens("starcoder")

    def render(p: str, s: str, extra: Sequence[FileChunk], path: str) -> str:
        repo = "".join(f"<file_sep>{c.path}\n{c.text}" for c in extra)
        head = f"<repo_name>workspace{repo}<file_sep>" if extra else ""
        name = f"{path}\n" if extra and path else ""
        if spm:
            return f"{head}{suf}{s}{pre}{name}{p}{mid}"
        return f"{head}{pre}{name}{p}{suf}{s}{mid}"
    return Template("spark" if spm else "starcoder", render, stops)


def _qwen() -> Template:
    (pre, suf, mid), stops = _tokens("qwen")

    def render(p: str, s: str, extra: Sequence[FileChunk], path: str) -> str:
        if not extra:
            return f"{pre}{p}{suf}{s}{mid}"
        files = "".join(f"<|file_sep|>{c.path}\n{c.text}\n" for c in extra)
        return f"<|repo_name|>workspace\n{files}<|file_sep|>{path or 'current'}\n{pre}{p}{suf}{s}{mid}"
    return Template("qwen", render, stops)


def _deepseek() -> Template:
    (pre, suf, mid), stops = _tokens("deepseek")

    def render(p: str, s: str, extra: Sequence[FileChunk], path: str) -> str:
        files = "".join(f"# {c.path}\n{c.text}\n" for c in extra)
        here = f"# {path}\n" if extra and path else ""
        return f"{pre}{files}{here}{p}{suf}{s}{mid}"
    return Template("deepseek", render, stops)


def _codellama() -> Template:
    (pre, suf, mid), stops = _tokens("codellama")

    def render(p: str, s: str, extra: Sequence[FileChunk], path: str) -> str:
        return f"{pre} {p} {suf}{s} {mid}"
    return Template("codellama", render, stops)


def _codestral() -> Template:
    def render(p: str, s: str, extra: Sequence[FileChunk], path: str) -> str:
        return f"[SUFFIX]{s}[PREFIX]{p}"
    return Template("codestral", render, ("</s>", "[PREFIX]", "[SUFFIX]", "[MIDDLE]"))


def _custom(layout: str) -> Template:
    if "{prefix}" not in layout or "{suffix}" not in layout:
        raise ValueError("a custom FIM template needs both {prefix} and {suffix}, e.g. "
                         "'<PRE>{prefix}<SUF>{suffix}<MID>'")

    def render(p: str, s: str, extra: Sequence[FileChunk], path: str) -> str:
        # plain replacement, not str.format: code is full of braces
        return layout.replace("{path}", path).replace("{suffix}", s).replace("{prefix}", p)
    return Template("custom", render, ())


_BUILDERS = {"starcoder": lambda: _starcoder(False), "spark": lambda: _starcoder(True), "qwen": _qwen,
             "deepseek": _deepseek, "codellama": _codellama, "codestral": _codestral}


def family_of(model: str | None) -> str | None:
    """The FIM family a model name suggests (``qwen2.5-coder:1.5b`` -> ``qwen``), or None."""
    if not model:
        return None
    low = model.lower()
    for pattern, family in _FAMILY_PATTERNS:
        if re.search(pattern, low):
            return family
    return None


def resolve(setting: str | None, model: str | None) -> Template | None:
    """The template for the ``fimTemplate`` setting (``auto``/None: from the model name; a family
    name; or a custom layout with ``{prefix}`` and ``{suffix}``); None when ``auto`` finds no
    family (then the server lays out the prompt, e.g. through a ``suffix`` parameter)."""
    if setting in (None, "", "auto"):
        family = family_of(model)
        return _BUILDERS[family]() if family else None
    if setting in _BUILDERS:
        return _BUILDERS[setting]()
    return _custom(setting)
