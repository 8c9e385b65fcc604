"""`spark-lsp bench service` runs all three transports on a short trace and reports each."""

import json
import sys

import pytest

from spark_lsp.bench import service as bench_service
from spark_lsp.bench import service_memory, service_ray


@pytest.mark.slow
def test_bench_service_reports_every_transport(capsys):
    assert (
        bench_service.main(["--max-chars", "6", "--max-tokens", "4", "--cancels", "3", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert set(out["transports"]) == {"inproc", "ws", "sse"}
    n = out["keystrokes"]
    assert n >= 3
    for s in out["transports"].values():
        assert s["keystrokes"] == n
        assert s["suggestion_ms"]["p50"] > 0 and s["first_byte_ms"]["p50"] > 0
        assert 0 < s["prefix_reuse"] <= 1  # the document's slot is reused keystroke after keystroke
    assert out["ws_vs_sse"]["overhead_p50_ratio"] is not None
    t = out["transports"]
    # after the first keystroke the socket carries prompt deltas, HTTP the whole prompt each time
    assert t["ws"]["request_bytes_mean"] < t["sse"]["request_bytes_mean"] / 2
    for name, key in (
        ("inproc", "cancel_ms"),
        ("ws", "cancel_ms"),
        ("ws", "cancel_engine_ms"),  # the local daemon shares cancel flags and its clock
        ("ws", "cancel_socket_ms"),
    ):
        assert t[name][key]["n"] == 3 and t[name][key]["p50"] > 0  # every cancel stopped it
    assert set(out["load_average"]) == {"before", "after"}


@pytest.mark.slow
def test_bench_service_takes_a_hub_model(capsys, tiny_llama, tmp_path, monkeypatch):
    """`--model hf:ORG/REPO` (or a catalogue name) is resolved once, as `serve` resolves it, and
    every runner (here the daemon) uses that folder."""
    from fake_hub import FakeHub

    with FakeHub() as hub:
        hub.add_folder("test-org/tiny-llama", tiny_llama)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        args = ["--model", "hf:test-org/tiny-llama", "--max-chars", "6", "--max-tokens", "4"]
        assert bench_service.main([*args, "--cancels", "0", "--transports", "ws", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "/models--test-org--tiny-llama/snapshots/" in out["model"]
    assert out["transports"]["ws"]["keystrokes"] == out["keystrokes"] >= 3


@pytest.mark.slow
def test_bench_service_over_tls_labels_wss_and_https_sse(capsys, tmp_path):
    """--tls: the daemon serves wss:// and the endpoint https:// (a throwaway certificate); the
    table and --json name the transports wss and https-sse and keep the ratio lines; --plot
    draws them."""
    args = ["--max-chars", "4", "--max-tokens", "3", "--cancels", "2", "--tls"]
    assert bench_service.main([*args, "--transports", "ws,sse", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tls"] is True and set(out["transports"]) == {"wss", "https-sse"}
    for s in out["transports"].values():
        assert s["keystrokes"] == out["keystrokes"] >= 2 and s["first_byte_ms"]["p50"] > 0
    assert out["ws_vs_sse"]["overhead_p50_ratio"] is not None
    assert out["transports"]["wss"]["cancel_socket_ms"]["n"] == 2
    png = tmp_path / "service.png"
    rc = bench_service.main(
        [*args, "--transports", "wss,https-sse", "--cancels", "0", "--plot", str(png)]
    )
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "wss / https-sse: per-request overhead p50" in table
    assert "\nwss " in table and "\nhttps-sse " in table


@pytest.mark.slow
def test_bench_service_over_an_emulated_link_pays_its_round_trips(capsys):
    """--rtt: ws and sse each behind a link process; the socket's requests pay one round trip,
    a new HTTPS connection per request three (TCP, TLS, the request): lower bounds, by
    construction of the link, not a speed claim."""
    rtt = 40.0
    args = ["--max-chars", "4", "--max-tokens", "3", "--cancels", "2", "--tls", "--rtt", str(rtt)]
    assert bench_service.main([*args, "--transports", "ws,sse", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rtt_ms"] == rtt
    t = out["transports"]
    assert t["wss"]["first_byte_ms"]["p50"] >= rtt
    assert t["https-sse"]["first_byte_ms"]["p50"] >= 3 * rtt
    assert t["wss"]["cancel_socket_ms"]["n"] == 2  # cancels travel the link as well
    assert "cancel_engine_ms" not in t["wss"]  # no cancel flags shared across a "network"


def test_bench_service_tls_says_how_to_install_trustme(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "trustme", None)  # import trustme raises ImportError
    with pytest.raises(SystemExit, match="pip install trustme"):
        bench_service.throwaway_certificate(str(tmp_path))


@pytest.mark.slow
def test_memory_compares_four_thin_servers_sharing_one_daemon_with_one_in_process_server(
    tiny_llama, capsys
):
    text = "import os\n\n\ndef total(xs):\n    s = 0\n    for x in xs:\n        s += x\n" * 20
    m = service_memory.run_memory(str(tiny_llama), None, text, sessions=4)
    # run_memory itself refuses a run where the servers did not all join the one daemon
    assert m["sessions"] == 4 and len(m["session_servers_mb"]) == 4
    assert m["thin_servers_without_onnxruntime"]
    parts = [*m["session_servers_mb"], m["daemon_mb"]]
    for k in ("rss", "pss"):
        assert m["one_inproc_server_mb"][k] > 0
        assert all(p[k] > 0 for p in parts)
        assert m["shared_total_mb"][k] == pytest.approx(sum(p[k] for p in parts))
    assert m["ratio_rss"] == pytest.approx(
        m["shared_total_mb"]["rss"] / m["one_inproc_server_mb"]["rss"]
    )
    # a thin server holds no engine: it is smaller than the server that has one in-process
    assert max(p["rss"] for p in m["session_servers_mb"]) < m["one_inproc_server_mb"]["rss"]
    # mode host: 4 bridges and the one session host they share (run_memory checks one host, one
    # engine used by the 4 sessions)
    h = m["host"]
    assert len(h["bridges_mb"]) == 4 and h["bridges_without_onnxruntime"]
    assert h["shared_models"][0]["sessions"] == 4
    for k in ("rss", "pss"):
        assert h["total_mb"][k] == pytest.approx(
            sum(p[k] for p in [*h["bridges_mb"], h["host_mb"]])
        )
        # a bridge is Python alone: far smaller than a thin server (pygls, the tokenizer)
        assert max(p[k] for p in h["bridges_mb"]) < min(p[k] for p in m["session_servers_mb"]) / 2
    assert h["ratio_rss"] < m["ratio_rss"]  # the point of it
    # mode host-daemon: the bridges, their host, and the daemon the host's sessions joined
    # (run_memory checks one host, and one daemon every session's engine is)
    hd = m["host_daemon"]
    assert len(hd["bridges_mb"]) == 4 and hd["daemon_mb"]["rss"] > 0
    for k in ("rss", "pss"):
        assert hd["total_mb"][k] == pytest.approx(
            sum(p[k] for p in [*hd["bridges_mb"], hd["host_mb"], hd["daemon_mb"]])
        )
    assert hd["ratio_rss"] < m["ratio_rss"]  # 4 thin sessions in one process, not 4 processes
    # and the table prints each mode's line
    bench_service.print_table(
        {"keystrokes": 0, "max_tokens": 0, "transports": {}, "memory": {"m": m}}
    )
    out = capsys.readouterr().out
    assert "4 servers sharing one daemon" in out
    assert "4 bridges sharing a session host RSS" in out
    assert "4 bridges sharing a session host + daemon" in out


@pytest.mark.slow
def test_bench_service_ray_runs_every_part_on_a_local_cluster():
    """--ray end to end on a short trace (in its own process: the bench starts and stops its own
    Ray cluster): 1 and 2 replicas for each K, the proxy run, a replica killed with nothing lost,
    and the scale-out comparison's three deployments taking turns for every round."""
    pytest.importorskip(
        "ray", reason="the Ray bench needs the 'ray' extra (part of the test extra)"
    )
    import subprocess

    args = ["--transports", "inproc", "--cancels", "0", "--max-chars", "4", "--max-tokens", "3"]
    run = subprocess.run(
        [sys.executable, "-m", "spark_lsp.cli", "bench", "service", *args, "--ray"]
        + ["--editors", "1,2", "--rounds", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ray = json.loads(run.stdout)["ray"]
    n = json.loads(run.stdout)["keystrokes"]
    assert set(ray["runs"]) == {
        "replicas=1,editors=1",
        "replicas=1,editors=2",
        "replicas=2,editors=1",
        "replicas=2,editors=2",
        "replicas=2,editors=2,proxy",
    }
    # the documents of each run spread with those placed before them (the warm-ups, K = 1's), so
    # 2 editors may share a replica; every document is counted on one
    two = ray["runs"]["replicas=2,editors=2"]
    assert sum(x["documents"] for x in two["per_replica"]) == 2 and two["replicas_used"] >= 1
    assert ray["replica_kill"]["all_answered_or_cancelled"] is True
    # the ingress through Serve's handles (no replica sockets) beside the sockets, in turns
    svh = ray["sockets_vs_handles"]
    assert svh["editors"] == 2 and len(svh["per_round"]) == 2 and svh["overhead_p50"] > 0
    for arm in svh["runs"].values():
        assert arm["outcomes"]["answered"] == arm["keystrokes"] == 2 * 2 * n
    so = ray["scale_out"]
    assert so["editors"] == [1, 2] and so["rounds"] == 2 and len(so["per_round"]) == 2
    assert so["p95_2_replicas_over_1"] > 0
    assert {a: s["keystrokes"] for a, s in so["runs"].items()} == {
        "one": 2 * n,  # one editor, two rounds
        "two": 2 * 2 * n,
        "one_share": 2 * n,
    }


def test_ray_summary_counts_every_outcome_and_the_reuse_after_each_first_request(capsys):
    def row(finish, prompt, reused, ms=10.0, replica="h:1", restarts=0, document="a"):
        return {
            "document": document,
            "finish": finish,
            "prompt_tokens": prompt,
            "reused_tokens": reused,
            "suggestion_ms": ms,
            "first_byte_ms": ms / 2,
            "ttft_ms": 1.0,
            "overhead_ms": ms / 2 - 1.0,
            "replica": replica,
            "restarts": restarts,
        }

    # two editors of three keystrokes each: the first row of each is the document's cold request
    rows = [
        row("length", 100, 0),
        row("length", 101, 99),
        row("cancelled", 102, 100, replica="h:2", restarts=1),
        row("length", 100, 0, ms=30.0, replica="h:2", document="b"),
        {"finish": "hung", "suggestion_ms": 120_000.0, "replica": None, "restarts": 0},
        row("error", 102, 0, ms=50.0, replica="h:2", document="b"),
    ]
    s = service_ray.ray_summary(rows, per_editor=3, lag_ms=[0.1, 0.2, 0.3, 0.4, 2.0])
    assert s["client_lag_ms"]["p50"] == pytest.approx(0.3)
    assert "client_lag_ms" not in service_ray.ray_summary(rows, per_editor=3)
    assert s["outcomes"] == {"answered": 3, "cancelled": 1, "error": 1, "hung": 1, "restarted": 1}
    assert s["prefix_reuse"] == pytest.approx(199 / 505)  # the hung one has no stats
    assert s["prefix_reuse_after_first"] == pytest.approx(199 / 305)
    # the hung one counts in the tail: 75 % of the way from the fifth (50 ms) to it
    assert s["suggestion_ms"]["p95_all"] == pytest.approx(50.0 + (120_000.0 - 50.0) * 0.75)
    assert s["replicas_used"] == 2
    # document "a" lives on h:1 (two of its three suggestions), "b" on h:2
    assert s["per_replica"] == [
        {"replica": "h:1", "documents": 1, "suggestion_ms": {"p50": 10.0, "p95": 10.0}},
        {"replica": "h:2", "documents": 1, "suggestion_ms": {"p50": 30.0, "p95": 48.0}},
    ]
    runs = {"replicas=2,editors=2": s, "replicas=1,editors=1": s}
    bench_service.print_table(
        {
            "keystrokes": 6,
            "max_tokens": 4,
            "transports": {},
            "ray": {
                "cpus": 2,
                "threads": {1: 2, 2: 1},
                "slots_per_replica": 4,
                "runs": runs,
                "scale_out": {
                    "editors": [1, 2],
                    "rounds": 2,
                    "per_round": [
                        {
                            "p95_2_replicas_over_1": 1.4,
                            "p95_2_replicas_over_1_same_cores_per_replica": 1.1,
                        },
                        {
                            "p95_2_replicas_over_1": 1.6,
                            "p95_2_replicas_over_1_same_cores_per_replica": 1.3,
                        },
                    ],
                    "p95_2_replicas_over_1": 1.5,
                    "p95_2_replicas_over_1_same_cores_per_replica": 1.2,
                    "runs": {"one": s, "two": s, "one_share": s},
                },
                "sockets_vs_handles": {
                    "editors": 2,
                    "rounds": 2,
                    "overhead_p50": 0.3,
                    "suggestion_p50": 0.7,
                    "suggestion_p95": 0.6,
                },
                "direct_vs_proxy": {
                    "editors": 2,
                    "overhead_p50": 0.25,
                    "suggestion_p50": 0.8,
                    "suggestion_p95": 0.9,
                },
                "replica_kill": {"editors": 2, "killed": None, **s},
            },
        }
    )
    out = capsys.readouterr().out
    assert "ray replicas=2,editors=2" in out and "x1.50" in out and "x1.20" in out
    assert "median of 2 rounds taking turns" in out and "rounds 1.40, 1.60" in out
    assert "ray scale-out one_share" in out and "the editors' event loop late p50 0.30" in out
    assert "proxy: overhead p50 x0.25, suggest p50 x0.80, p95 x0.90" in out
    assert (
        "sockets vs through Serve's handles, median of 2 rounds taking turns: overhead p50 x0.30"
        in out
    )
    assert "answered 3, cancelled 1, error 1, hung 1, restarted 1" in out


def test_a_failed_run_shows_the_daemons_log(tmp_path, capsys):
    """The daemon's warnings go to a file in the run's directory, which is gone after the run:
    when the run fails, its last lines go to stderr; a run that succeeds prints nothing."""
    bench_service.daemon_log(str(tmp_path)).write_text(
        "".join(f"line {i}\n" for i in range(50)) + "engine: TLS handshake with ? failed\n"
    )
    assert bench_service._show_daemon_log(str(tmp_path), None, None, None) is False
    assert capsys.readouterr().err == ""
    err = RuntimeError("cannot reach")
    assert bench_service._show_daemon_log(str(tmp_path), RuntimeError, err, None) is False
    shown = capsys.readouterr().err
    assert "the engine daemon's log" in shown and "TLS handshake with ? failed" in shown
    assert "line 49" in shown and "line 5\n" not in shown  # the last lines only


@pytest.mark.parametrize("spinning", ["off", "on", "auto"])
def test_the_daemon_and_the_sse_endpoint_spin_alike(monkeypatch, tmp_path, spinning):
    """Both transports' engines get the run's --spinning (the SSE endpoint's own default is
    auto, the daemon's off: compared with their defaults, the two would differ by more than
    their transports)."""
    started: list[list[str]] = []

    class Stop(Exception):
        pass

    def popen(cmd, **kw):
        started.append(cmd)
        raise Stop

    monkeypatch.setattr(bench_service.subprocess, "Popen", popen)
    with pytest.raises(Stop):
        bench_service.start_daemon(None, str(tmp_path), None, spinning)
    with pytest.raises(Stop):
        bench_service.start_sse(None, None, spinning)
    for cmd in started:
        assert cmd[cmd.index("--spinning") + 1] == spinning
    assert bench_service.DEFAULT_SPINNING == "off"  # the daemon's own default, measured by default


def test_the_sse_endpoint_refuses_an_unknown_spinning():
    from engine.service import sse

    with pytest.raises(SystemExit):
        sse.main(["--spinning", "sometimes"])


def test_percentiles_interpolate_between_ranks_as_numpy_does():
    import numpy as np

    from spark_lsp.bench.stats import pct

    xs = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.0]
    for q in (0.0, 0.25, 0.5, 0.9, 0.95, 1.0):
        assert pct(xs, q) == pytest.approx(float(np.percentile(xs, q * 100)))
    assert pct([], 0.5) is None and pct([3.0], 0.95) == 3.0
    from spark_lsp.status import Metrics  # the server's metrics report the same percentile

    snap = Metrics().snapshot(xs)
    assert snap["cancelLatencyMsP95"] == round(float(np.percentile(xs, 95)), 3)
    assert snap["cancelLatencyMsMedian"] == 4.0
