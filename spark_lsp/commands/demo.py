"""`spark-lsp demo [FILE]`: a scripted walk-through against the real server over stdio.

It starts `spark-lsp serve --stdio` as an editor would and, on a sample file (or yours): types a
function with ghost text arriving after each keystroke (and its latency), interrupts a long
suggestion by typing, streams a code-action edit into the file, then prints the figures. Works
without a terminal (CI logs get plain text) and with `--model DIR`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

SAMPLE_TYPED = ("def most_valuable(inventory: Inventory) -> Item:\n"
                "    return max(inventory.items.values(), key=lambda item: item.price * item.quantity)\n")
GENERIC_TYPED = ("def first_or_none(values):\n"
                 "    for value in values:\n"
                 "        return value\n"
                 "    return None\n")


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="a scripted walk-through: ghost text, interruption, live edit",
                              description=__doc__.splitlines()[0])
    p.add_argument("file", nargs="?", help="Python file to use (default: a bundled sample); it is not modified")
    p.add_argument("--model", metavar="DIR", help="model folder (default: the bundled model)")
    p.add_argument("--cps", type=float, default=15.0, help="typing speed in characters per second (default 15)")
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


def run(args) -> int:
    from spark_lsp.rpc_client import LspClient, RpcError, server_cmd
    from spark_lsp.bench_lsp import keystrokes

    scr = Screen(sys.stdout.isatty() and not args.no_color)
    if args.file:
        path = Path(args.file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            print(f"spark-lsp demo: {path}: {exc}", file=sys.stderr)
            return 2
        typed = GENERIC_TYPED
    else:
        path = Path(__file__).resolve().parent.parent / "demo_sample.py"
        text = path.read_text(encoding="utf-8")
        typed = SAMPLE_TYPED
    if args.cps <= 0:
        print("spark-lsp demo: --cps must be positive", file=sys.stderr)
        return 2
    uri = "file://" + str(path.resolve()) + ".demo"
    if not text.endswith("\n"):
        text += "\n"
    text += "\n\n"

    which = f"--model {args.model}" if args.model else "bundled model"
    print(scr.bold("spark-lsp demo") + f": starting the server over stdio ({which})")
    client = LspClient(server_cmd(args.model))
    try:
        t0 = time.perf_counter()
        client.initialize({"liveEdits": True, "liveEditHz": 20, "maxTokens": 48})
        info = client.wait_ready()
        print(f"model {info['model']} ready in {time.perf_counter() - t0:.1f} s")
        client.open(uri, text)
        latencies: list[float] = []

        # -- 1. typing with ghost text ------------------------------------------------------------
        scr.title("1. Typing, with ghost text after every keystroke")
        offset = len(text)
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
        print(f"{len(latencies)} suggestions: median {statistics.median(latencies):.1f} ms, "
              f"max {max(latencies):.1f} ms; {m1['typingThrough']} served by typing-through (no model call), "
              f"{m1['prefixCacheHits']} of {m1['modelCalls']} model calls reused the cached prompt prefix")

        # -- 2. a suggestion interrupted by typing -----------------------------------------------
        scr.title("2. A long suggestion, interrupted by typing")
        client.call("workspace/executeCommand", {"command": "spark.configure",
                                                 "arguments": [{"maxTokens": 256, "maxLines": 60}]})
        header = "def summarize(inventory: Inventory) -> str:"
        offset = client.type_text(uri, offset, "\n" + header)
        fut = client.inline(uri, offset, trigger=1)
        time.sleep(0.04)
        t_type = time.perf_counter()
        offset = client.type_text(uri, offset, "\n    lines")
        try:
            fut.result(60)
            if fut.received_at < t_type:
                print(f"{header}  -> the suggestion finished before the keystroke ({fut.latency_ms:.0f} ms)")
            else:  # the keystroke typed what the generation was writing: it went on (typing through)
                print(f"{header}  -> the keystroke typed what the suggestion was writing, so it went on "
                      f"({fut.latency_ms:.0f} ms)")
        except RpcError as exc:
            after = (fut.received_at - t_type) * 1e3
            m2 = client.call("spark/metrics", {})
            lat = m2["cancelLatencyMs"][-1] if m2["cancelLatencyMs"] else None
            print(f"{header}  -> typing after 40 ms interrupted it: answered {exc.code} "
                  f"{after:.1f} ms after the keystroke; engine stopped "
                  f"{f'{lat:.2f} ms' if lat is not None else '(not measured)'} after the cancel")
        client.call("workspace/executeCommand", {"command": "spark.configure",
                                                 "arguments": [{"maxTokens": 48, "maxLines": 12}]})

        # -- 3. a code action streaming in -------------------------------------------------------
        scr.title("3. Code action 'Generate a test for this function', streamed into the file")
        doc = client.docs[uri]
        fn_line = doc.text.splitlines().index(_first_line(typed))
        pos = {"line": fn_line + 1, "character": 4}
        acts = client.call("textDocument/codeAction", {"textDocument": {"uri": uri},
                                                       "range": {"start": pos, "end": pos},
                                                       "context": {"diagnostics": []}})
        act = next(a for a in acts if (a.get("data") or {}).get("action") == "test")
        resolved = client.call("codeAction/resolve", act)
        before_len = len(doc.text)
        flushes: list[tuple[float, int]] = []
        t_edit = time.perf_counter()
        client.on_apply = lambda u: flushes.append((time.perf_counter() - t_edit, len(client.docs[u].text)))
        cmd = resolved["command"]
        res = client.call("workspace/executeCommand", {"command": cmd["command"],
                                                       "arguments": cmd["arguments"]}, 120)
        for t, n in flushes:
            print(f"  +{t * 1e3:7.1f} ms  applyEdit: {n - before_len:+5d} chars in the file")
        inserted = doc.text[before_len:].strip("\n")
        print(scr.dim("---") if not scr.color else "")
        print("\n".join("  " + ln for ln in inserted.splitlines()[:14]))
        print(f"edit {res['outcome']} in {len(flushes)} streamed edits")

        # -- figures -------------------------------------------------------------------------------
        scr.title("Figures")
        m = client.call("spark/metrics", {})
        status = [p for _, meth, p in client.notifications if meth == "spark/status"]
        last = status[-1] if status else {}
        lat_sorted = sorted(latencies)
        p95 = lat_sorted[min(len(lat_sorted) - 1, int(round(0.95 * (len(lat_sorted) - 1))))]
        rows = [
            ("model", m["model"]),
            ("keystroke -> suggestion, median / p95", f"{statistics.median(latencies):.1f} / {p95:.1f} ms"),
            ("served by typing-through", m["typingThrough"]),
            ("model calls / reusing the cached prefix", f"{m['modelCalls']} / {m['prefixCacheHits']}"),
            ("prompt tokens / reused", f"{m['promptTokens']} / {m['reusedTokens']}"),
            ("time to first token, median", f"{m['ttftMsMedian']} ms"),
            ("decode speed (last generation)", f"{last.get('tokensPerSecond')} tok/s"),
            ("cancel -> engine stopped, median", f"{m['cancelLatencyMsMedian']} ms"),
        ]
        wafer = last.get("wafer") or {}
        if wafer.get("decode_tok_s"):
            rows.append(("projected wafer decode", f"{wafer['decode_tok_s']:,} tok/s on {wafer['chip']} "
                                                   f"({wafer['grid'][0]}x{wafer['grid'][1]} PEs per layer)"))
        w = max(len(r[0]) for r in rows)
        for k, v in rows:
            print(f"  {k:<{w}}  {v}")
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
