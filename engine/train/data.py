"""Training data: files -> (FIM-transformed) token documents -> packed fixed-length sequences.

About half of the documents are turned into fill-in-the-middle examples, half of those in
PSM order (``<fim_prefix>P<fim_suffix>S<fim_middle>M<|endoftext|>``) and half in SPM order
(``<fim_suffix>S<fim_prefix>P<fim_middle>M<|endoftext|>``; the server uses SPM because the
prompt then grows at its end while the user types, so the KV cache of the prompt is reused).
The middle is usually the rest of a line (what an editor asks for), sometimes the rest of a
line plus a few lines, sometimes a random character span.  Each part is encoded separately,
exactly as the server encodes prompts, so the tokens at the part boundaries match.

The stream is a pure function of (files, seed): resuming skips the sequences already
consumed instead of storing loader state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .tokenizer import EOS, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX


@dataclass(frozen=True)
class FimConfig:
    rate: float = 0.5          # fraction of documents turned into FIM examples
    spm_rate: float = 0.5      # of those, fraction in SPM order
    line_rate: float = 0.5     # middle = rest of one line
    lines_rate: float = 0.2    # middle = rest of a line + 1..4 more lines; else a random span


def _line_starts(text: str) -> list[int]:
    starts = [0]
    i = text.find("\n")
    while i != -1:
        starts.append(i + 1)
        i = text.find("\n", i + 1)
    return starts


def fim_split(text: str, rng: random.Random, cfg: FimConfig = FimConfig()) -> tuple[str, str, str]:
    """Split ``text`` into (prefix, middle, suffix) at character level.

    Line-level middles start somewhere inside a non-blank line (after its indentation) and end
    before the line's newline, which stays in the suffix: the same shape as an editor's
    "complete the rest of this line" request with the text after the line as suffix.
    """
    r = rng.random()
    if r < cfg.line_rate + cfg.lines_rate:
        starts = _line_starts(text)
        ends = [s - 1 for s in starts[1:]] + [len(text)]
        lines = [i for i, (s, e) in enumerate(zip(starts, ends)) if text[s:e].strip()]
        if lines:
            li = rng.choice(lines)
            s, e = starts[li], ends[li]
            line = text[s:e]
            indent = len(line) - len(line.lstrip())
            # cursor in [indent, len(line)]; the end of the line (empty middle) is rare
            cursor = s + (rng.randint(indent, len(line) - 1) if rng.random() > 0.05 else len(line))
            if r >= cfg.line_rate:  # extend the middle over 1..4 following lines
                for _ in range(rng.randint(1, 4)):
                    if e >= len(text):
                        break
                    n = text.find("\n", e + 1)
                    e = len(text) if n == -1 else n
            return text[:cursor], text[cursor:e], text[e:]
    a, b = sorted(rng.randint(0, len(text)) for _ in range(2))
    return text[:a], text[a:b], text[b:]


def split_segments(text: str, max_chars: int) -> list[str]:
    """Split a long file at line boundaries into pieces of at most ~max_chars characters, so
    that a FIM example (prefix, suffix and middle) fits into one training sequence."""
    if len(text) <= max_chars:
        return [text]
    out, start = [], 0
    while start < len(text):
        end = min(start + max_chars, len(text))
        if end < len(text):
            nl = text.rfind("\n", start, end)
            if nl > start:
                end = nl + 1
        out.append(text[start:end])
        start = end
    return out


class DocumentEncoder:
    """Turns a file's text into the token ids of its training documents."""

    def __init__(self, tokenizer, fim: FimConfig = FimConfig(), segment_chars: int = 3000):
        self.tok = tokenizer
        self.fim = fim
        self.segment_chars = segment_chars
        self.eos = tokenizer.token_to_id(EOS)
        self.pre = tokenizer.token_to_id(FIM_PREFIX)
        self.suf = tokenizer.token_to_id(FIM_SUFFIX)
        self.mid = tokenizer.token_to_id(FIM_MIDDLE)
        if None in (self.eos, self.pre, self.suf, self.mid):
            raise ValueError("tokenizer lacks the special tokens "
                             f"{EOS}, {FIM_PREFIX}, {FIM_SUFFIX}, {FIM_MIDDLE}")

    def _enc(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False).ids if s else []

    def fim_ids(self, prefix: str, middle: str, suffix: str, spm: bool) -> list[int]:
        p, m, s = self._enc(prefix), self._enc(middle), self._enc(suffix)
        if spm:
            return [self.suf, *s, self.pre, *p, self.mid, *m, self.eos]
        return [self.pre, *p, self.suf, *s, self.mid, *m, self.eos]

    def encode_file(self, text: str, rng: random.Random) -> list[int]:
        """Plain segments stay contiguous (one file = one document ending in EOS); a segment
        drawn for FIM becomes its own self-contained example."""
        out: list[int] = []
        plain = ""
        for seg in split_segments(text, self.segment_chars):
            if rng.random() < self.fim.rate and seg.strip():
                if plain:
                    out += self._enc(plain) + [self.eos]
                    plain = ""
                pre, mid, suf = fim_split(seg, rng, self.fim)
                out += self.fim_ids(pre, mid, suf, spm=rng.random() < self.fim.spm_rate)
            else:
                plain += seg
        if plain:
            out += self._enc(plain) + [self.eos]
        return out


def packed_sequences(files: list[Path], tokenizer, seq_len: int, seed: int,
                     fim: FimConfig = FimConfig(), segment_chars: int = 3000,
                     epochs: int | None = None) -> Iterator[list[int]]:
    """Endless (or ``epochs``-long) stream of ``seq_len``-token sequences: files shuffled per
    epoch, documents concatenated and cut into fixed lengths (no padding)."""
    texts = [p.read_text(encoding="utf-8") for p in files]
    enc = DocumentEncoder(tokenizer, fim, segment_chars)
    buf: list[int] = []
    epoch = 0
    while epochs is None or epoch < epochs:
        rng = random.Random(seed * 1_000_003 + epoch)
        order = list(range(len(texts)))
        rng.shuffle(order)
        for i in order:
            buf += enc.encode_file(texts[i], rng)
            while len(buf) >= seq_len:
                yield buf[:seq_len]
                buf = buf[seq_len:]
        epoch += 1


def count_tokens(files: list[Path], tokenizer) -> int:
    """Tokens of the files as plain text (without FIM): the size of one epoch."""
    return sum(len(tokenizer.encode(p.read_text(encoding="utf-8"), add_special_tokens=False).ids)
               for p in files)


def shuffle_buffer(stream: Iterator[list[int]], size: int, seed: int) -> Iterator[list[int]]:
    """Shuffle a stream through a buffer of ``size`` sequences, so that one small batch mixes
    many files instead of consecutive pieces of one (far less gradient noise).  Deterministic."""
    if size <= 1:
        yield from stream
        return
    rng = random.Random(seed)
    buf: list[list[int]] = []
    for item in stream:
        if len(buf) < size:
            buf.append(item)
            continue
        i = rng.randrange(size)
        yield buf[i]
        buf[i] = item
    rng.shuffle(buf)
    yield from buf
