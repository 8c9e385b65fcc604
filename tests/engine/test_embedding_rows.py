"""The token embedding rows the runtime reads from the graph's data file (engine.embedding): the
rows of the table, whole or read a row at a time with preadv, bad ids and broken files refused,
no row read from the file resident in the process, and an engine's tokens the same as with the
Gather inside the graph."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import greedy, hf_greedy, random_ids
from onnx import TensorProto

import engine.engine as engine_mod
from engine import Engine, ModelError
from engine import embedding as embedding_mod
from engine.embedding import EmbeddingRows
from engine.graph import build_decoder

TYPES = {
    TensorProto.BFLOAT16: np.uint16,
    TensorProto.FLOAT16: np.float16,
    TensorProto.FLOAT: np.float32,
}


def _table_file(
    path: Path, rows: int, cols: int, onnx_type: int, offset: int = 8192, seed: int = 0
):
    """A data file with junk before a random table at ``offset``; returns the table."""
    rng = np.random.default_rng(seed)
    if onnx_type == TensorProto.FLOAT:
        table = rng.standard_normal((rows, cols)).astype(np.float32)
    else:  # any 16 bits: bf16 and fp16 rows are compared as bytes
        table = rng.integers(0, 1 << 16, (rows, cols)).astype(np.uint16).view(TYPES[onnx_type])
    with open(path, "wb") as f:
        f.write(rng.integers(0, 256, offset, dtype=np.uint8).tobytes())
        f.write(table.tobytes())
        f.write(b"\xff" * 100)  # junk after it
    return table


@pytest.mark.parametrize("mode", ["whole", "pread"])
@pytest.mark.parametrize("onnx_type", list(TYPES))
def test_rows_are_the_tables_rows(tmp_path, mode, onnx_type):
    table = _table_file(tmp_path / "d", 700, 24, onnx_type)
    rows = EmbeddingRows(
        tmp_path / "d", 8192, 700, 24, onnx_type, whole_bytes=None if mode == "whole" else 0
    )
    assert rows.reads_rows == (mode == "pread")
    ids = np.random.default_rng(1).integers(0, 700, 57)
    ids[:3] = [0, 699, 0]  # first, last, repeated
    out = rows.read(ids, rows.empty(len(ids)))
    assert out.dtype == table.dtype and out.shape == (1, 57, 24)
    assert np.array_equal(out[0].view(np.uint8), table[ids].view(np.uint8))
    one = rows.empty(1)
    for t in (0, 345, 699):
        rows.read_one(t, one)
        assert np.array_equal(one[0, 0].view(np.uint8), table[t].view(np.uint8))
    assert rows.read([], rows.empty(0)).shape == (1, 0, 24)


@pytest.mark.parametrize("mode", ["whole", "pread"])
def test_an_id_outside_the_table_is_a_model_error(tmp_path, mode):
    _table_file(tmp_path / "d", 100, 8, TensorProto.BFLOAT16)
    rows = EmbeddingRows(
        tmp_path / "d",
        8192,
        100,
        8,
        TensorProto.BFLOAT16,
        whole_bytes=0 if mode == "pread" else None,
    )
    for bad in (100, -1, 1 << 40):
        with pytest.raises(ModelError, match=f"token id {bad} is outside"):
            rows.read([3, bad], rows.empty(2))
        with pytest.raises(ModelError, match=f"token id {bad} is outside"):
            rows.read_one(bad, rows.empty(1))
    rows.read([3, 99], rows.empty(2))  # and it still reads


def test_a_table_past_the_files_end_or_bad_metadata_is_a_model_error(tmp_path):
    _table_file(tmp_path / "d", 100, 8, TensorProto.FLOAT16)
    with pytest.raises(ModelError, match="past the file's end"):
        EmbeddingRows(
            tmp_path / "d", 8192, 107, 8, TensorProto.FLOAT16
        )  # 100 bytes of junk: 6 rows
    with pytest.raises(ModelError, match="unsupported type"):
        EmbeddingRows(tmp_path / "d", 8192, 10, 8, TensorProto.INT64)
    with pytest.raises(ModelError, match="embedding table"):
        EmbeddingRows(tmp_path / "missing", 0, 10, 8, TensorProto.FLOAT16)
    graph = tmp_path / "model.onnx"
    assert EmbeddingRows.of(graph, {}) is None
    for spec in ("{", json.dumps({"location": "d", "offset": 8192}), json.dumps([1])):
        with pytest.raises(ModelError, match="bad embedding metadata"):
            EmbeddingRows.of(graph, {"spark_lsp.embedding": spec})
    spec = {"location": "d", "offset": 8192, "rows": 100, "cols": 8, "type": TensorProto.FLOAT16}
    assert EmbeddingRows.of(graph, {"spark_lsp.embedding": json.dumps(spec)}).rows == 100


def test_a_file_truncated_while_in_use_or_a_closed_table_is_a_model_error(tmp_path):
    _table_file(tmp_path / "d", 100, 8, TensorProto.FLOAT)
    rows = EmbeddingRows(tmp_path / "d", 8192, 100, 8, TensorProto.FLOAT, whole_bytes=0)
    with open(tmp_path / "d", "r+b") as f:
        f.truncate(8192 + 50 * 32)
    rows.read([49], rows.empty(1))
    with pytest.raises(ModelError, match="truncated"):
        rows.read([50], rows.empty(1))
    rows.close()
    with pytest.raises(ModelError, match="closed"):
        rows.read_one(1, rows.empty(1))


def _rss_file_kb() -> int:
    """File-backed resident memory (a file on tmpfs counts as shared memory)."""
    status = Path("/proc/self/status").read_text()
    return sum(
        int(re.search(rf"{k}:\s+(\d+) kB", status).group(1)) for k in ("RssFile", "RssShmem")
    )


def test_rows_read_from_the_file_never_become_resident(tmp_path):
    """The point of reading rows: 3,000 distinct 4 KB rows of a 64 MB table read with preadv add
    nothing to the process's file-backed resident memory; read through a map (what the Gather's
    initializer was), the same rows add at least their pages."""
    if (
        not Path("/proc/self/status").exists()
        or "RssFile" not in Path("/proc/self/status").read_text()
    ):
        pytest.skip("no RssFile in /proc/self/status here")
    cols, n = 2048, 16384  # bf16: 4 KB a row, 64 MB
    path = tmp_path / "d"
    with open(path, "wb") as f:
        f.write(np.arange(n * cols, dtype=np.uint32).astype(np.uint16).tobytes())
    path.read_bytes()  # in the page cache, not mapped
    ids = np.random.default_rng(0).choice(n, 3000, replace=False)
    rows = EmbeddingRows(path, 0, n, cols, TensorProto.BFLOAT16)
    assert rows.reads_rows
    before = _rss_file_kb()
    for start in range(0, len(ids), 100):
        chunk = ids[start : start + 100]
        rows.read(chunk, rows.empty(len(chunk)))
    for t in ids[:300]:
        rows.read_one(int(t), rows.empty(1))
    assert _rss_file_kb() - before < 2048
    mapped = np.memmap(path, np.uint16, "r").reshape(n, cols)
    before = _rss_file_kb()
    assert int(mapped[ids].sum()) > 0
    assert _rss_file_kb() - before >= 3000 * 4


@pytest.fixture(scope="module")
def three_engines(tiny_llama, tmp_path_factory):
    """The same int8 model: rows in memory (a small table), rows read from the file, and the
    Gather inside the graph."""
    engines = {}
    mp = pytest.MonkeyPatch()
    try:
        base = tmp_path_factory.mktemp("embedding_engines")
        engines["whole"] = Engine.load(
            tiny_llama, cache_dir=base / "a", precision="int8", threads=2
        )
        mp.setattr(embedding_mod, "WHOLE_TABLE_BYTES", 0)
        engines["pread"] = Engine.load(
            tiny_llama, cache_dir=base / "a", precision="int8", threads=2
        )
        mp.setattr(
            engine_mod, "build_decoder", functools.partial(build_decoder, runtime_embedding=False)
        )
        engines["gather"] = Engine.load(
            tiny_llama, cache_dir=base / "b", precision="int8", threads=2
        )
    finally:
        mp.undo()
    return engines


def test_the_engines_read_their_rows_as_asked(three_engines):
    e = three_engines
    assert e["whole"].graph_path == e["pread"].graph_path
    assert not e["whole"].runtime.embedding.reads_rows and e["pread"].runtime.embedding.reads_rows
    assert e["gather"].runtime.embedding is None and e["gather"].runtime.token_input == "input_ids"
    assert {i.name for i in e["pread"].runtime.session.get_inputs()} >= {"inputs_embeds"}


def test_reading_rows_gives_the_gathers_logits_and_tokens(three_engines, tiny_llama):
    e = three_engines
    ids = random_ids(e["whole"], 40, seed=7)
    want = hf_greedy(tiny_llama, ids, 12)
    for name, eng in e.items():
        assert greedy(eng, ids, 12).tokens == want, name
    # prefill (many rows), decode (one) and a verification pass (a few) give the same logits
    logits = {}
    for name, eng in e.items():
        rt = eng.runtime
        kv = rt.new_kv()
        prefill = rt.forward(kv, ids[:30], 0)
        step = rt.decode(kv, ids[30], 30).copy()
        wide = rt.forward(kv, ids[31:36], 31, num_logits=5)
        logits[name] = (prefill, step, wide)
    for name in ("pread", "gather"):
        for a, b in zip(logits["whole"], logits[name]):
            np.testing.assert_array_equal(a, b, err_msg=name)
