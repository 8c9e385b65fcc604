"""The options a caller gives the engine: ``GenerationParams`` (one generation) and
``PRECISIONS`` (the weight precisions a model loads at).

Apart from ``engine.generate`` and ``engine.linears`` (which run and build with them) so that a
client of the engine service, which only checks these options and sends them over the wire,
does not load ONNX Runtime with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sampling import Sampler

#: The weight precisions (``engine.linears`` has an emitter for each; "auto" chooses among them).
PRECISIONS = ("fp32", "int8", "int8-rowq", "int4")


@dataclass(frozen=True)
class GenerationParams:
    """How to generate. ``stop``: strings that end the text (not included in it).

    ``stop_ids``: token ids that end the text like eos (not decoded, not included): callers pass
    the control tokens (FIM markers, file separators) so ``<fim_suffix>`` never appears as text.
    ``ignore_eos`` keeps generating past eos and stop_ids (benchmarks, reference comparisons).
    ``healed_prefix``: text the output must begin with (token healing: the prompt's last tokens
    were backed off, see ``engine.fim.heal``); it is generated but not emitted, so ``text`` and
    the chunks start right after it.  Its tokens count in ``tokens`` and ``max_new_tokens``.
    ``logprobs``: each chunk carries its token's log-probability under the model (and
    ``Generation.logprobs`` lists them): what a caller scores its confidence in the text by.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_time_s: float | None = None
    ignore_eos: bool = False
    stop_ids: frozenset[int] = frozenset()
    healed_prefix: str = ""
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.healed_prefix is None:
            object.__setattr__(self, "healed_prefix", "")
        if not isinstance(self.healed_prefix, str):
            raise ValueError(f"healed_prefix={self.healed_prefix!r} must be a string")
        try:
            ids = frozenset(int(i) for i in (self.stop_ids or ()))
        except (TypeError, ValueError):
            raise ValueError(f"stop_ids={self.stop_ids!r} must be token ids (integers)") from None
        if any(i < 0 for i in ids):
            raise ValueError(f"stop_ids={self.stop_ids!r} must be non-negative token ids")
        object.__setattr__(self, "stop_ids", ids)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be a positive integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        if self.max_time_s is not None and not self.max_time_s > 0:
            raise ValueError(f"max_time_s={self.max_time_s!r} must be positive or None")
        Sampler(
            self.temperature, self.top_k, self.top_p, self.seed
        )  # validates the sampling fields
