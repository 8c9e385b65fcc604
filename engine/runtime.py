"""Run the decoder graph in ONNX Runtime with preallocated KV buffers and IOBinding.

Each :class:`KVBuffers` owns one sequence's cache: per layer a key and a value OrtValue of shape
[1, kv_heads, max_len, head_dim], allocated once and bound as both ``past`` and ``present``
(GroupQueryAttention writes the new positions in place).  Rewinding a sequence is free: the next
run simply passes a smaller position.  The decode step reuses a fully pre-bound IOBinding whose
inputs and logits output are numpy-backed OrtValues, so a step is: write three integers, run,
read one logits row — no allocation, no KV copy, no numpy conversion of the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .config import ModelError

#: Graph inputs besides the KV buffers (see engine.graph).
INPUTS = ("input_ids", "seqlens_k", "total_sequence_length", "logits_from")


def physical_cores() -> int:
    """Physical CPU cores available to this process (SMT siblings counted once)."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return max(1, (os.cpu_count() or 2) // 2)
    cores = set()
    for cpu in allowed:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            siblings = str(cpu)
        cores.add(siblings)
    return max(1, len(cores))


def session_options(threads: int | None = None, *, spinning: bool = False) -> ort.SessionOptions:
    """Session options for low-latency decoding on a shared machine.

    Spinning is off by default: intra-op threads then sleep between the many tiny decode steps
    instead of burning the CPU an editor (and the language server) needs.  Measured on the busy
    2-core dev machine: spinning halved mean decode speed and doubled CPU per token.
    """
    so = ort.SessionOptions()
    so.intra_op_num_threads = int(threads or physical_cores())
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.log_severity_level = 3
    return so


def _runner(session: ort.InferenceSession):
    """``run(binding, run_options)`` for ``session``.

    The public run_with_iobinding wrapper probes a run-config entry per call (WebGPU graph
    capture), which costs a C++ exception (~0.1 ms) per decode step: call the binding directly.
    """
    inner = getattr(session, "_sess", None)
    if inner is not None and hasattr(inner, "run_with_iobinding"):
        return lambda b, ro: inner.run_with_iobinding(b._iobinding, ro)
    return session.run_with_iobinding  # pragma: no cover - other onnxruntime builds


class KVBuffers:
    """One sequence's preallocated KV cache plus the IOBindings that use it."""

    def __init__(self, runtime: "Runtime") -> None:
        rt = runtime
        shape = [1, rt.kv_heads, rt.max_len, rt.head_dim]
        self.values = {}
        for i in range(rt.num_layers):
            for t in ("key", "value"):
                self.values[i, t] = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, "cpu", 0)
        # Decode step: everything pre-bound; inputs/outputs share memory with these numpy arrays.
        self.step_ids = np.zeros([1, 1], np.int64)
        self.step_seqlens = np.zeros([1], np.int32)
        self.step_total = np.zeros([], np.int32)
        self.step_logits = np.zeros([1, 1, rt.vocab_size], np.float32)
        self._keep = [ort.OrtValue.ortvalue_from_numpy(a) for a in
                      (self.step_ids, self.step_seqlens, self.step_total, rt.zero_i64, self.step_logits)]
        self.step_binding = rt.decode_session.io_binding()
        for name, v in zip(INPUTS, self._keep[:4]):
            self.step_binding.bind_ortvalue_input(name, v)
        self.step_binding.bind_ortvalue_output("logits", self._keep[4])
        self._bind_kv(self.step_binding)
        # General forward (prefill, several logits): inputs/outputs re-bound per call; one binding
        # per session (short runs go to the decode session, see Runtime).
        self.binding = rt.session.io_binding()
        self._bind_kv(self.binding)
        if rt.decode_session is rt.session:
            self.small_binding = self.binding
        else:
            self.small_binding = rt.decode_session.io_binding()
            self._bind_kv(self.small_binding)

    def _bind_kv(self, binding: ort.IOBinding) -> None:
        for (i, t), v in self.values.items():
            binding.bind_ortvalue_input(f"past.{i}.{t}", v)
            binding.bind_ortvalue_output(f"present.{i}.{t}", v)


#: Weights up to this size decode on one thread: per-step work is then so small that waking a
#: second thread for every op costs more than it saves (measured: 1 thread matched 2 threads'
#: speed at ~35 % less CPU per token on the 8M model; a loaded machine favours 1 thread more).
SMALL_MODEL_BYTES = 64 << 20
#: Runs of at most this many tokens (decode steps, speculative verification, small prefills
#: after an edit) go to the decode session; longer prefills use all threads.
SMALL_RUN_TOKENS = 16


class Runtime:
    """ORT sessions over a decoder graph built by :func:`engine.graph.build_decoder`.

    Two sessions of the same graph may share the KV buffers: ``session`` with ``threads`` for
    long prefills, and ``decode_session`` with ``decode_threads`` for decode steps and short runs.
    ``decode_threads=None`` picks 1 for small models (see ``SMALL_MODEL_BYTES``), else ``threads``
    (then there is only one session).
    """

    def __init__(self, model_path: str | Path, config, *, max_len: int, threads: int | None = None,
                 decode_threads: int | None = None, spinning: bool = False) -> None:
        self.config = config
        self.max_len = int(max_len)
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.vocab_size = config.vocab_size
        self.threads = int(threads or physical_cores())
        model_path = Path(model_path)
        if decode_threads is None:
            size = sum(p.stat().st_size for p in model_path.parent.glob(model_path.name + "*") if p.is_file())
            decode_threads = 1 if size <= SMALL_MODEL_BYTES else self.threads
        self.decode_threads = min(int(decode_threads), self.threads)
        providers = ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(model_path), session_options(self.threads, spinning=spinning),
                                            providers=providers)
        if self.decode_threads == self.threads:
            self.decode_session = self.session
        else:
            self.decode_session = ort.InferenceSession(
                str(model_path), session_options(self.decode_threads, spinning=spinning), providers=providers)
        self._run_wide = _runner(self.session)
        self._run = _runner(self.decode_session)
        self.zero_i64 = np.zeros([1], np.int64)
        # KV head size as built (the graph pads it to a multiple of 16).
        self.head_dim = int(next(i.shape[3] for i in self.session.get_inputs() if i.name == "past.0.key"))

    def new_kv(self) -> KVBuffers:
        return KVBuffers(self)

    def kv_bytes(self) -> int:
        """Bytes of one sequence's KV buffers."""
        return 2 * self.num_layers * self.kv_heads * self.max_len * self.head_dim * 4

    def _check_span(self, pos: int, n: int) -> None:
        if pos < 0 or n < 1 or pos + n > self.max_len:
            raise ModelError(f"sequence of {pos + n} tokens exceeds the context of {self.max_len} tokens")

    def forward(self, kv: KVBuffers, tokens, pos: int, num_logits: int = 1,
                run_options: ort.RunOptions | None = None) -> np.ndarray:
        """Write KV for ``tokens`` at positions ``pos..``; return logits [num_logits, vocab] (a new array)."""
        ids = np.ascontiguousarray(tokens, dtype=np.int64).reshape(1, -1)
        n = ids.shape[1]
        self._check_span(pos, n)
        num_logits = max(1, min(int(num_logits), n))
        small = n <= SMALL_RUN_TOKENS
        b = kv.small_binding if small else kv.binding
        logits = np.empty([1, num_logits, self.vocab_size], np.float32)
        feeds = (ids, np.array([pos + n - 1], np.int32), np.array(pos + n, np.int32), np.array([n - num_logits], np.int64))
        for name, arr in zip(INPUTS, feeds):
            b.bind_cpu_input(name, arr)
        out = ort.OrtValue.ortvalue_from_numpy(logits)
        b.bind_ortvalue_output("logits", out)
        (self._run if small else self._run_wide)(b, run_options)
        return logits[0]

    def decode(self, kv: KVBuffers, token: int, pos: int, run_options: ort.RunOptions | None = None) -> np.ndarray:
        """One decode step; returns the logits row [vocab] (a view valid until the next step on ``kv``)."""
        if pos + 1 > self.max_len:
            self._check_span(pos, 1)
        kv.step_ids[0, 0] = token
        kv.step_seqlens[0] = pos
        kv.step_total[...] = pos + 1
        self._run(kv.step_binding, run_options)
        return kv.step_logits[0, 0]
