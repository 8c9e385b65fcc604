"""Choose the next token from a logits row: greedy, or temperature / top-k / top-p with a seed."""

from __future__ import annotations

import numpy as np


class Sampler:
    """Stateful sampler; one per generation so a seed reproduces the whole sequence.

    ``temperature == 0`` is greedy (argmax, first index on ties, like transformers).
    ``top_k == 0`` and ``top_p == 1`` disable those filters.
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> None:
        if not temperature >= 0:
            raise ValueError(f"temperature={temperature!r} must be >= 0")
        if top_k < 0:
            raise ValueError(f"top_k={top_k!r} must be >= 0")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.greedy = self.temperature == 0.0 or self.top_k == 1
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(logits.argmax())
        x = logits.astype(np.float64) / self.temperature
        idx = None
        if 0 < self.top_k < x.shape[0]:
            idx = np.argpartition(-x, self.top_k - 1)[: self.top_k]
            x = x[idx]
        if self.top_p < 1.0:
            order = np.argsort(-x, kind="stable")
            p = np.exp(x[order] - x[order[0]])
            p /= p.sum()
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)  # smallest set with mass >= top_p
            order = order[:keep]
            x = x[order]
            idx = order if idx is None else idx[order]
        p = np.exp(x - x.max())
        p /= p.sum()
        choice = int(self.rng.choice(p.shape[0], p=p))
        return int(idx[choice]) if idx is not None else choice
