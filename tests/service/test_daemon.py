"""The engine daemon as a process: its private record, token, SIGTERM, and join-or-start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import subprocess
import time

import pytest
from service_support import run_dir, start_daemon  # noqa: F401 (run_dir: a fixture)

from engine import GenerationParams
from engine.models import default_model_dir
from engine.service import launch, rundir
from engine.service.client import EngineClient
from engine.service.client_core import EngineUnavailable


def wait_record(key: str, proc: subprocess.Popen, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = rundir.read_record(key)
        if rec is not None and rec["pid"] == proc.pid:
            return rec
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
        time.sleep(0.05)
    raise AssertionError("the daemon wrote no record")


@pytest.mark.slow
def test_daemon_record_token_and_clean_sigterm(run_dir):
    proc = start_daemon()
    try:
        key = rundir.model_key(launch.resolve_models([None]))
        rec = wait_record(key, proc)
        path = rundir.record_path(key)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        assert rec["url"].startswith("ws://127.0.0.1:") and len(rec["token"]) >= 32

        async def scenario():
            with pytest.raises(EngineUnavailable, match="401"):
                await EngineClient.connect(rec["url"], "not-the-token-not-the-token")
            c = await EngineClient.connect(rec["url"], rec["token"])
            gen = await c.generate(
                "def main():\n", GenerationParams(max_new_tokens=1500, ignore_eos=True), slot="d"
            )
            async for _ in gen:
                break
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(gen.wait(), 30)
            await c.close()
            return gen

        gen = asyncio.run(scenario())
        assert (
            gen.finish_reason == "cancelled"
        )  # in flight at SIGTERM: cancelled, its done delivered
        assert proc.wait(30) == 0
        assert not path.exists()
        log = proc.stderr.read().decode()
        assert "connected" in log and "stopped" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_client_with_a_keepalive_gives_up_a_service_that_stops_answering(run_dir):
    """A service that stops answering without closing its socket (here a stopped process; a
    machine gone from the network alike): a client with ``keepalive_s`` ends the generations on
    it (``disconnected``) within two of those; the protocol's default pings would wait 80 s."""
    from engine.service.client_core import DISCONNECTED

    proc = start_daemon()
    try:
        rec = wait_record(rundir.model_key(launch.resolve_models([None])), proc)

        async def scenario():
            c = await EngineClient.connect(rec["url"], rec["token"], keepalive_s=0.5)
            params = GenerationParams(max_new_tokens=1900, ignore_eos=True)
            gen = await c.generate("def main():\n", params, slot="k")
            async for _ in gen:
                break
            proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            await asyncio.wait_for(gen.wait(), 30)
            waited = time.monotonic() - t0
            await c.close()
            return gen, waited

        gen, waited = asyncio.run(scenario())
        assert gen.finish_reason == "error" and gen.error["code"] == DISCONNECTED, gen.error
        assert waited < 5.0
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_non_loopback_bind_needs_allow_remote(run_dir):
    proc = start_daemon("--ws", "0.0.0.0:0")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert b"--allow-remote" in err


@pytest.mark.slow
def test_join_or_start_starts_one_detached_daemon_and_joins_it(run_dir):
    rec = launch.join_or_start(None, idle_exit_s=120)
    try:
        again = launch.join_or_start(None)
        assert again["pid"] == rec["pid"] and again["token"] == rec["token"]

        async def use():
            c = await EngineClient.connect(rec["url"], rec["token"])
            g = await (await c.generate("x = ", GenerationParams(max_new_tokens=3))).wait()
            await c.close()
            return g

        assert asyncio.run(use()).finish_reason in ("length", "eos")
    finally:
        os.kill(rec["pid"], signal.SIGTERM)
        for _ in range(600):  # join_or_start reaps the daemon it started when it exits
            if not rundir.pid_alive(rec["pid"]):
                break
            time.sleep(0.05)
        assert not rundir.pid_alive(rec["pid"])
    assert rundir.read_record(rundir.model_key(launch.resolve_models([None]))) is None


def test_daemon_engines_do_not_spin_unless_asked():
    """A daemon's event loop writes every token and reads every cancel between steps: its ONNX
    Runtime threads must not spin by default (`--spinning off`), and `auto` keeps the in-process
    behaviour (a spinning decode session for small models while the CPU is calm)."""
    import argparse

    from engine.service.daemon import load_engines
    from engine.service.options import SPINNING, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).spinning == "off"
    (eng,) = load_engines([default_model_dir()], slots=1, spinning=SPINNING["off"])
    rt = eng.runtime
    assert rt.calm is rt.busy and not rt.busy.spinning
    (eng,) = load_engines([default_model_dir()], slots=1, spinning=SPINNING["auto"])
    assert eng.runtime.calm.spinning  # the bundled model is small: a spinning calm session


@pytest.mark.parametrize(
    "args,said",
    [
        (["--idle-exit", "-1"], "argument --idle-exit: must be above 0 seconds"),  # exited at once
        (["--idle-exit", "0"], "argument --idle-exit: must be above 0 seconds"),
        # Ray's own traceback, after starting a cluster
        (["--replicas", "0", "--ray"], "argument --replicas: '0': expected a positive integer"),
        (["--token-file", "/nonexistent/token"], "--token-file /nonexistent/token: No such file"),
    ],
)
def test_engine_serve_refuses_arguments_it_cannot_serve_with(run_dir, capsys, args, said):
    from spark_lsp.cli import main

    with contextlib.suppress(SystemExit):  # argparse's errors exit 2
        assert main(["engine", "serve", *args]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
