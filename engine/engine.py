"""The engine façade: load a model folder once, then generate many times.

``Engine.load`` validates the folder, takes the decoder graph from the on-disk cache (building
it from the weights on a miss), opens an ONNX Runtime session and a prefix cache of KV slots.
``generate`` returns a streaming :class:`~engine.generate.Generation`; model runs are serialised
by one lock, so the engine can be shared between threads.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import threading
import time
from array import array
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from . import graph_cache, models
from . import precision as precision_rule
from .cancel import CancelToken
from .config import ModelConfig, ModelError, model_name
from .generate import Generation, GenerationParams
from .gguf import default_precision
from .gguf_quant import gguf_linear
from .graph import KV_DTYPES, build_decoder
from .linears import PRECISIONS, float_linear, make_linear
from .prefix_cache import PrefixCache, Slot
from .runtime import Runtime
from .source import open_model
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: KV buffers are preallocated for the whole context; cap it so a 128k-context model does not
#: reserve gigabytes per slot.  Override with ``Engine.load(max_context=...)``.
DEFAULT_MAX_CONTEXT = 8192
#: Prompt tokens per prefill run: bounds the attention scratch memory and lets a cancel keep the
#: chunks already written.
PREFILL_CHUNK = 1024


def _in_background(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """``fn()`` run on a thread of its own; its result (or exception) from ``.result()``."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to the caller of .result()
            future.set_exception(e)

    threading.Thread(target=run, name="spark-digest", daemon=True).start()
    return future


class Engine:
    """A loaded model: ``tokenizer``, ``config``, ``name``, ``model_dir`` and ``generate()``."""

    def __init__(
        self,
        model_dir: Path,
        config: ModelConfig,
        tokenizer: Tokenizer,
        runtime: Runtime,
        *,
        slots: int = 1,
        graph_path: Path | None = None,
        graph_built: bool = False,
        linear=None,
        load_s: float = 0.0,
    ) -> None:
        self.model_dir = model_dir
        self.name = model_name(model_dir)
        self.config = config
        self.tokenizer = tokenizer
        self.runtime = runtime
        self.linear = linear
        self.precision = "fp32"  # what Engine.load resolved ("auto" becomes a concrete precision)
        self.precision_reason = (
            ""  # why, for precision="auto" (a stored decision or the static rule)
        )
        self.graph_path = graph_path
        self.graph_built = graph_built  # False: the graph came from the on-disk cache
        self.load_s = load_s
        self.context = runtime.max_len
        self.eos_ids = frozenset(tokenizer.eos_ids) | frozenset(config.eos_token_ids)
        self.prefill_chunk = PREFILL_CHUNK
        # Padded embedding rows past the tokenizer's vocabulary are never sampled (undecodable).
        self.sample_vocab = min(config.vocab_size, tokenizer.vocab_size)
        self._lock = threading.RLock()
        self._cache = PrefixCache(runtime, slots)
        self.slots = slots  # how many sequences keep their KV cache (prefix reuse)
        self._scratch = None

    @classmethod
    def load(
        cls,
        model_dir: str | Path | None = None,
        *,
        grid=None,
        wafer: bool = True,
        threads: int | None = None,
        cache_dir: str | Path | None = None,
        slots: int = 1,
        max_context: int | None = None,
        spinning: bool | None = None,
        linear=None,
        decode_threads: int | None = None,
        precision: str = "fp32",
        profile: str | None = None,
        kv_cache: str = "auto",
    ) -> Engine:
        """Load a Hugging Face model folder or a GGUF file (``None``: the bundled default model).

        ``wafer``/``grid``: partition every weight matmul over an emulated grid of PEs
        (``engine.wafer.partition.TiledLinear``); ``wafer=False`` uses plain MatMuls.
        ``threads``: intra-op threads (default: physical cores).  ``slots``: how many sequences
        keep their KV cache for prefix reuse.  ``max_context``: cap on the KV buffer length.
        ``decode_threads``: threads for decode steps (default: ``threads``).  ``spinning``: None
        (default) lets small models decode with spinning threads while the CPU is calm and
        without while it is contended; True/False force it (see ``engine.runtime.Runtime``).
        ``linear``: an explicit linear emitter (e.g. a quantising one); overrides ``wafer``/``grid``
        and ``precision``.  ``precision``: 'fp32' (default), 'int8', 'int4', 'int8-rowq', or 'auto':
        the decision ``spark-lsp tune`` stored for this model and machine, else a static rule
        (``engine.precision``); loading never measures and loads exactly one engine.  For a GGUF
        file 'auto' keeps the file's own precision (``engine.gguf.default_precision``).
        ``profile``: record ONNX Runtime's per-node profile to files with this prefix
        (:meth:`end_profiling` returns them; ``spark-lsp bench profile``).  ``kv_cache``: the KV
        cache's element type, 'float32', 'float16' or 'auto' (default): float16 for quantised
        weights (int8, int4: a quantising ``linear`` too), as llama.cpp's default cache, float32
        for fp32 weights, which are the exact path.  A float16 cache halves what attention reads per token and what a long
        context holds in memory; it needs the wafer attention op (``spark.wafer::DecoderAttention``)
        and is float32 where the graph falls back to GroupQueryAttention.
        """
        t0 = time.perf_counter()
        if model_dir is None:
            model_dir = models.default_model_dir()
        source = open_model(model_dir)
        folder, config, tokenizer = source.path, source.config, source.tokenizer
        # Hashing the weights (a graph-cache key: seconds the first time a model is seen) reads
        # the files while the emitter below may be compiling the op library (a first run).
        digest = _in_background(source.digest)
        if max_context is not None and (
            isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2
        ):
            raise ValueError(f"max_context={max_context!r} must be an integer >= 2")
        for name, v in (("threads", threads), ("decode_threads", decode_threads)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}={v!r} must be a positive integer")
        max_len = min(config.max_position_embeddings, max_context or DEFAULT_MAX_CONTEXT)
        explicit_linear = linear is not None
        reason = ""
        if source.gguf is not None:
            if precision == "auto":  # the file's quantisation was the user's choice: keep it
                precision, reason = default_precision(source.gguf), "the GGUF file's own precision"
            if linear is None and precision in ("int8", "int4"):
                linear = gguf_linear(source.gguf, precision, wafer, grid)  # the file's own blocks
        if linear is None and precision != "fp32":
            if precision == "auto":
                choice = precision_rule.resolve(
                    folder, config, wafer=wafer, grid=grid, threads=threads, cache_dir=cache_dir
                )
                precision, reason = choice.precision, choice.reason
                log.info("precision auto for %s: %s (%s)", folder.name, precision, reason)
            elif precision not in PRECISIONS:
                raise ValueError(f"precision={precision!r}: expected 'auto' or one of {PRECISIONS}")
            if precision != "fp32":
                linear = make_linear(precision, wafer=wafer, grid=grid)
        linear = linear if linear is not None else float_linear(wafer, grid)
        if kv_cache == "auto":  # quantised weights, whichever way they were chosen: float16
            kv_cache = "float16" if getattr(linear, "bits", None) in (4, 8) else "float32"
        elif kv_cache not in KV_DTYPES:
            raise ValueError(f"kv_cache={kv_cache!r}: expected 'auto' or one of {KV_DTYPES}")
        options = {"rope_len": config.max_position_embeddings, "kv_dtype": kv_cache}
        key = graph_cache.graph_key(digest.result(), config, options, linear)

        def build(data_file: Path):
            log.info("building the decoder graph for %s", folder)
            with source.open_weights() as weights:
                return build_decoder(
                    config,
                    weights,
                    linear,
                    max_len=options["rope_len"],
                    external_data=data_file,
                    kv_dtype=kv_cache,
                )

        info = {
            "model_dir": str(folder),
            "emitter": graph_cache.emitter_key(linear),
            "options": options,
        }
        custom_ops = tuple(getattr(linear, "custom_op_libraries", ()))
        path, built = graph_cache.get_or_build(folder.name, key, build, cache_dir, info)

        def open_runtime(graph_path) -> Runtime:
            return Runtime(
                graph_path,
                config,
                max_len=max_len,
                threads=threads,
                decode_threads=decode_threads,
                spinning=spinning,
                profile=profile,
                custom_ops=custom_ops,
            )

        try:
            runtime = open_runtime(path)
        except Exception as e:
            if built:
                raise
            log.warning(
                "cached graph %s cannot be loaded (%s); rebuilding",
                path,
                str(e).splitlines()[0] if str(e) else e,
            )
            graph_cache.invalidate(path)
            path, built = graph_cache.get_or_build(folder.name, key, build, cache_dir, info)
            runtime = open_runtime(path)
        eng = cls(
            folder,
            config,
            tokenizer,
            runtime,
            slots=slots,
            graph_path=path,
            graph_built=built,
            linear=linear,
            load_s=time.perf_counter() - t0,
        )
        eng.precision = "custom" if explicit_linear else precision
        eng.precision_reason = reason
        return eng

    # -- generation ----------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (text or ids), checked against the vocabulary and the context."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids, low, high = _token_ids(prompt)
            vocab = self.config.vocab_size
            if ids and not (0 <= low and high < vocab):
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise ValueError(
                    f"prompt token id {bad} is outside the vocabulary (0..{self.config.vocab_size - 1})"
                )
        if not ids:
            if self.config.bos_token_id is None:
                raise ValueError("prompt is empty and the model has no bos_token_id to start from")
            ids = [self.config.bos_token_id]
        if len(ids) >= self.context:
            raise ModelError(
                f"prompt has {len(ids)} tokens but the context is {self.context} tokens "
                f"(at most {self.context - 1} prompt tokens leave room for one new token)"
            )
        return ids

    def generate(
        self,
        prompt: str | Sequence[int],
        params: GenerationParams | None = None,
        slot: Hashable = None,
        *,
        cancel: CancelToken | None = None,
        stop_flag: ctypes.c_int32 | None = None,
    ) -> Generation:
        """Start a generation (lazily: the work happens while iterating).

        ``slot``: a key (e.g. a document URI) whose KV cache is reused for the common prefix.
        ``cancel``: a token (``engine.cancel``) that stops it within one step, from any thread.
        ``stop_flag``: a word that stops it when another process sets it non-zero (a client's
        cancel flag in shared memory, ``engine.service.cancel_flags``), seen inside a run too.
        Generation stops at the context end with finish_reason 'length'.
        """
        params = params or GenerationParams()
        ids = self.encode_prompt(prompt)
        room = self.context - len(ids)
        if params.max_new_tokens > room:
            params = _replace_max(params, room)
        return Generation(self, ids, params, slot, cancel, stop_flag)

    def forward_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] for every position of a sequence (evaluation, tests)."""
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("forward_logits needs at least one token")
        if len(ids) > self.context:
            raise ModelError(
                f"sequence has {len(ids)} tokens but the context is {self.context} tokens"
            )
        with self._lock:
            if self._scratch is None:
                self._scratch = self.runtime.new_kv()
            out = []
            # bound each run's logits to ~64 MB (large vocabularies)
            step = max(16, min(self.prefill_chunk, (64 << 20) // (4 * self.config.vocab_size)))
            for start in range(0, len(ids), step):
                part = ids[start : start + step]
                out.append(self.runtime.forward(self._scratch, part, start, num_logits=len(part)))
            return np.concatenate(out, axis=0)

    # -- what a Generation uses (engine.generate.Model) ------------------------------------------
    @property
    def lock(self) -> threading.RLock:
        """Serialises model runs; held around each ONNX Runtime run and while taking a KV slot."""
        return self._lock

    def acquire_slot(self, key: Hashable) -> Slot:
        """The KV slot for ``key`` (recycling the least recently used one); hold ``lock``."""
        return self._cache.acquire(key)

    def cached_slots(self) -> list[Hashable]:
        """The keys whose KV cache is kept, least recently used first."""
        with self._lock:
            return self._cache.keys()

    def slot_tokens(self, slot: Hashable = None) -> int:
        """How many tokens of ``slot`` have KV cached (0 if the slot is unknown)."""
        with self._lock:
            s = self._cache.peek(slot)
            return len(s.tokens) if s is not None else 0

    def forget(self, keys: Iterable[Hashable]) -> int:
        """Forget the cached sequences of ``keys`` and free their KV buffers (a client that goes
        away, such as a closed editor session sharing this engine); how many were cached."""
        with self._lock:
            return sum(self._cache.drop(k) for k in list(keys))

    def reset(self) -> None:
        """Forget every cached sequence."""
        with self._lock:
            self._cache.clear()

    def end_profiling(self) -> list[str]:
        """The ONNX Runtime profile files of an engine loaded with ``profile=`` (profiling stops)."""
        with self._lock:
            return self.runtime.end_profiling()

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, context={self.context}, linear={graph_cache.emitter_key(self.linear)})"


def _token_ids(prompt: Sequence[int]) -> tuple[list[int], int, int]:
    """A prompt's ids as a list of ints, with their least and greatest (0, -1 when empty).
    This runs on every request: packed into 32-bit ints and checked by numpy it costs half of
    ``int()`` on each id; ids that do not pack (beyond 32 bits, digit strings) take that path."""
    try:
        packed = array("i", prompt)
    except (TypeError, OverflowError, ValueError):
        ids = list(map(int, prompt))
        return ids, min(ids, default=0), max(ids, default=-1)
    if not packed:
        return [], 0, -1
    v = np.frombuffer(packed, dtype=np.int32)
    return packed.tolist(), int(v.min()), int(v.max())


def _replace_max(params: GenerationParams, n: int) -> GenerationParams:
    return replace(params, max_new_tokens=max(1, n))
