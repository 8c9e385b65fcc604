"""Quality of a code model on Python files: FIM line completion and bits per byte.

Line completion imitates an editor's request: at a sampled cursor inside a non-blank line,
the prompt is the text before the cursor (prefix) and the text after the line (suffix,
starting with its newline); the model completes greedily until a newline and its first line
is compared with the real rest of the line (exact match, and edit similarity = 1 -
normalised Levenshtein distance).  ``line_start=True`` puts every cursor at column 0 of an
indented line instead (the prediction is the whole line, indentation included: what an editor
asks for on a line whose indentation is not typed yet).  Prompts are token-healed by default,
as the server's are (``engine.fim.heal``: the partial word at the cursor, or the line break
before a column-0 cursor, is generated, not prompted, and not counted in the prediction);
``heal=False`` measures the raw prompt.  ``mid_line=True`` keeps the rest of the line after a
hidden span: the cursor is inside the line, the suffix starts with the line's remaining text,
and the prediction is the hidden span (what an editor asks for when the user edits the middle
of a line).  TTFT and decode speed come from the engine's own stats, measured cold (prefix cache
cleared) for every sample.

Confidence: every sample records the probability the model gave its generated line (the
product of its tokens' probabilities, the ending line break included); the ``gate`` table gives,
for each threshold on it, the share of cursors that would get a suggestion (non-empty and at
least that likely) and the exact match and edit similarity of those shown: the trade-off a
confidence gate chooses from.

Bits per byte: the files' total negative log-likelihood (each file starting after an
end-of-text token, as in training) divided by their UTF-8 size, over windows of at most
``window`` tokens.  Comparable across tokenizers, unlike loss per token.
"""

from __future__ import annotations

import glob
import math
import random
import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from ..engine import Engine
from ..fim import FimFormat
from ..generate import GenerationParams

PREFIX_CHARS = 2000  # prompt budget per side, cut at line boundaries; the bundled model was
SUFFIX_CHARS = 1000  # trained on FIM examples of at most 3,000 characters


def resolve_files(specs: Iterable[str]) -> list[Path]:
    """Glob patterns (``**`` allowed) or ``@list.txt`` files with one path per line."""
    out: list[Path] = []
    for spec in specs:
        if spec.startswith("@"):
            lst = Path(spec[1:])
            if not lst.is_file():
                raise ValueError(f"--files {spec}: list file not found")
            out += [Path(line.strip()) for line in lst.read_text().splitlines() if line.strip()]
        else:
            hits = sorted(glob.glob(spec, recursive=True))
            out += [Path(h) for h in hits if Path(h).is_file()]
    seen, files = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            files.append(p)
    if not files:
        raise ValueError(f"--files {' '.join(specs)}: no files matched")
    return files


def read_texts(files: list[Path]) -> dict[Path, str]:
    texts = {}
    for p in files:
        try:
            texts[p] = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"{p}: file not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{p}: cannot read as UTF-8: {e}") from None
    return texts


@dataclass(frozen=True)
class Position:
    file: str
    line: int  # 0-based
    prefix: str
    suffix: str
    target: str  # the real rest of the line after the cursor


def sample_positions(
    texts: dict[Path, str],
    n: int,
    seed: int,
    *,
    line_start: bool = False,
    mid_line: bool = False,
    after_indent: bool = False,
) -> list[Position]:
    """``n`` cursors drawn uniformly over all non-blank lines of the files, then uniformly
    inside the line after its indentation (leaving at least one character to complete); with
    ``line_start`` over the indented lines only, each at column 0; with ``mid_line`` over lines
    of two tokens or more, the span from one token's start to a later one's hidden, the rest of
    the line kept after the cursor; with ``after_indent`` over the indented lines, each right
    after its indentation (the editor indented the new line; the model writes the rest)."""
    if mid_line:
        return _mid_line_positions(texts, n, seed)
    lines = []
    for path, text in texts.items():
        start = 0
        for i, line in enumerate(text.split("\n")):
            if line.strip() and (not (line_start or after_indent) or line[0] in " \t"):
                lines.append((path, i, start, line))
            start += len(line) + 1
    if not lines:
        raise ValueError(
            "the files have no " + ("indented lines" if line_start else "non-blank lines")
        )
    rng = random.Random(seed)
    picks = [lines[rng.randrange(len(lines))] for _ in range(n)]
    out = []
    for path, i, start, line in picks:
        body = line.rstrip()
        indent = len(line) - len(line.lstrip())
        cursor = (
            start
            if line_start
            else start + indent
            if after_indent
            else start + rng.randint(indent, len(body) - 1)
        )
        text = texts[path]
        end = start + len(line)
        prefix = text[:cursor]
        if len(prefix) > PREFIX_CHARS:
            cut = prefix.find("\n", len(prefix) - PREFIX_CHARS)
            prefix = prefix[cut + 1 :] if cut != -1 else prefix[-PREFIX_CHARS:]
        suffix = text[end:]
        if len(suffix) > SUFFIX_CHARS:
            cut = suffix.rfind("\n", 0, SUFFIX_CHARS)
            suffix = suffix[: cut + 1] if cut > 0 else suffix[:SUFFIX_CHARS]
        out.append(Position(str(path), i, prefix, suffix, text[cursor:end]))
    return out


_TOKEN_START = re.compile(r"\w+|[^\w\s]")  # spans run from a token's start to a later one's


def _mid_line_positions(texts: dict[Path, str], n: int, seed: int) -> list[Position]:
    cands = []
    for path, text in texts.items():
        start = 0
        for i, line in enumerate(text.split("\n")):
            body = line.rstrip()
            indent = len(line) - len(line.lstrip())
            marks = [m.start() for m in _TOKEN_START.finditer(body) if m.start() >= indent]
            if len(marks) >= 2:
                cands.append((path, i, start, line, marks))
            start += len(line) + 1
    if not cands:
        raise ValueError("the files have no lines of two words (or marks) or more")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        path, i, start, line, marks = cands[rng.randrange(len(cands))]
        a = rng.randrange(len(marks) - 1)
        b = rng.randrange(a + 1, len(marks))
        cursor, span_end = start + marks[a], start + marks[b]
        text = texts[path]
        prefix, suffix = _clip_prefix(text[:cursor]), _clip_suffix(text[span_end:])
        out.append(Position(str(path), i, prefix, suffix, text[cursor:span_end]))
    return out


def _clip_prefix(prefix: str) -> str:
    if len(prefix) > PREFIX_CHARS:
        cut = prefix.find("\n", len(prefix) - PREFIX_CHARS)
        prefix = prefix[cut + 1 :] if cut != -1 else prefix[-PREFIX_CHARS:]
    return prefix


def _clip_suffix(suffix: str) -> str:
    if len(suffix) > SUFFIX_CHARS:
        cut = suffix.rfind("\n", 0, SUFFIX_CHARS)
        suffix = suffix[: cut + 1] if cut > 0 else suffix[:SUFFIX_CHARS]
    return suffix


#: thresholds on the probability of the generated line that the gate table reports
GATE_THRESHOLDS = (0.0, 1e-8, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.3)


def gate_table(samples: list[dict], thresholds=GATE_THRESHOLDS) -> list[dict]:
    """For each threshold: coverage (share of samples with a non-empty prediction at least that
    confident), and exact match / edit similarity of those (None when none is shown)."""
    rows = []
    for t in thresholds:
        shown = [s for s in samples if s["prediction"] and s["confidence"] >= t]
        k = len(shown)
        rows.append(
            {
                "threshold": t,
                "coverage": k / len(samples) if samples else 0.0,
                "shown": k,
                "exact_match": sum(s["exact"] for s in shown) / k if k else None,
                "edit_similarity": sum(s["edit_similarity"] for s in shown) / k if k else None,
            }
        )
    return rows


def edit_similarity(a: str, b: str) -> float:
    """1 - Levenshtein(a, b) / max(len(a), len(b)); 1.0 for two empty strings."""
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return 1.0 - prev[-1] / max(len(a), len(b))


@dataclass
class CompletionResult:
    n: int
    exact_match: float
    edit_similarity: float
    ttft_ms_median: float
    decode_tok_s_median: float | None
    samples: list[dict] = field(default_factory=list)


def complete_lines(
    engine: Engine,
    positions: list[Position],
    *,
    spm: bool | None = None,
    max_new_tokens: int = 48,
    heal: bool = True,
    finish: Callable[[Position, str], str] | None = None,
    context: Callable[[Position], list[tuple[str, str]]] | None = None,
) -> CompletionResult:
    """Greedy FIM line completion at every position (see the module docstring).

    ``finish(position, raw)``: what a client makes of the raw output before it is compared (the
    language server passes its post-processing, so the score is the suggestion users would see).
    ``context(position)``: other files ((path, text) pairs) put first in the prompt, in the
    model's repository format (``FimFormat.context_ids``)."""
    fim = FimFormat.detect(engine.tokenizer)
    if fim is None:
        raise ValueError(f"{engine.name}: the tokenizer has no fill-in-the-middle tokens")
    spm = fim.supports_spm if spm is None else spm
    params = GenerationParams(
        max_new_tokens=max_new_tokens, temperature=0.0, stop=("\n",), logprobs=True
    )
    samples, ttft, speed = [], [], []
    for pos in positions:
        engine.reset()  # cold prefill: TTFT without prefix reuse
        ctx = (
            fim.context_ids(context(pos), path=Path(pos.file).name) if context is not None else None
        )
        if ctx is not None and len(ctx.head) + len(ctx.lead) > engine.context // 2:
            ctx = None  # a context that leaves the file itself no room is not used
        ids, healed = (
            fim.build_healed(pos.prefix, pos.suffix, spm=spm, newline=True, context=ctx)
            if heal
            else (fim.build(pos.prefix, pos.suffix, spm=spm, context=ctx), "")
        )
        gen = engine.generate(ids, replace(params, healed_prefix=healed) if healed else params)
        for _ in gen:
            pass
        pred = (
            (finish(pos, gen.text) if finish is not None else gen.text).split("\n", 1)[0].rstrip()
        )
        target = pos.target.rstrip()
        line_lp = (
            sum(gen.logprobs) if gen.logprobs else float("-inf")
        )  # the line, its break included
        samples.append(
            {
                "file": pos.file,
                "line": pos.line + 1,
                "target": target,
                "prediction": pred,
                "healed": healed,
                "prompt_tokens": len(ids),
                "exact": pred == target,
                "edit_similarity": edit_similarity(pred, target),
                "confidence": math.exp(line_lp),
                "ttft_ms": gen.stats["ttft_ms"],
                "new_tokens": gen.stats["new_tokens"],
            }
        )
        ttft.append(gen.stats["ttft_ms"])
        if gen.stats["new_tokens"] >= 4:
            speed.append(gen.stats["decode_tok_s"])
    n = len(samples)
    return CompletionResult(
        n=n,
        exact_match=sum(s["exact"] for s in samples) / n,
        edit_similarity=sum(s["edit_similarity"] for s in samples) / n,
        ttft_ms_median=statistics.median(ttft),
        decode_tok_s_median=statistics.median(speed) if speed else None,
        samples=samples,
    )


def bits_per_byte(
    engine: Engine, texts: Iterable[str], *, window: int = 1024, max_bytes: int | None = None
) -> tuple[float, int]:
    """(bits per UTF-8 byte, bytes scored) over ``texts``; stops after ``max_bytes``."""
    eos = min(engine.tokenizer.eos_ids) if engine.tokenizer.eos_ids else None
    window = max(2, min(window, engine.context))
    nats, nbytes = 0.0, 0
    for text in texts:
        if max_bytes is not None and nbytes >= max_bytes:
            break
        if not text:
            continue
        ids = engine.tokenizer.encode(text)
        seq = (
            [eos] if eos is not None else []
        ) + ids  # without eos the first token is context only
        for start in range(0, len(seq) - 1, window - 1):
            chunk = seq[start : start + window]
            if len(chunk) < 2:
                break
            logits = engine.forward_logits(chunk).astype(np.float64)
            lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            tgt = np.asarray(chunk[1:])
            nats += float((lse[:-1] - logits[np.arange(len(tgt)), tgt]).sum())
        scored = text if eos is not None else engine.tokenizer.decode(ids[1:])
        nbytes += len(scored.encode("utf-8"))
    if nbytes == 0:
        raise ValueError("no text to score")
    return nats / math.log(2) / nbytes, nbytes


def evaluate(
    engine: Engine,
    files: list[Path],
    *,
    n: int = 200,
    seed: int = 0,
    spm: bool | None = None,
    max_new_tokens: int = 48,
    bpb_max_bytes: int | None = 400_000,
    window: int = 1024,
    heal: bool = True,
    line_start: bool = False,
    mid_line: bool = False,
    after_indent: bool = False,
    finish: Callable[[Position, str], str] | None = None,
    context: Callable[[Position], list[tuple[str, str]]] | None = None,
) -> dict:
    """Both measures on ``files``; a JSON-ready dict (``finish``: see :func:`complete_lines`).

    With ``context`` the completions run twice, without and with the other files in the prompt
    (same cursors): ``exact_match`` / ``edit_similarity`` are without, ``context`` holds both."""
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    texts = read_texts(files)
    positions = sample_positions(
        texts, n, seed, line_start=line_start, mid_line=mid_line, after_indent=after_indent
    )
    comp = complete_lines(
        engine, positions, spm=spm, max_new_tokens=max_new_tokens, heal=heal, finish=finish
    )
    with_ctx = (
        complete_lines(
            engine,
            positions,
            spm=spm,
            max_new_tokens=max_new_tokens,
            heal=heal,
            finish=finish,
            context=context,
        )
        if context is not None
        else None
    )
    order = sorted(texts)  # deterministic subset when capped
    random.Random(seed).shuffle(order)
    bpb, scored = bits_per_byte(
        engine, (texts[p] for p in order), window=window, max_bytes=bpb_max_bytes
    )
    out = {
        "model": engine.name,
        "files": len(files),
        "seed": seed,
        "heal": heal,
        "line_start": line_start,
        "mid_line": mid_line,
        "after_indent": after_indent,
        **asdict(comp),
        "gate": gate_table(comp.samples),
        "bits_per_byte": bpb,
        "bpb_bytes": scored,
        "bpb_window": window,
    }
    if with_ctx is not None:
        out["context"] = {
            "without": {
                "exact_match": comp.exact_match,
                "edit_similarity": comp.edit_similarity,
                "ttft_ms_median": comp.ttft_ms_median,
            },
            "with": {
                "exact_match": with_ctx.exact_match,
                "edit_similarity": with_ctx.edit_similarity,
                "ttft_ms_median": with_ctx.ttft_ms_median,
                "prompt_tokens_median": statistics.median(
                    s["prompt_tokens"] for s in with_ctx.samples
                ),
            },
        }
        out["context_samples"] = with_ctx.samples
    out["samples"] = out.pop("samples")
    return out
