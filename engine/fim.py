"""Fill-in-the-middle prompt layouts of the code models we can drive.

``FimFormat.detect(tokenizer)`` recognises a tokenizer's FIM special tokens:

* ``spark`` / StarCoder style: ``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>``
  (the bundled model; stops at ``<|endoftext|>`` and ``<file_sep>``),
* Qwen2.5-Coder: ``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>``,
* CodeLlama: ``▁<PRE>``/``<PRE>``, ``▁<SUF>``, ``▁<MID>``, ends with ``▁<EOT>``.

``build(prefix, suffix, spm)`` returns token ids.  Each part is encoded on its own, so the
tokens of the prefix do not change when text is added to the suffix and vice versa, and in
SPM order (``<fim_suffix>S<fim_prefix>P<fim_middle>``) the prompt only grows at its end as
the user types, which keeps the prompt's KV cache reusable.  SPM is offered only for the
StarCoder-style tokens, in the order the bundled model was trained on; Qwen2.5-Coder and
CodeLlama were trained on PSM, so they get PSM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class _Tok(Protocol):
    def token_to_id(self, token: str) -> int | None: ...
    def encode(self, text: str): ...


# name, (prefix, suffix, middle) alternatives, extra stop tokens, supports SPM
_STYLES = (
    ("starcoder", (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),),
     ("<|endoftext|>", "<file_sep>", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"), True),
    ("qwen", (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),),
     ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>", "<|fim_prefix|>"), False),
    ("codellama", (("▁<PRE>", "▁<SUF>", "▁<MID>"), ("<PRE>", "<SUF>", "<MID>")),
     ("▁<EOT>", "<EOT>", "</s>"), False),
)


@dataclass(frozen=True)
class FimFormat:
    """The FIM layout of one tokenizer: special token ids plus the tokens that end a middle."""

    name: str
    prefix_id: int
    suffix_id: int
    middle_id: int
    stop_ids: frozenset[int]
    supports_spm: bool
    _tok: _Tok = field(repr=False, compare=False, default=None)

    @classmethod
    def detect(cls, tokenizer: _Tok) -> "FimFormat | None":
        """The format whose three FIM tokens are all in the vocabulary, or None."""
        for name, alternatives, stops, spm in _STYLES:
            for tokens in alternatives:
                ids = [tokenizer.token_to_id(t) for t in tokens]
                if None in ids:
                    continue
                stop = {i for t in stops if (i := tokenizer.token_to_id(t)) is not None}
                stop |= set(getattr(tokenizer, "eos_ids", ()) or ())
                return cls(name, ids[0], ids[1], ids[2], frozenset(stop), spm, tokenizer)
        return None

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        out = self._tok.encode(text)
        return list(getattr(out, "ids", out))  # engine Tokenizer -> list, tokenizers -> Encoding

    def build(self, prefix: str, suffix: str, spm: bool = False) -> list[int]:
        """Prompt ids; the model's answer (the middle) follows the last id."""
        if not isinstance(prefix, str) or not isinstance(suffix, str):
            raise TypeError("prefix and suffix must be str")
        if spm and not self.supports_spm:
            raise ValueError(f"the {self.name} FIM format was not trained in SPM order; use spm=False")
        p, s = self._encode(prefix), self._encode(suffix)
        if spm:
            return [self.suffix_id, *s, self.prefix_id, *p, self.middle_id]
        return [self.prefix_id, *p, self.suffix_id, *s, self.middle_id]
