"""The token embedding rows a decoder graph takes as its ``inputs_embeds``, read from its data file.

A step reads one row of the embedding table per token, but the table is vocabulary x hidden:
151,936 x 896 bf16 (272 MB) for Qwen2.5-Coder-0.5B, 467 MB at 1.5B.  Left in the graph, ONNX
Runtime maps it from the data file, and the kernel maps the page cache into a process in large
folios (reading 500 random rows of the 0.5B table mapped 258 MB of it; ``MADV_RANDOM`` does not
change that): a few hundred distinct tokens make most of the table resident in the process
(``RssFile``), although each step reads a few KB of it.
So the graph builder writes the table into the data file outside the graph
(:func:`engine.graph.build_decoder`, metadata ``spark_lsp.embedding``) and the runtime reads the
rows here, with ``preadv`` into the bound input: the rows come from the page cache, the process
holds none of them, and the page cache is shared by every process of the same model.

A table of at most :data:`WHOLE_TABLE_BYTES` is read whole into memory instead (numpy's ``take``
over a prompt's rows beats a read per row, and the table costs little), as is any table where the
platform has no ``preadv`` (then mapped from the file, as ONNX Runtime would).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from .config import ModelError

#: Tables up to this size are read whole into memory (the bundled model's is 4 MB).
WHOLE_TABLE_BYTES = 16 << 20

#: numpy storage of each element type a table may have (bfloat16 as its uint16 bits).
_STORAGE = {
    TensorProto.BFLOAT16: np.uint16,
    TensorProto.FLOAT16: np.float16,
    TensorProto.FLOAT: np.float32,
}


class EmbeddingRows:
    """Rows ``ids`` of a ``rows`` x ``cols`` table of ONNX element type ``onnx_type`` stored at
    ``offset`` of ``path``, written into ``[1, n, cols]`` arrays that are bound as the graph's
    ``inputs_embeds``.  ``whole_bytes``: read a table of at most this size whole (default
    :data:`WHOLE_TABLE_BYTES`)."""

    def __init__(
        self,
        path: str | Path,
        offset: int,
        rows: int,
        cols: int,
        onnx_type: int,
        *,
        whole_bytes: int | None = None,
    ) -> None:
        self._fd: int | None = None
        self._table: np.ndarray | None = None
        if onnx_type not in _STORAGE:
            raise ModelError(f"{Path(path).name}: embedding rows of unsupported type {onnx_type}")
        self.rows, self.cols, self.onnx_type = int(rows), int(cols), int(onnx_type)
        self.dtype = np.dtype(_STORAGE[onnx_type])
        self.row_bytes = self.cols * self.dtype.itemsize
        self.offset = int(offset)
        size = self.rows * self.row_bytes
        try:
            file_size = Path(path).stat().st_size
        except OSError as e:
            raise ModelError(f"embedding table {path}: {e.strerror or e}") from None
        if self.offset < 0 or self.offset + size > file_size:
            raise ModelError(f"{Path(path).name}: the embedding table lies past the file's end")
        limit = WHOLE_TABLE_BYTES if whole_bytes is None else whole_bytes
        if size <= limit:
            self._table = np.fromfile(path, self.dtype, self.rows * self.cols, offset=self.offset)
        elif not hasattr(os, "preadv"):  # pragma: no cover - platforms without preadv
            self._table = np.memmap(path, self.dtype, "r", self.offset, self.rows * self.cols)
        else:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        if self._table is not None:
            self._table = self._table.reshape(self.rows, self.cols)

    @classmethod
    def of(cls, graph_path: str | Path, metadata: dict[str, str]) -> EmbeddingRows | None:
        """The rows a graph with ``inputs_embeds`` reads (its metadata ``spark_lsp.embedding``);
        None for a graph that gathers them itself."""
        spec = metadata.get("spark_lsp.embedding")
        if spec is None:
            return None
        try:
            e = json.loads(spec)
            where = Path(graph_path).parent / e["location"]
            return cls(where, int(e["offset"]), int(e["rows"]), int(e["cols"]), int(e["type"]))
        except (ValueError, KeyError, TypeError) as err:
            raise ModelError(f"{Path(graph_path).name}: bad embedding metadata ({err})") from None

    @property
    def reads_rows(self) -> bool:
        """Whether rows are read from the file per token (else the table is in memory)."""
        return self._fd is not None

    def empty(self, n: int) -> np.ndarray:
        """A ``[1, n, cols]`` buffer for :meth:`read` (uninitialised)."""
        return np.empty([1, n, self.cols], self.dtype)

    def ortvalue(self, buf: np.ndarray) -> ort.OrtValue:
        """``buf`` (from :meth:`empty`) as an OrtValue of the table's type, sharing its memory."""
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(buf, self.onnx_type)

    def read(self, ids, out: np.ndarray) -> np.ndarray:
        """Write the rows of token ``ids`` into ``out`` ``[1, len(ids), cols]``; returns ``out``.
        An id outside the table raises :class:`ModelError`."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        n = len(ids)
        if n and (int(ids.min()) < 0 or int(ids.max()) >= self.rows):
            raise self._outside(next(int(t) for t in ids if not 0 <= t < self.rows))
        if self._table is not None:
            np.take(self._table, ids, axis=0, out=out[0])
            return out
        view = memoryview(out.reshape(-1)).cast("B")
        rb = self.row_bytes
        for i, t in enumerate(ids.tolist()):
            self._pread(view[i * rb : (i + 1) * rb], t)
        return out

    def read_one(self, token: int, out: np.ndarray) -> None:
        """:meth:`read` of one token (a decode step's), without the array handling."""
        if not 0 <= token < self.rows:
            raise self._outside(token)
        if self._table is not None:
            out[0, 0] = self._table[token]
        else:
            self._pread(memoryview(out).cast("B"), token)

    def _outside(self, token: int) -> ModelError:
        return ModelError(f"token id {token} is outside the model's {self.rows} embedding rows")

    def _pread(self, into: memoryview, token: int) -> None:
        if self._fd is None:
            raise ModelError("the embedding table was closed")
        if os.preadv(self._fd, [into], self.offset + token * self.row_bytes) != self.row_bytes:
            raise ModelError("the embedding table's file was truncated while in use")

    def close(self) -> None:
        """Close the file (a later :meth:`read` of rows from it fails)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.close()
