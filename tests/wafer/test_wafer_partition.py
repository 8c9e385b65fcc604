"""Partitioned execution (engine.wafer.partition): tiles, single linears in ONNX Runtime, and the
whole decoder on several grids (uneven ones included) against the unpartitioned engine."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from engine import Engine, GenerationParams
from engine.graph import GraphBuilder
from engine.runtime import session_options
from engine.wafer.partition import (
    DEFAULT_GRID,
    FORMS,
    ROW_REDUCE,
    TiledLinear,
    block_sizes,
    parse_grid,
    pe_tiles,
)


def test_block_sizes_cover_dimension_with_uneven_tail():
    assert block_sizes(10, 3) == [4, 4, 2]
    assert block_sizes(64, 5) == [13, 13, 13, 13, 12]
    assert block_sizes(2, 4) == [1, 1]  # a grid wider than the dimension drops empty PEs
    assert sum(block_sizes(160, 7)) == 160


@pytest.mark.parametrize("role", ["qkv", "o", "down", "lm_head"])
@pytest.mark.parametrize("grid", [(2, 2), (3, 5), (4, 1)])
def test_pe_tiles_reassemble_and_alternate_axes(role, grid):
    w = np.arange(10 * 13, dtype=np.float32).reshape(10, 13)
    tiles = pe_tiles(w, grid, role)
    R, C = grid
    k_parts, n_parts = (R, C) if role in ROW_REDUCE else (C, R)
    rows = []
    for a in range(len(block_sizes(10, k_parts))):
        # Row-reduce: K-block a lives on mesh row a; o/down (transposed): on mesh column a.
        key = (lambda b: (a, b)) if role in ROW_REDUCE else (lambda b: (b, a))
        rows.append(
            np.concatenate([tiles[key(b)] for b in range(len(block_sizes(13, n_parts)))], axis=1)
        )
    np.testing.assert_array_equal(np.concatenate(rows, axis=0), w)


def test_parse_grid_errors_name_the_flag():
    assert parse_grid("3x5") == (3, 5)
    assert parse_grid(" 4X4 ") == (4, 4)
    for bad in ("3", "0x4", "ax2", "2x2x2"):
        with pytest.raises(ValueError, match="--grid"):
            parse_grid(bad)


def test_bad_grid_and_role_rejected():
    with pytest.raises(ValueError, match="positive"):
        TiledLinear((0, 2))
    with pytest.raises(ValueError, match="grid"):
        TiledLinear("2x2x")
    with pytest.raises(ValueError, match="role"):
        TiledLinear((2, 2)).emit(
            GraphBuilder(), "x", np.zeros((4, 4), np.float32), name="l", role="embed"
        )


def _run_linear(role, grid, K, N, T, bias, form="graph"):
    rng = np.random.default_rng(K * N + T)
    w = rng.standard_normal((K, N)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    x = rng.standard_normal((T, K)).astype(np.float32)
    gb = GraphBuilder()
    xi = gb.input("x", TensorProto.FLOAT, ["T", K])
    lin = TiledLinear(grid, form=form)
    y = lin.emit(gb, xi, w, name="lin", role=role, bias=b)
    gb.output(y, "y", TensorProto.FLOAT, ["T", N])
    sess = ort.InferenceSession(
        gb.to_model().SerializeToString(),
        session_options(1, custom_ops=lin.custom_op_libraries),
        providers=["CPUExecutionProvider"],
    )
    out = sess.run(None, {"x": x})[0]
    ref = x @ w + (b if bias else 0)
    return out, ref, lin, gb


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("role", ["qkv", "o", "gate_up", "down", "lm_head"])
@pytest.mark.parametrize("grid", [(2, 2), (3, 5), (1, 4), (7, 3)])
def test_single_linear_matches_matmul(role, grid, form):
    out, ref, lin, gb = _run_linear(role, grid, K=37, N=29, T=3, bias=role == "qkv", form=form)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-5)
    info = lin.layout["lin"]
    parts = grid[0] if role in ROW_REDUCE else grid[1]
    assert info["k_blocks"] == block_sizes(37, parts)
    # The reduction is explicit: one GEMV per mesh line along the reduction axis, chained — as
    # graph nodes, or as the MeshLinear op over one tile initializer per mesh line.
    ops = [n.op_type for n in gb.nodes]
    if form == "graph":
        assert ops.count("MatMul") == 1 and ops.count("Gemm") == len(info["k_blocks"]) - 1
    else:
        (node,) = [n for n in gb.nodes if n.op_type == "MeshLinear"]
        has_bias = role == "qkv"  # the op adds the bias itself: no Add node
        assert node.domain == "spark.wafer"
        assert len(node.input) == 2 + len(info["k_blocks"]) + has_bias
        assert "MatMul" not in ops and "Gemm" not in ops and "Add" not in ops
    rows = 0 if form == "graph" else 1  # the op's tiles: [panels, rows, 64]
    tiles = [
        t
        for t in gb.initializers
        if t.name.startswith("lin.") and t.name not in ("lin.bias", "lin.mesh_shape")
    ]
    assert sum(t.dims[rows] for t in tiles) == 37


# -- the whole decoder: partitioned vs unpartitioned engine -----------------------------------

GRIDS = [(2, 2), (3, 5), (4, 4), (1, 3), (5, 2)]


@pytest.fixture(scope="module")
def dense_engines(tiny_models, tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "graph_cache"
    return {
        a: Engine.load(p, wafer=False, cache_dir=cache, threads=1) for a, p in tiny_models.items()
    }


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "arch,grid",
    [
        ("llama", (2, 2)),
        ("qwen2", (3, 5)),
        ("mistral", (4, 4)),
        ("qwen2", (1, 3)),
        ("llama", (5, 2)),
        ("mistral", None),
        ("qwen3", (2, 3)),
        ("starcoder2", (3, 2)),
        ("gemma", (2, 2)),
    ],
)
def test_partitioned_engine_equals_dense(
    arch, grid, form, tiny_models, dense_engines, tmp_path_factory
):
    dense = dense_engines[arch]
    lin = TiledLinear(grid, form=form)
    eng = Engine.load(
        tiny_models[arch],
        linear=lin,
        cache_dir=tmp_path_factory.getbasetemp() / "graph_cache",
        threads=1,
    )
    assert eng.linear.grid == (grid or DEFAULT_GRID)
    graph = onnx.load(str(eng.graph_path), load_external_data=False).graph
    linears = 4 * dense.config.num_hidden_layers + 1
    if form == "graph":
        assert sum(n.op_type == "Gemm" and n.name.endswith("_gemv_reduce") for n in graph.node) >= 5
    else:
        assert sum(n.op_type == "MeshLinear" for n in graph.node) == linears
        assert not any(n.op_type in ("MatMul", "Gemm") for n in graph.node)
    ids = np.random.default_rng(7).integers(0, dense.sample_vocab, 24).tolist()
    np.testing.assert_allclose(
        eng.forward_logits(ids), dense.forward_logits(ids), atol=1e-4, rtol=0
    )
    params = GenerationParams(max_new_tokens=16, ignore_eos=True)
    a, b = eng.generate(ids, params), dense.generate(ids, params)
    a.result(), b.result()
    assert a.tokens == b.tokens


def test_tied_head_reads_the_embedding_in_place(tiny_models, dense_engines, tmp_path_factory):
    """A tied model's LM head is MeshLinear(transposed=1) over the embedding initializer itself:
    the graph holds the table once, and the logits are the dense engine's."""
    dense = dense_engines["llama"]
    assert dense.config.tie_word_embeddings
    eng = Engine.load(
        tiny_models["llama"],
        linear=TiledLinear((2, 2), form="op"),
        cache_dir=tmp_path_factory.getbasetemp() / "graph_cache",
        threads=1,
    )
    graph = onnx.load(str(eng.graph_path), load_external_data=False).graph
    (head,) = [n for n in graph.node if n.name == "lm_head/mesh_linear"]
    # inputs: the final norm's (x, skip, gamma: the op runs it), shape, then the table itself
    assert head.input[-1] == "embed_tokens"
    assert {a.name: a.i for a in head.attribute if a.name != "epsilon"} == {
        "transposed": 1,
        "norm": 1,
    }
    assert not any(t.name.startswith("lm_head.row") for t in graph.initializer)
    ids = np.random.default_rng(5).integers(0, dense.sample_vocab, 12).tolist()
    np.testing.assert_allclose(
        eng.forward_logits(ids), dense.forward_logits(ids), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("form", FORMS)
def test_tiling_only_some_linears(form, tiny_models, dense_engines, tmp_path_factory):
    """`bench wafer --tile`: the named linears are tiled, the others stay one MatMul; same logits."""
    dense = dense_engines["qwen2"]
    eng = Engine.load(
        tiny_models["qwen2"],
        linear=TiledLinear((2, 2), roles=["lm_head"], form=form),
        cache_dir=tmp_path_factory.getbasetemp() / "graph_cache",
        threads=1,
    )
    graph = onnx.load(str(eng.graph_path), load_external_data=False).graph
    reduced = {
        n.name.split("/")[0]
        for n in graph.node
        if n.name.endswith("_gemv_reduce") or n.op_type == "MeshLinear"
    }
    assert reduced == {"lm_head"}
    ids = np.random.default_rng(3).integers(0, dense.sample_vocab, 16).tolist()
    np.testing.assert_allclose(
        eng.forward_logits(ids), dense.forward_logits(ids), atol=1e-4, rtol=0
    )
    assert TiledLinear((2, 2), roles=["lm_head"]).cache_key() != TiledLinear((2, 2)).cache_key()
    with pytest.raises(ValueError, match="roles"):
        TiledLinear((2, 2), roles=["attention"])
