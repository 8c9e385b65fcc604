"""Tokenizer of a model folder, over the ``tokenizers`` library (no transformers at run time).

Reads ``tokenizer.json`` for the vocabulary and ``tokenizer_config.json`` /
``special_tokens_map.json`` / ``generation_config.json`` / ``config.json`` for the special tokens,
so eos is the union of everything the folder declares, and keeps the chat template
(``tokenizer_config.json``, else ``chat_template.jinja``) as ``Tokenizer.chat``. ``Tokenizer.fim`` is the folder's
fill-in-the-middle format (``engine.fim``), and ``stream()`` decodes incrementally for streaming.
``Tokenizer.byte_index()`` spells every token as raw bytes (built once per tokenizer) so
generation can be constrained to text that must come next (token healing, ``engine.sampling``).
"""

from __future__ import annotations

import bisect
import json
import operator
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, SupportsIndex, overload

import numpy as np

from .config import ModelError, model_name, model_path
from .fim import FimFormat
from .heap import trim_heap

_EOS_FALLBACKS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<EOT>")


#: The keys of ``tokenizer_config.json`` a chat template is rendered with (``Tokenizer.chat``).
CHAT_KEYS = ("chat_template", "bos_token", "eos_token")


def _chat_settings(folder: Path, tcfg: dict[str, Any]) -> dict[str, Any]:
    """``Tokenizer.chat`` of a folder: ``tokenizer_config.json``'s, its template from
    ``chat_template.jinja`` when it has none (where recent Hugging Face tooling writes it)."""
    chat = {k: tcfg[k] for k in CHAT_KEYS if tcfg.get(k) is not None}
    jinja = folder / "chat_template.jinja"
    if "chat_template" not in chat and jinja.is_file():
        try:
            chat["chat_template"] = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelError(f"{jinja}: cannot read: {e}") from None
    return chat


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


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte, inverted."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_LEVEL_CHARS = _bytes_to_unicode()
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes(Sequence):
    """What each token id spells, as a read-only sequence: ``tb[i]`` is bytes, or None for a
    special/control token.

    A view of a :class:`ByteIndex`'s storage (one bytes blob of every token in id order, its
    offsets, a None mask), so a large vocabulary costs no Python object per token; each lookup
    slices a fresh bytes object out of the blob.
    """

    __slots__ = ("_blob", "_off", "_none")

    def __init__(self, blob: bytes, off: memoryview, none: memoryview) -> None:
        self._blob = blob
        self._off = off  # token i is blob[off[i] : off[i + 1]]
        self._none = none  # none[i]: token i spells nothing (None, not b"")

    def __len__(self) -> int:
        return len(self._none)

    @overload
    def __getitem__(self, i: SupportsIndex) -> bytes | None: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[bytes | None, ...]: ...
    def __getitem__(self, i: SupportsIndex | slice) -> bytes | None | tuple[bytes | None, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        i = operator.index(i)
        if i < 0:
            i += len(self._none)
        if not 0 <= i < len(self._none):
            raise IndexError("token id out of range")
        if self._none[i]:
            return None
        return self._blob[self._off[i] : self._off[i + 1]]

    def __repr__(self) -> str:
        return f"<TokenBytes of {len(self)} tokens>"


_KEY_MAX = 2**64 - 1


class ByteIndex:
    """Token ids looked up by their bytes, for constraining the next token to a pending text.

    ``token_bytes[i]`` is what token ``i`` spells (None for special/control tokens; see
    :class:`TokenBytes`).  The tokens with non-empty bytes are also kept sorted by their bytes
    (``_order``), so the tokens that start with a text are one contiguous range and the text's
    own spellings (several ids may spell the same bytes) are the first tokens of that range.
    Each sorted token's first 8 bytes, zero-padded, are a big-endian uint64 (``_keys``), sorted
    like the bytes: ``consistent`` finds the ranges of every prefix of up to 8 pending bytes
    with one vectorised ``searchsorted`` and narrows a longer pending text by bisection inside
    its 8-byte range (usually a handful of tokens), so a lookup costs microseconds plus the
    size of the answer, even for a 150k vocabulary.

    Storage is one bytes blob of every token (in id order) and a few numpy arrays (offsets,
    order, keys, a None mask: 17 bytes a token), with no Python object per token: every engine
    process builds an index, and tuples, lists and dicts of a 150k vocabulary cost tens of MB.
    Construction sorts by the uint64 keys in numpy and sorts only the runs of tokens that share
    their first 8 bytes by their full bytes in Python.
    """

    def __init__(self, token_bytes: Sequence[bytes | None]) -> None:
        tb = token_bytes if isinstance(token_bytes, (list, tuple)) else list(token_bytes)
        count = len(tb)
        lens = np.fromiter((-1 if b is None else len(b) for b in tb), np.int32, count)
        none = lens < 0
        lens[none] = 0
        # joined in chunks: bytes.join of the whole vocabulary would take a scratch buffer
        # descriptor (80 bytes) per token, several times the blob, that the allocator keeps
        blob = b"".join(
            [b"".join([b for b in tb[s : s + 4096] if b]) for s in range(0, count, 4096)]
        )
        off = np.zeros(count + 1, np.int32 if len(blob) < 2**31 else np.int64)
        np.cumsum(lens, out=off[1:])
        keys = np.fromiter(
            (int.from_bytes(b[:8].ljust(8, b"\0"), "big") if b else 0 for b in tb), np.uint64, count
        )
        order = np.argsort(keys, kind="stable")  # ties stay in id order
        order = order[lens[order] > 0].astype(np.int32)  # only tokens that spell something
        keys = keys[order]
        # equal keys: tokens that share their first 8 bytes (or, zero-padded, are prefixes of
        # one another); the bytes after the 8th decide their order
        tied = np.flatnonzero(keys[1:] == keys[:-1])
        if tied.size:
            firsts = tied[np.r_[True, tied[1:] != tied[:-1] + 1]]
            lasts = tied[np.r_[tied[1:] != tied[:-1] + 1, True]] + 2
            for a, b in zip(firsts.tolist(), lasts.tolist()):
                order[a:b] = sorted(order[a:b].tolist(), key=tb.__getitem__)  # stable
        self._blob = blob
        self._off = off
        self._none = none
        self._order = order  # token ids in byte order (only tokens that spell something)
        self._keys = keys  # _keys[r]: the first 8 bytes of the r-th token in byte order
        self._off_mv = memoryview(off)
        self._order_mv = memoryview(order)
        self._keys_mv = memoryview(keys)
        self.token_bytes = TokenBytes(blob, self._off_mv, memoryview(none))

    def __reduce__(self) -> tuple[Any, ...]:
        return ByteIndex, (tuple(self.token_bytes),)  # memoryviews do not pickle: rebuilt

    @property
    def nbytes(self) -> int:
        """Bytes of storage: the blob and the arrays."""
        arrays = (self._off, self._none, self._order, self._keys)
        return len(self._blob) + sum(a.nbytes for a in arrays)

    def _key(self, r: int) -> bytes:
        """The bytes of the ``r``-th token in byte order."""
        i = self._order_mv[r]
        return self._blob[self._off_mv[i] : self._off_mv[i + 1]]

    def consistent(self, pending: bytes) -> np.ndarray:
        """Sorted ids whose bytes start with ``pending`` or are a non-empty prefix of it."""
        if not pending:
            raise ValueError("pending text is empty: every token is consistent")
        n, size = len(self._order), len(pending)
        m = min(size, 8)
        head = int.from_bytes(pending[:m], "big")
        # pending[:k] zero-padded to a key: every token that starts with it has a key in
        # [wanted[k - 1], that + 2 ** (64 - 8k)), and so do tokens shorter than k that are
        # prefixes of it when pending[:k] ends in zero bytes (the scans below skip those)
        wanted = [(head >> 8 * (m - k)) << (64 - 8 * k) for k in range(1, m + 1)]
        top = (head + 1) << (64 - 8 * m)  # 2**64 when pending[:8] is all 0xff: to the end
        at = self._keys.searchsorted(np.array([*wanted, top & _KEY_MAX], np.uint64)).tolist()
        keys, off, order = self._keys_mv, self._off_mv, self._order_mv
        exact: list[int] = []  # the tokens that spell a proper prefix of pending
        for k in range(1, min(size - 1, 8) + 1):
            r, key = at[k - 1], wanted[k - 1]
            while r < n and keys[r] == key:  # pending[:k] zero-padded: shorter, exact, longer
                i = order[r]
                length = off[i + 1] - off[i]
                if length > k:
                    break
                if length == k:
                    exact.append(i)
                r += 1
        lo, hi = at[m - 1], (at[m] if top <= _KEY_MAX else n)
        while lo < hi and off[order[lo] + 1] - off[order[lo]] < m:
            lo += 1
        if size > 8:  # [lo, hi) start with pending[:8]: narrow it a byte at a time
            key_of, places = self._key, range(n)  # bisect over places: r is the r-th token
            for k in range(9, size + 1):
                if lo >= hi:
                    break
                prefix = pending[:k]
                lo = bisect.bisect_left(places, prefix, lo, hi, key=key_of)
                if prefix[-1] != 0xFF:  # else the range already ends where pending[:k] does
                    succ = prefix[:-1] + bytes((prefix[-1] + 1,))
                    hi = bisect.bisect_left(places, succ, lo, hi, key=key_of)
                r = lo  # pending[:k] itself sorts first among the tokens that start with it
                while k < size and r < hi and off[order[r] + 1] - off[order[r]] == k:
                    exact.append(order[r])
                    r += 1
        found = max(hi - lo, 0)
        out = np.empty(found + len(exact), np.int64)
        out[:found] = self._order[lo : lo + found]
        out[found:] = exact
        out.sort()
        return out


class Tokenizer:
    """Encode/decode plus the special tokens the engine and the prompt builder need."""

    def __init__(
        self,
        tok: Any,
        *,
        eos_ids: Iterable[int] = (),
        bos_id: int | None = None,
        pad_id: int | None = None,
        name: str = "tokenizer",
        chat: dict[str, Any] | None = None,
    ) -> None:
        self._tok = tok
        self.name = name
        #: What a chat template needs of the model (``chat_template``, ``bos_token``,
        #: ``eos_token``, as ``tokenizer_config.json`` holds them); empty for a model without one.
        self.chat: dict[str, Any] = dict(chat or {})
        self.special_tokens: dict[str, int] = {
            t.content: i for i, t in sorted(tok.get_added_tokens_decoder().items()) if t.special
        }
        eos = set(eos_ids)
        if not eos:
            eos = {i for t in _EOS_FALLBACKS if (i := tok.token_to_id(t)) is not None}
        self.eos_ids: frozenset[int] = frozenset(eos)
        self.bos_id = bos_id
        self.pad_id = pad_id
        self._vocab_size = tok.get_vocab_size(with_added_tokens=True)  # fixed once loaded
        self.fim = FimFormat.detect(self)  # None for models without FIM tokens
        self._byte_index: ByteIndex | None = None
        self._byte_index_lock = threading.Lock()  # built once, by whichever thread asks first
        self._spell: Callable[[int], bytes | None] | None = None

    @classmethod
    def load(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the special-token files of a model folder."""
        from tokenizers import Tokenizer as HFTokenizer

        folder = model_path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelError(
                f"{path}: file not found (a tokenizers-format tokenizer.json is required)"
            )
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on corrupt files
            raise ModelError(
                f"tokenizer.json: cannot load: {str(e).splitlines()[0] if str(e) else e!r}"
            ) from None
        trim_heap()  # the parsed JSON (tens of MB for a 150k vocabulary) is freed, not returned

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
                        raise ModelError(
                            f"{fname}: {key}={content!r} is not in the vocabulary of tokenizer.json"
                        )
                    return tid
            return None

        vocab = tok.get_vocab_size(with_added_tokens=True)
        eos: list[int] = []
        if (e := special("eos_token")) is not None:
            eos.append(e)
        for cfg, fname in ((gcfg, "generation_config.json"), (mcfg, "config.json")):
            v = cfg.get("eos_token_id")
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, int) and not isinstance(x, bool):
                    if not 0 <= x < vocab:
                        raise ModelError(
                            f"{fname}: eos_token_id={x} is outside the tokenizer vocabulary ({vocab})"
                        )
                    eos.append(x)
        return cls(
            tok,
            eos_ids=eos,
            bos_id=special("bos_token"),
            pad_id=special("pad_token"),
            name=model_name(folder),
            chat=_chat_settings(folder, tcfg),
        )

    # -- vocabulary ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def serialized(self) -> str:
        """The vocabulary and its rules as a ``tokenizer.json`` (the ``tokenizers`` format)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def byte_index(self) -> ByteIndex:
        """The :class:`ByteIndex` of this vocabulary (built on first use, then cached).

        Its ``token_bytes`` are the raw bytes each token id spells; None for special tokens.
        Byte-level BPE tokens map back through the GPT-2 byte alphabet; SentencePiece tokens
        turn ``▁`` into a space and ``<0xNN>`` into that byte; added non-special tokens are their
        literal content.
        """
        if self._byte_index is None:
            with self._byte_index_lock:
                if self._byte_index is None:
                    self._byte_index = ByteIndex(self._spell_tokens())
                    trim_heap()  # the spelled list and the sort's temporaries
        return self._byte_index

    def build_byte_index_in_background(self) -> threading.Thread:
        """Start building :meth:`byte_index` on a daemon thread (a large vocabulary takes about a
        second of Python): a server that starts it while it warms up the model is ready that much
        sooner, and a token-healed request that comes first waits only for what is left."""
        t = threading.Thread(target=self.byte_index, name="spark-byte-index", daemon=True)
        t.start()
        return t

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes token ``token_id`` spells, as in :meth:`byte_index` (None for special
        tokens and ids outside the vocabulary).

        From the index once it is built; else this one token is spelled alone, so a prompt
        builder that heals a few tokens per prompt (``engine.fim.heal``) needs no index of the
        whole vocabulary: a language server whose engine runs elsewhere never builds one.
        """
        if not 0 <= token_id < self.vocab_size:
            return None
        if self._byte_index is not None:
            return self._byte_index.token_bytes[token_id]
        return self._speller()(token_id)

    def _spell_tokens(self) -> list[bytes | None]:
        spell = self._speller()
        return [spell(i) for i in range(self.vocab_size)]

    def _speller(self) -> Callable[[int], bytes | None]:
        """``spell(i)``: what token ``i`` spells (made once: the decoder kind, the added tokens)."""
        if self._spell is not None:
            return self._spell
        try:
            decoder = (
                json.loads(self._tok.decoder.__getstate__())
                if self._tok.decoder is not None
                else {}
            )
        except Exception:  # an exotic decoder: fall back to the SentencePiece/literal spelling
            decoder = {}
        kinds = {decoder.get("type")} | {
            d.get("type") for d in decoder.get("decoders", ()) if isinstance(d, dict)
        }
        byte_level = "ByteLevel" in kinds
        added = self._tok.get_added_tokens_decoder()
        id_to_token = self._tok.id_to_token

        def spell(i: int) -> bytes | None:
            if i in added:
                return None if added[i].special else added[i].content.encode("utf-8")
            piece = id_to_token(i)
            if piece is None:
                return None
            if byte_level and all(c in _BYTE_LEVEL_CHARS for c in piece):
                return bytes(_BYTE_LEVEL_CHARS[c] for c in piece)
            if (m := _SP_BYTE.fullmatch(piece)) is not None:
                return bytes([int(m.group(1), 16)])
            return piece.replace("▁", " ").encode("utf-8")

        self._spell = spell
        return spell

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

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenisation: ``push(id)`` returns only the newly completed text.

    Decodes a short window of recent tokens twice (with and without the new one) and emits the
    difference, holding it back while it ends in U+FFFD (a UTF-8 character split across byte-level
    tokens). The window keeps leading-space handling of SentencePiece-style decoders right.
    A UTF-8 character spans at most 4 bytes, so text still undecodable after ``MAX_HELD`` tokens
    is invalid, not pending: it is emitted (with U+FFFD) instead of growing the window forever.
    """

    MAX_HELD = 8

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # tokens whose text was already emitted

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if (
            not 0 <= token_id < self._tok.vocab_size
        ):  # checked once here, not on every window decode
            raise ValueError(
                f"token id {token_id} is outside the vocabulary (0..{self._tok.vocab_size - 1})"
            )
        self._ids.append(token_id)
        decode = self._tok._tok.decode  # ids already checked: the raw decoder, once per window
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=False)
        new_text = decode(self._ids[self._prefix :], skip_special_tokens=False)
        held = len(self._ids) - self._read
        if len(new_text) > len(prefix_text) and (
            not new_text.endswith("\ufffd") or held >= self.MAX_HELD
        ):
            out = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return out
        return ""

    def flush(self) -> str:
        """Text still held back (e.g. a truncated UTF-8 sequence, as U+FFFD) at the end of a stream."""
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]
