"""The embedding table is stored in the narrowest type that holds its values exactly (bf16 or fp16
checkpoints: half the bytes of float32), unless a tied LM head reads it in place; the answers do
not change (engine.graph.embedding_table)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from engine_helpers import greedy
from onnx import TensorProto
from tiny_models import write_variant

from engine import Engine
from engine import graph as graph_mod

PROMPT = [1, 5, 9, 17, 33, 2, 8, 40, 3]


def _bf16_exact(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _stored(t: np.ndarray) -> tuple[np.ndarray, int]:
    kind = graph_mod.embedding_type(t)
    return np.concatenate(list(graph_mod.embedding_chunks(t, kind))), kind


def test_a_bf16_exact_table_is_stored_as_bf16_bits(monkeypatch):
    monkeypatch.setattr(graph_mod, "_TABLE_CHUNK", 64)  # several chunks
    rng = np.random.default_rng(0)
    t = _bf16_exact(rng.standard_normal((300, 16)).astype(np.float32))
    out, kind = _stored(t)
    assert kind == TensorProto.BFLOAT16 and out.dtype == np.uint16 and out.shape == t.shape
    assert np.array_equal((out.astype(np.uint32) << 16).view(np.float32), t)


def test_an_fp16_exact_table_is_stored_as_fp16(monkeypatch):
    monkeypatch.setattr(graph_mod, "_TABLE_CHUNK", 64)
    rng = np.random.default_rng(1)
    t = rng.standard_normal((300, 16)).astype(np.float16).astype(np.float32)
    out, kind = _stored(t)
    assert kind == TensorProto.FLOAT16 and out.dtype == np.float16
    assert np.array_equal(out.astype(np.float32), t)
    half = t.astype(np.float16)  # a float16 array as loaded: kept as it is
    out, kind = _stored(half)
    assert kind == TensorProto.FLOAT16 and np.array_equal(out, half)


@pytest.mark.parametrize("value", [1.0 + 2.0**-20, 70000.5])  # too fine / too large for both
def test_one_value_that_neither_holds_keeps_float32_even_in_the_last_chunk(monkeypatch, value):
    monkeypatch.setattr(graph_mod, "_TABLE_CHUNK", 64)
    rng = np.random.default_rng(2)
    t = _bf16_exact(rng.standard_normal((300, 8)).astype(np.float32))
    t[-1, -1] = value
    out, kind = _stored(t)
    assert kind == TensorProto.FLOAT and out.dtype == np.float32
    assert np.array_equal(out, t)


def test_a_streamed_table_is_the_same_initializer_in_memory_and_in_the_data_file(tmp_path):
    rng = np.random.default_rng(3)
    t = _bf16_exact(rng.standard_normal((20000, 8)).astype(np.float32))
    kind = graph_mod.embedding_type(t)
    expected = (t.view(np.uint32) >> 16).astype(np.uint16)
    gb = graph_mod.GraphBuilder()
    gb.initializer_rows("e", t.shape, kind, graph_mod.embedding_chunks(t, kind))
    (mem,) = gb.initializers
    assert mem.data_type == TensorProto.BFLOAT16
    assert np.array_equal(np.frombuffer(mem.raw_data, np.uint16).reshape(t.shape), expected)
    data = tmp_path / "model.onnx.data"
    gb = graph_mod.GraphBuilder(external_data=data)
    gb.initializer("before", np.ones(3000, np.float32))  # so the table starts at an aligned offset
    gb.initializer_rows("e", t.shape, kind, graph_mod.embedding_chunks(t, kind))
    gb.close()
    ext = {kv.key: kv.value for kv in gb.initializers[-1].external_data}
    assert int(ext["offset"]) % graph_mod.GraphBuilder.ALIGN == 0
    assert int(ext["length"]) == expected.nbytes
    raw = data.read_bytes()[int(ext["offset"]) : int(ext["offset"]) + int(ext["length"])]
    assert np.array_equal(np.frombuffer(raw, np.uint16).reshape(t.shape), expected)


def _table_type(engine: Engine) -> int:
    """The stored table's element type: the Gather's initializer, or the rows the runtime reads."""
    m = onnx.load(str(engine.graph_path), load_external_data=False)
    tables = [i for i in m.graph.initializer if i.name == "embed_tokens"]
    if tables:
        return tables[0].data_type
    return engine.runtime.embedding.onnx_type


@pytest.mark.parametrize("dtype,kind", [("bfloat16", "BFLOAT16"), ("float16", "FLOAT16")])
def test_a_16_bit_checkpoint_runs_on_a_16_bit_table_with_the_same_answers(
    tiny_llama, tmp_path, monkeypatch, dtype, kind
):
    model = write_variant(tiny_llama, tmp_path / dtype, dtype=dtype)
    compact = Engine.load(model, wafer=False, precision="int8", cache_dir=tmp_path / "a")
    assert _table_type(compact) == getattr(TensorProto, kind)
    # the same graph with a float32 table
    monkeypatch.setattr(graph_mod, "embedding_type", lambda t: TensorProto.FLOAT)
    wide = Engine.load(model, wafer=False, precision="int8", cache_dir=tmp_path / "b")
    assert _table_type(wide) == TensorProto.FLOAT
    assert greedy(compact, PROMPT, 12).tokens == greedy(wide, PROMPT, 12).tokens


def test_a_tied_head_that_reads_the_table_in_place_keeps_it_float32(tiny_llama, tmp_path):
    from engine.wafer import mesh_op

    if mesh_op.library() is None:
        pytest.skip(f"the mesh op cannot be built here: {mesh_op.why_not()}")
    model = write_variant(tiny_llama, tmp_path / "bf16", dtype="bfloat16")
    eng = Engine.load(model, wafer=True, precision="fp32", cache_dir=tmp_path / "g")
    m = onnx.load(str(eng.graph_path), load_external_data=False)
    assert any(n.op_type == "MeshLinear" and "embed_tokens" in n.input for n in m.graph.node)
    assert _table_type(eng) == TensorProto.FLOAT
