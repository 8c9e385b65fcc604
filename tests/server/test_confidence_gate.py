"""The confidence gate: an automatic suggestion the model gave low probabilities is hidden, an
invoked one never is; the model's own log-probabilities are asked for only when the gate is on.
The model is scripted (its chunks and their log-probabilities exact)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from engine import GenerationParams
from engine.generate import Chunk
from spark_lsp import completions
from spark_lsp.scheduler import Job
from spark_lsp.settings import Settings


class _Gen:
    def __init__(self, chunks):
        self.chunks, self.finish_reason, self.stats = chunks, "stop", {"new_tokens": len(chunks)}

    def __iter__(self):
        return iter(self.chunks)

    def cancel(self):
        pass


class _Model:
    """Writes `text` in two tokens with probabilities `probs` (log-probabilities only when asked)."""

    context = None

    def __init__(self, text: str, probs: tuple[float, float]):
        self.text, self.probs, self.params = text, probs, []

    def generate(self, ids, params, slot, cancel=None, speculative=False, draft=None, text=None):
        self.params.append(params)
        half = len(self.text) // 2
        parts = (self.text[:half], self.text[half:])
        return _Gen(
            [
                Chunk(i, t, math.log(p) if params.logprobs else None)
                for i, (t, p) in enumerate(zip(parts, self.probs))
            ]
        )


@dataclass
class _Prompt:
    ids: list
    healed: str = ""
    fim: bool = True
    prefix: str = ""  # the text the ids encode, for remote backends
    suffix: str = ""


class _Builder:
    stop_strings = ()

    class tokenizer:  # noqa: N801
        special_tokens: dict = {}

    def build(self, text, offset, budget, key=None):
        return _Prompt([1, 2, 3])


def _complete(model, trigger, min_confidence):
    loop = asyncio.new_event_loop()
    try:
        settings = Settings(min_confidence=min_confidence)
        text = "def area(w, h):\n    return "
        return completions.complete(
            model,
            _Builder(),
            Job("doc", lambda j: None, loop),
            text,
            len(text),
            settings,
            trigger,
            GenerationParams,
        )
    finally:
        loop.close()


def test_an_unsure_automatic_suggestion_is_hidden_and_an_invoked_one_shown():
    unsure = _Model("w * h", (0.9, 0.1))  # the line's probability: 0.09
    res = _complete(unsure, completions.AUTOMATIC, 0.5)
    assert res.items == [] and res.stats["hidden"] == "low confidence"
    assert math.isclose(res.stats["confidence"], 0.09) and unsure.params[0].logprobs
    assert _complete(unsure, completions.AUTOMATIC, 0.05).items == ["w * h"]  # above the threshold
    invoked = _complete(unsure, completions.INVOKED, 0.5)
    assert "w * h" in invoked.items and not any(p.logprobs for p in unsure.params[-3:])
    sure = _Model("w * h", (0.9, 0.8))  # 0.72
    assert _complete(sure, completions.AUTOMATIC, 0.5).items == ["w * h"]


def test_only_the_first_line_counts_in_a_multi_line_suggestion():
    # the first token ends the first line (its break included); the second is all of line 2
    model = _Model("return w * h\n    # the area", (0.8, 0.01))
    text = "def area(w, h):\n    "
    loop = asyncio.new_event_loop()
    try:
        res = completions.complete(
            model,
            _Builder(),
            Job("doc", lambda j: None, loop),
            text,
            len(text),
            Settings(min_confidence=0.5),
            completions.AUTOMATIC,
            GenerationParams,
        )
    finally:
        loop.close()
    assert res.stats["multiline"] and math.isclose(res.stats["confidence"], 0.8)


def test_no_gate_asks_for_no_logprobs_and_a_model_without_them_is_not_gated():
    m = _Model("w * h", (0.9, 0.1))
    res = _complete(m, completions.AUTOMATIC, 0.0)
    assert res.items == ["w * h"] and not m.params[0].logprobs and "confidence" not in res.stats
    assert Settings().min_confidence == 1e-6  # the default: see docs/suggestions.md

    class NoLogprobs(_Model):  # e.g. a remote backend that does not report them
        def generate(
            self, ids, params, slot, cancel=None, speculative=False, draft=None, text=None
        ):
            return _Gen([Chunk(0, self.text)])

    res = _complete(NoLogprobs("w * h", (0.1, 0.1)), completions.AUTOMATIC, 0.9)
    assert res.items == ["w * h"] and "confidence" not in res.stats
