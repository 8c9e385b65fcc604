"""`spark-lsp bench service --memory`: resident memory (RSS and PSS) of editor sessions sharing one
engine against one in-process language server: 4 servers with `engine: auto` and their daemon,
4 editors' bridges and the session host they share, and that host's sessions on a daemon. Each
session has a document open and one suggestion made, so its KV slot and runs exist."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from engine.service import rundir

from .. import bridge
from ..rpc_client import LspClient, server_cmd
from .trace import source_file

#: The memory comparison's sizes: the bench's model and a real-size one (NAME@PRECISION).
MEMORY_MODELS = "default,synthetic-qwen2.5-coder-0.5b@int4"
MEMORY_MODES = "daemon,host,host-daemon"


def memory_mb(pid: int) -> dict[str, float]:
    """Resident memory of a process, MB: ``rss`` (VmRSS) and ``pss`` (proportional set size,
    /proc/PID/smaps_rollup: a page shared by n processes counts 1/n in each, so the sum over a
    group of processes counts shared libraries once)."""
    out = {"rss": 0.0, "pss": 0.0}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            out["rss"] = int(line.split()[1]) / 1024
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                out["pss"] = int(line.split()[1]) / 1024
    except OSError:  # no smaps_rollup (an old kernel): PSS unknown
        out["pss"] = float("nan")
    return out


def maps_onnxruntime(pid: int) -> bool:
    """Whether ONNX Runtime is loaded in process `pid` (a thin language server must not be)."""
    return "onnxruntime" in Path(f"/proc/{pid}/maps").read_text()


def bridge_cmd(model: str | None) -> list[str]:
    """What an editor runs to share the session host: `spark-lsp serve --stdio --shared`."""
    cmd = [sys.executable, "-m", "spark_lsp.cli", "serve", "--stdio", "--shared"]
    return cmd + (["--model", model] if model else [])


def _server(model: str | None, options: dict, uri: str, text: str, cmd: list[str] | None = None):
    client = LspClient(cmd or server_cmd(model))
    try:
        client.initialize({"tunePrecision": False, "liveEdits": False, **options})
        client.wait_ready(timeout=900)
        client.open(uri, text)
        client.inline(uri, len(text)).result(300)  # a suggestion: its KV slot and runs are made
        engine = (client.call("spark/metrics", {}, 30) or {}).get("engine") or {}
    except BaseException:
        client.shutdown()
        raise
    return client, engine


@contextlib.contextmanager
def _private_run_dir():
    """A runtime directory of this run only (the daemons' and the session host's records and
    sockets: `rundir` and `bridge` read the same variable), not the user's; short, for the
    host's Unix socket path."""
    with tempfile.TemporaryDirectory(prefix="spark-") as run_dir:
        old = os.environ.get(rundir.ENV_DIR)
        os.environ[rundir.ENV_DIR] = run_dir
        try:
            yield run_dir
        finally:
            if old is None:
                os.environ.pop(rundir.ENV_DIR, None)
            else:
                os.environ[rundir.ENV_DIR] = old


def _daemon_records(run_dir: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in Path(run_dir).glob("engine-*.json")]


def _on_one_daemon(recs: list[dict], engines: list[dict]) -> bool:
    """Whether one daemon runs and every server's engine (`spark/metrics`) is a daemon."""
    return len(recs) == 1 and all(str(e.get("engine", "")).startswith("ws://") for e in engines)


def _stop_daemons(recs: list[dict]) -> None:
    for r in recs:
        try:
            os.kill(r["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass


def _sum(parts: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(p[k] for p in parts) for k in ("rss", "pss")}


def run_memory(
    model: str | None,
    precision: str | None,
    text: str,
    sessions: int = 4,
    modes: tuple[str, ...] = tuple(MEMORY_MODES.split(",")),
) -> dict:
    """Resident memory of one in-process language server vs `sessions` language servers with
    `engine: auto` and the one daemon they share (mode `daemon`), vs `sessions` editors'
    bridges and the one session host they share (mode `host`), and vs the bridges, the host and
    the daemon its sessions use with `engine: auto` (mode `host-daemon`), each session with a
    document open and one suggestion made."""
    from engine.lab.models import SYNTHETIC, synthetic_model

    if model in SYNTHETIC:  # written once into the bench cache, then served as a folder
        model = str(synthetic_model(model))
    options = {"precision": precision} if precision else {}
    local, _ = _server(model, options, "file:///bench/local.py", text)
    try:
        one = memory_mb(local.proc.pid)
    finally:
        local.shutdown()
    out: dict[str, Any] = {
        "model": Path(model).name if model else "default",
        "precision": precision or "default",
        "sessions": sessions,
        "one_inproc_server_mb": one,
    }
    if "daemon" in modes:
        out.update(_memory_daemon(model, options, text, sessions, one))
    if "host" in modes:
        out["host"] = _memory_host(model, options, text, sessions, one)
    if "host-daemon" in modes:
        out["host_daemon"] = _memory_host(model, options, text, sessions, one, daemon=True)
    return out


def _memory_daemon(
    model: str | None, options: dict, text: str, sessions: int, one: dict[str, float]
) -> dict:
    """`sessions` language servers with `engine: auto` and their daemon."""
    with _private_run_dir() as run_dir:
        clients, recs = [], []
        try:
            engines = []
            for i in range(sessions):
                client, engine = _server(
                    model, {**options, "engine": "auto"}, f"file:///bench/s{i}.py", text
                )
                clients.append(client)
                engines.append(engine)
            recs = _daemon_records(run_dir)
            if not _on_one_daemon(recs, engines):
                raise RuntimeError(
                    f"the {sessions} servers did not share one daemon: {len(recs)} daemon(s), "
                    f"engines {[e.get('engine') for e in engines]}"
                )
            servers = [memory_mb(c.proc.pid) for c in clients]
            thin = not any(maps_onnxruntime(c.proc.pid) for c in clients)
            daemon = memory_mb(recs[0]["pid"])
        finally:
            for c in clients:
                c.shutdown()
            _stop_daemons(recs)
    total = _sum([*servers, daemon])
    return {
        "session_servers_mb": servers,
        "daemon_mb": daemon,
        "shared_total_mb": total,
        "ratio_rss": total["rss"] / one["rss"] if one["rss"] else None,
        "ratio_pss": total["pss"] / one["pss"] if one["pss"] else None,
        "thin_servers_without_onnxruntime": thin,
    }


def _memory_host(
    model: str | None,
    options: dict,
    text: str,
    sessions: int,
    one: dict[str, float],
    daemon: bool = False,
) -> dict:
    """`sessions` editors' bridges (`serve --stdio --shared`) and the session host they share
    (the first bridge starts it; the bench checks that every session runs in it and that they
    share one engine); with `daemon`, the sessions use `engine: auto`, so that engine is the
    daemon the first one starts (and its memory is counted)."""
    if daemon:
        options = {**options, "engine": "auto"}
    with _private_run_dir() as run_dir:
        clients, host_pid, recs, parts = [], None, [], []
        try:
            hosts, engines = [], []
            for i in range(sessions):
                client, engine = _server(
                    model, options, f"file:///bench/h{i}.py", text, cmd=bridge_cmd(model)
                )
                clients.append(client)
                engines.append(engine)
                hosts.append((client.call("spark/metrics", {}, 30) or {}).get("sessionHost"))
            pids = {h.get("pid") if h else None for h in hosts}
            shared = hosts[-1].get("models") if hosts[-1] else None
            recs = _daemon_records(run_dir)
            if daemon:
                one_engine = _on_one_daemon(recs, engines)
            else:
                one_engine = len(shared or []) == 1 and shared[0].get("sessions") == sessions
            if len(pids) != 1 or None in pids or not one_engine:
                raise RuntimeError(
                    f"the {sessions} sessions did not share one host and one engine: {hosts}, "
                    f"{len(recs)} daemon(s)"
                )
            host_pid = pids.pop()
            bridges = [memory_mb(c.proc.pid) for c in clients]
            host = memory_mb(host_pid)
            parts = [memory_mb(recs[0]["pid"])] if daemon else []
            thin = not any(maps_onnxruntime(c.proc.pid) for c in clients)
        finally:
            for c in clients:
                c.shutdown()
            if host_pid is not None:
                bridge.stop_host(host_pid)
            _stop_daemons(recs)
    total = _sum([*bridges, host, *parts])
    return {
        "bridges_mb": bridges,
        "host_mb": host,
        "daemon_mb": parts[0] if parts else None,
        "shared_models": shared,
        "total_mb": total,
        "ratio_rss": total["rss"] / one["rss"] if one["rss"] else None,
        "ratio_pss": total["pss"] / one["pss"] if one["pss"] else None,
        "bridges_without_onnxruntime": thin,
    }


def run_memories(args) -> dict:
    """`run_memory` at each of ``--memory-models`` (``default``: the bench's ``--model``)."""
    path = source_file(args.file)
    text = path.read_text(encoding="utf-8")[:4000]
    out = {}
    for spec in (m.strip() for m in args.memory_models.split(",")):
        if not spec:
            continue
        name, _, precision = spec.partition("@")
        model = args.model if name == "default" else name
        modes = tuple(m.strip() for m in args.memory_modes.split(",") if m.strip())
        out[spec] = run_memory(model, precision or None, text, modes=modes)
    return out
