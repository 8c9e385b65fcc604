"""`spark-lsp demo [FILE]`: a scripted walk-through against the real server over stdio.

It starts `spark-lsp serve --stdio` as an editor would and, on a sample file (or yours, in memory:
the file on disk is not changed): types a function with ghost text arriving after each keystroke
(and its latency), interrupts a long suggestion by typing, streams a code-action edit into the
file, then prints the figures, the measured ones apart from the projected. With your file it
retypes the body of one of your functions. Works without a terminal (CI logs get plain text)
and with `--model DIR`.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import time
from pathlib import Path

SAMPLE_TYPED = (
    "def most_valuable(inventory: Inventory) -> Item:\n"
    "    return max(inventory.items.values(), key=lambda item: item.price * item.quantity)\n"
)
GENERIC_TYPED = (
    "def first_or_none(values):\n    for value in values:\n        return value\n    return None\n"
)


#: the model a user should try for real suggestions (downloaded once; any model folder works too)
REAL_MODEL = "hf:Qwen/Qwen2.5-Coder-0.5B"
DEMO_NOTE = (
    "The bundled model (spark-code-mini, about 7 million parameters, trained on Python's standard\n"
    "library) is a small demo: it shows the machinery and its speed, not what a real code model\n"
    "writes, so expect odd suggestions. For real suggestions use a real model:\n"
    f"  spark-lsp serve --model {REAL_MODEL}      (and: spark-lsp demo --model {REAL_MODEL})"
)
#: JSON-RPC error codes the demo may meet, in words
ERRORS = {-32801: "content modified", -32800: "request cancelled", -32602: "invalid params"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="a scripted walk-through: ghost text, interruption, live edit",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "file", nargs="?", help="Python file to use (default: a bundled sample); it is not modified"
    )
    p.add_argument("--model", metavar="DIR", help="model folder (default: the bundled model)")
    p.add_argument(
        "--cps", type=float, default=15.0, help="typing speed in characters per second (default 15)"
    )
    p.add_argument("--no-color", action="store_true", help="plain text even on a terminal")
    p.set_defaults(func=run)


class Screen:
    def __init__(self, color: bool):
        self.color = color

    def dim(self, s: str) -> str:
        return f"\x1b[2m{s}\x1b[0m" if self.color else f"[{s}]"

    def bold(self, s: str) -> str:
        return f"\x1b[1m{s}\x1b[0m" if self.color else s

    def title(self, s: str) -> None:
        print("\n" + self.bold(f"== {s}"), flush=True)

    def live(self, s: str) -> None:
        """Redraw the current terminal line (terminal only)."""
        if self.color:
            sys.stdout.write("\r\x1b[K" + s)
            sys.stdout.flush()


def _first_line(s: str) -> str:
    return s.split("\n", 1)[0]


def pick_function(text: str) -> tuple[str, int, str, int] | None:
    """A function of `text` to retype: (the text without its body, the cursor offset at the end of
    its header, the body to type (from a line break on), the header's line index); the last
    function with a body of 2 to 14 lines, or None when `text` has none (or does not parse)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    lines = text.splitlines(keepends=True)
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first, last = node.body[0].lineno, node.end_lineno or node.body[-1].lineno
            header_end = first - 1  # the header's lines are node.lineno .. first - 1 (1-based)
            if (
                2 <= last - first + 1 <= 14
                and header_end >= node.lineno
                and all(ln.strip() for ln in lines[first - 1 : last])
            ):
                if best is None or node.lineno > best[0]:
                    best = (node.lineno, header_end, first, last)
    if best is None:
        return None
    lineno, header_end, first, last = best
    head = "".join(lines[:header_end])
    cursor = len(head) - 1 if head.endswith("\n") else len(head)
    body = "".join(lines[first - 1 : last]).rstrip("\r\n")
    rest = "".join(lines[last:])
    return (
        head[:cursor] + "\n" + rest if rest else head[:cursor] + "\n",
        cursor,
        "\n" + body,
        lineno - 1,
    )


def _ms(v) -> str:
    return f"{v:.1f} ms" if isinstance(v, (int, float)) else "n/a"


def run(args) -> int:
    from spark_lsp.bench.trace import keystrokes
    from spark_lsp.rpc_client import LspClient, RpcError, server_cmd

    scr = Screen(sys.stdout.isatty() and not args.no_color)
    if args.cps <= 0:
        print("spark-lsp demo: --cps must be positive", file=sys.stderr)
        return 2
    picked = None
    if args.file:
        path = Path(args.file)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            print(
                f"spark-lsp demo: {path}: not a UTF-8 text file (byte {exc.object[exc.start]:#04x} "
                f"at offset {exc.start})",
                file=sys.stderr,
            )
            return 2
        except OSError as exc:
            print(f"spark-lsp demo: {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        picked = pick_function(text)
    else:
        path = Path(__file__).resolve().parent.parent / "demo_sample.py"
        text = path.read_text(encoding="utf-8")
    if picked is not None:  # retype the body of one of the user's functions, in place
        text, offset, typed, fn_line = picked
        header = text.splitlines()[fn_line].strip()
        name = header.split("(", 1)[0].split()[-1]
        header2 = header.replace(f"def {name}(", f"def {name}_again(", 1)
    else:  # the bundled sample (or a file without a function to retype): a function at its end
        if not text.endswith("\n"):
            text += "\n"
        text += "\n\n"
        offset, fn_line = len(text), None
        typed = SAMPLE_TYPED if not args.file else GENERIC_TYPED
        header2 = (
            "def summarize(inventory: Inventory) -> str:"
            if not args.file
            else "def describe(values):"
        )
    uri = "file://" + str(path.resolve()) + ".demo"

    if not args.model:
        print(DEMO_NOTE + "\n")
    which = f"--model {args.model}" if args.model else "the bundled demo model"
    print(
        scr.bold("spark-lsp demo") + f": starting the server over stdio ({which}); "
        f"{'typing into a copy of ' + str(path) + ' (the file is not changed)' if args.file else 'on a sample file'}"
    )
    client = LspClient(server_cmd(args.model))
    try:
        t0 = time.perf_counter()
        client.initialize({"liveEdits": True, "liveEditHz": 20, "maxTokens": 48})
        # a first run prepares the model (graph build, native op compile): say what takes the time
        info = client.wait_ready(on_progress=lambda msg: print(f"  {msg}", flush=True))
        print(f"model {info['model']} ready in {time.perf_counter() - t0:.1f} s")
        client.open(uri, text)
        latencies: list[float] = []

        # -- 1. typing with ghost text ------------------------------------------------------------
        what = f"the body of {name}() again" if picked is not None else "a new function"
        scr.title(f"1. Typing {what}, with ghost text after every keystroke")
        line, ghost = "", ""
        dt = 1.0 / args.cps
        for key in keystrokes(typed):
            offset = client.type_text(uri, offset, key)
            fut = client.inline(uri, offset)
            try:
                res = fut.result(60)
            except RpcError:
                continue
            latencies.append(fut.latency_ms)
            items = (res or {}).get("items") or []
            ghost = _first_line(items[0]["insertText"])[:60] if items else ""
            if "\n" in key:
                shown = f"{line}  {scr.dim('⏎')}"
                if scr.color:
                    scr.live(shown)
                    print()
                line = key.split("\n", 1)[1]
            else:
                line += key
            scr.live(f"{line}{scr.dim(ghost) if ghost else ''}   {fut.latency_ms:6.1f} ms")
            if not scr.color and key.endswith(("(", ":", ",", " ")) and ghost:
                print(f"  {line}{scr.dim(ghost)}   ({fut.latency_ms:.1f} ms)")
            time.sleep(dt)
        if scr.color:
            print()
        m1 = client.call("spark/metrics", {})
        if latencies:
            print(
                f"{len(latencies)} suggestions: median {statistics.median(latencies):.1f} ms, "
                f"max {max(latencies):.1f} ms; {m1['typingThrough']} served by typing-through (no model "
                f"call), {m1['prefixCacheHits']} of {m1['modelCalls']} model calls reused the cached prompt prefix"
            )

        # -- 2. a suggestion interrupted by typing -----------------------------------------------
        scr.title("2. A long suggestion, interrupted by typing")
        client.call(
            "workspace/executeCommand",
            {"command": "spark.configure", "arguments": [{"maxTokens": 256, "maxLines": 60}]},
        )
        header = header2
        end = len(client.docs[uri].text.rstrip("\n"))  # below the last line of the file
        offset = client.type_text(uri, end, "\n\n\n" + header)
        fut = client.inline(uri, offset, trigger=1)
        time.sleep(0.04)
        t_type = time.perf_counter()
        offset = client.type_text(uri, offset, "\n    lines")
        try:
            fut.result(60)
            if fut.received_at < t_type:
                print(
                    f"{header}  -> the suggestion finished before the keystroke ({fut.latency_ms:.0f} ms)"
                )
            else:  # the keystroke typed what the generation was writing: it went on (typing through)
                print(
                    f"{header}  -> the keystroke typed what the suggestion was writing, so it went on "
                    f"({fut.latency_ms:.0f} ms)"
                )
        except RpcError as exc:
            after = (fut.received_at - t_type) * 1e3
            m2 = client.call("spark/metrics", {})
            lat = m2["cancelLatencyMs"][-1] if m2["cancelLatencyMs"] else None
            answer = ERRORS.get(exc.code, "an error")
            stopped = (
                f"the engine stopped {lat:.2f} ms after the cancel"
                if lat is not None
                else "the engine had nothing left to stop"
            )
            print(
                f"{header}\n  -> typing 40 ms later interrupted it: the request was answered "
                f"'{answer}' (JSON-RPC {exc.code}) {after:.1f} ms after the keystroke; {stopped}"
            )
        client.call(
            "workspace/executeCommand",
            {"command": "spark.configure", "arguments": [{"maxTokens": 48, "maxLines": 12}]},
        )

        # -- 3. a code action streaming in -------------------------------------------------------
        scr.title("3. Code action 'Generate a test for this function', streamed into the file")
        doc = client.docs[uri]
        if fn_line is None:
            fn_line = doc.text.splitlines().index(_first_line(typed))
        pos = {"line": fn_line + 1, "character": 4}
        acts = client.call(
            "textDocument/codeAction",
            {
                "textDocument": {"uri": uri},
                "range": {"start": pos, "end": pos},
                "context": {"diagnostics": []},
            },
        )
        act = next((a for a in acts if (a.get("data") or {}).get("action") == "test"), None)
        if act is None:
            print("(no 'Generate a test' action here: the function is a test itself)")
            return 0
        resolved = client.call("codeAction/resolve", act)
        before_len = len(doc.text)
        flushes: list[tuple[float, int]] = []
        t_edit = time.perf_counter()
        client.on_apply = lambda u: flushes.append(
            (time.perf_counter() - t_edit, len(client.docs[u].text))
        )
        cmd = resolved["command"]
        res = client.call(
            "workspace/executeCommand",
            {"command": cmd["command"], "arguments": cmd["arguments"]},
            120,
        )
        for t, n in flushes:
            print(f"  +{t * 1e3:7.1f} ms  applyEdit: {n - before_len:+5d} chars in the file")
        inserted = doc.text[before_len:].strip("\n")
        if res["outcome"] == "done":
            print("the test it wrote:")
            print("\n".join("  " + ln for ln in inserted.splitlines()[:14]))
            print(f"written in {len(flushes)} streamed edits")
        elif res["outcome"].startswith("Spark:"):  # the edit checks refused the model's test
            print(f"{res['outcome']}\n  -> what was streamed was taken back; the file is as it was")
        else:
            print(f"edit {res['outcome']} after {len(flushes)} streamed edits")

        # -- figures -------------------------------------------------------------------------------
        scr.title("Figures")
        m = client.call("spark/metrics", {})
        status = [p for _, meth, p in client.notifications if meth == "spark/status"]
        last = status[-1] if status else {}
        lat_sorted = sorted(latencies)
        p95 = lat_sorted[min(len(lat_sorted) - 1, int(round(0.95 * (len(lat_sorted) - 1))))]
        tps = last.get("tokensPerSecond")
        cancel = m["cancelLatencyMsMedian"]
        rows = [
            ("model", m["model"]),
            (
                "keystroke -> suggestion, median / p95",
                f"{statistics.median(latencies):.1f} / {p95:.1f} ms" if latencies else "n/a",
            ),
            ("served by typing-through", m["typingThrough"]),
            (
                "model calls / reusing the cached prefix",
                f"{m['modelCalls']} / {m['prefixCacheHits']}",
            ),
            ("prompt tokens / reused", f"{m['promptTokens']} / {m['reusedTokens']}"),
            ("time to first token, median", _ms(m["ttftMsMedian"])),
            (
                "decode speed (last generation)",
                f"{tps:,.0f} tok/s" if isinstance(tps, (int, float)) else "n/a",
            ),
            (
                "cancel -> engine stopped, median",
                _ms(cancel)
                if cancel is not None
                else "n/a (no generation was running when a cancel came)",
            ),
        ]
        w = max(len(r[0]) for r in rows)
        print("  measured on this machine:")
        for k, v in rows:
            print(f"    {k:<{w}}  {v}")
        wafer = last.get("wafer") or {}
        if wafer.get("decode_tok_s"):
            print(
                "  projected (the performance model's estimate for a wafer-scale chip, not measured):"
            )
            print(
                f"    {'wafer decode':<{w}}  {wafer['decode_tok_s']:,} tok/s on {wafer['chip']} "
                f"({wafer['grid'][0]}x{wafer['grid'][1]} PEs per layer)"
            )
        if not args.model:
            print(f"\nFor real suggestions: spark-lsp serve --model {REAL_MODEL}")
    except (RpcError, TimeoutError, RuntimeError, ConnectionError, StopIteration) as exc:
        print(f"spark-lsp demo: {exc}", file=sys.stderr)
        return 1
    finally:
        client.shutdown()
    return 0


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="spark-lsp")
    register(_p.add_subparsers())
    sys.exit(run(_p.parse_args(["demo", *sys.argv[1:]])))
