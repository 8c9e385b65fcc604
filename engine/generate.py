"""A streaming generation: prefill with prefix reuse, then decode token by token.

The work happens in the thread that iterates (no background thread).  The engine lock is held
for the prefill and for each decode step, never while the consumer handles a chunk, so several
generations on different slots interleave fairly and an abandoned generation holds nothing.
``cancel()`` may be called from any thread, as may the ``CancelToken`` the caller passed
(``engine.cancel``): a cancel is checked before every step and terminates an ONNX Runtime run in
flight (``RunOptions.terminate``); the generation then ends with finish_reason 'cancelled'.

Only tokens whose KV was completely written are recorded in the slot, so a cancel in the middle
of a prefill or a decode step leaves the prefix cache consistent.

Token healing (``GenerationParams.healed_prefix``): the first tokens are constrained to spell
the given text (``engine.sampling.Healing``) and that text is cut from what the caller sees, so
stop strings and chunks concern only the text after it.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Hashable, Iterator
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from .cancel import Cancelled, CancelToken
from .config import ModelError
from .heap import trim_heap
from .params import GenerationParams
from .prefix_cache import Slot
from .runtime import Interrupt, Runtime
from .sampling import Healing, Sampler, token_logprob
from .tokenizer import Tokenizer

#: Prompt tokens a prefill must run for its generation to give the C heap's free memory back
#: afterwards (:meth:`Generation._release_prefill_memory`).
TRIM_AFTER_PREFILL = 256


class Model(Protocol):
    """What a generation needs from the engine that runs it (``engine.Engine`` is one).

    ``lock`` serialises model runs: a generation holds it around each ONNX Runtime run and while
    it takes a KV slot (``acquire_slot``), never while its consumer handles a chunk.
    """

    tokenizer: Tokenizer
    runtime: Runtime
    linear: (
        Any  # the linear emitter: speculation reads its ``max_verify_tokens`` / ``verify_margin``
    )
    eos_ids: frozenset[int]
    sample_vocab: int
    prefill_chunk: int
    context: int

    @property
    def lock(self) -> ContextManager: ...

    def acquire_slot(self, key: Hashable) -> Slot: ...

    def encode_prompt(self, prompt: Any) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Chunk:
    """One generated token and the text it completed ("" while a UTF-8 character or a possible
    stop string is incomplete).  A final chunk carrying an eos id may flush held-back text.
    ``logprob``: the model's log-probability of the token, when ``GenerationParams.logprobs``."""

    token_id: int
    text: str
    logprob: float | None = None


def _held_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class _Emitter:
    """Sampled tokens -> text chunks, shared by the plain and the speculative decoding loops so
    both end a generation identically: eos / stop_ids end it undecoded, a stop string cuts the
    text, a possible stop-string prefix is held back until it resolves, and max_new_tokens or the
    deadline end it with the stream flushed.  The healed prefix is cut from the decoded text
    before any of that, so stop strings only see text after it."""

    def __init__(self, gen: Generation) -> None:
        p = gen.params
        self.gen = gen
        self.stops = p.stop
        self.eos = frozenset() if p.ignore_eos else gen._engine.eos_ids
        self.ends = self.eos | (frozenset() if p.ignore_eos else p.stop_ids)
        self.stream = gen._engine.tokenizer.stream()
        self.held = ""
        self.skip = p.healed_prefix  # healed text not yet cut from the decoded stream
        self.fresh = True  # nothing decoded yet
        self.deadline = None if p.max_time_s is None else gen._t0 + p.max_time_s

    def _cut(self, text: str) -> str:
        """``text`` (newly decoded) without the part of the healed prefix it still spells.  A
        mismatch (the constraint was abandoned) stops the cutting: the rest is output."""
        if not self.skip or not text:
            return text
        if self.fresh and self.skip[0] == " " and text[0] != " ":
            self.skip = self.skip[
                1:
            ]  # SentencePiece decoders drop the stream's first leading space
        self.fresh = False
        k, m = 0, min(len(text), len(self.skip))
        while k < m and text[k] == self.skip[k]:
            k += 1
        self.skip = self.skip[k:] if k == len(text) else ""
        return text[k:]

    def emit(
        self, token: int, now: float, logprob: float | None = None
    ) -> tuple[Chunk | None, bool]:
        """(the chunk to yield, or None; whether the generation has finished); ``logprob``: the
        token's log-probability, when the generation records them."""
        g = self.gen
        if token in self.ends:
            g.finish_reason = "eos" if token in self.eos else "stop"
            rest = self.held + self._cut(self.stream.flush())
            if rest:
                g.text += rest
                return Chunk(token, rest), True
            return None, True
        g.tokens.append(token)
        if logprob is not None:
            g.logprobs.append(logprob)
        buf = self.held + self._cut(self.stream.push(token))
        last = len(g.tokens) >= g.params.max_new_tokens
        timed_out = self.deadline is not None and now >= self.deadline
        if self.stops:
            cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                g.text += buf[:cut]
                g.finish_reason = "stop"
                return Chunk(token, buf[:cut], logprob), True
            if last or timed_out:
                buf += self._cut(self.stream.flush())
                k = 0
            else:
                k = _held_suffix(buf, self.stops)
            out, self.held = buf[: len(buf) - k], buf[len(buf) - k :]
        else:
            out = buf + self._cut(self.stream.flush()) if (last or timed_out) else buf
        g.text += out
        if last or timed_out:
            g.finish_reason = "length" if last else "time"
        return Chunk(token, out, logprob), last or timed_out


class Generation:
    """Iterate for :class:`Chunk` objects; then read ``text``, ``tokens``, ``finish_reason``, ``stats``."""

    def __init__(
        self,
        engine: Model,
        prompt: list[int],
        params: GenerationParams,
        slot: Hashable = None,
        cancel: CancelToken | None = None,
        stop_flag: ctypes.c_int32 | None = None,
    ) -> None:
        self._engine = engine
        self.prompt = prompt
        self.params = params
        self.slot_key = slot
        self.tokens: list[int] = []
        self.logprobs: list[float] = []  # per token in `tokens`, when params.logprobs
        self.text = ""
        self.finish_reason: str | None = None
        self._prefilled = 0  # prompt tokens this generation's prefill ran (the rest were reused)
        self.stats: dict[str, float | int] = {
            "prompt_tokens": len(prompt),
            "reused_tokens": 0,
            "new_tokens": 0,
            "ttft_ms": 0.0,
            "decode_tok_s": 0.0,
            "total_ms": 0.0,
        }
        # its own token, a child of the caller's: stopping early on its own leaves the caller's alone
        self.cancel_token = cancel.child() if cancel is not None else CancelToken()
        self._interrupt = Interrupt(stop_flag)
        self.cancel_token.on_cancel(lambda reason: self._interrupt.set())
        self._sampler = Sampler(params.temperature, params.top_k, params.top_p, params.seed)
        self._healing = (
            Healing(engine.tokenizer.byte_index(), params.healed_prefix)
            if params.healed_prefix
            else None
        )
        self._t0 = time.perf_counter()
        self._iter = self._run()

    # -- public ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        return next(self._iter)

    def cancel(self) -> None:
        """Stop as soon as possible (thread-safe); aborts an ONNX Runtime run in flight."""
        self.cancel_token.cancel("generation cancelled")

    @property
    def cancelled(self) -> bool:
        return self.cancel_token.cancelled

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> str:
        """Run to the end (if not yet) and return the text."""
        for _ in self:
            pass
        return self.text

    # -- work --------------------------------------------------------------------------------
    def _pick(self, logits, choose=None) -> int:
        """The next token from a logits row: the sampler (or ``choose``), within the healing
        constraint while it is active."""
        choose = choose or self._sampler
        if self._healing is not None and self._healing.active:
            return self._healing.pick(logits, choose)
        return choose(logits)

    def _watch(self) -> None:
        """A set stop flag (a client's, in shared memory) cancels the generation."""
        if self._interrupt.watched:
            self.cancel_token.cancel("generation cancelled")

    def _check(self, slot) -> None:
        self._watch()
        self.cancel_token.check()
        if slot.owner is not self:
            raise Cancelled("another generation took the KV slot")

    def _run_model(self, fn, *args):
        """``fn(*args)`` (a runtime run) stoppable by this generation's cancel; Cancelled when it
        was cancelled, even if the run ended: a node cut short by the cancel leaves its output
        unfinished, so nothing a cancelled run returns is used (nor its KV counted)."""
        try:
            out = fn(*args, interrupt=self._interrupt)
        except ModelError:
            raise
        except Exception:
            self._watch()
            if self.cancel_token.cancelled:  # ORT raises when RunOptions.terminate aborts the run
                raise Cancelled(self.cancel_token.reason) from None
            raise
        self._watch()
        if self.cancel_token.cancelled:
            raise Cancelled(self.cancel_token.reason)
        return out

    def _prefill(self):
        """Rewind the slot to the common prefix, prefill the rest; returns (slot, last logits row)."""
        eng = self._engine
        rt = eng.runtime
        with eng.lock:
            slot = eng.acquire_slot(self.slot_key)
            slot.owner = self
            self._check(slot)
            rt.refresh_mode()  # spinning decode session only while the CPU is calm
            reused = slot.rewind(self.prompt)
            self.stats["reused_tokens"] = reused
            pos = reused
            logits = None
            chunk = eng.prefill_chunk
            while pos < len(self.prompt):
                self._check(slot)
                part = self.prompt[pos : pos + chunk]
                logits = self._run_model(rt.forward, slot.kv, part, pos)
                slot.tokens.extend(part)
                pos += len(part)
                self._prefilled += len(part)
            return slot, logits[-1]

    def _release_prefill_memory(self) -> None:
        """After a long prefill, once its first tokens are out: give the C heap's free pages back
        to the system.  A prefill's chunks allocate and free buffers of many MB; glibc keeps what
        is freed in the heap of the thread that ran the chunk, so a process's memory grew with
        its long prompts, and a daemon running its connections' generations on several threads
        kept such a heap per thread.  Trimming costs a few ms: it runs after the first chunk has
        been yielded (or when the generation ends), never before it."""
        if self._prefilled >= TRIM_AFTER_PREFILL:
            self._prefilled = 0
            trim_heap()

    def _run(self) -> Iterator[Chunk]:
        eng = self._engine
        emitter = _Emitter(self)
        t_first = t_last = None
        slot = None
        nv = eng.sample_vocab  # ids the tokenizer can decode (model vocabularies are often padded)
        try:
            slot, logits = self._prefill()
            pos = len(slot.tokens)
            while True:
                token = self._pick(logits[:nv])
                lp = token_logprob(logits[:nv], token) if self.params.logprobs else None
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                    self.stats["ttft_ms"] = (now - self._t0) * 1e3
                t_last = now
                chunk, done = emitter.emit(token, now, lp)
                if chunk is not None:
                    yield chunk
                if done:
                    return
                self._release_prefill_memory()
                with eng.lock:
                    self._check(slot)
                    logits = self._run_model(eng.runtime.decode, slot.kv, token, pos)
                    slot.tokens.append(token)
                    pos += 1
        except Cancelled:
            self.finish_reason = "cancelled"
        finally:
            self._finish(slot, t_first, t_last)

    def _finish(self, slot, t_first: float | None, t_last: float | None) -> None:
        """End of any decoding loop: settle finish_reason, release the KV slot, fill the stats."""
        if self.finish_reason is None:  # an exception or the consumer closed the iterator
            self.finish_reason = "cancelled"
        if slot is not None and slot.owner is self:
            slot.owner = None
        self._release_prefill_memory()  # a generation that ended at its first tokens
        self.stats["new_tokens"] = len(self.tokens)
        self.stats["total_ms"] = (time.perf_counter() - self._t0) * 1e3
        if t_first is not None and t_last is not None and len(self.tokens) > 1 and t_last > t_first:
            self.stats["decode_tok_s"] = (len(self.tokens) - 1) / (t_last - t_first)
