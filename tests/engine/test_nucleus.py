"""Nucleus (top-p) selection without sorting the vocabulary: the same tokens, in the same order,
as a stable sort of every logit."""

from __future__ import annotations

import numpy as np
import pytest

from engine.sampling import Sampler, nucleus


def _by_full_sort(x: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-x, kind="stable")
    p = np.exp(x[order] - x[order[0]])
    p /= p.sum()
    return order[: int(np.searchsorted(np.cumsum(p), top_p) + 1)]


@pytest.mark.parametrize("seed", range(4))
def test_nucleus_equals_full_sort(seed):
    rng = np.random.default_rng(seed)
    for trial in range(300):
        n = int(rng.integers(1, 5000))
        x = rng.standard_normal(n) * rng.choice([0.05, 1.0, 4.0, 40.0])
        if trial % 3 == 0:
            x = np.round(x, 1)  # many ties, some at the cut
        top_p = float(rng.choice([0.05, 0.5, 0.9, 0.95, 0.9999]))
        np.testing.assert_array_equal(nucleus(x, top_p), _by_full_sort(x, top_p))


def test_nucleus_grows_past_the_first_candidates():
    x = np.zeros(10_000)  # flat: the nucleus is most of the vocabulary
    got = nucleus(x, 0.5)
    assert got.shape[0] == 5000 and np.array_equal(got, np.arange(5000))


def test_top_p_sampling_on_a_large_vocabulary_is_reproducible():
    logits = np.random.default_rng(0).standard_normal(151_936).astype(np.float32) * 6
    a = [Sampler(temperature=0.8, top_p=0.95, seed=3)(logits) for _ in range(3)]
    allowed = set(nucleus(logits.astype(np.float64) / 0.8, 0.95).tolist())
    assert len(set(a)) == 1 and a[0] in allowed
