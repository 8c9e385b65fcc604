"""`spark-lsp bench robustness`: fuzz, load, lifecycle and fault scenarios against a real server.

Each scenario starts `spark-lsp serve --stdio` as an editor does, attacks or loads it, and then
checks that the next ordinary request is answered correctly. It prints one table: whether each
scenario held, the slowest answer after its burst, and the server's peak and final memory (RSS,
from /proc). `--quick` is the short form CI runs; the default is the long form (10 s bursts, a
longer typing replay). Correctness of every piece is asserted by the tests; this command gives the
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..rpc_client import LspClient, RpcError, server_cmd

LINE = "    total = compute(values, factor) + offset  # running sum\n"
FUNC = "def scale(values, factor):\n    out = []\n    for v in values:\n        out.append(v * factor)\n    return out\n\n\n"
OPTIONS = {"contextTokens": 256, "maxTokens": 8, "liveEdits": False}


def _rss_mb(pid: int) -> tuple[float | None, float | None]:
    """(current RSS, peak RSS) of a process in MB, from /proc (None elsewhere)."""
    try:
        fields = dict(
            line.split(":", 1)
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if ":" in line
        )
    except OSError:
        return None, None

    def mb(key: str) -> float | None:
        v = fields.get(key)
        return round(int(v.split()[0]) / 1024, 1) if v else None

    return mb("VmRSS"), mb("VmHWM")


class Scenario:
    def __init__(self, name: str) -> None:
        self.name, self.held, self.slowest_ms, self.note = name, False, None, ""
        self.peak_mb = self.final_mb = None

    def row(self) -> dict:
        return {
            "scenario": self.name,
            "held": self.held,
            "slowest_ms": self.slowest_ms,
            "peak_rss_mb": self.peak_mb,
            "final_rss_mb": self.final_mb,
            "note": self.note,
        }


def _start(model: str | None, env: dict | None = None, process_id: int | None = None) -> LspClient:
    c = LspClient(server_cmd(model), env=env, stderr=subprocess.DEVNULL)
    c.call(
        "initialize",
        {
            "processId": process_id if process_id is not None else os.getpid(),
            "rootUri": None,
            "capabilities": {},
            "initializationOptions": OPTIONS,
        },
        120,
    )
    c.notify("initialized", {})
    c.wait_ready()
    return c


def _timed(fut, timeout: float = 120.0) -> tuple[float, object]:
    t0 = time.perf_counter()
    try:
        res = fut.result(timeout)
    except RpcError as exc:
        res = exc
    return (time.perf_counter() - t0) * 1e3, res


def _answered(c: LspClient, uri: str, offset: int) -> tuple[bool, float]:
    """An ordinary completion request after the scenario: (answered with a list, ms)."""
    fut = c.inline(uri, offset)
    ms, res = _timed(fut)
    latency = getattr(fut, "latency_ms", None) or ms
    return isinstance(res, dict) and "items" in res, round(latency, 1)


def _finish(s: Scenario, c: LspClient, peak_before: float | None = None) -> None:
    s.final_mb, s.peak_mb = _rss_mb(c.proc.pid)
    c.shutdown()
    s.held = s.held and c.proc.returncode == 0


# -- scenarios ------------------------------------------------------------------------------------
def fuzz(model, quick: bool) -> Scenario:
    s = Scenario("fuzz: random and malformed messages")
    rng = random.Random(1234)
    n = 500 if quick else 5000
    c = _start(model)
    uri = "file:///bench/fuzz.py"
    c.open(uri, FUNC * 20)
    methods = [
        "textDocument/inlineCompletion",
        "textDocument/codeAction",
        "codeAction/resolve",
        "workspace/executeCommand",
        "textDocument/didChange",
        "textDocument/didOpen",
        "spark/metrics",
        "workspace/didChangeConfiguration",
        "$/cancelRequest",
        "nope/nope",
        "initialize",
    ]
    values = [
        None,
        True,
        -1,
        2**63,
        1.5,
        "",
        "x" * 100,
        [],
        {},
        [1, {"a": None}],
        {"line": -1, "character": "a"},
    ]
    for i in range(n):
        kind = rng.random()
        if kind < 0.2:
            c.send_raw(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40))))
        elif kind < 0.35:
            c.send_raw(json.dumps(rng.choice(values)).encode())
        else:
            msg = {
                "jsonrpc": "2.0",
                "method": rng.choice(methods),
                "params": {
                    "textDocument": {"uri": rng.choice([uri, "file:///x.py", 5])},
                    "position": {
                        "line": rng.choice([0, 3, -1, 10**9]),
                        "character": rng.choice(values),
                    },
                    "range": rng.choice(values),
                    "command": rng.choice(["spark.toggle", "spark.configure"]),
                    "arguments": [rng.choice(values)],
                    "settings": rng.choice(values),
                    "contentChanges": [{"text": "x", "range": rng.choice(values)}],
                },
            }
            if kind < 0.7:
                msg["id"] = f"fuzz-{i}"
            c.send_raw(json.dumps(msg).encode())
    c.call("workspace/executeCommand", {"command": "spark.toggle", "arguments": [True]}, 60)
    c.call("workspace/executeCommand", {"command": "spark.configure", "arguments": [OPTIONS]}, 60)
    c.open(uri, FUNC * 20)
    s.held, s.slowest_ms = _answered(c, uri, len(FUNC) * 10 - 1)
    s.note = f"{n} messages"
    _finish(s, c)
    return s


def large_file(model, quick: bool, size_mb: float, name: str, one_line: bool = False) -> Scenario:
    s = Scenario(name)
    c = _start(model)
    small = "file:///bench/small.py"
    c.open(small, FUNC * 20)
    _, base = _answered(c, small, len(FUNC) * 10 - 1)
    uri = "file:///bench/large.py"
    text = (
        ("x = " + "1 + " * int(size_mb * 1e6 / 4) + "\n")
        if one_line
        else (
            LINE * int(size_mb * 1e6 / len(LINE))
            if name.startswith("10 MB")
            else "    x += 1\n" * 200_000
        )
    )
    c.open(uri, text)
    ok1, t_end = _answered(c, uri, len(text) - 1)
    ok2, t_mid = _answered(c, uri, len(text) // 2)
    # typing at the end: each keystroke a didChange and a completion, as an editor sends them
    worst = 0.0
    offset = len(text) - 1
    for ch in "total = 0":
        offset = c.type_text(uri, offset, ch)
        ok, ms = _answered(c, uri, offset)
        worst = max(worst, ms)
        ok1 = ok1 and ok
    s.held = ok1 and ok2
    s.slowest_ms = max(t_end, t_mid, worst)
    s.note = f"{len(text) / 1e6:.1f} MB; small-file answer {base} ms"
    _finish(s, c)
    return s


def burst(model, quick: bool) -> Scenario:
    s = Scenario("burst: 1,000 didChange/s with completions")
    seconds = 3 if quick else 10
    c = _start(model)
    uri = "file:///bench/burst.py"
    c.open(uri, FUNC * 40)
    offset = len(FUNC) * 20 - 1
    pending = None
    sent = 0
    t_start = time.perf_counter()
    t_end = t_start + seconds
    while time.perf_counter() < t_end:
        offset = c.type_text(uri, offset, "ab"[sent % 2])
        sent += 1
        if sent % 20 == 0:
            if pending is not None and not pending.done():
                c.cancel(pending)
            pending = c.inline(uri, offset)
        ahead = t_start + sent / 1000 - time.perf_counter()  # paced on the clock: 1,000 a second
        if ahead > 0:
            time.sleep(ahead)
    s.held, s.slowest_ms = _answered(c, uri, offset)
    s.note = f"{sent} changes in {seconds} s; answer after the burst"
    _finish(s, c)
    return s


def many_documents(model, quick: bool) -> Scenario:
    s = Scenario("500 open documents")
    c = _start(model)
    for i in range(500):
        c.open(f"file:///bench/doc{i}.py", FUNC * 12)
    s.held, s.slowest_ms = _answered(c, "file:///bench/doc499.py", len(FUNC) * 6 - 1)
    _finish(s, c)
    return s


def cancelled(model, quick: bool) -> Scenario:
    s = Scenario("5,000 requests each cancelled at once")
    c = _start(model)
    uri = "file:///bench/cancel.py"
    c.open(uri, FUNC * 20)
    futs = []
    for _ in range(5000):
        f = c.inline(uri, len(FUNC) * 10 - 1, trigger=1)
        c.cancel(f)
        futs.append(f)
    done = 0
    for f in futs:
        try:
            f.result(120)
        except RpcError:
            pass
        except Exception:
            continue
        done += 1
    ok, ms = _answered(c, uri, len(FUNC) * 10 - 1)
    s.held, s.slowest_ms = ok and done == len(futs), ms
    s.note = f"{done}/5000 answered (result or -32800)"
    _finish(s, c)
    return s


def replay(model, quick: bool, minutes: float) -> Scenario:
    s = Scenario("typing replay: memory over time")
    c = _start(model)
    uri = "file:///bench/replay.py"
    c.open(uri, FUNC * 30)
    start_mb, _ = _rss_mb(c.proc.pid)
    offset = len(FUNC) * 15 - 1
    t_end = time.perf_counter() + minutes * 60
    keys = 0
    worst = 0.0
    pending = None
    ok = True
    while time.perf_counter() < t_end:
        word = f"value_{keys % 97} "
        for ch in word:
            offset = c.type_text(uri, offset, ch)
            if pending is not None and not pending.done():
                c.cancel(pending)
            pending = c.inline(uri, offset)
            keys += 1
            time.sleep(0.01)
        ok_, ms = _answered(c, uri, offset)
        ok, worst = ok and ok_, max(worst, ms)
        # the word is deleted again, so the document does not grow: memory should not either
        start_pos, end_pos = c.position(uri, offset - len(word)), c.position(uri, offset)
        c.edit(uri, [({"start": start_pos, "end": end_pos}, "")])
        offset -= len(word)
    s.held, s.slowest_ms = ok, worst
    s.final_mb, s.peak_mb = _rss_mb(c.proc.pid)
    s.note = f"{keys} keystrokes in {minutes:g} min; RSS {start_mb} -> {s.final_mb} MB"
    c.shutdown()
    s.held = s.held and c.proc.returncode == 0
    return s


def lifecycle(model, quick: bool) -> Scenario:
    s = Scenario("lifecycle: exit codes, stdin, parent, SIGTERM")
    results = {}
    c = _start(model)
    c.call("shutdown", None)
    c.notify("exit", None)
    results["shutdown+exit=0"] = c.proc.wait(30) == 0
    c = _start(model)
    c.notify("exit", None)
    results["exit=1"] = c.proc.wait(30) == 1
    c = _start(model)
    t0 = time.perf_counter()
    c.proc.stdin.close()
    c.proc.wait(30)
    results["stdin closed"] = True
    stdin_s = time.perf_counter() - t0
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    c = _start(model, process_id=parent.pid)
    parent.kill()
    parent.wait()
    t0 = time.perf_counter()
    c.proc.wait(30)
    results["parent gone"] = True
    parent_s = time.perf_counter() - t0
    c = _start(model)
    uri = "file:///bench/term.py"
    c.open(uri, FUNC * 20)
    c.call(
        "workspace/executeCommand",
        {"command": "spark.configure", "arguments": [{"maxTokens": 2048}]},
    )
    c.inline(uri, len(FUNC) * 10 - 1, trigger=1)
    c.proc.send_signal(signal.SIGTERM)
    results["SIGTERM=0"] = c.proc.wait(30) == 0
    s.held = all(results.values())
    s.note = (
        f"{sum(results.values())}/{len(results)}; exit after stdin closed {stdin_s:.1f} s, "
        f"after the parent died {parent_s:.1f} s"
    )
    return s


def faults(model, quick: bool) -> Scenario:
    """A damaged graph cache, and a model folder broken while the server runs."""
    s = Scenario("faults: damaged cache, broken model folder")
    if model is None:
        s.note = "needs --model DIR (a folder it can copy)"
        return s
    tmp = Path(tempfile.mkdtemp(prefix="spark-bench-faults-"))
    try:
        folder = tmp / "model"
        shutil.copytree(model, folder)
        env = {"SPARK_LSP_CACHE": str(tmp / "cache")}
        c = _start(str(folder), env=env)
        c.shutdown()
        entries = [
            p for p in (tmp / "cache" / "graphs").glob("*") if (p / "model.onnx.data").is_file()
        ]
        for entry in entries:  # a crash of the machine left half a file
            data = entry / "model.onnx.data"
            with open(data, "r+b") as f:
                f.truncate(data.stat().st_size // 2)
        c = _start(str(folder), env=env)
        uri = "file:///bench/faults.py"
        c.open(uri, FUNC * 20)
        ok_cache, ms1 = _answered(c, uri, len(FUNC) * 10 - 1)
        # the model folder breaks while the server runs; a reload must fail clearly, not kill it
        for f in folder.iterdir():
            if f.suffix in (".safetensors", ".json", ".gguf"):
                f.write_bytes(b"")
        err = None
        try:
            c.call(
                "workspace/executeCommand",
                {"command": "spark.configure", "arguments": [{"precision": "fp32"}]},
            )
            c.wait_notification("window/showMessage", timeout=60)
            err = "shown"
        except Exception as exc:
            err = f"no message ({exc})"
        alive = c.call("spark/metrics", {}, 30) is not None
        s.held = ok_cache and alive and err == "shown"
        s.slowest_ms = ms1
        s.note = f"{len(entries)} cache entr{'y' if len(entries) == 1 else 'ies'} truncated; broken folder: {err}"
        _finish(s, c)
        s.held = s.held and alive
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return s


def run(args) -> int:
    model = os.path.abspath(args.model) if args.model else None
    quick = args.quick
    plan = [
        ("fuzz", lambda: fuzz(model, quick)),
        ("10mb", lambda: large_file(model, quick, 10, "10 MB file")),
        ("line", lambda: large_file(model, quick, 1, "1 MB single line", one_line=True)),
        ("200k", lambda: large_file(model, quick, 0, "200,000-line file")),
        ("burst", lambda: burst(model, quick)),
        ("docs", lambda: many_documents(model, quick)),
        ("cancel", lambda: cancelled(model, quick)),
        ("lifecycle", lambda: lifecycle(model, quick)),
        ("faults", lambda: faults(model, quick)),
        ("replay", lambda: replay(model, quick, args.replay_minutes or (0.5 if quick else 30))),
    ]
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for key, fn in plan:
        if only and key not in only:
            continue
        try:
            sc = fn()
        except Exception as exc:  # noqa: BLE001 (a scenario that breaks is reported as not held)
            sc = Scenario(key)
            sc.note = f"error: {type(exc).__name__}: {exc}"[:200]
        rows.append(sc.row())
        if not args.json:
            print(f"  {sc.name}: {'held' if sc.held else 'NOT HELD'}", file=sys.stderr, flush=True)
    held = sum(r["held"] for r in rows)
    if args.json:
        print(json.dumps({"held": held, "tried": len(rows), "scenarios": rows}, indent=1))
    else:
        print(table(rows))
    return 0 if held == len(rows) else 1


def table(rows: list[dict]) -> str:
    """The Markdown table docs/reliability.md shows."""
    out = [
        f"Scenarios held: {sum(r['held'] for r in rows)} / {len(rows)}",
        "",
        "| scenario | held | slowest answer after it (ms) | peak RSS (MB) | final RSS (MB) | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['scenario']} | {'yes' if r['held'] else 'NO'} | {r['slowest_ms'] or '-'} | "
            f"{r['peak_rss_mb'] or '-'} | {r['final_rss_mb'] or '-'} | {r['note']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None, plot=None) -> int:
    p = argparse.ArgumentParser(
        prog="spark-lsp bench robustness", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", metavar="DIR", help="model folder (default: the bundled model)")
    p.add_argument(
        "--quick", action="store_true", help="the short form (CI): 3 s burst, 30 s replay"
    )
    p.add_argument(
        "--replay-minutes",
        type=float,
        default=None,
        help="typing replay length (default 30; quick 0.5)",
    )
    p.add_argument(
        "--only",
        metavar="LIST",
        help="comma-separated scenarios: fuzz,10mb,line,200k,burst,docs,"
        "cancel,lifecycle,faults,replay",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
