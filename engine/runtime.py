"""Run the decoder graph in ONNX Runtime with preallocated KV buffers and IOBinding.

Each :class:`KVBuffers` owns one sequence's cache: per layer a key and a value OrtValue of shape
[1, kv_heads, max_len, head_dim], allocated once and bound as both ``past`` and ``present``
(GroupQueryAttention writes the new positions in place).  Rewinding a sequence is free: the next
run simply passes a smaller position.  The decode step reuses a fully pre-bound IOBinding whose
inputs and logits output are numpy-backed OrtValues, so a step is: write the token (its id, or
its embedding row: :mod:`engine.embedding`) and two integers, run, read one logits row — no
allocation, no KV copy, no numpy conversion of the cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from .config import ModelError
from .embedding import EmbeddingRows

#: Graph inputs besides the tokens (``input_ids``, or ``inputs_embeds``: the rows of
#: :mod:`engine.embedding`) and the KV buffers (see engine.graph).
INPUTS = ("seqlens_k", "total_sequence_length", "logits_from")


def physical_cores() -> int:
    """Physical CPU cores available to this process (SMT siblings counted once)."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return max(1, (os.cpu_count() or 2) // 2)
    cores = set()
    for cpu in allowed:
        try:
            siblings = (
                Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
                .read_text()
                .strip()
            )
        except OSError:
            siblings = str(cpu)
        cores.add(siblings)
    return max(1, len(cores))


def session_options(
    threads: int | None = None,
    *,
    spinning: bool = False,
    profile: str | None = None,
    custom_ops: tuple[str, ...] = (),
) -> ort.SessionOptions:
    """Session options for low-latency decoding (see :class:`Runtime` for when to spin);
    ``profile``: write ONNX Runtime's per-node profile (Chrome trace JSON) to files with this prefix;
    ``custom_ops``: op libraries the graph needs (e.g. the wafer package's MeshLinear)."""
    so = ort.SessionOptions()
    for lib in custom_ops:
        so.register_custom_ops_library(str(lib))
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile)
    so.intra_op_num_threads = int(threads or physical_cores())
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.log_severity_level = 3
    return so


#: Bytes per read-ahead advice of :func:`prefetch`.
PREFETCH_WINDOW = 8 << 20


def prefetch(paths) -> threading.Thread | None:
    """Ask the kernel to read the graph's weight files into the page cache, in the background.

    ONNX Runtime maps external weights into memory, so a page is read from disk the first time a
    step touches it.  The quantised linears touch all of theirs while the model warms up, but the
    embedding table is read a row per token: on a cold page cache (a fresh boot, or after other
    files pushed the graph out) every new token in a prompt or a decode step is a disk read
    (milliseconds each, about as long as a whole decode step of a 0.5B model).  llama.cpp advises
    its mapped GGUF the same way.  The pages go to the page cache, which the kernel reclaims under
    pressure; none enter the process's resident memory until a step touches them.  Returns the
    thread (already started) or None where the platform has no ``posix_fadvise``."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return None

    def run() -> None:
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                # One advice per window: Linux reads ahead only the first few MB of a single
                # whole-file WILLNEED.  Each call queues its reads and returns (about 0.1 s of
                # calls for 1 GB); the disk fills the cache behind them.
                size = os.fstat(fd).st_size
                for offset in range(0, size, PREFETCH_WINDOW):
                    advise(fd, offset, PREFETCH_WINDOW, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    t = threading.Thread(target=run, name="spark-weights-prefetch", daemon=True)
    t.start()
    return t


def _runner(session: ort.InferenceSession):
    """``run(binding, run_options)`` for ``session``.

    The public run_with_iobinding wrapper probes a run-config entry per call (WebGPU graph
    capture), which costs a C++ exception per decode step: call the binding directly.
    """
    inner = getattr(session, "_sess", None)
    if inner is not None and hasattr(inner, "run_with_iobinding"):
        return lambda b, ro: inner.run_with_iobinding(b._iobinding, ro)
    return session.run_with_iobinding  # pragma: no cover - other onnxruntime builds


def cpu_contended(threshold: float = 20.0) -> bool:
    """Whether other work is competing for the CPU right now.

    Linux pressure stall information (``/proc/pressure/cpu``, "some avg10": share of the last
    10 s in which a runnable task waited for a CPU); else the 1-minute load average against the
    cores.  Spinning threads only pay off when they do not have to fight for a core.
    """
    try:
        line = Path("/proc/pressure/cpu").read_text().split("\n", 1)[0]
        fields = dict(kv.split("=") for kv in line.split()[1:])
        return float(fields["avg10"]) >= threshold
    except (OSError, KeyError, ValueError):
        pass
    try:
        return os.getloadavg()[0] >= physical_cores()
    except OSError:  # pragma: no cover - no load average on this platform
        return True


class Interrupt:
    """How another thread stops a generation's run in flight: ONNX Runtime's
    ``RunOptions.terminate``, which it looks at between nodes, and the flag the wafer ops look at
    between their tasks (``spark_bind_abort`` in engine/wafer/mesh_op.c), so that a cancel which
    lands in a long node (a prefill's linears) does not wait for the node to end.

    ``watch``: a word that another process sets to stop the generation (a client's cancel flag in
    shared memory, engine.service.cancel_flags); the wafer ops look at it as at the flag, and the
    generation between its runs (``watched``).  ONNX Runtime's own nodes do not see it."""

    __slots__ = ("options", "flag", "address", "watch", "watch_address")

    def __init__(self, watch: ctypes.c_int32 | None = None) -> None:
        self.options = ort.RunOptions()
        self.flag = ctypes.c_int(0)
        self.address = ctypes.addressof(self.flag)
        self.watch = watch
        self.watch_address = ctypes.addressof(watch) if watch is not None else None

    def set(self) -> None:
        """Stop the run in flight and every later one (callable from any thread)."""
        self.options.terminate = True
        self.flag.value = 1

    @property
    def watched(self) -> bool:
        """Whether the watched word asks to stop."""
        return self.watch is not None and self.watch.value != 0


def _abort_binder(libs: tuple[str, ...]):
    """``spark_bind_abort`` of the first op library that has it (``None``: no wafer ops)."""
    for lib in libs:
        try:
            fn = ctypes.CDLL(str(lib)).spark_bind_abort  # the copy ONNX Runtime loaded
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = None
        return fn
    return None


class _Target:
    """One ORT session of the decoder and the fast way to run a binding on it."""

    def __init__(self, session: ort.InferenceSession, threads: int, spinning: bool) -> None:
        self.session = session
        self.threads = threads
        self.spinning = spinning
        self.run = _runner(session)

    def __repr__(self) -> str:
        return f"<session threads={self.threads} spinning={self.spinning}>"


class KVBuffers:
    """One sequence's preallocated KV cache plus the IOBindings (per session) that use it.

    The cache lives in one anonymous mapping of its own, not on the heap: its pages stay
    untouched (not resident) until a position is written, so a slot costs the positions it holds,
    not its whole buffer, and its memory goes back to the system when the slot does. (Heap
    buffers land in memory an earlier run's temporaries already touched: every slot's whole
    buffer was resident, 100 MB at 0.5B over the default 8,192-token buffer in float16.)"""

    def __init__(self, runtime: Runtime) -> None:
        rt = runtime
        shape = (1, rt.kv_heads, rt.max_len, rt.head_dim)
        self._memory = mmap.mmap(-1, rt.kv_bytes())  # anonymous: zero pages until written
        whole = np.frombuffer(self._memory, dtype=rt.kv_dtype).reshape((-1, *shape))
        self.values = {}
        for i in range(rt.num_layers):
            for j, t in enumerate(("key", "value")):
                # shares the array's memory (and keeps the array alive)
                self.values[i, t] = ort.OrtValue.ortvalue_from_numpy(whole[2 * i + j])
        # Decode step: everything pre-bound; inputs/outputs share memory with these numpy arrays
        # (the token: its id, or its embedding row where the runtime reads those).
        self.step_ids = np.zeros([1, 1], np.int64)
        self.step_embeds = rt.embedding.empty(1) if rt.embedding is not None else None
        self.step_seqlens = np.zeros([1], np.int32)
        self.step_total = np.zeros([], np.int32)
        self.step_logits = np.zeros([1, 1, rt.vocab_size], np.float32)
        self._step_token = (
            rt.embedding.ortvalue(self.step_embeds)
            if rt.embedding is not None
            else ort.OrtValue.ortvalue_from_numpy(self.step_ids)
        )
        self._step_values = [
            ort.OrtValue.ortvalue_from_numpy(a)
            for a in (self.step_seqlens, self.step_total, rt.zero_i64, self.step_logits)
        ]
        self._token_input = rt.token_input
        self._step: dict[_Target, ort.IOBinding] = {}
        self._general: dict[_Target, ort.IOBinding] = {}

    def step_binding(self, target: _Target) -> ort.IOBinding:
        """The fully pre-bound decode-step binding on ``target`` (made once)."""
        b = self._step.get(target)
        if b is None:
            b = self._step[target] = target.session.io_binding()
            b.bind_ortvalue_input(self._token_input, self._step_token)
            for name, v in zip(INPUTS, self._step_values[:3]):
                b.bind_ortvalue_input(name, v)
            b.bind_ortvalue_output("logits", self._step_values[3])
            self._bind_kv(b)
        return b

    def binding(self, target: _Target) -> ort.IOBinding:
        """A binding on ``target`` with the KV bound; inputs and logits are re-bound per call."""
        b = self._general.get(target)
        if b is None:
            b = self._general[target] = target.session.io_binding()
            self._bind_kv(b)
        return b

    def _bind_kv(self, binding: ort.IOBinding) -> None:
        for (i, t), v in self.values.items():
            binding.bind_ortvalue_input(f"past.{i}.{t}", v)
            binding.bind_ortvalue_output(f"present.{i}.{t}", v)


#: Graphs without the wafer ops up to this size (graph files) also get the spinning decode session.
SMALL_MODEL_BYTES = 64 << 20
#: ONNX Runtime's linears, which pre-pack constant weights when a session loads.
PREPACKING_OPS = frozenset(
    {"MatMul", "Gemm", "FusedMatMul", "MatMulNBits", "MatMulInteger", "MatMulIntegerToFloat"}
)


def huge_pages_available() -> bool:
    """Whether ``MADV_HUGEPAGE`` can give this process transparent huge pages (Linux, with them
    set to ``always`` or ``madvise``); elsewhere a copy of the weights would gain nothing."""
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def _aligned(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def huge_buffer(size: int) -> np.ndarray:
    """``size`` bytes of anonymous memory advised for transparent huge pages where the platform
    has them (else ordinary pages)."""
    import mmap

    buf = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise = getattr(buf, "madvise", None)
    if advise is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            advise(mmap.MADV_HUGEPAGE)
        except OSError:  # no transparent huge pages here: ordinary pages
            pass
    return np.frombuffer(buf, np.uint8)


class SharedWeights:
    """The graph's external initializers as OrtValues, one copy for every session of a
    :class:`Runtime` (``SessionOptions.add_initializer``); the runtime holds this object, since
    the arrays must outlive the sessions. ``None`` for a graph with no external data.

    Each ONNX Runtime session otherwise maps the data file itself, one mapping per initializer:
    a second session then counts every weight again in the process's resident memory. One copy
    lets a model keep a spinning decode session beside the plain one at no cost in memory.

    The weights a decode step streams are read into anonymous memory advised for transparent huge
    pages (``MADV_HUGEPAGE``), not used from the file's 4 KB pages: streaming hundreds of MB per
    token through 4 KB pages misses the TLB on every page, and under virtualisation each miss
    walks two page tables (measured on the 2-core VM: 0.5B decode int8 +29 %, int4 +6 %). (The
    embedding table, read a row per token, is not among them: :mod:`engine.embedding`.)
    ``SPARK_LSP_WEIGHTS_MMAP=1``, or a system without
    transparent huge pages, maps everything from the file instead (the page cache's pages,
    shared with other processes of the same model).
    """

    def __init__(self, model_path: Path, proto) -> None:
        import onnx

        mapped = os.environ.get("SPARK_LSP_WEIGHTS_MMAP", "") in ("1", "true", "yes")
        copy = not mapped and huge_pages_available()
        self._maps: dict[Path, np.memmap] = {}  # each data file, mapped once
        entries = []  # (initializer, file, offset, length, read into the buffer)
        for t in proto.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            path = model_path.parent / info["location"]
            if path not in self._maps:
                self._maps[path] = np.memmap(path, mode="r")
            offset, length = int(info.get("offset", 0)), int(info["length"])
            if offset + length > self._maps[path].size:
                raise ModelError(f"{path.name}: initializer {t.name} lies past the file's end")
            entries.append((t, path, offset, length, copy))
        total = sum(_aligned(length) for *_, length, read in entries if read)
        self._heap = huge_buffer(total) if total else None
        self.values: list[tuple[str, ort.OrtValue]] = []
        at = 0
        with contextlib.ExitStack() as stack:
            files: dict[Path, Any] = {}
            for t, path, offset, length, read in entries:
                if read:  # a plain read, not through a map: the map's pages would stay resident
                    raw = self._heap[at : at + length]
                    at += _aligned(length)
                    if path not in files:
                        files[path] = stack.enter_context(open(path, "rb"))
                    files[path].seek(offset)
                    if files[path].readinto(memoryview(raw)) != length:
                        raise ModelError(f"{path.name}: initializer {t.name} could not be read")
                else:
                    raw = self._maps[path][offset : offset + length]
                dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
                arr = raw.view(dtype).reshape(tuple(t.dims))
                self.values.append(
                    (t.name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr, t.data_type))
                )

    @classmethod
    def of(cls, model_path: str | Path) -> SharedWeights | None:
        """The shared weights of a graph whose linears are the wafer ops; None for one with ONNX
        Runtime's own (MatMul, MatMulNBits, ...): those pre-pack their weights at session load,
        which ONNX Runtime does not do for an initializer handed to it (measured: dense float
        decoding about 10 % slower), and pre-pack a copy per session anyway."""
        import onnx

        model_path = Path(model_path)
        proto = onnx.load(str(model_path), load_external_data=False)
        if any(n.op_type in PREPACKING_OPS for n in proto.graph.node):
            return None
        shared = cls(model_path, proto)
        return shared if shared.values else None

    def add_to(self, so: ort.SessionOptions) -> None:
        for name, value in self.values:
            so.add_initializer(name, value)


#: Runs of at most this many tokens (decode steps, speculative verification, small prefills
#: after an edit) go to the decode session; longer prefills to the non-spinning one.
SMALL_RUN_TOKENS = 16


class Runtime:
    """ORT sessions over a decoder graph built by :func:`engine.graph.build_decoder`, sharing KV buffers.

    Spinning intra-op threads make a decode step faster on an idle machine (a small model's
    step, or a large one's small linears, is shorter than the time a sleeping thread takes to
    wake: every parallel node pays that wake-up) but slow it down when other processes compete
    for the cores (the spinning thread holds a core the working thread needs).
    ``spinning=None`` (auto) therefore keeps two sessions, over one copy of the weights
    (:class:`SharedWeights`): a spinning one for
    decode steps and short runs while the CPU is calm, and a non-spinning one for long prefills
    and for decoding while it is contended (:func:`cpu_contended`, checked by :meth:`refresh_mode`
    at the start of each generation).  ``True``/``False`` force one behaviour (one session).
    Spinning threads stop shortly after a generation, so an idle editor keeps its CPU.
    """

    def __init__(
        self,
        model_path: str | Path,
        config,
        *,
        max_len: int,
        threads: int | None = None,
        decode_threads: int | None = None,
        spinning: bool | None = None,
        profile: str | None = None,
        custom_ops: tuple[str, ...] = (),
    ) -> None:
        self.config = config
        self.max_len = int(max_len)
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.vocab_size = config.vocab_size
        self.threads = int(threads or physical_cores())
        self.custom_ops = tuple(custom_ops)
        self._bind_abort = _abort_binder(self.custom_ops)
        self.decode_threads = min(int(decode_threads or self.threads), self.threads)
        model_path = Path(model_path)
        files = [p for p in model_path.parent.glob(model_path.name + "*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        prefetch(files)
        # one copy of the weights for every session (below: two or three of them)
        self.shared = SharedWeights.of(model_path)

        def target(n: int, spin: bool) -> _Target:
            so = session_options(n, spinning=spin, profile=profile, custom_ops=custom_ops)
            if self.shared is not None:
                self.shared.add_to(so)
            return _Target(
                ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"]),
                n,
                spin,
            )

        self.wide = target(self.threads, bool(spinning))  # long prefills
        self.busy = (
            self.wide
            if self.decode_threads == self.threads
            else target(self.decode_threads, bool(spinning))
        )
        self.calm = self.busy
        # ONNX Runtime's own linears (MatMul, MatMulNBits: graphs without the wafer ops) pre-pack
        # a copy of their weights per session, so only a small such model gets a second session
        if spinning is None and (self.shared is not None or size <= SMALL_MODEL_BYTES):
            self.calm = target(self.decode_threads, True)
        self.target = self.busy
        self.session = self.wide.session
        self.zero_i64 = np.zeros([1], np.int64)
        # The tokens' embedding rows, where the graph takes them rather than their ids
        meta = self.session.get_modelmeta().custom_metadata_map
        self.embedding = EmbeddingRows.of(model_path, meta)
        self.token_input = "input_ids" if self.embedding is None else "inputs_embeds"
        # KV head size as built (the graph pads it to a multiple of 16) and element type
        # (float32, or float16 where the graph's attention op reads a half cache).
        past = next(i for i in self.session.get_inputs() if i.name == "past.0.key")
        self.head_dim = int(past.shape[3])
        self.kv_dtype = np.dtype(np.float16 if past.type == "tensor(float16)" else np.float32)

    def end_profiling(self) -> list[str]:
        """Stop profiling (``profile=``) and return the profile files, one per session."""
        targets = {id(t): t for t in (self.wide, self.busy, self.calm)}.values()
        return [t.session.end_profiling() for t in targets]

    def refresh_mode(self) -> _Target:
        """Pick the decode session for the next generation (spinning only while the CPU is calm)."""
        self.target = self.busy if self.calm is self.busy or cpu_contended() else self.calm
        return self.target

    def new_kv(self) -> KVBuffers:
        return KVBuffers(self)

    def kv_bytes(self, positions: int | None = None) -> int:
        """Bytes of one sequence's KV buffers (``positions``: of that many positions of them)."""
        n = self.max_len if positions is None else positions
        return 2 * self.num_layers * self.kv_heads * n * self.head_dim * self.kv_dtype.itemsize

    def _check_span(self, pos: int, n: int) -> None:
        if pos < 0 or n < 1 or pos + n > self.max_len:
            raise ModelError(
                f"sequence of {pos + n} tokens exceeds the context of {self.max_len} tokens"
            )

    def forward(
        self,
        kv: KVBuffers,
        tokens,
        pos: int,
        num_logits: int = 1,
        interrupt: Interrupt | None = None,
    ) -> np.ndarray:
        """Write KV for ``tokens`` at positions ``pos..``; return logits [num_logits, vocab] (a new array)."""
        ids = np.ascontiguousarray(tokens, dtype=np.int64).reshape(1, -1)
        n = ids.shape[1]
        self._check_span(pos, n)
        num_logits = max(1, min(int(num_logits), n))
        target = self.target if n <= SMALL_RUN_TOKENS else self.wide
        b = kv.binding(target)
        bound = self.bind_tokens(b, ids)  # noqa: F841 - bound in place: kept until the run returns
        logits = np.empty([1, num_logits, self.vocab_size], np.float32)
        feeds = (
            np.array([pos + n - 1], np.int32),
            np.array(pos + n, np.int32),
            np.array([n - num_logits], np.int64),
        )
        for name, arr in zip(INPUTS, feeds):
            b.bind_cpu_input(name, arr)
        b.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        self._run(target, b, interrupt)
        return logits[0]

    def bind_tokens(self, binding: ort.IOBinding, tokens) -> np.ndarray:
        """Bind ``tokens`` as the graph takes them: their ids, or their embedding rows
        (:mod:`engine.embedding`).  Returns the array bound, which ONNX Runtime reads in place:
        keep it until the run has returned."""
        ids = np.ascontiguousarray(tokens, dtype=np.int64).reshape(1, -1)
        if self.embedding is None:
            binding.bind_cpu_input("input_ids", ids)
            return ids
        rows = self.embedding.read(ids, self.embedding.empty(ids.shape[1]))
        binding.bind_ortvalue_input("inputs_embeds", self.embedding.ortvalue(rows))
        return rows

    def decode(
        self, kv: KVBuffers, token: int, pos: int, interrupt: Interrupt | None = None
    ) -> np.ndarray:
        """One decode step; returns the logits row [vocab] (a view valid until the next step on ``kv``)."""
        if pos + 1 > self.max_len:
            self._check_span(pos, 1)
        if self.embedding is None:
            kv.step_ids[0, 0] = token
        else:
            self.embedding.read_one(token, kv.step_embeds)
        kv.step_seqlens[0] = pos
        kv.step_total[...] = pos + 1
        target = self.target
        self._run(target, kv.step_binding(target), interrupt)
        return kv.step_logits[0, 0]

    def _run(self, target: _Target, binding, interrupt: Interrupt | None) -> None:
        """Run ``binding`` on ``target``, stoppable by ``interrupt`` (its flag bound for the
        wafer ops on this thread, the one their nodes run on)."""
        if interrupt is None:
            target.run(binding, None)
        elif self._bind_abort is None:
            target.run(binding, interrupt.options)
        else:
            self._bind_abort(interrupt.address, interrupt.watch_address)
            try:
                target.run(binding, interrupt.options)
            finally:
                self._bind_abort(None, None)
