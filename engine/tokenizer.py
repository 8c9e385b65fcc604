"""Tokenizer of a model folder, over the ``tokenizers`` library (no transformers at run time).

Reads ``tokenizer.json`` for the vocabulary and ``tokenizer_config.json`` /
``special_tokens_map.json`` / ``generation_config.json`` / ``config.json`` for the special tokens,
so eos is the union of everything the folder declares. Also detects the fill-in-the-middle token
style (StarCoder, Qwen2.5-Coder, CodeLlama, DeepSeek) and decodes incrementally for streaming.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .config import ModelError, model_path


@dataclass(frozen=True)
class FimFormat:
    """Fill-in-the-middle special tokens of a model; prompt = prefix P suffix S middle (PSM)."""

    name: str  # 'starcoder' | 'qwen' | 'codellama' | 'deepseek'
    prefix: str
    suffix: str
    middle: str
    prefix_id: int
    suffix_id: int
    middle_id: int
    file_sep: str | None = None  # repo-level file separator token, if the vocabulary has one
    file_sep_id: int | None = None


# (name, prefix, suffix, middle, file separators to look for)
_FIM_STYLES = (
    ("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<file_sep>",)),
    ("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", ("<|file_sep|>", "<file_sep>")),
    ("codellama", "<PRE>", "<SUF>", "<MID>", ()),
    ("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", ()),
    ("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", ()),
)
_EOS_FALLBACKS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<EOT>")


def _token_content(v: Any) -> str | None:
    """A special-token entry is either a string or an AddedToken dict with 'content'."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path.name}: cannot parse: {e}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path.name}: expected a JSON object")
    return data


class Tokenizer:
    """Encode/decode plus the special tokens the engine and the prompt builder need."""

    def __init__(self, tok: Any, *, eos_ids: Iterable[int] = (), bos_id: int | None = None,
                 pad_id: int | None = None, name: str = "tokenizer") -> None:
        self._tok = tok
        self.name = name
        self.special_tokens: dict[str, int] = {
            t.content: i for i, t in sorted(tok.get_added_tokens_decoder().items()) if t.special
        }
        eos = set(eos_ids)
        if not eos:
            eos = {i for t in _EOS_FALLBACKS if (i := tok.token_to_id(t)) is not None}
        self.eos_ids: frozenset[int] = frozenset(eos)
        self.bos_id = bos_id
        self.pad_id = pad_id
        self.fim = self._detect_fim()

    @classmethod
    def load(cls, model_dir: str | Path) -> "Tokenizer":
        """Load ``tokenizer.json`` and the special-token files of a model folder."""
        from tokenizers import Tokenizer as HFTokenizer

        folder = model_path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"{path}: file not found (a tokenizers-format tokenizer.json is required)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on corrupt files
            raise ModelError(f"tokenizer.json: cannot load: {str(e).splitlines()[0] if str(e) else e!r}") from None

        tcfg = _read_optional_json(folder / "tokenizer_config.json")
        smap = _read_optional_json(folder / "special_tokens_map.json")
        gcfg = _read_optional_json(folder / "generation_config.json")
        mcfg = _read_optional_json(folder / "config.json")

        def special(key: str) -> int | None:
            for cfg, fname in ((tcfg, "tokenizer_config.json"), (smap, "special_tokens_map.json")):
                content = _token_content(cfg.get(key))
                if content is not None:
                    tid = tok.token_to_id(content)
                    if tid is None:
                        raise ModelError(f"{fname}: {key}={content!r} is not in the vocabulary of tokenizer.json")
                    return tid
            return None

        vocab = tok.get_vocab_size(with_added_tokens=True)
        eos: list[int] = []
        if (e := special("eos_token")) is not None:
            eos.append(e)
        for cfg, fname in ((gcfg, "generation_config.json"), (mcfg, "config.json")):
            v = cfg.get("eos_token_id")
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, int) and not isinstance(x, bool):
                    if not 0 <= x < vocab:
                        raise ModelError(f"{fname}: eos_token_id={x} is outside the tokenizer vocabulary ({vocab})")
                    eos.append(x)
        return cls(tok, eos_ids=eos, bos_id=special("bos_token"), pad_id=special("pad_token"),
                   name=folder.name)

    # -- vocabulary ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # -- text ----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no bos/eos added. Special-token strings in text become their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (incomplete UTF-8 at the end becomes U+FFFD; see StreamDecoder)."""
        ids = list(ids)
        vocab = self.vocab_size
        for i in ids:
            if not 0 <= int(i) < vocab:
                raise ValueError(f"token id {i} is outside the vocabulary (0..{vocab - 1})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def _detect_fim(self) -> FimFormat | None:
        for name, p, s, m, seps in _FIM_STYLES:
            ids = [self._tok.token_to_id(t) for t in (p, s, m)]
            if None in ids:
                continue
            sep = next((t for t in seps if self._tok.token_to_id(t) is not None), None)
            return FimFormat(name, p, s, m, ids[0], ids[1], ids[2], sep,
                             self._tok.token_to_id(sep) if sep else None)
        return None


class StreamDecoder:
    """Incremental detokenisation: ``push(id)`` returns only the newly completed text.

    Decodes a short window of recent tokens twice (with and without the new one) and emits the
    difference, holding it back while it ends in U+FFFD (a UTF-8 character split across byte-level
    tokens). The window keeps leading-space handling of SentencePiece-style decoders right.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # tokens whose text was already emitted

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            out = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            return out
        return ""

    def flush(self) -> str:
        """Text still held back (e.g. a truncated UTF-8 sequence, as U+FFFD) at the end of a stream."""
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text):]
