"""DRAM read bandwidth, measured, and what it allows a decoder that streams its weights.

A decode step of a model much larger than the caches reads every weight it multiplies once, so
``bandwidth / weight bytes read per token`` bounds its tokens per second; a runner's decode as a
share of that bound says how close to the memory it runs.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..runtime import huge_buffer

#: Bytes read per measurement: far past the last-level cache (32 MB here), so it measures DRAM.
READ_BYTES = 512 << 20


def _max(part: np.ndarray) -> float:
    return float(np.max(part))


def _dot(part: np.ndarray) -> float:
    return float(np.dot(part, part))


#: The readers: each reads its part of the buffer once, with the GIL released.  The maximum is
#: a vectorised compare per loaded register; the dot product of a part with itself is BLAS's
#: (several accumulators, every element loaded once).  Which streams closer to the memory's
#: limit depends on the CPU and the numpy build (BENCHMARKS.md), so the bound is the best of
#: both.  A sum would not do: numpy's pairwise float summation is compute-limited below DRAM
#: speed on some CPUs.
READERS = (_max, _dot)


def read_bandwidth(threads: int = 1, repeats: int = 5, nbytes: int = READ_BYTES) -> float:
    """Best-of-``repeats`` read bandwidth in bytes/s of ``threads`` threads each reading its part
    of one float32 buffer, with each of :data:`READERS` (numpy releases the GIL in both, so the
    threads read concurrently).  A runner that streams its weights faster than this reads would
    show a share of the bound above 100 %: the best reader keeps the bound a bound."""
    n = max(1, nbytes // 4 // threads) * threads
    # in memory advised for huge pages, as the engine's weights are: the reader pays their TLB
    buf = huge_buffer(n * 4).view(np.float32)
    buf[:] = 1.0
    parts = np.array_split(buf, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for reader in READERS:
            list(pool.map(reader, parts))  # touch every page (and warm the reader) before timing
            for _ in range(repeats):
                t0 = time.perf_counter()
                list(pool.map(reader, parts))
                best = max(best, buf.nbytes / (time.perf_counter() - t0))
    return best


def graph_bytes_per_token(graph_path: str | Path) -> int:
    """Weight bytes one decode step of a built graph reads: every initializer except the rotary
    tables (one row per position) and the embedding table (one row per token: outside the graph,
    engine.embedding, or a Gather's), which counts when another node reads it whole (a tied LM
    head reading the table in place)."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    whole = {i for n in model.graph.node if n.op_type != "Gather" for i in n.input}
    total = 0
    for t in model.graph.initializer:
        if t.name in ("rope.cos", "rope.sin") or (t.name == "embed_tokens" and t.name not in whole):
            continue
        if t.data_location == onnx.TensorProto.EXTERNAL:
            total += int(next(e.value for e in t.external_data if e.key == "length"))
        else:
            total += len(t.raw_data)
    return total


def gguf_bytes_per_token(path: str | Path) -> int:
    """Weight bytes one llama.cpp decode step reads from a GGUF: every tensor except the token
    embedding, which counts when it is also the output layer (tied: no ``output.weight``)."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight" or tied)


def memory_bound(samples: list[float], streamed: dict[str, float]) -> tuple[float, str]:
    """The DRAM read bandwidth decode shares are taken of (bytes/s), and what set it: the
    reader's best sample, or a runner whose decode streamed its weights faster than the reader
    read (``streamed``: runner -> tok/s x weight bytes a step reads).  A runner that streams
    faster proves the memory delivers that much, so a bound below it would be no bound: every
    share is then at most 100 %."""
    bound, by = max(samples), "reader"
    for name, rate in streamed.items():
        if rate > bound:
            bound, by = rate, name
    return bound, by


def bandwidth_share(
    decode_tok_s: float, bytes_per_token: int, bandwidth: float
) -> dict[str, float]:
    """Weight MB read per token, the decode bound that sets (bandwidth / bytes), and the share of it."""
    limit = bandwidth / max(bytes_per_token, 1)
    return {
        "weight_mb_per_token": bytes_per_token / 1e6,
        "bandwidth_limit_tok_s": limit,
        "bandwidth_pct": 100.0 * decode_tok_s / limit,
    }
