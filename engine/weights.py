"""Read (and write) safetensors weights with numpy only — no torch at run time.

The header is parsed here rather than through ``safetensors.numpy`` because numpy has no bfloat16:
bf16 tensors are widened to float32 by shifting their 16 bits into the high half of a uint32.
Every tensor the decoder needs is checked for presence and shape, so a truncated or mismatched
checkpoint fails at load time with the file and tensor named.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np

from .config import ModelConfig, ModelError, model_path
from .files import write_json_atomic

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_MAX_HEADER = 100 * 1024 * 1024


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor (HF name → shape) the decoder reads; lm_head only when embeddings are untied."""
    h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if config.mlp_gated:
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (i, h),
                    p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i),
                }
            )
            if config.mlp_bias:
                shapes.update(
                    {
                        p + "mlp.gate_proj.bias": (i,),
                        p + "mlp.up_proj.bias": (i,),
                        p + "mlp.down_proj.bias": (h,),
                    }
                )
        else:
            shapes.update({p + "mlp.c_fc.weight": (i, h), p + "mlp.c_proj.weight": (h, i)})
            if config.mlp_bias:
                shapes.update({p + "mlp.c_fc.bias": (i,), p + "mlp.c_proj.bias": (h,)})
        if config.norm == "layer":
            shapes.update(
                {p + "input_layernorm.bias": (h,), p + "post_attention_layernorm.bias": (h,)}
            )
        if config.qk_norm:
            shapes.update(
                {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
            )
        if config.attention_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
        if config.attention_out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if config.norm == "layer":
        shapes["model.norm.bias"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a folder: the shards named by the index, or the single file."""
    folder = model_path(model_dir)
    index = folder / INDEX_FILE
    if index.is_file():
        return sorted({folder / f for f in _read_index(index).values()})
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    raise ModelError(
        f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are supported)"
    )


def _read_index(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{index.name}: cannot parse: {e}") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise ModelError(f"{index.name}: field 'weight_map' must map tensor names to file names")
    for f in set(wm.values()):
        if os.path.basename(f) != f:
            raise ModelError(f"{index.name}: weight_map names file {f!r} outside the model folder")
        if not (index.parent / f).is_file():
            raise ModelError(f"{index.name}: shard {f} listed in weight_map is missing")
    return wm


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """Parse a safetensors header: (tensor name → {dtype, shape, data_offsets}, data start offset)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(f"{path.name}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise ModelError(
                f"{path.name}: corrupt safetensors header (length {n} > file size {size})"
            )
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelError(f"{path.name}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path.name}: corrupt safetensors header (not an object)")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, info in header.items():
        try:
            dtype, shape, (a, b) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ModelError(f"{path.name}: tensor {name}: malformed header entry") from None
        if dtype not in _ITEMSIZE:
            raise ModelError(
                f"{path.name}: tensor {name}: dtype {dtype} is not supported (supported: F32, F16, BF16)"
            )
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not (0 <= a <= b <= data_len) or b - a != count * _ITEMSIZE[dtype]:
            raise ModelError(
                f"{path.name}: tensor {name}: data offsets {a}..{b} do not match shape {shape} "
                f"and dtype {dtype} within a {data_len}-byte data section (truncated file?)"
            )
    return header, 8 + n


def _to_float32(buf: memoryview | bytes, dtype: str, shape: list[int]) -> np.ndarray:
    """A float32 copy of one tensor's bytes (the result must outlive the mmap it was read from)."""
    raw = np.frombuffer(buf, dtype=_NP_DTYPES[dtype])
    if dtype == "BF16":
        out = np.empty(raw.shape, np.uint32)
        out[...] = raw
        out <<= 16  # in place: one allocation for the widened tensor
        out = out.view(np.float32)
    else:
        out = raw.astype(np.float32)
    return out.reshape(shape)


def read_tensors(path: Path, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Read tensors (all, or the given names) from one safetensors file as float32 arrays."""
    header, start = read_header(path)
    wanted = list(header) if names is None else [n for n in names if n in header]
    out: dict[str, np.ndarray] = {}
    if not wanted:
        return out
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            for name in wanted:
                info = header[name]
                a, b = info["data_offsets"]
                out[name] = _to_float32(view[start + a : start + b], info["dtype"], info["shape"])
        finally:
            view.release()
    return out


#: Elements converted per read: bounds the raw-bytes buffer a tensor read needs.
_CHUNK = 1 << 22


def _read_float32(f, offset: int, dtype: str, shape: list[int]) -> np.ndarray:
    """Read one tensor from an open file as a new float32 array, in chunks.

    Plain reads rather than a memory map: the file's pages then live in the page cache, not in
    this process's resident set, and only one chunk of raw bytes exists beside the result.
    """
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    out = np.empty(count, np.float32)
    src = _NP_DTYPES[dtype]
    buf = np.empty(min(count, _CHUNK), src) if dtype != "F32" else None
    f.seek(offset)
    for i in range(0, count, _CHUNK):
        n = min(_CHUNK, count - i)
        dst = out[i : i + n] if buf is None else buf[:n]
        if f.readinto(memoryview(dst).cast("B")) != dst.nbytes:
            raise ModelError(f"{Path(f.name).name}: unexpected end of file")
        if dtype == "BF16":
            wide = out[i : i + n].view(np.uint32)
            wide[...] = dst
            wide <<= 16
        elif buf is not None:
            out[i : i + n] = dst
    return out.reshape(shape)


class TensorRows:
    """One 2-D tensor of a :class:`WeightStore`, read a slice of rows at a time.

    ``rows[a:b]`` reads, widens to float32 and checks just those rows, so a graph builder can
    stream a vocabulary-sized table (Qwen2.5-Coder-0.5B's 151,936 x 896 embedding is 544 MB in
    float32) through a conversion or a quantiser with a few MB beside its output instead of the
    whole table. ``np.asarray(rows)`` still reads it all; ``rows.T`` is the lazy transpose a
    linear's ``[K, N]`` weight is (:class:`LazyColumns`).
    """

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, f, key: str, offset: int, dtype: str, shape: list[int]) -> None:
        if len(shape) != 2:
            raise ValueError(f"{key}: row access needs a 2-D tensor, got shape {shape}")
        self._f, self._key, self._offset, self._dtype = f, key, offset, dtype
        self.shape = (int(shape[0]), int(shape[1]))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> np.ndarray:
        if not isinstance(rows, slice):
            raise TypeError(f"{self._key}: rows are read by slice, got {rows!r}")
        r0, r1, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError(f"{self._key}: rows are read in order (step 1), got {step}")
        r1 = max(r0, r1)
        cols = self.shape[1]
        offset = self._offset + r0 * cols * _ITEMSIZE[self._dtype]
        arr = _read_float32(self._f, offset, self._dtype, [r1 - r0, cols])
        if not np.isfinite(arr).all():
            raise ModelError(
                f"{Path(self._f.name).name}: tensor {self._key} contains NaN or infinite values"
            )
        return arr

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype, copy=False)

    @property
    def T(self) -> LazyColumns:
        return LazyColumns(self, 0, self.shape[1])


class LazyColumns:
    """The transpose ``[K, N]`` of a :class:`TensorRows` ``[N, K]`` (a tied LM head's weight is the
    embedding table's transpose), restricted to K rows ``k0:k1``: ``w[k0:k1]`` narrows the view
    (a mesh line's rows), ``w[:, n0:n1]`` reads table rows ``n0:n1`` and returns those columns
    as an array. The quantisers take their weights in column chunks this way, so a tied head is
    quantised without its float32 table ever being whole in memory."""

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, rows: TensorRows, k0: int, k1: int) -> None:
        self._rows, self._k0, self._k1 = rows, k0, k1
        self.shape = (k1 - k0, rows.shape[0])

    def __getitem__(self, idx) -> LazyColumns | np.ndarray:
        if isinstance(idx, slice):
            a, b, step = idx.indices(self.shape[0])
            if step != 1:
                raise ValueError("LazyColumns: K rows are taken in order (step 1)")
            return LazyColumns(self._rows, self._k0 + a, self._k0 + max(a, b))
        ks, ns = idx
        if ks != slice(None) or not isinstance(ns, slice):
            raise TypeError(f"LazyColumns takes w[k0:k1] or w[:, n0:n1], got {idx!r}")
        return np.ascontiguousarray(self._rows[ns][:, self._k0 : self._k1].T)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:, :]
        return out if dtype is None else out.astype(dtype, copy=False)


def as_weight(w) -> np.ndarray | LazyColumns:
    """``w`` as a float32 array, or unchanged when it is a :class:`LazyColumns` view (read by the
    quantisers in column chunks)."""
    return w if isinstance(w, LazyColumns) else np.asarray(w, dtype=np.float32)


class WeightStore(Mapping[str, np.ndarray]):
    """The decoder's tensors by HF name, read from the safetensors files on access.

    Every access returns a new float32 array, checked for NaN/inf: a graph builder that takes one
    tensor at a time holds one tensor in RAM, not the model (a 1.5B model is 6 GB in float32).
    Shapes were checked against the config when the store was opened.  With tied embeddings
    ``lm_head.weight`` reads ``model.embed_tokens.weight``.  Use as a context manager (or call
    :meth:`close`) to close the files.
    """

    def __init__(
        self,
        folder: Path,
        entries: dict[str, tuple[Path, str, list[int], int, int]],
        aliases: dict[str, str],
    ) -> None:
        self.folder = folder
        self._entries = entries
        self._aliases = aliases
        self._files: dict[Path, object] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        key = self._aliases.get(name, name)
        path, dtype, shape, a, _ = self._entries[key]
        arr = _read_float32(self._file(path), a, dtype, shape)
        flat = arr.reshape(-1)
        for i in range(0, flat.size, _CHUNK):
            if not np.isfinite(flat[i : i + _CHUNK]).all():
                raise ModelError(f"{path.name}: tensor {key} contains NaN or infinite values")
        return arr

    def rows(self, name: str) -> TensorRows:
        """Tensor ``name`` (2-D) read a slice of rows at a time instead of whole."""
        key = self._aliases.get(name, name)
        path, dtype, shape, a, _ = self._entries[key]
        return TensorRows(self._file(path), key, a, dtype, shape)

    def _file(self, path: Path):
        if path not in self._files:
            self._files[path] = open(path, "rb")
        return self._files[path]

    def __iter__(self):
        yield from self._entries
        yield from self._aliases

    def __len__(self) -> int:
        return len(self._entries) + len(self._aliases)

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def nbytes(self) -> int:
        """Bytes of the stored tensors (in their file dtype)."""
        return sum(b - a for _, _, _, a, b in self._entries.values())

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_weights(model_dir: str | Path, config: ModelConfig) -> WeightStore:
    """The decoder tensors of a model folder as a :class:`WeightStore`, checked against ``config``.

    Only the headers are read here (names, dtypes, shapes, offsets); tensor data is read on access.
    Tensors the decoder does not use (e.g. ``rotary_emb.inv_freq``) are ignored.
    """
    folder = model_path(model_dir)
    shapes = expected_shapes(config)
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    index = folder / INDEX_FILE
    if index.is_file():
        wm = _read_index(index)
        by_file: dict[str, list[str]] = {}
        for name in list(shapes) + sorted(optional):
            if name in wm:
                by_file.setdefault(wm[name], []).append(name)
            elif name not in optional:
                raise ModelError(f"{INDEX_FILE}: tensor {name} is missing from weight_map")
        missing = f"is missing (listed in {INDEX_FILE})"
    else:
        files = weight_files(folder)
        by_file = {files[0].name: list(shapes) + sorted(optional)}
        missing = "is missing"
    entries: dict[str, tuple[Path, str, list[int], int, int]] = {}
    for fname, names in by_file.items():
        path = folder / fname
        header, start = read_header(path)
        for name in names:
            if name not in header:
                if name in optional:
                    continue
                raise ModelError(f"{fname}: tensor {name} {missing}")
            info = header[name]
            a, b = info["data_offsets"]
            entries[name] = (path, info["dtype"], list(info["shape"]), start + a, start + b)
    for name, shape in shapes.items():
        got = entries[name][2]
        if tuple(got) != shape:
            raise ModelError(
                f"{entries[name][0].name}: tensor {name} has shape {list(got)}, "
                f"expected {list(shape)} from config.json"
            )
    aliases = {}
    if config.tie_word_embeddings:
        entries.pop("lm_head.weight", None)
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    return WeightStore(folder, entries, aliases)


def load_weights(model_dir: str | Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """All decoder tensors by HF name, as float32 numpy arrays in RAM, checked against ``config``.

    With tied embeddings ``lm_head.weight`` is the *same* array object as
    ``model.embed_tokens.weight`` (test with ``is`` to share one initializer).  The graph builder
    reads through :func:`open_weights` instead, one tensor at a time.
    """
    with open_weights(model_dir, config) as store:
        out = {name: store[name] for name in store._entries}
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


_DIGESTS: dict[tuple, str] = {}
_DIGEST_LOCK = threading.Lock()
#: Content digests kept between processes (in the spark-lsp cache folder), by file identity.
DIGESTS_FILE = "digests.json"
#: Files remembered there (the oldest are forgotten first).
DIGESTS_KEPT = 512


def _digests_path() -> Path:
    from .graph_cache import cache_root  # the spark-lsp cache folder is the graphs' parent

    return cache_root().parent / DIGESTS_FILE


def _read_digests(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, unreadable or damaged: hash again
        return {}
    return data if isinstance(data, dict) else {}


def _remember_digest(name: str, stat: list[int], digest: str) -> None:
    """Add one file's digest to the shared record (written whole to a temporary name and renamed,
    so a concurrent reader never sees half a file; a cache folder that cannot be written only
    means hashing again next time)."""
    path = _digests_path()
    data = _read_digests(path)
    data.pop(name, None)
    data[name] = {"stat": stat, "digest": digest}
    for old in list(data)[: max(0, len(data) - DIGESTS_KEPT)]:
        del data[old]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, data)
    except OSError:
        pass


def file_digest(path: Path) -> str:
    """Content hash of one file, remembered by the file's identity: its resolved path, size,
    modification and change times (ns), inode and device.

    Hashing a model's weights is the slowest part of starting from a cached graph (seconds for a
    1.5B model), so the digest is kept for the next process too (``DIGESTS_FILE`` in the spark-lsp
    cache folder), the way build tools trust file status: any write to the file changes its
    change time (which, unlike the modification time, no tool can set back), so the file is
    hashed again."""
    path = Path(path)
    name = str(path.resolve())
    st = path.stat()
    stat = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    key = (name, *stat)
    with _DIGEST_LOCK:  # one hash at a time: a thread asking for the same file waits for it
        if key in _DIGESTS:
            return _DIGESTS[key]
        rec = _read_digests(_digests_path()).get(name)
        if isinstance(rec, dict) and rec.get("stat") == stat and isinstance(rec.get("digest"), str):
            _DIGESTS[key] = rec["digest"]
            return rec["digest"]
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _DIGESTS[key] = digest = h.hexdigest()
        _remember_digest(name, stat, digest)
        return digest


def weights_digest(model_dir: str | Path) -> str:
    """Content hash of ``config.json`` + the weight files: a graph-cache key.

    Hashes the bytes (not names or mtimes); each file's digest is remembered by its identity
    (:func:`file_digest`), so a later call, in this process or the next, hashes nothing.
    """
    folder = model_path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    for p in [folder / "config.json", *weight_files(folder)]:
        if not p.is_file():
            raise ModelError(f"{p}: file not found")
        h.update(p.name.encode() + b"\0" + file_digest(p).encode())
    return h.hexdigest()


def _encode(arr: np.ndarray, dtype: str) -> np.ndarray:
    a = np.ascontiguousarray(arr, dtype=np.float32)
    if dtype == "F16":
        return a.astype(np.float16)
    if dtype == "BF16":  # round to nearest even
        u = a.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return a


def save_safetensors(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    dtype: str = "F32",
    metadata: dict[str, str] | None = None,
) -> None:
    """Write tensors to a safetensors file in F32, F16 or BF16 (round-to-nearest-even), with numpy."""
    write_safetensors(
        path,
        {k: tuple(np.shape(v)) for k, v in tensors.items()},
        tensors.__getitem__,
        dtype,
        metadata,
    )


def write_safetensors(
    path: str | Path,
    shapes: Mapping[str, tuple[int, ...]],
    tensor: Callable[[str], np.ndarray],
    dtype: str = "F32",
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors file one tensor at a time: ``tensor(name)`` makes each in turn (a model
    larger than RAM can be written).  Written to a temporary name and renamed into place."""
    if dtype not in ("F32", "F16", "BF16"):
        raise ValueError(f"dtype={dtype!r}: expected F32, F16 or BF16")
    size = _ITEMSIZE[dtype]
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape, dtype=np.int64)) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, shape in shapes.items():
            data = _encode(tensor(name), dtype)
            if data.shape != tuple(shape):
                raise ValueError(f"tensor {name}: shape {data.shape}, declared {tuple(shape)}")
            f.write(data.data)
    os.replace(tmp, path)
