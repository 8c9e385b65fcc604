"""Choose the next token from a logits row: greedy, or temperature / top-k / top-p with a seed,
optionally constrained so the output begins with a given text (:class:`Healing`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def token_logprob(logits: np.ndarray, token: int) -> float:
    """The model's log-probability of ``token`` under a logits row (log-softmax at temperature 1,
    before any sampling filter): one pass over the row, in float32."""
    x = np.asarray(logits, dtype=np.float32)
    m = float(x.max())
    return float(x[token]) - m - float(np.log(np.exp(x - m).sum()))


class Sampler:
    """Stateful sampler; one per generation so a seed reproduces the whole sequence.

    ``temperature == 0`` is greedy (argmax, first index on ties, like transformers).
    ``top_k == 0`` and ``top_p == 1`` disable those filters.  The random generator is made at
    the first sampled token: seeding one from the OS costs more than a whole request's dispatch,
    and greedy requests (every completion) never draw from it.
    """

    def __init__(
        self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None
    ) -> None:
        if not temperature >= 0:
            raise ValueError(f"temperature={temperature!r} must be >= 0")
        if top_k < 0:
            raise ValueError(f"top_k={top_k!r} must be >= 0")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed={seed!r} must be a non-negative integer or None")
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.greedy = self.temperature == 0.0 or self.top_k == 1
        self.seed = seed
        self._rng: np.random.Generator | None = None

    @property
    def rng(self) -> np.random.Generator:
        if self._rng is None:
            self._rng = np.random.default_rng(self.seed)
        return self._rng

    def __call__(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(logits.argmax())
        x = logits.astype(np.float64) / self.temperature
        idx = None
        if 0 < self.top_k < x.shape[0]:
            idx = np.argpartition(-x, self.top_k - 1)[: self.top_k]
            x = x[idx]
        if self.top_p < 1.0:
            order = nucleus(x, self.top_p)
            x = x[order]
            idx = order if idx is None else idx[order]
        p = np.exp(x - x.max())
        p /= p.sum()
        choice = int(self.rng.choice(p.shape[0], p=p))
        return int(idx[choice]) if idx is not None else choice


def nucleus(x: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of logits ``x`` whose softmax mass reaches ``top_p``, highest
    first (ties by index, as a stable sort of ``-x``).

    Only the top candidates are sorted: a partition finds the ``k`` largest (``k`` doubling until
    they hold the mass), so a 152k-entry vocabulary costs a few linear passes, not a full sort.
    """
    n = x.shape[0]
    e = np.exp(x - x.max())
    total = e.sum()
    k = min(n, 64)
    while True:
        if k < n:
            thr = -np.partition(-x, k - 1)[k - 1]
            cand = np.flatnonzero(x >= thr)  # every tie at the threshold: the order stays exact
        else:
            cand = np.arange(n)
        cand = cand[np.argsort(-x[cand], kind="stable")]
        cum = np.cumsum(e[cand]) / total
        keep = int(np.searchsorted(cum, top_p) + 1)  # smallest prefix with mass >= top_p
        if keep <= cand.shape[0] or cand.shape[0] == n:
            return cand[: min(keep, cand.shape[0])]
        k = min(n, 4 * k)


class Healing:
    """Token healing: the output must begin with ``text`` (bytes the prompt's tokens left out).

    A FIM prompt whose prefix ends inside a word ends with a token the model rarely saw before
    the cursor; the caller backs those tokens off the prompt and asks for their text here
    instead, so the model re-spells it with the tokens it knows (``assertEq`` -> ``assertEqual``).
    While some of ``text`` is pending, only tokens consistent with it are allowed: tokens that
    start with the pending bytes or that the pending bytes start with (``index`` is the
    tokenizer's :class:`~engine.tokenizer.ByteIndex`).  Picking advances the pending bytes.
    If no token is consistent (a vocabulary that cannot spell the text), the constraint is
    dropped (``abandoned``) and sampling goes on unconstrained rather than failing.
    """

    def __init__(self, index, text: str | bytes) -> None:
        self.index = index
        self.pending = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        self.abandoned = False

    @property
    def active(self) -> bool:
        return bool(self.pending)

    def allowed(self, vocab: int) -> np.ndarray | None:
        """Sorted ids below ``vocab`` allowed next (None: anything, the text is covered)."""
        if not self.pending:
            return None
        ids = self.index.consistent(self.pending)
        return ids[: np.searchsorted(ids, vocab)]

    def advance(self, token: int) -> None:
        """``token`` was chosen: consume the pending bytes it spells."""
        b = self.index.token_bytes[token] if 0 <= token < len(self.index.token_bytes) else None
        if b and b.startswith(self.pending):
            self.pending = b""
        elif b and self.pending.startswith(b):
            self.pending = self.pending[len(b) :]
        elif self.pending:
            self.pending, self.abandoned = b"", True

    def pick(self, logits: np.ndarray, choose: Callable[[np.ndarray], int]) -> int:
        """Choose with ``choose`` (a :class:`Sampler`) among the allowed ids of ``logits``: the others
        are set to -inf (greedy ties still go to the lowest id, top-k/top-p see only allowed ones)."""
        ids = self.allowed(logits.shape[0])
        if ids is None:
            return choose(logits)
        if ids.size == 0:
            self.pending, self.abandoned = b"", True
            return choose(logits)
        masked = np.full(logits.shape, -np.inf, dtype=logits.dtype)  # the sampler sees a whole row
        masked[ids] = logits[ids]
        token = int(choose(masked))
        self.advance(
            token
        )  # a sampler that ignores the row (tests' scripted ones) abandons the constraint
        return token
