"""Fill-in-the-middle prompt layouts of the code models we can drive.

``FimFormat.detect(tokenizer)`` recognises a tokenizer's FIM special tokens (``STYLES``):

* ``starcoder``: StarCoder / StarCoder2 (and the bundled model): ``<fim_prefix>``,
  ``<fim_suffix>``, ``<fim_middle>``; repository level ``<repo_name>``, ``<file_sep>``;
* ``codegemma``: ``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>`` with
  ``<|file_separator|>`` between files;
* ``qwen``: Qwen2.5-Coder: the same three tokens, repository level ``<|repo_name|>``,
  ``<|file_sep|>``;
* ``codellama``: ``▁<PRE>``/``<PRE>``, ``▁<SUF>``, ``▁<MID>``, ends with ``▁<EOT>``;
* ``deepseek``: DeepSeek-Coder: ``<｜fim▁begin｜>``, ``<｜fim▁hole｜>``, ``<｜fim▁end｜>`` (PSM);
* ``codestral``: ``[SUFFIX]`` suffix ``[PREFIX]`` prefix, the middle follows (suffix first only).

Each family is also a text template (``FimStyle.render``), for backends that take a prompt
string rather than token ids.

This is the one FIM table of the project: the engine's ``Tokenizer.fim``, ``spark-lsp eval``
and the server's prompt builder all use it.

``build(prefix, suffix, spm)`` returns token ids.  Each part is encoded on its own, so the
tokens of the prefix do not change when text is added to the suffix and vice versa, and in
SPM order (``<fim_suffix>S<fim_prefix>P<fim_middle>``) the prompt only grows at its end as
the user types, which keeps the prompt's KV cache reusable.  SPM is offered only for the
StarCoder-style tokens, in the order the bundled model was trained on; Qwen2.5-Coder and
CodeLlama were trained on PSM, so they get PSM.

Token healing (``heal``, ``build_healed``): a cursor inside a word leaves the prefix ending in
a token the model rarely saw there (``self.assertEq`` -> ``assert E q``, where training always
had ``assertEqual``), and the middle would have to start at a token boundary it never learnt.
So the tokens of the partial word at the cursor are backed off the prompt and their text is
returned, for the engine to generate as the constrained start of the middle
(``GenerationParams.healed_prefix``).  The prompt is only shorter at its end, so in SPM order
the prefix KV cache still hits while the user types.

``heal(..., newline=True)`` also backs off a prompt's final line break: code actions cut the
prompt at a line start, and where the tokenizer keeps a newline together with the next line's
indentation (the bundled model's does) a bare ``"\n"`` before indented code is a token the
model never saw there — it then writes junk instead of the indented line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

#: What healing backs off at the end of a prefix: the partial word (identifier characters, with
#: the space before it), else a run of punctuation (``)``, ``=``, ``.``), else spaces or tabs
#: after the last word.  Never a newline: a line break and its indentation are in-distribution.
HEAL_RUN = re.compile(r"(?: ?\w+| ?[^\w\s]+|[ \t]+)\Z")
#: At most this many tokens are backed off (a long identifier heals its last part only).
#: Measured on the bundled model's held-out files (200 cursors, seeds 0 and 1, mean edit
#: similarity): no healing 0.143, last token only 0.169, the word 0.178, word or punctuation
#: 0.183, this rule 0.188 (2 tokens at most: 0.189, 8: same as 4 on seed 0).
HEAL_MAX_TOKENS = 4


class _Tok(Protocol):
    def token_to_id(self, token: str) -> int | None: ...
    def encode(self, text: str): ...


@dataclass(frozen=True)
class FimStyle:
    """One model family's FIM layout as text: its special tokens, the order of the parts, the
    tokens that end a middle and its repository-level tokens.

    :meth:`render` writes a prompt as a string (what a remote completion server such as
    llama.cpp's ``/completion`` takes); :class:`FimFormat` is the same layout in token ids.
    ``middle`` None: the middle follows the last part directly (Codestral).  ``spm_only``: the
    family was trained suffix-first only.  ``requires``: tokens that tell the family apart from
    another with the same three FIM tokens (CodeGemma's ``<|file_separator|>``).
    """

    name: str
    prefix: str
    suffix: str
    middle: str | None
    stops: tuple[str, ...]
    supports_spm: bool = False
    spm_only: bool = False
    repo_name: str | None = None
    file_sep: str | None = None  # before each file's path (Qwen2.5-Coder, StarCoder2)
    file_end: str | None = None  # after each file's content (CodeGemma)
    alternatives: tuple[tuple[str, str, str | None], ...] = ()
    requires: tuple[str, ...] = ()

    def spellings(self) -> tuple[tuple[str, str, str | None], ...]:
        return ((self.prefix, self.suffix, self.middle), *self.alternatives)

    def context_text(
        self, files=(), repo: str | None = None, path: str | None = None
    ) -> tuple[str, str]:
        """(text before the FIM part, text to put at the start of the prefix) for other files.

        Families with repository tokens get them (``<|repo_name|>`` / ``<|file_sep|>``,
        ``<|file_separator|>``); the others get each file as a ``#path`` line and its content at
        the start of the prefix, as DeepSeek-Coder's repository-level examples do."""
        files = [(str(p), str(c) if str(c).endswith("\n") else str(c) + "\n") for p, c in files]
        if self.file_sep is not None:
            # Qwen2.5-Coder: "<|repo_name|>name\n"; StarCoder2: "<repo_name>name" (no line break)
            after_name = "" if self.name == "starcoder" else "\n"
            out = (
                f"{self.repo_name}{repo or 'repo'}{after_name}"
                if self.repo_name and (repo or files)
                else ""
            )
            out += "".join(f"{self.file_sep}{p}\n{c}" for p, c in files)
            return out + (f"{self.file_sep}{path}\n" if path and out else ""), ""
        if self.file_end is not None:
            return "".join(f"{p}\n{c}{self.file_end}" for p, c in files), ""
        return "", "".join(f"#{p}\n{c}" for p, c in files)

    def render(
        self,
        prefix: str,
        suffix: str,
        *,
        files=(),
        repo: str | None = None,
        path: str | None = None,
        spm: bool | None = None,
    ) -> str:
        """The prompt as text: ``files`` ((path, content) pairs) of the same repository first, in
        the family's repository format, then the FIM part; the model's answer follows."""
        head, lead = self.context_text(files, repo, path)
        prefix = lead + prefix
        spm = self.spm_only if spm is None else spm
        if spm and not self.supports_spm:
            raise ValueError(
                f"the {self.name} FIM format was not trained in SPM order; use spm=False"
            )
        if self.spm_only and not spm:
            raise ValueError(f"the {self.name} FIM format is suffix-first only; use spm=True")
        middle = self.middle or ""
        if spm:
            return f"{head}{self.suffix}{suffix}{self.prefix}{prefix}{middle}"
        return f"{head}{self.prefix}{prefix}{self.suffix}{suffix}{middle}"


#: The FIM families, in detection order (a family that needs an extra token comes before one
#: with the same three FIM tokens).
STYLES: dict[str, FimStyle] = {
    s.name: s
    for s in (
        FimStyle(
            "starcoder",
            "<fim_prefix>",
            "<fim_suffix>",
            "<fim_middle>",
            ("<|endoftext|>", "<file_sep>", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
            supports_spm=True,
            repo_name="<repo_name>",
            file_sep="<file_sep>",
        ),
        FimStyle(
            "codegemma",
            "<|fim_prefix|>",
            "<|fim_suffix|>",
            "<|fim_middle|>",
            ("<|file_separator|>", "<eos>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
            file_end="<|file_separator|>",
            requires=("<|file_separator|>",),
        ),
        FimStyle(
            "qwen",
            "<|fim_prefix|>",
            "<|fim_suffix|>",
            "<|fim_middle|>",
            (
                "<|endoftext|>",
                "<|fim_pad|>",
                "<|file_sep|>",
                "<|repo_name|>",
                "<|im_end|>",
                "<|fim_prefix|>",
            ),
            repo_name="<|repo_name|>",
            file_sep="<|file_sep|>",
        ),
        FimStyle(
            "codellama",
            "▁<PRE>",
            "▁<SUF>",
            "▁<MID>",
            ("▁<EOT>", "<EOT>", "</s>"),
            alternatives=(("<PRE>", "<SUF>", "<MID>"),),
        ),
        FimStyle(
            "deepseek",
            "<｜fim▁begin｜>",
            "<｜fim▁hole｜>",
            "<｜fim▁end｜>",
            ("<｜end▁of▁sentence｜>", "<|EOT|>"),
        ),
        FimStyle(
            "codestral",
            "[PREFIX]",
            "[SUFFIX]",
            None,
            ("</s>", "[PREFIX]", "[SUFFIX]"),
            supports_spm=True,
            spm_only=True,
        ),
    )
}


class Context(NamedTuple):
    """Other files' token ids: ``head`` goes before the FIM part, ``lead`` at the start of the
    prefix (families without repository tokens)."""

    head: list[int]
    lead: list[int]


@dataclass(frozen=True)
class FimFormat:
    """The FIM layout of one tokenizer: special token ids plus the tokens that end a middle."""

    name: str
    prefix_id: int
    suffix_id: int
    middle_id: int | None
    stop_ids: frozenset[int]
    supports_spm: bool
    _tok: _Tok = field(repr=False, compare=False, default=None)
    style: FimStyle | None = field(repr=False, compare=False, default=None)

    @classmethod
    def detect(cls, tokenizer: _Tok, name: str | None = None) -> FimFormat | None:
        """The first family whose FIM tokens are all in the vocabulary, or None.

        ``name`` forces a family (overriding detection); ValueError when its tokens are missing."""
        if name is not None and name not in STYLES:
            raise ValueError(f"unknown FIM format {name!r}; known: {', '.join(STYLES)}")
        for style in [STYLES[name]] if name else STYLES.values():
            if any(tokenizer.token_to_id(t) is None for t in style.requires):
                continue
            for tokens in style.spellings():
                ids = [tokenizer.token_to_id(t) if t is not None else None for t in tokens]
                if None in ids[:2] or (tokens[2] is not None and ids[2] is None):
                    continue
                stop = {i for t in style.stops if (i := tokenizer.token_to_id(t)) is not None}
                stop |= set(getattr(tokenizer, "eos_ids", ()) or ())
                return cls(
                    style.name,
                    ids[0],
                    ids[1],
                    ids[2],
                    frozenset(stop),
                    style.supports_spm,
                    tokenizer,
                    style,
                )
        if name is not None:
            raise ValueError(
                f"the tokenizer has no {name} FIM tokens ({', '.join(t for t in STYLES[name].spellings()[0] if t)})"
            )
        return None

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        out = self._tok.encode(text)
        return list(getattr(out, "ids", out))  # engine Tokenizer -> list, tokenizers -> Encoding

    def build(
        self, prefix: str, suffix: str, spm: bool = False, *, context: Context | None = None
    ) -> list[int]:
        """Prompt ids; the model's answer (the middle) follows the last id.  ``context``: other
        files' ids from :meth:`context_ids`, placed first (or at the start of the prefix)."""
        self._check(prefix, suffix, spm)
        return self.layout(self._encode(prefix), self._encode(suffix), spm, context=context)

    def context_ids(self, files, repo: str | None = None, path: str | None = None) -> Context:
        """Other files of the repository ((path, text) pairs) in this family's repository format
        (:meth:`FimStyle.context_text`), encoded: ``(ids before the FIM part, ids at the start of
        the prefix)``.  Encoded on their own, so the prompt's start is the same tokens for every
        cursor and the engine's prefix cache keeps hitting."""
        if self.style is None or not files:
            return Context([], [])
        head, lead = self.style.context_text(files, repo, path)
        return Context(self._encode(head), self._encode(lead))

    def build_healed(
        self,
        prefix: str,
        suffix: str,
        spm: bool = False,
        *,
        newline: bool = False,
        context: Context | None = None,
    ) -> tuple[list[int], str]:
        """``build`` with the prefix healed (:func:`heal`): (prompt ids, the text the middle
        must begin with, to pass as ``GenerationParams.healed_prefix``; "" if nothing healed)."""
        self._check(prefix, suffix, spm)
        kept, healed = heal(self._tok, prefix, self._encode(prefix), newline=newline)
        return self.layout(kept, self._encode(suffix), spm, context=context), healed

    def _check(self, prefix: str, suffix: str, spm: bool) -> None:
        if not isinstance(prefix, str) or not isinstance(suffix, str):
            raise TypeError("prefix and suffix must be str")
        if spm and not self.supports_spm:
            raise ValueError(
                f"the {self.name} FIM format was not trained in SPM order; use spm=False"
            )

    def layout(
        self, p: list[int], s: list[int], spm: bool = False, *, context: Context | None = None
    ) -> list[int]:
        """Prompt ids from already encoded prefix ``p`` and suffix ``s`` (SPM or PSM order),
        after the ``context`` of other files when given."""
        middle = [self.middle_id] if self.middle_id is not None else []
        head, lead = (context.head, context.lead) if context is not None else ((), ())
        if spm or (self.style is not None and self.style.spm_only):
            return [*head, self.suffix_id, *s, self.prefix_id, *lead, *p, *middle]
        return [*head, self.prefix_id, *lead, *p, self.suffix_id, *s, *middle]


def heal(
    tokenizer,
    prefix: str,
    ids: list[int] | None = None,
    *,
    max_tokens: int = HEAL_MAX_TOKENS,
    keep: int = 0,
    run: re.Pattern[str] | None = HEAL_RUN,
    newline: bool = False,
) -> tuple[list[int], str]:
    """Back the partial word at the end of ``prefix`` off its token ids.

    Returns (the ids without the backed-off tokens, their text): every trailing token that
    overlaps ``run``'s match at the end of ``prefix`` (at most ``max_tokens``, never one that
    holds a newline, always leaving ``keep`` ids), cut where the removed tokens' bytes are
    exactly the end of ``prefix`` on a character boundary (``run=None``: no partial words).
    With ``newline`` a prefix that ends in a line break instead loses its last token when that
    token is nothing but line breaks.
    ``ids`` defaults to ``tokenizer.encode(prefix)``.  Needs ``tokenizer.token_bytes(id)`` (the
    engine's :class:`~engine.tokenizer.Tokenizer`); other tokenizers, or nothing to heal, give
    ``(ids, "")``.
    """
    if ids is None:
        out = tokenizer.encode(prefix) if prefix else []
        ids = list(getattr(out, "ids", out))
    ids = list(ids)
    spell = getattr(tokenizer, "token_bytes", None)
    if not callable(spell) or len(ids) <= keep:
        return ids, ""
    raw = prefix.encode("utf-8")
    if newline and raw.endswith((b"\n", b"\r")):
        b = spell(ids[-1])
        if b and not b.strip(b"\r\n") and raw.endswith(b):
            return ids[:-1], b.decode("ascii")
        return ids, ""
    m = run.search(prefix) if run is not None else None
    if m is None:
        return ids, ""
    need = len(prefix[m.start() :].encode("utf-8"))
    tail, best = b"", (0, "")
    for k in range(1, min(max_tokens, len(ids) - keep) + 1):
        b = spell(ids[-k])
        if not b or b"\n" in b or b"\r" in b:
            break
        tail = b + tail
        if not raw.endswith(tail):
            break
        try:
            best = (k, tail.decode("utf-8"))  # a token may end inside a character: keep going
        except UnicodeDecodeError:
            continue
        if len(tail) >= need:
            break
    k, text = best
    return (ids[:-k], text) if k else (ids, "")
