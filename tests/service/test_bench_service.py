"""`spark-lsp bench service` runs all three transports on a short trace and reports each."""

import json

import pytest

from spark_lsp import bench_service


@pytest.mark.slow
def test_bench_service_reports_every_transport(capsys):
    assert bench_service.main(["--max-chars", "6", "--max-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["transports"]) == {"inproc", "ws", "sse"}
    n = out["keystrokes"]
    assert n >= 3
    for s in out["transports"].values():
        assert s["keystrokes"] == n
        assert s["suggestion_ms"]["p50"] > 0 and s["first_byte_ms"]["p50"] > 0
        assert 0 < s["prefix_reuse"] <= 1  # the document's slot is reused keystroke after keystroke
    assert out["ws_vs_sse"]["overhead_p50_ratio"] is not None
