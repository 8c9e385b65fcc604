"""One engine replica of the Ray Serve application (``engine.service.ray_app``): a Serve
deployment holding one copy of the engine, whose ``generate`` streams one generation's tokens
to the ingress (``engine.service.ray_ingress``) in batches."""

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

from ..config import ModelError
from . import protocol as P
from .daemon import INTERACTIVE_PREFILL_CHUNK
from .local import describe
from .options import DEFAULT_SPINNING, SPINNING
from .placement import Documents

log = logging.getLogger(__name__)

#: KV slots per replica (documents whose prefix each replica keeps warm), unless told otherwise.
SLOTS = 16


@serve.deployment(max_ongoing_requests=64, health_check_period_s=2, health_check_timeout_s=10)
class EngineReplica:
    """One copy of the engine; every generation it runs streams from a worker thread."""

    def __init__(
        self,
        model_dir: str,
        threads: int | None = None,
        slots: int = SLOTS,
        precision: str = "fp32",
        spinning: bool | None = SPINNING[DEFAULT_SPINNING],
    ) -> None:
        from ..engine import Engine  # ONNX Runtime loads in the replica process only

        # spinning: the daemon's default (off), for the same reason: a replica hands every
        # token to its event loop (Serve's streaming), which needs a core between steps
        self.engine = Engine.load(
            model_dir, slots=slots, threads=threads, precision=precision, spinning=spinning
        )
        self.engine.prefill_chunk = min(self.engine.prefill_chunk, INTERACTIVE_PREFILL_CHUNK)
        self.engine.tokenizer.byte_index()  # token-healed prompts need it: built now
        self.where = f"{os.uname().nodename}:{os.getpid()}"
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="spark-replica-gen")
        self.documents = Documents()  # this replica's load, as every ingress places by it

    async def load(self) -> int:
        """Documents this replica served recently (``placement.Documents``)."""
        return self.documents.load()

    async def claim(self, key: str, cap: int) -> bool:
        """Take document ``key`` if this replica has fewer than ``cap`` documents (the share the
        ingress computed): ``placement.Documents.claim``."""
        return self.documents.claim(key, cap)

    def describe(self) -> dict[str, Any]:
        return {**describe(self.engine), "replica": self.where}

    async def generate(self, request: dict[str, Any]):
        params = P.params_from_json(request.get("params"))
        if request.get("slot"):
            self.documents.use(request["slot"])
        try:
            gen = self.engine.generate(request["prompt"], params, slot=request.get("slot"))
        except (ValueError, ModelError) as e:
            yield {"done": "error", "stats": {}, "error": {"code": P.BAD_PROMPT, "message": str(e)}}
            return
        # The generation runs on a worker thread that queues each token here; every item this
        # stream yields carries all the tokens ready by then, so a caller that falls behind (many
        # editors on few cores) gets one Ray message for several tokens instead of one each.
        # The first token comes with the generation's early stats (protocol.EARLY_STATS), which
        # the ingress sends with its first ``tokens`` message, as the daemon does.
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue = asyncio.Queue()

        def produce() -> None:
            try:
                early: dict[str, Any] | None = None
                for chunk in gen:
                    if early is None:
                        early = P.early_stats(gen.stats)
                        item = (int(chunk.token_id), chunk.text, early)
                    else:
                        item = (int(chunk.token_id), chunk.text, None)
                    loop.call_soon_threadsafe(ready.put_nowait, item)
                end: BaseException | None = None
            except BaseException as e:  # raised again on the event loop
                end = e
            loop.call_soon_threadsafe(ready.put_nowait, end)

        worker = loop.run_in_executor(self.pool, produce)
        try:
            while True:
                items = [await ready.get()]
                while not ready.empty():
                    items.append(ready.get_nowait())
                tokens = [x for x in items if isinstance(x, tuple)]
                if tokens:
                    out: dict[str, Any] = {"tokens": [[t, text] for t, text, _ in tokens]}
                    if tokens[0][2] is not None:
                        out["stats"] = tokens[0][2]
                    yield out
                if len(tokens) < len(items):  # the end (None) or the generation's error
                    end = items[-1]
                    if end is not None:
                        raise end
                    break
        except BaseException:  # the caller cancelled (or went away): stop within one step
            gen.cancel()
            raise
        await worker
        yield {
            "done": gen.finish_reason or "cancelled",
            "stats": dict(gen.stats),
            "replica": self.where,
        }
