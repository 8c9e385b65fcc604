"""Chips, placement, the calibrated performance model and the mesh simulator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.projection import perfmodel
from engine.projection.chips import WSE2, WSE3, ChipError, load_chip
from engine.projection.perfmodel import (
    Constants,
    allreduce_cycles,
    calibrate,
    calibration_table,
    plan,
    project,
)
from engine.projection.placement import ModelShape, PlacementError, load_shape, place
from engine.projection.simulator import Mesh, _allreduce, analytic_layer, simulate_layer

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def llama8b():
    return load_shape(DATA / "llama-3-8b.json")


@pytest.fixture(scope="module")
def llama70b():
    return load_shape(DATA / "llama-3-70b.json")


# -- chips ---------------------------------------------------------------------------------------


def test_builtin_chips():
    assert load_chip("wse2") is WSE2 and load_chip("WSE3") is WSE3
    assert WSE2.sram_kb_per_pe == 48 and WSE2.clock_ghz == 1.1 and WSE2.link_bits == 32
    assert (WSE2.simd_fp16, WSE3.simd_fp16) == (4, 8)
    assert 800_000 > WSE2.pes > 700_000 and WSE3.pes > WSE2.pes


def test_custom_chip_toml_json_and_base(tmp_path):
    t = tmp_path / "mini.toml"
    t.write_text(
        'name = "mini"\nmesh_rows = 64\nmesh_cols = 32\nsram_kb_per_pe = 24\nclock_ghz = 1.0\nsimd_fp16 = 2\n'
    )
    c = load_chip(t)
    assert (c.name, c.pes, c.sram_bytes_per_pe, c.ramp_cycles) == ("mini", 2048, 24 * 1024, 2.0)
    j = tmp_path / "fast.json"
    j.write_text(json.dumps({"base": "wse3", "clock_ghz": 1.5}))
    c = load_chip(j)
    assert c.clock_ghz == 1.5 and c.mesh_cols == WSE3.mesh_cols


@pytest.mark.parametrize(
    "body,match",
    [
        ("mesh_rows = 64\n", "required field"),
        ('base = "wse2"\nclock_ghz = -1\n', "clock_ghz.*positive"),
        ('base = "wse2"\nmesh_rows = 1.5\n', "mesh_rows.*integer"),
        ('base = "wse2"\nmesh_rows = "big"\n', "mesh_rows.*number"),
        ('base = "wse9"\n', "base"),
        ('base = "wse2"\ncolour = 3\n', "unknown field.*colour"),
        ("mesh_rows = [\n", "invalid TOML"),
    ],
)
def test_bad_chip_specs_name_file_and_field(tmp_path, body, match):
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(ChipError, match=match) as e:
        load_chip(f)
    assert "bad.toml" in str(e.value)


def test_unknown_chip_name():
    with pytest.raises(ChipError, match="not a built-in chip"):
        load_chip("wse7")


# -- placement -----------------------------------------------------------------------------------


def test_shape_from_config_file(llama8b, llama70b):
    assert llama8b.name == "Meta-Llama-3-8B" and llama8b.layers == 32
    assert 7.9e9 < llama8b.params < 8.1e9 and 70e9 < llama70b.params < 71e9


def test_shape_counts_every_architectures_linear_weights(tiny_models):
    """The projection's weight count is the engine's: gated MLPs (gate + up) and Starcoder2's single
    up projection alike."""
    from engine.config import load_config
    from engine.weights import expected_shapes

    for arch, folder in tiny_models.items():
        cfg = load_config(folder)
        shape = ModelShape.from_config(cfg)
        linears = sum(
            int(np.prod(s))
            for n, s in expected_shapes(cfg).items()
            if len(s) == 2 and n.startswith("model.layers.")
        )
        assert shape.layers * shape.layer_params == linears, arch
    assert not ModelShape.from_config(load_config(tiny_models["starcoder2"])).gated


def test_layer_regions_tiles_and_kv(llama8b):
    pl = place(llama8b, WSE2, (420, 420), context=8192)
    layers = pl.layer_regions()
    assert len(layers) == 32 and {r.kind for r in pl.regions} == {"embed", "layer", "lm_head"}
    r = layers[0]
    # PE (0, 0) holds ceil-blocks of every matrix (4096/420 -> 10 rows of qkv, etc.).
    assert r.parts["qkv"] == 10 * 15 * 2 and r.parts["o"] == 10 * 10 * 2
    assert r.parts["kv_cache"] == int(np.ceil(2 * 8192 * 8 * 128 * 2 / 420**2))
    assert pl.wafers > 1 and max(x.peak_bytes for x in pl.regions) <= pl.budget_bytes
    # Regions never overlap on a wafer and stay inside the mesh.
    for w in range(pl.wafers):
        occ = np.zeros((WSE2.mesh_rows, WSE2.mesh_cols), int)
        for x in pl.regions:
            if x.wafer == w:
                occ[x.row : x.row + x.rows, x.col : x.col + x.cols] += 1
        assert occ.max() == 1
    # Cuts fall at layer boundaries: layers are in order over wafers.
    assert [x.wafer for x in layers] == sorted(x.wafer for x in layers)


def test_uneven_region_fill_map_sums_to_totals(llama8b):
    pl = place(llama8b, WSE2, (97, 131), context=1024)
    m = pl.fill_map(0)
    assert np.nanmax(m) <= pl.budget + 1e-9
    r = pl.layer_regions()[0]
    block = m[r.row : r.row + r.rows, r.col : r.col + r.cols] * WSE2.sram_bytes_per_pe
    assert block.sum() == pytest.approx(r.total_bytes, rel=1e-6)
    assert block[0, 0] == r.peak_bytes and block[-1, -1] < block[0, 0]  # uneven tail is lighter


def test_refusal_says_how_much_is_missing(llama70b):
    with pytest.raises(PlacementError, match=r"missing [\d.]+ KB per PE") as e:
        place(llama70b, WSE2, (64, 64))
    assert "64x64" in str(e.value) and "budget" in str(e.value)
    with pytest.raises(
        PlacementError, match=r"needs \d+ wse2 wafers but at most 1 allowed: missing \d+ wafer"
    ):
        place(llama70b, WSE2, (360, 360), max_wafers=1)
    with pytest.raises(PlacementError, match="larger than"):
        place(llama70b, WSE2, (800, 800))


def test_multi_wafer_split_of_70b(llama70b):
    pl, proj = plan(llama70b, WSE2, context=4096)
    assert pl.wafers >= 4  # 141 GB of fp16 weights vs ~30 GB usable SRAM per WSE-2
    assert perfmodel.io_seconds(pl) > 0
    per_wafer = {}
    for r in pl.layer_regions():
        per_wafer.setdefault(r.wafer, []).append(r.layer)
    assert sorted(sum(per_wafer.values(), [])) == list(range(80))
    assert proj.decode_tok_s > 0 and len(proj.per_layer) == 80


def test_auto_grid_beats_neighbours(llama8b):
    pl, proj = plan(llama8b, WSE3, context=4096)
    assert pl.wafers == 1
    for dr, dc in ((-16, 0), (16, 0), (0, -16), (0, 16)):
        try:
            p2, pr2 = plan(
                llama8b, WSE3, grid=(pl.grid[0] + dr, pl.grid[1] + dc), context=4096, max_wafers=1
            )
        except PlacementError:
            continue
        assert pr2.decode_tok_s <= proj.decode_tok_s + 1e-9


# -- performance model ---------------------------------------------------------------------------


def test_calibration_matches_waferllm_within_15pct(llama8b):
    for row in calibration_table(llama8b, WSE2):
        assert abs(row["error"]) < 0.15, row


def test_shipped_constants_are_the_fit(llama8b):
    k = calibrate(llama8b, WSE2)
    assert k.eta == pytest.approx(perfmodel.ETA_GEMV, rel=0.01)
    assert k.c0 == pytest.approx(perfmodel.C0_CYCLES, abs=50)
    assert 0 < k.eta <= 1


def test_calibration_can_fail(llama8b):
    # A model 4x slower per MAC misses the published points by far more than 15%.
    bad = Constants(eta=perfmodel.ETA_GEMV / 4, c0=perfmodel.C0_CYCLES)
    assert any(abs(r["error"]) > 0.15 for r in calibration_table(llama8b, WSE2, bad))


def test_ttft_close_to_waferllm_prefill(llama8b):
    # WaferLLM: 4K-token prefill on 720x720 at 27,686 tok/s (TTFT ~148 ms).
    pl = place(llama8b, WSE2, (720, 720), context=4096)
    ttft = project(pl, prompt_tokens=4096).ttft_s
    assert 0.85 * 0.148 < ttft < 1.15 * 0.148


def test_wse3_faster_than_wse2(llama8b):
    a = project(place(llama8b, WSE2, (200, 200))).decode_tok_s
    b = project(place(llama8b, WSE3, (200, 200))).decode_tok_s
    assert b > a


# -- simulator -----------------------------------------------------------------------------------

SMALL = ModelShape(
    "small", hidden=256, ffn=768, layers=4, heads=8, kv_heads=4, head_dim=32, vocab=8192
)
ODD = ModelShape(
    "odd", hidden=320, ffn=864, layers=2, heads=10, kv_heads=5, head_dim=32, vocab=1000
)


@pytest.mark.parametrize("n", [2, 3, 7, 16, 33])
def test_isolated_allreduce_matches_formula(n):
    mesh = Mesh(1, n, WSE2)
    ready = np.zeros((1, n))
    _allreduce(mesh, ready, [[(0, j) for j in range(n)]], 4)
    assert ready.max() == pytest.approx(
        allreduce_cycles(n, 4, WSE2), abs=4
    )  # tree messages may share a link


@pytest.mark.parametrize(
    "shape,grid,chip",
    [
        (SMALL, (8, 8), WSE2),
        (SMALL, (32, 32), WSE3),
        (SMALL, (12, 20), WSE2),
        (ODD, (48, 40), WSE2),
        (ODD, (64, 64), WSE3),
        (SMALL, (17, 9), WSE2),
    ],
)
def test_analytic_agrees_with_simulator(shape, grid, chip):
    sim = simulate_layer(shape, grid, chip, context=256)
    ana = analytic_layer(shape, grid, chip, context=256)
    assert sim.dataflow == pytest.approx(ana["dataflow"], rel=0.10)
    assert sim.messages > grid[0] * grid[1]


def test_simulator_sees_contention():
    designed = simulate_layer(SMALL, (32, 32), WSE2, handoff="rows")
    naive = simulate_layer(SMALL, (32, 32), WSE2, handoff="corner")
    assert naive.stall_cycles > designed.stall_cycles
    assert naive.phases["handoff"] > designed.phases["handoff"] + 100


def test_project_model_is_the_status_bar_figure():
    """engine.projection.project_model: what the server shows, from a loaded model's config."""
    from engine.config import load_config
    from engine.projection import ChipError, project_model

    cfg = load_config(Path(__file__).resolve().parents[2] / "engine" / "models" / "spark-code-mini")
    out = project_model(cfg, chip="wse3", name="spark-code-mini")
    assert out["chip"] == WSE3.name and len(out["grid"]) == 2
    assert out["decode_tok_s"] > 0 and out["ttft_ms"] > 0
    pinned = project_model(cfg, chip="wse3", grid=tuple(out["grid"]))
    assert pinned == {**out, "chip": WSE3.name}
    with pytest.raises(PlacementError):
        project_model(cfg, chip="wse3", grid=(8, 8))  # a layer's weights and KV do not fit 64 PEs
    with pytest.raises(ChipError):
        project_model(cfg, chip="wse9")
