"""The in-process engine as a backend: token-healed FIM prompts from the engine's own tokenizer,
KV-cache slots per document, speculative decoding for greedy requests.

The engine's ``Generation`` already keeps the `Stream` contract (chunks, ``cancel()`` that aborts
the ONNX Runtime run in flight, ``finish_reason``, ``stats``), so it is returned as is.
"""

from __future__ import annotations

from typing import Any

from engine import speculative as spec
from engine.fim import heal as heal_ids
from engine.generate import GenerationParams

from ..prompt import PromptBuilder
from .base import Backend, Request, Stream


def control_ids(builder: PromptBuilder) -> frozenset[int]:
    """Token ids the engine must stop at before decoding them: the FIM format's stop tokens and
    every special (control) token of the tokenizer, so no "<fim_suffix>" ever becomes text."""
    specials = getattr(builder.tokenizer, "special_tokens", None) or {}
    return frozenset(getattr(getattr(builder, "fim", None), "stop_ids", ()) or ()) | frozenset(specials.values())


class LocalBackend(Backend):
    kind = "local"

    def __init__(self, engine: Any, builder: PromptBuilder | None = None, chat: Any = None,
                 speculative: bool = True) -> None:
        self.engine = engine
        self.builder = builder if builder is not None else PromptBuilder(engine.tokenizer)
        self.chat = chat                    # ChatTemplate of a chat model, else None
        self.speculative = speculative
        self._control = control_ids(self.builder)

    @property
    def name(self) -> str:
        return str(getattr(self.engine, "name", None) or "model")

    @property
    def supports_chat(self) -> bool:  # type: ignore[override]
        return self.chat is not None

    def prepare(self, r: Request) -> tuple[list[int], str]:
        """(prompt ids, healed text) of a request: its `prepared` prompt, else built here."""
        if r.prepared is not None:
            return r.prepared
        if r.messages is not None:
            if self.chat is None:
                raise ValueError(f"{self.name} has no chat template")
            return list(self.engine.tokenizer.encode(self.chat.render(list(r.messages)))), ""
        if r.suffix is None:
            return heal_ids(self.engine.tokenizer, r.prefix, keep=1, newline=True)
        return self.builder.encode_healed(r.prefix, r.suffix)

    def infill(self, r: Request) -> Stream:
        ids, healed = self.prepare(r)
        params = GenerationParams(max_new_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                                  seed=r.seed, stop=r.stop, stop_ids=self._control, healed_prefix=healed)
        if self.speculative and r.temperature == 0.0:
            return spec.generate(self.engine, ids, params, r.slot, draft=r.draft)
        return self.engine.generate(ids, params, slot=r.slot)

    def status(self) -> dict:
        return {"kind": self.kind, "name": self.name}
