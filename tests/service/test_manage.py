"""`spark-lsp engine list` / `engine stop`: the user's running services, found by their records,
checked as a client would, stopped by SIGTERM, and never a process that merely reuses a pid."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from service_support import run_dir, start_daemon  # noqa: F401 (run_dir: a fixture)

from engine.service import launch, manage, rundir
from spark_lsp.cli import main as cli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_record(key: str, pid: int, models: list[str], **extra) -> None:
    """A record as a daemon writes it, for a process that is no daemon (its URL: nothing)."""
    data = {
        "url": f"ws://127.0.0.1:{free_port()}",
        "token": "t" * 43,
        "pid": pid,
        "started": rundir.process_start(pid),
        "since": time.time(),
        "models": models,
        **extra,
    }
    rundir.write_private(rundir.record_path(key), json.dumps(data))


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


@pytest.mark.slow
def test_list_checks_a_real_daemon_and_stop_ends_it_cleanly(run_dir, capsys):
    proc = start_daemon()
    try:
        key = rundir.model_key(launch.resolve_models([None]))
        for _ in range(2400):
            rec = rundir.read_record(key)
            if rec is not None and rec["pid"] == proc.pid:
                break
            assert proc.poll() is None
            time.sleep(0.05)
        assert rec["started"] == rundir.process_start(proc.pid)

        assert cli(["engine", "list", "--json"]) == 0
        out = capsys.readouterr().out
        (listed,) = json.loads(out)
        assert listed["pid"] == proc.pid and listed["url"] == rec["url"]
        assert listed["answers"] is True and listed["status"]["models"][0]["name"]
        assert rec["token"] not in out  # a listing never shows the secret

        assert cli(["engine", "list"]) == 0
        line = capsys.readouterr().out
        assert f"pid {proc.pid}" in line and "answers in" in line

        assert cli(["engine", "stop"]) == 0  # the only one: no name needed
        assert "stopped" in capsys.readouterr().out
        assert proc.wait(5) == 0  # SIGTERM: a clean exit, its record removed by itself
        assert not rundir.record_path(key).exists()
        assert cli(["engine", "list"]) == 0
        assert "no engine service runs" in capsys.readouterr().out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_silent_service_is_listed_as_not_answering(run_dir, capsys):
    sleeper = child("import time; time.sleep(60)")
    try:
        fake_record("a" * 16, sleeper.pid, ["/models/stuck"])
        assert cli(["engine", "list"]) == 1  # a health check: one service does not answer
        out = capsys.readouterr().out
        assert "stuck" in out and "NOT ANSWERING" in out
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_reused_pid_is_never_signalled(run_dir, capsys):
    """The record's pid now belongs to another process (here: this test's own): stop removes
    the stale record and signals nothing."""
    fake_record("b" * 16, os.getpid(), ["/models/gone"])
    data = json.loads(rundir.record_path("b" * 16).read_text())
    data["started"] -= 1  # the process that wrote it started at another time
    rundir.write_private(rundir.record_path("b" * 16), json.dumps(data))
    assert cli(["engine", "stop", "gone"]) == 0  # we are still here
    assert "record was stale" in capsys.readouterr().out
    assert not rundir.record_path("b" * 16).exists()


def test_stop_names_one_of_several_and_refuses_to_guess(run_dir, capsys):
    a = child("import time; time.sleep(60)")
    b = child("import time; time.sleep(60)")
    try:
        fake_record("c" * 16, a.pid, ["/models/alpha"])
        fake_record("d" * 16, b.pid, ["/models/beta"])
        assert cli(["engine", "stop"]) == 2
        err = capsys.readouterr().err
        assert "several engine services run" in err and "alpha" in err and "beta" in err
        assert err.count("\n") == 1  # one line, as every command's errors
        assert cli(["engine", "stop", "gamma"]) == 2
        assert "no running engine service matches 'gamma'" in capsys.readouterr().err
        assert a.poll() is None and b.poll() is None  # nothing signalled

        assert cli(["engine", "stop", "beta"]) == 0
        assert b.wait(5) == -signal.SIGTERM and a.poll() is None
        assert cli(["engine", "stop", str(a.pid)]) == 0  # by pid
        assert a.wait(5) == -signal.SIGTERM
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_service_that_ignores_sigterm_is_killed_only_with_force(run_dir, capsys):
    stubborn = child(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    try:
        assert stubborn.stdout.readline() == b"ready\n"
        fake_record("e" * 16, stubborn.pid, ["/models/stubborn"])
        assert cli(["engine", "stop", "--timeout", "0.3"]) == 2
        assert "did not stop within 0.3 s" in capsys.readouterr().err
        assert stubborn.poll() is None and rundir.record_path("e" * 16).exists()
        assert cli(["engine", "stop", "--all", "--timeout", "0.3", "--force"]) == 0
        assert "killed" in capsys.readouterr().out
        assert stubborn.wait(5) == -signal.SIGKILL
        assert not rundir.record_path("e" * 16).exists()  # it could not remove its own
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
            stubborn.wait()


def test_select_matches_names_paths_keys_and_urls(tmp_path):
    svc = manage.Service(
        key="f" * 16, pid=1, url="ws://127.0.0.1:9/", models=[str(tmp_path / "qwen")]
    )
    for want in ("qwen", str(tmp_path / "qwen"), "f" * 16, "1", "ws://127.0.0.1:9"):
        assert manage.select([svc], [want], False) == [svc]
    assert manage.select([svc], [], False) == [svc]
    assert manage.select([], [], True) == []
    with pytest.raises(manage.ManageError):
        manage.select([svc], ["qwe"], False)
    # a Hub model: by its name (the repository's), or as it was served, by catalogue name or hf:
    hub = manage.Service(
        key="e" * 16,
        pid=2,
        url="ws://127.0.0.1:8/",
        models=["/c/hub/models--Qwen--Qwen2.5-Coder-0.5B/snapshots/0123abc"],
    )
    for want in ("Qwen2.5-Coder-0.5B", "qwen2.5-coder-0.5b", "hf:Qwen/Qwen2.5-Coder-0.5B"):
        assert manage.select([svc, hub], [want], False) == [hub]
    with pytest.raises(manage.ManageError):
        manage.select([svc, hub], ["qwen2.5-coder-1.5b"], False)


def test_list_asks_services_named_by_url_with_the_token_from_the_environment(
    run_dir, capsys, monkeypatch, tiny_llama, tiny_qwen2
):
    """`engine list URL`: a service that is not one of the user's (a team's daemon), asked with
    $SPARK_LSP_ENGINE_TOKEN as the language server would: the names `model` takes, or why it
    does not answer."""
    from engine import Engine
    from engine.service.local import LocalModels
    from engine.service.server import EngineServer

    token = "s" * 43
    engines = [Engine.load(model_dir=m) for m in (tiny_llama, tiny_qwen2)]
    srv = EngineServer(LocalModels(engines), token=token).open()
    try:
        monkeypatch.setenv(rundir.TOKEN_ENV, token)
        assert cli(["engine", "list", srv.url]) == 0
        out = capsys.readouterr().out
        assert out.startswith("tiny_llama (fp32), tiny_qwen2 (fp32)  " + srv.url), out
        assert "answers in" in out and "pid" not in out
        monkeypatch.setenv(rundir.TOKEN_ENV, "w" * 43)
        assert cli(["engine", "list", "--json", srv.url]) == 1
        (listed,) = json.loads(capsys.readouterr().out)
        assert listed["answers"] is False and "HTTP 401" in listed["problem"]
        assert cli(["engine", "list", f"ws://127.0.0.1:{free_port()}"]) == 1
        assert "NOT ANSWERING: cannot reach" in capsys.readouterr().out
    finally:
        srv.close()
