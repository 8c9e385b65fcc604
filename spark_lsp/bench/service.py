"""`spark-lsp bench service`: the engine in-process, over the persistent WebSocket, over HTTP+SSE.

The typing trace is `bench lsp`'s (a function body of a real file typed back keystroke by
keystroke); every keystroke builds the inline-completion prompt the server would (same prompt
builder, the document as slot) and asks for a greedy suggestion of `--max-tokens` tokens:

- `inproc`: `engine.Engine` in this process (what `spark-lsp serve` does by default);
- `ws`: the engine daemon (`engine.service`: its threaded server, where the thread reading the
  socket takes each request and each generation writes its own tokens) over one persistent
  WebSocket, with the thread-side client the language server uses (`SyncEngineClient`): after
  the first keystroke a request is a prompt delta against the previous one;
- `sse`: the same engine behind a plain HTTP endpoint (`engine.service.sse`), the
  request-per-generation baseline as a client without a connection pool does it: a new TCP
  connection, one HTTP/1.1 POST with the whole prompt as JSON token ids, the tokens streamed
  back as Server-Sent Events, the connection closed.

`--tls`: the daemon serves `wss://` and the endpoint HTTPS, with a throwaway CA's certificate for
localhost (made with `trustme`); the transports are then `wss` (one TLS connection for the whole
run) and `https-sse` (a new TCP + TLS connection, handshake included, per request), what a client
pays over a real network, where plain text is no option.

Per keystroke: first byte (the keystroke's request is built -> its first text arrives; each
client's encoding is inside), the engine's own TTFT (from the `done` stats: the engine takes the
request -> first token), the per-request overhead (first byte - engine TTFT), keystroke-to-
suggestion (-> the whole suggestion), the engine's own time for the whole suggestion (so a
service's decoding slowed by its own I/O shows apart from the transport) and the bytes of the
request message.  Each server runs in its
own process with its own copy of the model; the three transports take turns keystroke by
keystroke, so a busy machine weighs on each alike, each turn `SETTLE_S` after the last (the
engine before leaves its threads spinning for a while).  Cancel: a generation is cancelled from another
thread a few ms after its third token (as an editor's cancel reaches the language server while
the engine works); the time from `cancel()` to the consuming thread seeing the end, in-process and
through the service's thread-side client (the language server's path); `cancel_socket_ms` is the
asyncio client's `cancel` sent -> `done` received.
`--rtt MS`: the daemon and the HTTP endpoint each behind an emulated network link of that round
trip (`bench_link`: a TCP proxy in its own process, delay only), so a new connection per request
costs its handshakes as it would between machines (one round trip for TCP, one more for TLS).
`--ray`: then K simulated editors (K = 1, 4, 8, 16), each typing its own copy of the trace at
once, against 1 and 2 Ray Serve replicas: keystroke-to-suggestion p50/p95 and the prefix-reuse
rate (reused prompt tokens / prompt tokens, each document's first, cold request included), then
2 replicas with the clients through Serve's proxy, and with the ingress going through Serve's
handles instead of the replicas' own sockets (taking turns), then 2 replicas with one killed
halfway (every suggestion answered, cancelled, failed or hung), then the scale-out comparison,
its three deployments taking turns for `--rounds` rounds.
`--memory`: resident memory (RSS, PSS) of 4 language servers sharing one daemon, and of 4
editors' bridges (`serve --stdio --shared`) with the one session host they share, vs one
in-process server, at the bundled model and a real-size one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import http.client
import json
import os
import random
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from engine import Engine, GenerationParams
from engine.service import protocol as P
from engine.service import rundir, tls
from engine.service.client import EngineClient
from engine.service.options import DEFAULT_SPINNING, SPINNING
from engine.service.sync_client import SyncEngineClient

from ..prompt import PromptBuilder
from . import link as bench_link
from .service_memory import MEMORY_MODELS, MEMORY_MODES, run_memories
from .service_ray import run_ray
from .stats import keystroke_row, percentiles, ratio, summary
from .trace import DEFAULT_FILE, keystrokes, pick_function, source_file

ROOT = Path(__file__).resolve().parents[2]  # the checkout, for the daemons' PYTHONPATH


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="MODEL",
        help="a model folder, .gguf file, catalogue name, hf:ORG/REPO or synthetic-* model "
        "(default: the bundled model)",
    )
    p.add_argument(
        "--file", metavar="PY", help=f"Python file to type into (default: stdlib {DEFAULT_FILE})"
    )
    p.add_argument("--function", metavar="NAME", help="function whose body is typed")
    p.add_argument(
        "--max-chars", type=int, default=80, help="characters of the body typed (default 80)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per suggestion (default 16)")
    p.add_argument(
        "--context-tokens", type=int, default=1024, help="prompt budget in tokens (default 1024)"
    )
    p.add_argument(
        "--transports",
        default="inproc,ws,sse",
        help="which of inproc,ws,sse (default: all; with --tls ws and sse are wss and https-sse)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="ws and sse over TLS (wss, https-sse) with a throwaway localhost certificate "
        "(needs trustme: pip install trustme)",
    )
    p.add_argument(
        "--rtt",
        type=float,
        default=0.0,
        metavar="MS",
        help="put ws and sse behind an emulated network link of this round trip, ms (default 0: "
        "loopback; see spark_lsp/bench/link.py)",
    )
    p.add_argument(
        "--spinning",
        choices=sorted(SPINNING),
        default=DEFAULT_SPINNING,
        help="ONNX Runtime spinning of the daemon's and the SSE endpoint's engines alike "
        f"(default {DEFAULT_SPINNING}, the daemon's default; the in-process engine keeps its "
        "own default, auto)",
    )
    p.add_argument(
        "--ray", action="store_true", help="also K editors against 1 and 2 Ray Serve replicas"
    )
    p.add_argument("--editors", default="1,4,8,16", help="K values for --ray (default 1,4,8,16)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of --ray's scale-out comparison, its deployments taking turns (default 3)",
    )
    p.add_argument(
        "--cancels", type=int, default=30, help="cancels timed per transport (default 30)"
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="also: resident memory of 4 language servers sharing one daemon vs one in-process server",
    )
    p.add_argument(
        "--memory-models",
        default=MEMORY_MODELS,
        metavar="LIST",
        help="models of --memory, NAME[@PRECISION] each; 'default' is --model "
        f"(default {MEMORY_MODELS})",
    )
    p.add_argument(
        "--memory-modes",
        default=MEMORY_MODES,
        metavar="LIST",
        help="what --memory compares with one in-process server: daemon (4 servers with "
        "engine: auto and their daemon), host (4 bridges and their session host), host-daemon "
        f"(4 bridges, their host, its sessions with engine: auto, and their daemon); default "
        f"{MEMORY_MODES}",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also draw the figures into a PNG: suggestion and overhead per transport, the Ray "
        "runs, the memory ratios (needs matplotlib)",
    )


def main(argv: list[str] | None = None, plot=None) -> int:
    p = argparse.ArgumentParser(prog="spark-lsp bench service", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv), plot=plot)


# -- the trace --------------------------------------------------------------------------------
def prompts(args, tokenizer) -> tuple[str, list[list[int]]]:
    """(the document URI, the prompt ids at every keystroke of the trace)."""
    path = source_file(args.file)
    source = path.read_text(encoding="utf-8")
    start, end, _ = pick_function(source, args.function)
    keys = keystrokes(source[start:end])
    text = source[:start] + source[end:]
    uri = path.resolve().as_uri()
    builder = PromptBuilder(tokenizer)
    out, typed = [], ""
    for k in keys:
        typed += k
        if len(typed) > args.max_chars:
            break
        doc = text[:start] + typed + text[start:]
        # key: the document's prefix anchor, as the server keeps it (completions.suggest)
        out.append(builder.build(doc, start + len(typed), args.context_tokens, key=uri).ids)
    return uri, out


# -- the transports ---------------------------------------------------------------------------
def generate_one(
    source: Engine | SyncEngineClient, uri: str, ids: list[int], params: GenerationParams
) -> dict:
    """One generation of the in-process engine or of the daemon's thread-side client (both
    `generate(ids, params, slot=...)`, iterated for chunks)."""
    t0 = time.perf_counter()
    t_first = None
    gen = source.generate(ids, params, slot=uri)
    for chunk in gen:
        if t_first is None and chunk.text:
            t_first = time.perf_counter()
    return keystroke_row(t0, t_first, time.perf_counter(), gen.stats)


def sse_one(
    url: str,
    uri: str,
    ids: list[int],
    params: GenerationParams,
    ssl_context: ssl.SSLContext | None = None,
) -> dict:
    """One generation as a pool-less HTTP client makes it: connect (HTTPS: with ``ssl_context``,
    a full TLS handshake each time), POST the whole prompt, read the event stream, close."""
    where = urllib.parse.urlsplit(url)
    host, port = where.hostname or "127.0.0.1", where.port or (443 if ssl_context else 80)
    t0 = time.perf_counter()
    body = json.dumps({"prompt": ids, "params": P.params_to_json(params), "slot": uri})
    if ssl_context is not None:  # a new TCP + TLS connection per request
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, context=ssl_context
        )
    else:
        conn = http.client.HTTPConnection(host, port)  # a new connection per request
    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    t_first, stats, event = None, {}, "message"
    for raw in resp:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            if event == "done":
                stats = data["stats"]
            elif t_first is None and data.get("text"):
                t_first = time.perf_counter()
        elif not line:
            event = "message"
    conn.close()
    row = keystroke_row(t0, t_first, time.perf_counter(), stats)
    row["request_bytes"] = len(body)
    return row


def count_sent(client: SyncEngineClient) -> list[int]:
    """Sizes of the frames the client sends from now on (the bench's own accounting)."""
    sizes: list[int] = []
    send = client.ws.send

    def counting(data, *a, **kw):
        sizes.append(len(data))
        return send(data, *a, **kw)

    client.ws.send = counting
    return sizes


#: Pause before each transport's turn: the engine that ran last leaves its ONNX Runtime threads
#: spinning for a while, and on a small machine they would slow the next transport's engine
#: (another process).  A typist's keystrokes at 10 characters a second are as far apart.
SETTLE_S = 0.1


def take_turns(
    wanted: list[str],
    engine: Engine | None,
    ws: tuple[str, str] | None,
    sse_url: str | None,
    uri: str,
    trace: list[list[int]],
    params: GenerationParams,
    cafile: str | None = None,
    cancel_flags: bool = True,
) -> dict[str, list[dict]]:
    """Every keystroke on every transport in turn (each on its own slot of its own engine),
    each turn SETTLE_S after the last. ``cafile``: the CA that signed the servers' certificates
    (their URLs are then wss/https); ``cancel_flags``: whether the client may share the daemon's
    cancel flags (not over an emulated link: a remote client could not)."""
    rows: dict[str, list[dict]] = {name: [] for name in wanted}
    # the language server's client (engine_ws): requests from the calling thread, no event loop
    client = (
        SyncEngineClient(*ws, client="bench", cafile=cafile, cancel_flags=cancel_flags)
        if ws
        else None
    )
    sse_ctx = tls.client_context(cafile) if sse_url and tls.is_secure(sse_url) else None
    try:
        sizes = count_sent(client) if client else []
        for ids in trace:
            if "inproc" in rows:
                time.sleep(SETTLE_S)
                rows["inproc"].append(generate_one(engine, uri, ids, params))
            if client is not None:
                time.sleep(SETTLE_S)
                rows["ws"].append(generate_one(client, uri, ids, params))
                rows["ws"][-1]["request_bytes"] = sizes[-1]
            if "sse" in rows:
                time.sleep(SETTLE_S)
                rows["sse"].append(sse_one(sse_url, uri, ids, params, sse_ctx))
    finally:
        if client is not None:
            client.close()
    return rows


def cancel_from_thread(
    start, n: int, seed: int = 0, engine_stops: list[float] | None = None
) -> list[float]:
    """`n` long generations made by `start()`, each cancelled from another thread 0-3 ms after
    its third chunk: ms from `cancel()` to this (consuming) thread seeing the end.  Where the
    engine says when it stopped, on this clock (a daemon here with shared cancel flags: its
    `done`'s `ended_at`), `engine_stops` gets the ms from `cancel()` to that as well."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        gen = start()
        fired: list[float] = []
        timer = None
        for i, _chunk in enumerate(gen):
            if i == 2:

                def fire(g=gen) -> None:
                    fired.append(time.perf_counter())
                    g.cancel()

                timer = threading.Timer(rng.uniform(0.0, 0.003), fire)
                timer.start()
        t_end = time.perf_counter()
        if timer is not None:
            timer.join()
        if fired and gen.finish_reason == "cancelled":
            out.append((t_end - fired[0]) * 1e3)
            ended = (gen.stats or {}).get("ended_at")
            if engine_stops is not None and isinstance(ended, float) and ended >= fired[0]:
                engine_stops.append((ended - fired[0]) * 1e3)
    return out


async def _ws_cancels(
    url: str, token: str, ids: list[int], n: int, cafile: str | None = None
) -> list[float]:
    """The asyncio client on the socket: ms from sending `cancel` to receiving `done`."""
    client = await EngineClient.connect(url, token, client="bench", cafile=cafile)
    out = []
    try:
        params = GenerationParams(max_new_tokens=500, ignore_eos=True)
        for _ in range(n):
            gen = await client.generate(ids, params, slot="cancel")
            seen = 0
            async for piece in gen:
                seen += len(piece.ids)
                if seen >= 3:
                    break
            t0 = time.perf_counter()
            await gen.cancel()
            await gen.wait()
            out.append((time.perf_counter() - t0) * 1e3)
    finally:
        await client.close()
    return out


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def start_daemon(
    model: str | None,
    run_dir: str,
    cert: tuple[str, str] | None = None,
    spinning: str = DEFAULT_SPINNING,
) -> tuple[subprocess.Popen, dict]:
    """The daemon (``cert``: its certificate and key files, for wss://) and its record. Its log
    goes to ``daemon_log(run_dir)`` (warnings and above), which a failed run shows."""
    env = _env()
    env[rundir.ENV_DIR] = run_dir
    cmd = [sys.executable, "-m", "engine.service.daemon", "--log-level", "WARNING"]
    # the in-process engine's and the SSE endpoint's precision (Engine.load's default): the
    # transports compare at one precision
    cmd += ["--spinning", spinning, "--precision", "fp32"]
    if model:
        cmd += ["--model", model]
    if cert:
        cmd += ["--tls-cert", cert[0], "--tls-key", cert[1]]
    with open(daemon_log(run_dir), "ab") as log_file:
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for path in Path(run_dir).glob("engine-*.json"):
            rec = json.loads(path.read_text())
            if rec.get("pid") == proc.pid:
                return proc, rec
        if proc.poll() is not None:
            raise RuntimeError(f"the engine daemon exited with {proc.returncode}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the engine daemon did not start")


def daemon_log(run_dir: str) -> Path:
    return Path(run_dir) / "daemon.log"


def _show_daemon_log(run_dir: str, exc_type, exc, tb) -> bool:
    """An exit callback: when the run fails, the daemon's log (its last lines) goes to stderr,
    which is otherwise lost with the run's directory."""
    if exc_type is not None:
        try:
            lines = daemon_log(run_dir).read_text(errors="replace").splitlines()[-40:]
        except OSError:
            lines = []
        if lines:
            print("the engine daemon's log (last lines):", *lines, sep="\n  ", file=sys.stderr)
    return False


def start_sse(
    model: str | None, cert: tuple[str, str] | None = None, spinning: str = DEFAULT_SPINNING
) -> tuple[subprocess.Popen, str]:
    """The SSE endpoint (``cert``: its certificate and key files, for https://) and its URL; its
    engine spins as the daemon's (``spinning``), so the two transports serve the same engine."""
    cmd = [sys.executable, "-m", "engine.service.sse", "--spinning", spinning]
    cmd += ["--model", model] if model else []
    if cert:
        cmd += ["--tls-cert", cert[0], "--tls-key", cert[1]]
    proc = subprocess.Popen(
        cmd,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    url = proc.stdout.readline().strip()
    if not url:
        raise RuntimeError("the SSE endpoint did not start")
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def throwaway_certificate(folder: str) -> tuple[str, str, str]:
    """A throwaway CA and a certificate it signs for localhost / 127.0.0.1 / ::1, written to
    ``folder``: (certificate, key, CA) PEM files.  Needs ``trustme`` (the test extra)."""
    try:
        import trustme
    except ImportError:
        raise SystemExit(
            "spark-lsp bench service --tls needs trustme to make a throwaway certificate: "
            "pip install trustme (or the test extra: pip install 'spark-lsp[test]')"
        ) from None
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1", "::1")
    out = Path(folder)
    paths = (str(out / "cert.pem"), str(out / "key.pem"), str(out / "ca.pem"))
    leaf.cert_chain_pems[0].write_to_path(paths[0])
    leaf.private_key_pem.write_to_path(paths[1])
    ca.cert_pem.write_to_path(paths[2])
    return paths


#: What the table and --json call the service transports, plain and over TLS.
LABELS = {False: {"ws": "ws", "sse": "sse"}, True: {"ws": "wss", "sse": "https-sse"}}


def run(args, plot=None) -> int:
    """``plot(results, FILE)`` draws ``--plot FILE`` (default: ``spark_lsp.bench.plot``)."""
    if args.plot:
        from . import plot as bench_plot

        plot = bench_plot.plotter_for_run("service", plot)
        if plot is None:
            return 2
    try:
        ks = [int(k) for k in args.editors.split(",") if k.strip()]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        print(
            f"spark-lsp bench service: --editors {args.editors!r}: expected positive counts, "
            "e.g. 1,4,8,16",
            file=sys.stderr,
        )
        return 2
    if args.model:  # a name: resolved once (downloaded, or written: synthetic-*) for every runner
        from engine.lab.models import resolve_model

        args.model = str(resolve_model(args.model))
    labels = {"inproc": "inproc", **LABELS[bool(args.tls)]}
    names = {**{v: k for k, v in labels.items()}, "inproc": "inproc", "ws": "ws", "sse": "sse"}
    given = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = {t for t in given if t not in names}
    if bad:
        print(f"spark-lsp bench service: unknown transport(s) {sorted(bad)}", file=sys.stderr)
        return 2
    wanted = list(dict.fromkeys(names[t] for t in given))  # ws/wss -> ws, sse/https-sse -> sse
    engine = Engine.load(args.model, slots=8)
    uri, trace = prompts(args, engine.tokenizer)
    params = GenerationParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    results: dict[str, Any] = {
        "model": str(engine.model_dir),
        "keystrokes": len(trace),
        "max_tokens": args.max_tokens,
        "tls": bool(args.tls),
        "rtt_ms": args.rtt,
        "spinning": args.spinning,
        "transports": {},
    }
    load_before = os.getloadavg()
    long = GenerationParams(max_new_tokens=500, ignore_eos=True)
    with tempfile.TemporaryDirectory() as run_dir, contextlib.ExitStack() as stack:
        ws = sse_url = cert = cafile = None
        if args.tls:
            *pair, cafile = throwaway_certificate(run_dir)
            cert = (pair[0], pair[1])
        if "ws" in wanted:
            proc, rec = start_daemon(args.model, run_dir, cert, args.spinning)
            # last in, first out: the daemon is stopped (its log complete) before it is shown
            stack.push(functools.partial(_show_daemon_log, run_dir))
            stack.callback(_stop, proc)
            ws = (rec["url"], rec["token"])
            if args.rtt > 0:
                link, url = bench_link.start(rec["url"], args.rtt)
                stack.callback(_stop, link)
                ws = (url, rec["token"])
        if "sse" in wanted:
            proc, sse_url = start_sse(args.model, cert, args.spinning)
            stack.callback(_stop, proc)
            if args.rtt > 0:
                link, sse_url = bench_link.start(sse_url, args.rtt)
                stack.callback(_stop, link)
        local = engine if "inproc" in wanted else None
        gc.collect()
        gc.freeze()  # as the servers do: the loaded model stays out of full collections
        # the same warm-up everywhere (ONNX Runtime's first runs), then a cold document slot
        flags = args.rtt <= 0  # behind a link the client is as if on another machine
        take_turns(wanted, local, ws, sse_url, "warm-up", trace[:2], params, cafile, flags)
        rows = take_turns(wanted, local, ws, sse_url, uri, trace, params, cafile, flags)
        t = results["transports"]
        for name in wanted:
            t[labels[name]] = summary(rows[name])
        if "inproc" in wanted:
            t["inproc"]["cancel_ms"] = percentiles(
                cancel_from_thread(
                    lambda: engine.generate(trace[-1], long, slot="cancel"), args.cancels
                )
            )
        if ws is not None:
            client = SyncEngineClient(*ws, client="bench", cafile=cafile, cancel_flags=flags)
            stops: list[float] = []
            try:
                t[labels["ws"]]["cancel_ms"] = percentiles(
                    cancel_from_thread(
                        lambda: client.generate(trace[-1], long, slot="cancel"),
                        args.cancels,
                        engine_stops=stops,
                    )
                )
            finally:
                client.close()
            if stops:  # shared cancel flags: the daemon said when its engine stopped
                t[labels["ws"]]["cancel_engine_ms"] = percentiles(stops)
            t[labels["ws"]]["cancel_socket_ms"] = percentiles(
                asyncio.run(_ws_cancels(*ws, trace[-1], args.cancels, cafile))
            )
    results["load_average"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    if "ws" in wanted and "sse" in wanted:
        ws, sse = t[labels["ws"]], t[labels["sse"]]
        # the key stays `ws_vs_sse` plain or over TLS (`tls` says which)
        results["ws_vs_sse"] = {
            "overhead_p50_ratio": ratio(ws["overhead_ms"]["p50"], sse["overhead_ms"]["p50"]),
            "first_byte_p50_ratio": ratio(ws["first_byte_ms"]["p50"], sse["first_byte_ms"]["p50"]),
        }
    if "ws" in wanted and "inproc" in wanted:
        results["ws_minus_inproc_suggestion_p50_ms"] = (
            t[labels["ws"]]["suggestion_ms"]["p50"] - t["inproc"]["suggestion_ms"]["p50"]
        )
    if args.ray:
        results["ray"] = run_ray(args, uri, trace, params, ks)
    if args.memory:
        results["memory"] = run_memories(args)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_table(results)
    from engine.lab.bench_report import plot_results

    return plot_results(plot, results, args.plot, "service")


def print_table(r: dict) -> None:
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    load = r.get("load_average", {})
    link = (
        f", ws and sse over an emulated link of {r['rtt_ms']:g} ms round trip"
        if r.get("rtt_ms")
        else ""
    )
    print(
        f"{r['keystrokes']} keystrokes, {r['max_tokens']} tokens per suggestion{link}, "
        f"daemon and SSE engines spinning {r.get('spinning', DEFAULT_SPINNING)} "
        f"(load average {f(load.get('before'))} -> {f(load.get('after'))})"
    )
    print(
        f"{'transport':10} {'1st byte p50':>12} {'TTFT p50':>9} {'overhead p50':>12} {'p95':>7} "
        f"{'suggest p50':>11} {'p95':>7} {'reuse':>6} {'request B':>9}"
    )
    for name, s in r["transports"].items():
        print(
            f"{name:10} {f(s['first_byte_ms']['p50']):>12} {f(s['ttft_ms']['p50']):>9} "
            f"{f(s['overhead_ms']['p50']):>12} {f(s['overhead_ms']['p95']):>7} {f(s['suggestion_ms']['p50']):>11} "
            f"{f(s['suggestion_ms']['p95']):>7} {f(s['prefix_reuse']):>6} "
            f"{f(s.get('request_bytes_mean')):>9}"
        )
    for name, s in r["transports"].items():
        for key, what in (
            ("cancel_ms", "cancel() -> stopped"),
            ("cancel_engine_ms", "cancel() -> engine stopped"),
            ("cancel_socket_ms", "cancel sent -> done"),
        ):
            if key in s:
                print(f"{name}: {what} p50 {f(s[key]['p50'])} ms, p95 {f(s[key]['p95'])} ms")
    ws, sse = LABELS[bool(r.get("tls"))].values()
    if "ws_vs_sse" in r:
        v = r["ws_vs_sse"]
        print(
            f"{ws} / {sse}: per-request overhead p50 x{f(v['overhead_p50_ratio'])}, "
            f"first byte p50 x{f(v['first_byte_p50_ratio'])}"
        )
    if "ws_minus_inproc_suggestion_p50_ms" in r:
        print(
            f"{ws} - inproc keystroke-to-suggestion p50: "
            f"{r['ws_minus_inproc_suggestion_p50_ms']:+.2f} ms"
        )
    for name, m in r.get("memory", {}).items():
        one = m["one_inproc_server_mb"]
        for key, what in (("host", "a session host"), ("host_daemon", "a session host + daemon")):
            h = m.get(key)
            if not h:
                continue
            d = h.get("daemon_mb")
            daemon = f", daemon {d['rss']:.0f}" if d else ""
            print(
                f"memory {name}: one in-process server RSS {one['rss']:.0f} MB (PSS "
                f"{one['pss']:.0f}); {m['sessions']} bridges sharing {what} RSS "
                f"{h['total_mb']['rss']:.0f} MB (PSS {h['total_mb']['pss']:.0f}; host "
                f"{h['host_mb']['rss']:.0f}{daemon}, each bridge "
                f"{statistics.median(s['rss'] for s in h['bridges_mb']):.1f}, PSS "
                f"{statistics.median(s['pss'] for s in h['bridges_mb']):.1f}): "
                f"x{f(h['ratio_rss'])} RSS, x{f(h['ratio_pss'])} PSS"
            )
        if "daemon_mb" not in m:
            continue
        total, d = m["shared_total_mb"], m["daemon_mb"]
        print(
            f"memory {name}: one in-process server RSS {one['rss']:.0f} MB (PSS {one['pss']:.0f}); "
            f"{m['sessions']} servers sharing one daemon RSS {total['rss']:.0f} MB "
            f"(PSS {total['pss']:.0f}; daemon {d['rss']:.0f}, each server "
            f"{statistics.median(s['rss'] for s in m['session_servers_mb']):.0f}): "
            f"x{f(m['ratio_rss'])} RSS, x{f(m['ratio_pss'])} PSS"
        )
    ray = r.get("ray")
    if ray:
        print(
            f"ray on {ray['cpus']} cores: intra-op threads per replica {ray['threads']}, "
            f"{ray['slots_per_replica']} KV slots per replica"
        )
        for name, s in ray["runs"].items():
            o = s["outcomes"]
            print(
                f"ray {name:24} suggest p50 {f(s['suggestion_ms']['p50'])} p95 "
                f"{f(s['suggestion_ms']['p95'])} reuse {f(s['prefix_reuse'])} (after each "
                f"document's first {f(s['prefix_reuse_after_first'])}); answered {o['answered']}"
                + (
                    "; documents per replica "
                    + "/".join(str(x["documents"]) for x in s["per_replica"])
                    if len(s.get("per_replica", [])) > 1
                    else ""
                )
            )
        if "direct_vs_proxy" in ray:
            d = ray["direct_vs_proxy"]
            print(
                f"ray {d['editors']} editors on the ingress replicas' own sockets vs through "
                f"Serve's proxy: overhead p50 x{f(d['overhead_p50'])}, suggest p50 "
                f"x{f(d['suggestion_p50'])}, p95 x{f(d['suggestion_p95'])}"
            )
        if "sockets_vs_handles" in ray:
            d = ray["sockets_vs_handles"]
            print(
                f"ray {d['editors']} editors on 2 replicas, generations on the replicas' own "
                f"sockets vs through Serve's handles, median of {d['rounds']} rounds taking turns: "
                f"overhead p50 x{f(d['overhead_p50'])}, suggest p50 x{f(d['suggestion_p50'])}, "
                f"p95 x{f(d['suggestion_p95'])}"
            )
        if "scale_out" in ray:
            so = ray["scale_out"]
            lo, hi = so["editors"]
            rounds = ", ".join(f(r["p95_2_replicas_over_1"]) for r in so["per_round"])
            print(
                f"ray p95, 2 replicas/{hi} editors over 1 replica/{lo} editors, median of "
                f"{so['rounds']} rounds taking turns: x{f(so['p95_2_replicas_over_1'])} "
                f"(1 replica with all {ray['cpus']} cores; rounds {rounds}), "
                f"x{f(so['p95_2_replicas_over_1_same_cores_per_replica'])} "
                "(1 replica with one replica's share)"
            )
            for name, s in so["runs"].items():
                lag = s.get("client_lag_ms")
                print(
                    f"ray scale-out {name:10} suggest p50 {f(s['suggestion_ms']['p50'])} p95 "
                    f"{f(s['suggestion_ms']['p95'])} over its rounds; overhead p50 "
                    f"{f(s['overhead_ms']['p50'])}"
                    + (
                        f", the editors' event loop late p50 {f(lag['p50'])} p95 {f(lag['p95'])}"
                        if lag
                        else ""
                    )
                )
        if "replica_kill" in ray:
            k, o = ray["replica_kill"], ray["replica_kill"]["outcomes"]
            print(
                f"ray kill one of 2 replicas ({k['editors']} editors, after {(k['killed'] or {}).get('after_suggestions')} "
                f"suggestions): answered {o['answered']}, cancelled {o['cancelled']}, error {o['error']}, "
                f"hung {o['hung']}, restarted {o['restarted']}; p95 {f(k['suggestion_ms']['p95_all'])} ms"
            )
