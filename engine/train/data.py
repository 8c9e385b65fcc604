"""Training data: files -> (FIM-transformed) token documents -> packed fixed-length sequences.

About half of the documents are turned into fill-in-the-middle examples, half of those in
PSM order (``<fim_prefix>P<fim_suffix>S<fim_middle>M<|endoftext|>``) and half in SPM order
(``<fim_suffix>S<fim_prefix>P<fim_middle>M<|endoftext|>``; the server uses SPM because the
prompt then grows at its end while the user types, so the KV cache of the prompt is reused).
The middle is usually the rest of a line (what an editor asks for), sometimes the rest of a
line plus a few lines, sometimes a random character span.  Each part is encoded separately,
exactly as the server encodes prompts, so the tokens at the part boundaries match.

With ``EditConfig.copy_rate`` > 0 files also yield shuffled token windows repeated
(:func:`copy_document`), which teach attention to copy from the context.  With
``EditConfig.rate`` > 0 some files also yield an *edited copy* document: a function or
class of the file, then the same block again after a small refactoring (renamed, a parameter
renamed or added, type hints added).  That is the shape of a rewrite code action — the original
is in the context and the model writes the new version, mostly by copying — and it teaches the
copying that speculative edits feed on (the original is the draft).

The stream is a pure function of (files, seed): resuming skips the sequences already
consumed instead of storing loader state.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .tokenizer import EOS, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX


@dataclass(frozen=True)
class FimConfig:
    rate: float = 0.5  # fraction of documents turned into FIM examples
    spm_rate: float = 0.5  # of those, fraction in SPM order
    line_rate: float = 0.5  # middle = rest of one line
    lines_rate: float = 0.2  # middle = rest of a line + 1..4 more lines; else a random span


@dataclass(frozen=True)
class EditConfig:
    rate: float = 0.0  # edited-copy documents per file (on average; 0.3: 30% of files get one)
    context_chars: int = 600  # file text kept before the original block
    max_block_chars: int = 1500
    copy_rate: float = 0.0  # repeated-window documents per file (on average), see copy_document


def _draws(rate: float, rng: random.Random) -> int:
    """How many documents a per-file ``rate`` gives this file: its whole part, plus one with the
    probability of its fraction."""
    return int(rate) + (rng.random() < rate % 1)


def copy_document(pool: list[int], rng: random.Random) -> list[int] | None:
    """A window of 16-96 of the file's tokens, shuffled, repeated 2-3 times.

    Shuffled, the window's n-gram statistics predict nothing: only looking back at the first
    occurrence (an induction head) predicts the repeats.  A small model trained on code alone had
    not formed one after 31M tokens (it could not copy a name it saw 100 tokens earlier), which
    is what both copying an original in an edit and reusing names from the context need.
    """
    n = rng.randint(16, 96)
    if len(pool) <= n:
        return None
    start = rng.randrange(len(pool) - n)
    window = pool[start : start + n]
    rng.shuffle(window)
    return window * rng.randint(2, 3)


_HEADER_RE = re.compile(r"^([ \t]*)(?:async[ \t]+)?(def|class)[ \t]+([A-Za-z_]\w*)(.*):[ \t]*$")
_TYPES = (
    "int",
    "str",
    "float",
    "bool",
    "bytes",
    "list",
    "dict",
    "object",
    "list[str]",
    "dict[str, int]",
)
_NAMES = (
    "value",
    "items",
    "data",
    "key",
    "name",
    "result",
    "count",
    "path",
    "text",
    "node",
    "obj",
    "options",
    "timeout",
    "limit",
    "index",
    "source",
    "target",
    "callback",
    "default",
    "verbose",
)


def code_blocks(text: str, max_chars: int = 1500) -> list[tuple[int, int]]:
    """(start, end) character spans of ``def``/``class`` blocks with a one-line header, 3+ lines."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))
    out = []
    for i, ln in enumerate(lines):
        m = _HEADER_RE.match(ln.rstrip("\r\n"))
        if not m:
            continue
        ind = len(m.group(1).expandtabs())
        j = i + 1
        while j < len(lines) and (
            not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > ind
        ):
            j += 1
        while j > i + 1 and not lines[j - 1].strip():  # trailing blank lines stay outside
            j -= 1
        if j - i >= 3 and starts[j] - starts[i] <= max_chars:
            out.append((starts[i], starts[j]))
    return out


def _split_params(params: str) -> list[str]:
    """Top-level comma split of a parameter list."""
    out, depth, cur = [], 0, ""
    for ch in params:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return out


def edit_block(block: str, rng: random.Random, words: list[str]) -> str | None:
    """A refactored copy of ``block`` (first line = its header), or None if nothing applies."""
    header, _, body = block.partition("\n")
    m = _HEADER_RE.match(header.rstrip("\r"))
    if not m:
        return None
    kind, name, rest = m.group(2), m.group(3), m.group(4)
    params = rest[rest.find("(") + 1 : rest.rfind(")")] if "(" in rest and ")" in rest else None
    simple = [
        p.strip()
        for p in _split_params(params or "")
        if re.fullmatch(r"\s*[A-Za-z_]\w*\s*", p) and p.strip() not in ("self", "cls")
    ]
    choices = ["rename"]
    if kind == "def" and params is not None:
        choices += ["add_param", "hints"] + (["rename_param"] * 2 if simple else [])
    op = rng.choice(choices)

    def fresh(pool) -> str | None:
        pool = [w for w in pool if not re.search(rf"\b{re.escape(w)}\b", block)]
        return rng.choice(pool) if pool else None

    if op == "rename":
        if kind == "class":
            new = rng.choice(
                [f"New{name}", f"{name}V2", f"Base{name}", f"{name}Impl", f"Simple{name}"]
            )
        else:
            new = rng.choice(
                [
                    f"{name}_v2",
                    f"new_{name}",
                    f"{name}_impl",
                    f"_{name}",
                    f"{name}2",
                    f"safe_{name}",
                ]
            )
        return re.sub(rf"(?<![.\w]){re.escape(name)}\b", new, block)
    if op == "rename_param":
        old = rng.choice(simple)
        new = fresh([w for w in words if w != old and len(w) > 2] + list(_NAMES))
        if new is None:
            return None
        return re.sub(rf"(?<![.\w]){re.escape(old)}\b", new, block)
    if op == "add_param":
        new = fresh(_NAMES)
        if new is None:
            return None
        cut = header.rfind(")")
        sep = ", " if params and params.strip() else ""
        return (
            header[:cut]
            + f"{sep}{new}={rng.choice(['None', 'False', '0', 'True'])}"
            + header[cut:]
            + "\n"
            + body
        )
    # hints: annotate bare parameters, add a return annotation when there is none
    parts = _split_params(params or "")
    hinted = [f"{p.rstrip()}: {rng.choice(_TYPES)}" if p.strip() in simple else p for p in parts]
    new_params = ",".join(hinted)
    close = rest.rfind(")")
    ret = rest[close + 1 :]
    if "->" not in ret:
        ret = f" -> {rng.choice(_TYPES + ('None',))}" + ret
    new_header = header[: header.find("(") + 1] + new_params + ")" + ret + ":"
    if new_header == header.rstrip("\r"):
        return None
    return new_header + "\n" + body


def edit_document(text: str, rng: random.Random, cfg: EditConfig) -> str | None:
    """Context + an original block + its edited copy, or None when the file has no usable block."""
    spans = code_blocks(text, cfg.max_block_chars)
    if not spans:
        return None
    s, e = rng.choice(spans)
    block = text[s:e]
    words = sorted(set(re.findall(r"\b[a-z_][a-z0-9_]{2,15}\b", text[max(0, s - 2000) : s])))
    edited = edit_block(block, rng, words)
    if edited is None or edited == block:
        return None
    c = text.rfind("\n", 0, max(0, s - cfg.context_chars)) + 1 if s > cfg.context_chars else 0
    return text[c:e] + ("\n" if block.startswith((" ", "\t")) else "\n\n") + edited


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

    def __init__(
        self,
        tokenizer,
        fim: FimConfig = FimConfig(),
        segment_chars: int = 3000,
        edit: EditConfig = EditConfig(),
    ):
        self.tok = tokenizer
        self.fim = fim
        self.edit = edit
        self.segment_chars = segment_chars
        self.eos = tokenizer.token_to_id(EOS)
        self.pre = tokenizer.token_to_id(FIM_PREFIX)
        self.suf = tokenizer.token_to_id(FIM_SUFFIX)
        self.mid = tokenizer.token_to_id(FIM_MIDDLE)
        if None in (self.eos, self.pre, self.suf, self.mid):
            raise ValueError(
                "tokenizer lacks the special tokens "
                f"{EOS}, {FIM_PREFIX}, {FIM_SUFFIX}, {FIM_MIDDLE}"
            )

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
        if self.edit.rate > 0:  # rate 0 leaves the rng stream as it was
            for _ in range(_draws(self.edit.rate, rng)):
                doc = edit_document(text, rng, self.edit)
                if doc:
                    out += self._enc(doc) + [self.eos]
        if self.edit.copy_rate > 0:
            special = {self.eos, self.pre, self.suf, self.mid}
            pool = [t for t in out if t not in special]
            for _ in range(_draws(self.edit.copy_rate, rng)):
                ids = copy_document(pool, rng)
                if ids:
                    out += ids + [self.eos]
        return out


def packed_sequences(
    files: list[Path],
    tokenizer,
    seq_len: int,
    seed: int,
    fim: FimConfig = FimConfig(),
    segment_chars: int = 3000,
    epochs: int | None = None,
    edit: EditConfig = EditConfig(),
) -> Iterator[list[int]]:
    """Endless (or ``epochs``-long) stream of ``seq_len``-token sequences: files shuffled per
    epoch, documents concatenated and cut into fixed lengths (no padding)."""
    texts = [p.read_text(encoding="utf-8") for p in files]
    enc = DocumentEncoder(tokenizer, fim, segment_chars, edit)
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
    return sum(
        len(tokenizer.encode(p.read_text(encoding="utf-8"), add_special_tokens=False).ids)
        for p in files
    )


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
