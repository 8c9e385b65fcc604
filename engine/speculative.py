"""Draft-free speculative decoding: verify several drafted tokens in one forward pass.

Greedy decoding of input-grounded text repeats a lot of what the model has already seen: a
rewrite keeps most of the original, a completion re-uses identifiers and lines from the prompt.
Instead of a draft *model*, the draft comes from text we already have:

* :class:`EditDrafter` — for rewrite-style edits the original text is the draft ("speculative
  edits", like OpenAI's Predicted Outputs).  A cursor follows the output through the original;
  after a mismatch the output's latest n-gram is looked up in the original again (nearest match
  after the old cursor first), so inserted or changed tokens cost one miss, not the rest of it.
* :class:`PromptLookup` — for completions: the longest recent n-gram of the context that occurred
  earlier is looked up and what followed it is the draft ("prompt lookup decoding").

:class:`SpeculativeGeneration` runs ``[last token] + draft`` through the decoder in one pass with
logits for every position (``Runtime.forward(..., num_logits=k+1)``), accepts the longest prefix
of the draft that equals the model's own argmax, and adds the model's token after it — so the
output is exactly greedy decoding's, only several tokens arrive per pass.  The KV of rejected
positions is left behind the slot's end, where the next pass overwrites it (rewinding is free).
Drafting adapts (:class:`DraftPolicy`): the draft length maximises expected tokens per second
from the running acceptance rate and the measured cost of a longer pass, drafting stops when it
would not pay, and consecutive misses switch it off for a growing number of steps, so fresh text
runs at (nearly) plain speed.  While a healed prefix (``GenerationParams.healed_prefix``) is
still being spelled, each token is a single constrained step (no draft), exactly as the plain
loop picks it.  It is a :class:`~engine.generate.Generation` — same iterator, ``cancel()``,
``text``/``tokens``/``finish_reason``/``stats`` — so callers use it interchangeably.  Sampling
(temperature > 0) is not speculated: it runs the plain loop.
"""

from __future__ import annotations

import json
import os
import re
import time
import weakref
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .cancel import Cancelled, CancelToken
from .cpu import cpu_id
from .files import write_json_atomic
from .generate import Chunk, Generation, GenerationParams, Model, _Emitter
from .sampling import token_logprob

#: Relative top-2 logit margin below which a batched verification's argmax is re-decided by a
#: single decode step (fp32: float summation-order noise is ~1e-7 of the logits).  Linear
#: emitters can set their own ``verify_margin`` (quantised activations jump more), and each
#: engine is calibrated once (:func:`verify_margin`).
DEFAULT_VERIFY_MARGIN = 1e-5
CALIBRATION_SAFETY = 4.0
_margins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def verify_margin(engine: Model, sample: Sequence[int]) -> float:
    """The relative logit margin under which a batched pass is not trusted, for this engine.

    Measured once per engine (cached): a few positions of ``sample`` (real prompt tokens) are run
    as 9-token passes and as single steps on a scratch KV cache; the margin is
    ``CALIBRATION_SAFETY`` times the largest relative difference seen, and at least the linear
    emitter's declared ``verify_margin``.  Holds the engine lock; ~30 small runs.
    """
    return _calibration(engine, sample)[0]


#: The calibration stored next to a cached graph (see :func:`_stored_calibration`).
CALIBRATION_FILE = "calibration.json"


def _calibration_record(engine: Model) -> tuple[Path | None, dict]:
    """Where this engine's calibration is kept, and what it must have been measured under: the
    graph (its cache entry), the threads, ONNX Runtime, the CPU and the AMX switches (each can
    change a pass's rounding)."""
    graph = getattr(engine, "graph_path", None)
    rt = engine.runtime
    import onnxruntime as ort

    under = {
        "threads": [getattr(rt, "threads", None), getattr(rt, "decode_threads", None)],
        "onnxruntime": ort.__version__,
        "cpu": cpu_id(),  # the model name: platform.processor() is just "x86_64" on Linux
        "amx": [os.environ.get("SPARK_LSP_AMX"), os.environ.get("SPARK_LSP_AMX_MIN_ROWS")],
    }
    return (Path(graph).parent / CALIBRATION_FILE if graph else None), under


def _stored_calibration(engine: Model) -> tuple | None:
    path, under = _calibration_record(engine)
    if path is None:
        return None
    try:
        rec = json.loads(path.read_text())
        if rec.get("under") == under:
            m, step_s, pass_s, width = rec["calibration"]
            return float(m), step_s, pass_s, int(width)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _store_calibration(engine: Model, result: tuple) -> None:
    path, under = _calibration_record(engine)
    if path is None:
        return
    try:
        write_json_atomic(path, {"under": under, "calibration": list(result)})
    except OSError:  # a read-only cache: calibrate again next time
        pass


def _calibration(
    engine: Model, sample: Sequence[int]
) -> tuple[float, float | None, float | None, int]:
    """(margin, single-step seconds, pass seconds, pass width) — see :func:`verify_margin`.

    Measured once per graph and machine: the result is kept next to the cached graph
    (``CALIBRATION_FILE``, with what it was measured under), since at real size the ~30 runs take
    seconds of every start."""
    if engine in _margins:
        return _margins[engine]
    stored = _stored_calibration(engine)
    if stored is not None:
        _margins[engine] = stored
        return stored
    declared = float(getattr(engine.linear, "verify_margin", DEFAULT_VERIFY_MARGIN))
    rt = engine.runtime
    ids = [int(t) for t in sample][:96]
    width = min(9, int(getattr(engine.linear, "max_verify_tokens", None) or 9))
    worst = 0.0
    steps, passes = [], []
    if width > 1 and len(ids) >= 8 + width and rt.max_len > len(ids):
        with engine.lock:
            kv_a, kv_b = rt.new_kv(), rt.new_kv()
            done = 0  # both caches hold ids[:done] from the same runs
            for start in range(4, len(ids) - width + 1, max(1, (len(ids) - width - 4) // 3)):
                # extend both caches alike (from `done` on: it also overwrites the positions
                # the previous round's steps and pass wrote), not prefill from 0 again
                rt.forward(kv_a, ids[done:start], done)
                rt.forward(kv_b, ids[done:start], done)
                done = start
                rows = []
                for i in range(width):
                    t0 = time.perf_counter()
                    rows.append(rt.decode(kv_a, ids[start + i], start + i).copy())
                    steps.append(time.perf_counter() - t0)
                single = np.stack(rows)
                t0 = time.perf_counter()
                batch = rt.forward(kv_b, ids[start : start + width], start, num_logits=width)
                passes.append(time.perf_counter() - t0)
                scale = np.maximum(np.abs(single).max(1), 1.0)
                worst = max(worst, float((np.abs(batch - single).max(1) / scale).max()))
    step_s = float(np.median(steps)) if steps else None
    pass_s = float(np.median(passes)) if passes else None
    _margins[engine] = (max(declared, CALIBRATION_SAFETY * worst), step_s, pass_s, width)
    if steps:
        _store_calibration(engine, _margins[engine])
    return _margins[engine]


class _Tokens:
    """A growing int64 token buffer (numpy, so n-gram searches are vectorised)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.buf = np.zeros(max(64, 2 * len(tokens)), np.int64)
        self.n = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        need = self.n + len(tokens)
        if need > self.buf.shape[0]:
            grown = np.zeros(max(need, 2 * self.buf.shape[0]), np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : need] = tokens
        self.n = need

    @property
    def view(self) -> np.ndarray:
        return self.buf[: self.n]


def ngram_matches(hay: np.ndarray, tail: np.ndarray, end: int | None = None) -> np.ndarray:
    """Start positions of the continuations after each occurrence of ``tail`` in ``hay[:end]``.

    An occurrence ending at index ``i`` yields ``i + 1``; only occurrences with something after
    them inside ``hay[:end]`` count.  Ascending order.
    """
    n = len(tail)
    end = hay.shape[0] if end is None else end
    if n == 0 or end <= n:
        return np.zeros(0, np.int64)
    last = hay[n - 1 : end - 1]  # candidate occurrence ends: n-1 .. end-2
    cand = np.flatnonzero(last == tail[-1]) + (n - 1)
    for j in range(1, n):
        if cand.size == 0:
            break
        cand = cand[hay[cand - j] == tail[-1 - j]]
    return cand + 1


class PromptLookup:
    """n-gram prompt lookup: draft what followed the latest earlier occurrence of the context's tail.

    Tries the longest n-gram first (``max_ngram`` down to ``min_ngram``); the most recent
    occurrence wins (code repeats locally).
    """

    #: nothing to look up now rarely means something next step: the policy may pause asking
    pause_when_empty = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def start(self, context: _Tokens) -> None:
        pass

    def observe(self, tokens: Sequence[int], from_draft: int) -> None:
        pass

    def propose(self, context: _Tokens, k: int) -> list[int]:
        ctx = context.view
        L = ctx.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            hits = ngram_matches(ctx, ctx[L - n :], L)
            if hits.size:
                c = int(hits[-1])
                draft = ctx[c : min(c + k, L)].tolist()
                while (
                    len(draft) < k
                ):  # the match runs into the present: the text repeats with period L - c
                    draft.append(draft[len(draft) - (L - c)])
                return draft
        return []


class EditDrafter:
    """The original text of a rewrite is the draft; a cursor follows the output through it.

    ``source``: token ids of the text being rewritten.  While the output copies the source the
    cursor just advances; on a mismatch it is lost and re-found from the output's last
    ``max_ngram..min_ngram`` tokens — the occurrence nearest after the old cursor, else the
    nearest before it (single-token matches only within ``window`` tokens ahead, where they are
    likely to be the same spot and not a coincidence).  When the source has nothing to offer,
    ``fallback`` (prompt lookup by default) drafts from the context.

    With a ``tokenizer`` the drafter also learns renames: when the output replaced one identifier
    of the source by another and then rejoined it, the rest of the source gets the new name
    wherever the old one stands as a whole word — an edit that renames something does it
    everywhere, and without this every later occurrence would cost a missed draft.
    """

    #: a learned rename replaces at most this many source tokens by at most this many
    MAX_RENAME_TOKENS = (8, 16)
    #: lost in the original, the cursor may be re-found at the very next step: never pause
    pause_when_empty = False

    def __init__(
        self,
        source: Sequence[int],
        *,
        max_ngram: int = 4,
        min_ngram: int = 1,
        window: int = 24,
        fallback: PromptLookup | None = None,
        tokenizer=None,
    ) -> None:
        self.source = np.asarray(list(source), np.int64)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.window = window
        self.fallback = fallback if fallback is not None else PromptLookup()
        self.tokenizer = tokenizer
        self.renames: dict[str, str] = {}
        self.cursor: int | None = 0
        self._last = 0  # where the cursor was before it got lost
        self._lost_at = 0  # the context index of the output token that lost it
        self._context: _Tokens | None = None

    def start(self, context: _Tokens) -> None:
        self.cursor, self._last = 0, 0
        self._context = context

    def observe(self, tokens: Sequence[int], from_draft: int) -> None:
        if self.cursor is not None:
            self.cursor += from_draft
        base = (self._context.n if self._context is not None else len(tokens)) - len(tokens)
        for j in range(from_draft, len(tokens)):
            t = tokens[j]
            if (
                self.cursor is not None
                and self.cursor < self.source.shape[0]
                and self.source[self.cursor] == t
            ):
                self.cursor += 1
            elif self.cursor is not None:
                self._last, self.cursor = self.cursor, None
                self._lost_at = base + j

    def _resync(self, ctx: np.ndarray) -> int | None:
        L = ctx.shape[0]
        for n in range(min(self.max_ngram, L), self.min_ngram - 1, -1):
            hits = ngram_matches(self.source, ctx[L - n :])
            if n == 1:
                hits = hits[(hits >= self._last) & (hits <= self._last + self.window)]
            if hits.size:
                after = hits[hits >= self._last]
                cursor = int(after[0]) if after.size else int(hits[-1])
                try:
                    self._learn_rename(self._last, cursor - n, ctx[self._lost_at : L - n], cursor)
                except (
                    ValueError
                ):  # ids the tokenizer cannot decode (a caller's token draft): no renames
                    pass
                return cursor
        return None

    def _learn_rename(self, start: int, end: int, new: np.ndarray, cursor: int) -> None:
        """The output wrote ``new`` where the source had ``source[start:end]``: if that changed
        one whole identifier (or attribute name) into another, rename it in the source after
        ``cursor``."""
        max_old, max_new = self.MAX_RENAME_TOKENS
        if self.tokenizer is None or not (
            1 <= end - start <= max_old and 1 <= new.shape[0] <= max_new
        ):
            return
        decode = self.tokenizer.decode
        # the changed text with a few tokens either side, to see the whole word it belongs to
        left, right = (
            decode(self.source[max(0, start - 4) : start].tolist()),
            decode(self.source[end : end + 4].tolist()),
        )
        old_text, new_text = (
            left + decode(self.source[start:end].tolist()) + right,
            left + decode(new.tolist()) + right,
        )
        p = len(os.path.commonprefix([old_text, new_text]))
        q = len(os.path.commonprefix([old_text[p:][::-1], new_text[p:][::-1]]))
        i, j = p, len(old_text) - q
        while i > 0 and _WORD.match(old_text[i - 1]):
            i -= 1
        while j < len(old_text) and _WORD.match(old_text[j]):
            j += 1
        if i == 0 or j == len(old_text):  # the word may go on beyond what was decoded: not sure
            return
        a, b = old_text[i:j], new_text[i : len(new_text) - (len(old_text) - j)]
        if a == b or not (_IDENTIFIER.fullmatch(a) and _IDENTIFIER.fullmatch(b)):
            return
        # an attribute (``self._items``) is renamed only after dots, a name only where no dot precedes
        attribute = old_text[i - 1] == "."
        rest = decode(self.source[cursor:].tolist())
        before = r"(?<=\.)" if attribute else r"(?<![\w.])"
        renamed = re.sub(before + re.escape(a) + r"(?!\w)", b, rest)
        if renamed == rest:
            return
        self.renames[("." if attribute else "") + a] = b
        # encoded whole, as the model's output is (a string encoded from its middle can split its
        # first word differently); the part before the cursor must keep its tokens
        whole = np.asarray(
            self.tokenizer.encode(decode(self.source[:cursor].tolist()) + renamed), np.int64
        )
        if whole.shape[0] >= cursor and np.array_equal(whole[:cursor], self.source[:cursor]):
            self.source = whole
        else:
            self.source = np.concatenate(
                [self.source[:cursor], np.asarray(self.tokenizer.encode(renamed), np.int64)]
            )

    def propose(self, context: _Tokens, k: int) -> list[int]:
        if self.cursor is None:
            self.cursor = self._resync(context.view)
        if self.cursor is not None and self.cursor < self.source.shape[0]:
            return self.source[self.cursor : self.cursor + k].tolist()
        return self.fallback.propose(context, k)


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WORD = re.compile(r"\w")


# -- adaptive draft length -----------------------------------------------------------------------


@dataclass
class DraftPolicy:
    """How many tokens to draft next: the draft length that maximises expected tokens per second.

    Model: each drafted token is accepted with probability ``alpha`` (running estimate, decayed so
    it follows the text), so a draft of k yields ``(1 - alpha**(k+1)) / (1 - alpha)`` tokens per
    pass; a pass of ``1 + k`` tokens costs ``1 + beta * k`` plain steps (``beta`` measured on this
    engine: cheap for fp32 GEMMs, dearer for kernels that work row by row).  The best k is drafted
    when its expected speed-up is at least ``min_gain``.  Otherwise — and after ``max_misses``
    consecutive drafts with nothing accepted — drafting is off for ``backoff`` plain steps
    (doubling up to ``max_backoff``; reset by any accepted token), and the last step of a
    back-off probes with ``k_min`` tokens, so fresh text costs at most a few short failed drafts.
    The same back-off starts when the *measured* rate of drafting passes (tokens emitted per second,
    single steps forced by near-ties included) falls below ``min_rate`` times plain steps' rate.
    Drafts also start short and grow by evidence (a slow start): the length is capped at
    ``k_min``, doubled after every draft accepted whole and reset to just past the accepted run
    after a partial one — a long draft that misses early costs a pass of many tokens for one.
    """

    k_min: int = 2
    k_max: int = 24
    max_misses: int = 2
    backoff: int = 4
    max_backoff: int = 64
    alpha: float = 0.7  # prior acceptance probability per drafted token
    beta: float = 0.15  # prior cost of one extra token in a pass, in plain steps
    min_gain: float = 1.05
    decay: float = 0.9
    min_rate: float = (
        0.95  # drafting must keep at least this share of plain decoding's measured speed
    )
    empty_pause: int = 2  # plain steps after the drafter had nothing to offer (see empty)

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min ({self.k_min}) <= k_max ({self.k_max})")
        if not 0.0 < self.alpha < 1.0 or self.beta < 0:
            raise ValueError(f"alpha={self.alpha!r} must be in (0, 1) and beta={self.beta!r} >= 0")
        self.k = self.k_min
        self._cap = self.k_min  # slow start: the longest draft the evidence allows now
        self._ks = np.arange(self.k_min, self.k_max + 1, dtype=np.float64)
        self._hits = 4.0 * self.alpha  # decayed counts behind the alpha estimate (prior weight 4)
        self._fails = 4.0 * (1 - self.alpha)
        self._misses = 0
        self._off = 0
        self._wait = self.backoff
        self._step_s: float | None = None  # plain step time (EMA)
        self._extra_s: float | None = None  # extra time per drafted token (EMA)
        self._rate = {
            "draft": [0.0, 0.0],
            "plain": [0.0, 0.0],
        }  # decayed [tokens, seconds] per mode

    @staticmethod
    def expected_tokens(alpha: float, k: int) -> float:
        """Tokens one pass yields with a draft of ``k`` (accepted prefix + the model's own token)."""
        if alpha >= 1.0:
            return k + 1.0
        return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)

    @property
    def acceptance(self) -> float:
        return self._hits / (self._hits + self._fails)

    @property
    def cost_per_token(self) -> float:
        if self._step_s and self._extra_s is not None:
            return max(0.0, self._extra_s / self._step_s)
        return self.beta

    def best(self, cap: int | None = None) -> tuple[int, float]:
        """(k, expected speed-up over plain decoding) for the current estimates, k at most ``cap``
        (vectorised: it runs before every step that could draft)."""
        a, c = self.acceptance, self.cost_per_token
        ks = self._ks if cap is None else self._ks[: max(1, cap - self.k_min + 1)]
        tokens = ks + 1.0 if a >= 1.0 else (1.0 - a ** (ks + 1.0)) / (1.0 - a)
        gains = tokens / (1.0 + c * ks)
        i = int(gains.argmax())
        return self.k_min + i, float(gains[i])

    def size(self) -> int:
        """Draft length for the next step (0: take a plain step)."""
        if self._off > 0:
            self._off -= 1
            return self.k_min if self._off == 0 else 0  # the last step of a back-off probes
        k, gain = self.best(self._cap)
        self.k = k
        if (
            gain < self.min_gain or self.losing()
        ):  # drafting does not pay now: plain steps, then probe
            self._off = self._wait
            self._wait = min(self.max_backoff, self._wait * 2)
            return 0
        return k

    def update(self, drafted: int, accepted: int) -> None:
        """A pass drafted ``drafted`` tokens and ``accepted`` of them matched the model."""
        if drafted == 0:
            return
        self._cap = (
            min(self.k_max, 2 * self._cap) if accepted == drafted else max(self.k_min, accepted + 1)
        )
        self._hits = self._hits * self.decay + accepted
        self._fails = self._fails * self.decay + (1.0 if accepted < drafted else 0.0)
        if accepted == 0:
            self._misses += 1
            if self._misses >= self.max_misses:
                self._off, self._misses = self._wait, 0
                self._wait = min(self.max_backoff, self._wait * 2)
        else:
            self._misses = 0
            self._wait = self.backoff

    def empty(self) -> None:
        """The drafter had nothing to offer: pause for ``empty_pause`` plain steps, so a stretch of
        text with no n-gram to look up does not pay a lookup (and this policy's arithmetic) on every
        step; no miss is counted and the acceptance estimate is untouched."""
        self._off = max(self._off, self.empty_pause)

    def prime(self, step_s: float | None, pass_s: float | None, width: int) -> None:
        """Start from this engine's measured costs: a single step and a ``width``-token pass."""
        if not step_s or not pass_s or width < 2:
            return
        self._step_s = step_s
        self._extra_s = max(0.0, pass_s - step_s) / (width - 1)
        self._rate["plain"] = [2.0, 2.0 * step_s]

    def losing(self) -> bool:
        """Measured: recent drafting passes (with the single steps they forced) emitted tokens more
        slowly than plain steps do — whatever the model says, stop for a while."""
        (dt, ds), (pt, ps) = self._rate["draft"], self._rate["plain"]
        if dt < 8 or pt < 2 or ds <= 0 or ps <= 0:
            return False
        return dt / ds < self.min_rate * (pt / ps)

    def emitted(self, mode: str, tokens: int, seconds: float) -> None:
        """A pass in ``mode`` ('draft' | 'plain') yielded ``tokens`` new tokens in ``seconds``."""
        r = self._rate[mode]
        r[0] = r[0] * self.decay + tokens
        r[1] = r[1] * self.decay + seconds

    def charge(self, seconds: float) -> None:
        """Drafting time that yielded no draft (the lookup found nothing): it slows drafting down."""
        self._rate["draft"][1] += seconds

    def timed(self, tokens: int, seconds: float) -> None:
        """A pass of ``tokens`` positions took ``seconds`` (feeds the cost model)."""
        if tokens <= 1:
            self._step_s = seconds if self._step_s is None else 0.8 * self._step_s + 0.2 * seconds
        elif self._step_s is not None:
            extra = max(0.0, seconds - self._step_s) / (tokens - 1)
            self._extra_s = extra if self._extra_s is None else 0.8 * self._extra_s + 0.2 * extra


# -- the generation ------------------------------------------------------------------------------


class SpeculativeGeneration(Generation):
    """A greedy :class:`Generation` that verifies drafted tokens in batches (see module docstring).

    Extra ``stats``: ``drafted_tokens``, ``accepted_tokens``, ``acceptance`` (accepted/drafted),
    ``model_runs`` (decoder passes after the prefill) and ``tokens_per_run``.
    """

    def __init__(
        self,
        engine: Model,
        prompt: list[int],
        params: GenerationParams,
        slot: Hashable = None,
        *,
        drafter=None,
        policy: DraftPolicy | None = None,
        cancel: CancelToken | None = None,
    ) -> None:
        super().__init__(engine, prompt, params, slot, cancel)
        self.drafter = drafter if drafter is not None else PromptLookup()
        self.policy = policy if policy is not None else DraftPolicy()
        self.stats.update(
            {
                "drafted_tokens": 0,
                "accepted_tokens": 0,
                "acceptance": 0.0,
                "model_runs": 0,
                "tokens_per_run": 0.0,
            }
        )

    def _run(self) -> Iterator[Chunk]:
        if not self._sampler.greedy:
            yield from super()._run()
            return
        p = self.params
        eng = self._engine
        rt = eng.runtime
        emitter = _Emitter(self)
        t_first = t_last = None
        slot = None
        nv = eng.sample_vocab
        # Emitters whose batched kernels round differently cap (or forbid: 1) multi-token passes.
        width = getattr(eng.linear, "max_verify_tokens", None)
        k_cap = (width - 1) if width else rt.max_len
        drafted = accepted_total = runs = rechecks = 0
        recheck = False
        try:
            self.cancel_token.check()
            # A batched pass and a single step may round differently (quantised activations flip a
            # code now and then): only trust argmaxes whose top-2 margin exceeds that noise.
            guard, step_s, pass_s, width_s = _calibration(eng, self.prompt)  # once per engine
            self.policy.prime(step_s, pass_s, width_s)
            slot, logits = self._prefill()
            pos = len(slot.tokens)
            context = _Tokens(self.prompt)
            self.drafter.start(context)
            decided = [self._pick(logits[:nv], _argmax)]  # tokens chosen but not yet emitted
            want_lp = p.logprobs
            lps = [token_logprob(logits[:nv], decided[0])] if want_lp else []  # theirs, when asked
            from_draft = 0  # how many leading `decided` tokens came from the draft
            while True:
                # Emit the decided tokens one by one, exactly as the plain loop would.
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                    self.stats["ttft_ms"] = (now - self._t0) * 1e3
                for i, token in enumerate(decided):
                    t_last = now
                    chunk, done = emitter.emit(
                        token, time.perf_counter(), lps[i] if want_lp else None
                    )
                    if chunk is not None:
                        yield chunk
                    if done:
                        return
                self._release_prefill_memory()
                context.extend(decided)
                self.drafter.observe(decided, from_draft)
                if decided:
                    token = decided[-1]  # emitted; its KV is written by the next pass
                # Draft, then run [token] + draft through the model in one pass.
                room = min(p.max_new_tokens - len(self.tokens) - 1, rt.max_len - pos - 1)
                was_recheck = recheck
                healing = self._healing is not None and self._healing.active
                # while healing, each token's allowed set depends on the one before: no drafts
                k = 0 if recheck or healing else min(self.policy.size(), room, k_cap)
                t_draft = time.perf_counter()
                draft = self.drafter.propose(context, k) if k > 0 else []
                draft = [int(t) for t in draft[:k] if 0 <= t < nv]
                # drafting's own time (n-gram search, resync, rename learning) is charged to it
                dt_draft = time.perf_counter() - t_draft if k > 0 else 0.0
                if k > 0 and not draft:
                    self.policy.charge(dt_draft)
                    if getattr(self.drafter, "pause_when_empty", False):
                        self.policy.empty()
                if not draft:  # a single step, as lean as the plain loop's (fresh text runs here)
                    with eng.lock:
                        self._check(slot)
                        t_run = time.perf_counter()
                        row = self._run_model(rt.decode, slot.kv, token, pos)[:nv]
                        pick = self._pick(row, _argmax) if healing else int(row.argmax())
                        dt_run = time.perf_counter() - t_run
                        self.policy.timed(1, dt_run)
                        slot.tokens.append(token)
                        pos += 1
                    runs += 1
                    # a single step forced by a near-tie is charged to drafting
                    self.policy.emitted("draft" if was_recheck else "plain", 1, dt_run)
                    decided, recheck, from_draft = [pick], False, 0
                    lps = [token_logprob(row, pick)] if want_lp else []
                    continue
                with eng.lock:
                    self._check(slot)
                    t_run = time.perf_counter()
                    logits = self._run_model(
                        rt.forward, slot.kv, [token] + draft, pos, len(draft) + 1
                    )
                    rows = logits[:, :nv]
                    picks = rows.argmax(-1)
                    a = 0
                    while a < len(draft) and picks[a] == draft[a]:
                        a += 1
                    sure = np.ones(a + 1, bool)
                    if guard > 0:  # margins of the rows we are about to use
                        top, margin = _top2_margin(rows[: a + 1], picks[: a + 1])
                        sure = margin >= guard * np.maximum(np.abs(top), 1.0)
                        a = int(np.argmin(sure)) if not sure.all() else a
                    # what the policy weighs: drafting, the pass and its verification (argmaxes, margins)
                    dt_run = time.perf_counter() - t_run + dt_draft
                    self.policy.timed(1 + len(draft), dt_run)
                    if sure[a]:  # the model's own next token is trustworthy too
                        slot.tokens.append(token)
                        slot.tokens.extend(draft[:a])
                        pos += 1 + a
                        decided = draft[:a] + [int(picks[a])]
                        recheck = False
                    else:  # a near-tie in a batched pass: decide this position with a single step
                        if a:
                            slot.tokens.append(token)
                            slot.tokens.extend(draft[: a - 1])
                            pos += a
                        decided = draft[:a]
                        recheck = True
                        rechecks += 1
                if want_lp:  # row i of the pass is the distribution of decided[i]
                    lps = [token_logprob(rows[i], t) for i, t in enumerate(decided)]
                runs += 1
                drafted += len(draft)
                accepted_total += a
                self.policy.update(len(draft), a)
                self.policy.emitted("draft", len(decided), dt_run)
                from_draft = a
        except Cancelled:
            self.finish_reason = "cancelled"
        finally:
            self._finish(slot, t_first, t_last)
            self.stats.update(
                {
                    "drafted_tokens": drafted,
                    "accepted_tokens": accepted_total,
                    "rechecks": rechecks,
                    "acceptance": accepted_total / drafted if drafted else 0.0,
                    "model_runs": runs,
                    "tokens_per_run": (len(self.tokens) - 1) / runs if runs else 0.0,
                }
            )


def _argmax(row: np.ndarray) -> int:
    return int(row.argmax())


def _top2_margin(rows: np.ndarray, picks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the top logit, its margin over the runner-up) of each row, ``picks`` being the argmaxes.

    Two passes over the rows (the top masked out in place, then put back): far cheaper than
    ``np.partition`` over a whole vocabulary, which costs about as much as a small model's decode
    step.
    """
    r = np.arange(rows.shape[0])
    top = rows[r, picks].copy()
    rows[r, picks] = -np.inf
    second = rows.max(axis=1)
    rows[r, picks] = top
    return top, top - second


def generate(
    engine: Model,
    prompt: str | Sequence[int],
    params: GenerationParams | None = None,
    slot: Hashable = None,
    *,
    draft: str | Sequence[int] | None = None,
    ngram: bool = True,
    policy: DraftPolicy | None = None,
    cancel: CancelToken | None = None,
) -> Generation:
    """Like ``engine.generate`` but speculative (greedy only; sampling runs the plain loop).

    ``draft``: the text (or token ids) being rewritten — speculative edits; ``None`` drafts by
    n-gram prompt lookup (``ngram=False`` turns that off too, leaving plain decoding in the same
    class, for comparisons).  ``cancel``: a token that stops it (see ``engine.cancel``).  A text draft follows ``params.healed_prefix`` (the output's first
    tokens spell it), so the two are encoded together: the draft's tokens then line up with
    the output's from the first token on.
    """
    params = params or GenerationParams()
    ids = engine.encode_prompt(prompt)
    room = engine.context - len(ids)
    if params.max_new_tokens > room:
        params = replace(params, max_new_tokens=max(1, room))
    if draft is not None:
        src = (
            engine.tokenizer.encode(params.healed_prefix + draft)
            if isinstance(draft, str)
            else [int(t) for t in draft]
        )
        drafter = EditDrafter(
            src, fallback=PromptLookup() if ngram else _NoDraft(), tokenizer=engine.tokenizer
        )
        policy = policy or DraftPolicy(alpha=0.9)
    elif ngram:
        drafter = PromptLookup()
    else:
        drafter = _NoDraft()
    return SpeculativeGeneration(
        engine, ids, params, slot, drafter=drafter, policy=policy, cancel=cancel
    )


class _NoDraft(PromptLookup):
    """Never drafts (plain greedy decoding through the speculative loop)."""

    def propose(self, context: _Tokens, k: int) -> list[int]:
        return []
