"""`spark-lsp bench service --ray`: K simulated editors typing at once against 1 and 2 Ray Serve
replicas of the engine on this machine, then 2 replicas through Serve's proxy, through Serve's
handles (`_sockets_vs_handles`) and with one killed halfway: keystroke-to-suggestion p50/p95,
prefix reuse (the slot-key routing at work), documents per replica and every suggestion's
outcome; then the scale-out comparison (2 replicas with 2K editors vs 1 with K) with
its deployments taking turns.  Ray (the `ray` extra) is imported only when this runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from engine import GenerationParams
from engine.service import rundir
from engine.service.client import EngineClient

from .stats import keystroke_row, pct, ratio, summary

#: Seconds a suggestion may take in the Ray runs before it counts as hung (and is cancelled).
HUNG_S = 120.0
#: Finish reasons of an answered suggestion.
ANSWERED = ("length", "eos", "stop")


async def _ray_editor(
    url: str,
    token: str,
    uri: str,
    trace: list[list[int]],
    params: GenerationParams,
    done: list[dict] | None = None,
    direct: bool = True,
) -> list[dict]:
    """One editor typing the trace against the Ray deployment over its own socket: a row per
    keystroke (`stats.keystroke_row`) with the suggestion's outcome (finish reason, replica,
    restarts); one that takes over HUNG_S is cancelled and counted ``hung``.  Every finished
    row is also appended to `done` (progress).  `direct`: on the ingress replica's own socket
    (as the language server connects), else through Serve's proxy."""
    client = await EngineClient.connect(url, token, client="bench", direct=direct)
    rows = []
    try:
        for ids in trace:
            t0 = time.perf_counter()
            first: list[float] = []
            gen = await client.generate(ids, params, slot=uri)

            async def read(gen=gen, first=first) -> None:
                async for piece in gen:
                    if not first and piece.text:
                        first.append(time.perf_counter())

            try:
                await asyncio.wait_for(read(), HUNG_S)
                t_end = time.perf_counter()
                row = keystroke_row(t0, first[0] if first else t_end, t_end, gen.stats)
                row["finish"] = gen.finish_reason
                row["error"] = (gen.error or {}).get("code")
            except asyncio.TimeoutError:
                await gen.cancel()
                row = {"finish": "hung", "suggestion_ms": HUNG_S * 1e3}
            row["replica"] = gen.stats.get("replica")
            row["document"] = uri
            row["restarts"] = gen.stats.get("restarts", 0)
            rows.append(row)
            if done is not None:
                done.append(row)
    finally:
        await client.close()
    return rows


def ray_summary(
    rows: list[dict], per_editor: int, lag_ms: list[float] | None = None
) -> dict[str, Any]:
    """`summary` plus the outcomes, the prefix reuse without each document's first (cold)
    request, whose prompt no replica can have seen, and how late the editors' own event loops
    ran (`lag_ms`, `EditorsRun`): time in the overhead that is the bench's, not the service's."""
    out = summary([r for r in rows if r.get("finish") != "hung"])
    warm = [r for i, r in enumerate(rows) if i % per_editor and r.get("finish") != "hung"]
    pt = sum(r.get("prompt_tokens", 0) for r in warm)
    out["prefix_reuse_after_first"] = (
        sum(r.get("reused_tokens", 0) for r in warm) / pt if pt else None
    )
    out["suggestion_ms"]["p95_all"] = pct([r["suggestion_ms"] for r in rows], 0.95)
    finish = [r.get("finish") for r in rows]
    out["outcomes"] = {
        "answered": sum(f in ANSWERED for f in finish),
        "cancelled": finish.count("cancelled"),
        "error": finish.count("error"),
        "hung": finish.count("hung"),
        "restarted": sum(1 for r in rows if r.get("restarts")),
    }
    out["replicas_used"] = len({r["replica"] for r in rows if r.get("replica")})
    out["per_replica"] = per_replica(rows)
    if lag_ms:
        out["client_lag_ms"] = {"p50": pct(lag_ms, 0.5), "p95": pct(lag_ms, 0.95)}
    return out


def per_replica(rows: list[dict]) -> list[dict[str, Any]]:
    """How the documents spread over the replicas (each document counted on the replica that
    answered most of its suggestions) and each replica's suggestion p50/p95: a replica with
    more documents than its share queues them, and its p95 is every editor's."""
    served: dict[str, dict[str, int]] = {}
    for r in rows:
        if r.get("replica") and r.get("document"):
            counts = served.setdefault(r["document"], {})
            counts[r["replica"]] = counts.get(r["replica"], 0) + 1
    home = {doc: max(c, key=c.get) for doc, c in served.items()}
    out = []
    for replica in sorted(set(home.values())):
        times = [
            r["suggestion_ms"]
            for r in rows
            if r.get("replica") == replica and r.get("finish") != "hung"
        ]
        out.append(
            {
                "replica": replica,
                "documents": sum(1 for h in home.values() if h == replica),
                "suggestion_ms": {"p50": pct(times, 0.5), "p95": pct(times, 0.95)},
            }
        )
    return out


class EditorsRun(NamedTuple):
    """One run of K editors: a row per keystroke (each editor's in order, editor by editor),
    the replica killed (`kill_at`) and how late the editors' event loops were
    (`LAG_PROBE_S`)."""

    rows: list[dict]
    killed: dict | None
    lag_ms: list[float]


#: The editors' event loops are probed this often: how late each wake-up comes is the time a
#: message waited for the client itself (many editors in one process), not for the service.
LAG_PROBE_S = 0.002


def run_ray_editors(
    url: str,
    token: str,
    uri: str,
    trace: list[list[int]],
    params: GenerationParams,
    k: int,
    kill_at: float | None = None,
    direct: bool = True,
) -> EditorsRun:
    """K editors typing at once on one event loop, each its own document over its own socket
    (`direct`: see `_ray_editor`), the loop probed for how late it runs meanwhile.  `kill_at`:
    when that fraction of all the suggestions is done, SIGKILL the replica that served most of
    them (returns what was killed)."""
    done: list[dict] = []
    killed: dict | None = None
    lag: list[float] = []

    async def killer() -> None:
        nonlocal killed
        while len(done) < kill_at * k * len(trace):
            await asyncio.sleep(0.005)
        counts: dict[str, int] = {}
        for r in done:
            if r.get("replica"):
                counts[r["replica"]] = counts.get(r["replica"], 0) + 1
        victim = max(counts, key=counts.get)
        os.kill(int(victim.rsplit(":", 1)[1]), signal.SIGKILL)
        killed = {"replica": victim, "after_suggestions": len(done)}

    async def probe() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            lag.append((time.perf_counter() - t - LAG_PROBE_S) * 1e3)

    async def all_editors() -> list[dict]:
        watch = [asyncio.ensure_future(probe())]
        if kill_at is not None:
            watch.append(asyncio.ensure_future(killer()))
        try:
            parts = await asyncio.gather(
                *(
                    _ray_editor(url, token, f"{uri}#editor{i}", trace, params, done, direct)
                    for i in range(k)
                )
            )
        finally:
            for w in watch:
                w.cancel()
        return [r for part in parts for r in part]

    rows = asyncio.run(all_editors())
    return EditorsRun(rows, killed, lag)


def run_ray(
    args, uri: str, trace: list[list[int]], params: GenerationParams, ks: list[int]
) -> dict:
    """K editors against 1 and 2 replicas of a local Ray Serve deployment on this machine's
    cores (each replica's intra-op threads: the cores shared out, `ray_app.replica_threads`),
    on the ingress replicas' own sockets; 2 replicas with max(K) editors through Serve's proxy
    as well; then 2 replicas with max(K) editors and one replica killed halfway; then the
    scale-out comparison, its deployments taking turns (`_scale_out`)."""
    # Ray prints its workers' deaths (the replica killed on purpose) on stdout: keep stdout for
    # the results (--json), send the rest to stderr
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return _run_ray(args, uri, trace, params, ks)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _deploy(
    args,
    port: int,
    replicas: int,
    threads: int,
    slots: int,
    trace: list[list[int]],
    params: GenerationParams,
    app: str | None = None,
    replica_sockets: bool = True,
) -> tuple[str, str]:
    """Deploy `replicas` engine shards (as application `app`, None: the default one, at "/")
    and warm up each shard's first runs (ONNX Runtime's): one document ranked first on each.
    Returns the URL and the token."""
    from engine.models import default_model_dir
    from engine.service import placement, ray_app

    token = rundir.new_token()
    where = {"name": _app_name(app), "route_prefix": f"/{app}"} if app else {}
    url = ray_app.deploy(
        str(args.model or default_model_dir()),
        port=port,
        replicas=replicas,
        token=token,
        num_cpus=0.25,  # room for the scale-out comparison's three applications on 2 cores
        threads=threads,
        slots=slots,
        replica_sockets=replica_sockets,
        **where,
    )
    warm, i = [], 0
    while len({placement.rank_shards(w, replicas)[0] for w in warm}) < replicas:
        warm.append(f"warm-up-{app}-{i}")
        i += 1
    for w in warm:
        run_ray_editors(url, token, w, trace[:2], params, 1)
    return url, token


def _app_name(app: str) -> str:
    """The Serve application of one of the scale-out comparison's deployments."""
    from engine.service import ray_app

    return f"{ray_app.APP_NAME}-{app}"


def _run_ray(
    args, uri: str, trace: list[list[int]], params: GenerationParams, ks: list[int]
) -> dict:
    import ray
    from ray import serve

    from engine.service import ray_app

    cpus = os.cpu_count() or 2
    slots = max(ks) + 2  # every document a replica may get, and the warm-up ones
    out: dict[str, Any] = {"cpus": cpus, "slots_per_replica": slots, "threads": {}, "runs": {}}
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as s:  # Serve's proxy keeps its first port: one for every run
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        hi = max(ks)
        lo = hi // 2 if hi // 2 in ks else None
        for replicas in (1, 2):
            threads = out["threads"][replicas] = ray_app.replica_threads(replicas)
            url, token = _deploy(args, port, replicas, threads, slots, trace, params)
            for k in ks:  # fresh documents for each K: their first request is cold
                run = run_ray_editors(url, token, f"{uri}?r{replicas}k{k}", trace, params, k)
                out["runs"][f"replicas={replicas},editors={k}"] = ray_summary(
                    run.rows, len(trace), run.lag_ms
                )
            if replicas == 2:  # the same through Serve's proxy, which the clients skip
                run = run_ray_editors(url, token, f"{uri}?proxy", trace, params, hi, direct=False)
                out["runs"][f"replicas=2,editors={hi},proxy"] = ray_summary(
                    run.rows, len(trace), run.lag_ms
                )
                out["sockets_vs_handles"] = _sockets_vs_handles(
                    args, port, (url, token), uri, trace, params, hi, slots, threads
                )
                run = run_ray_editors(url, token, f"{uri}?kill", trace, params, hi, kill_at=0.5)
                kill = ray_summary(run.rows, len(trace), run.lag_ms)
                o = kill["outcomes"]
                out["replica_kill"] = {
                    "editors": hi,
                    "killed": run.killed,
                    **kill,
                    "all_answered_or_cancelled": o["error"] == 0
                    and o["hung"] == 0
                    and o["answered"] + o["cancelled"] == len(run.rows),
                }
            serve.delete(ray_app.APP_NAME)
        if lo is not None:
            out["scale_out"] = _scale_out(
                args, port, uri, trace, params, lo, hi, slots, out["threads"], args.rounds
            )
    finally:
        serve.shutdown()
        ray.shutdown()
    runs = out["runs"]
    direct, proxy = runs[f"replicas=2,editors={hi}"], runs[f"replicas=2,editors={hi},proxy"]
    # clients on the ingress replicas' sockets vs through the proxy
    out["direct_vs_proxy"] = {"editors": hi, **_over(direct, proxy)}
    return out


def _over(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """Two runs' summaries compared, `a` over `b`: per-request overhead p50, suggestion p50
    and p95."""
    return {
        "overhead_p50": ratio(a["overhead_ms"]["p50"], b["overhead_ms"]["p50"]),
        "suggestion_p50": ratio(a["suggestion_ms"]["p50"], b["suggestion_ms"]["p50"]),
        "suggestion_p95": ratio(a["suggestion_ms"]["p95"], b["suggestion_ms"]["p95"]),
    }


def _take_turns(
    urls: dict[str, tuple[str, str]],
    editors: dict[str, int],
    uri: str,
    trace: list[list[int]],
    params: GenerationParams,
    rounds: int,
    ratios: Callable[[dict[str, dict]], dict[str, float | None]],
) -> dict[str, Any]:
    """Deployments running side by side (`urls`, by name, each with its number of `editors`)
    taking turns, round after round in the order ABC, CBA, ..., each round with fresh
    documents: a stretch where the machine is slower (other work on a shared host) then falls on
    all of them alike instead of on whichever ran then.  Returns each round's `ratios` (of that
    round's summaries by name), their medians, and each deployment's summary over its rounds."""
    rows: dict[str, list[dict]] = {a: [] for a in urls}
    lags: dict[str, list[float]] = {a: [] for a in urls}
    per_round = []
    for n in range(rounds):
        got = {}
        for a in list(urls) if n % 2 == 0 else list(urls)[::-1]:
            run = run_ray_editors(*urls[a], f"{uri}?{a}{n}", trace, params, editors[a])
            rows[a] += run.rows
            lags[a] += run.lag_ms
            got[a] = ray_summary(run.rows, len(trace))
        per_round.append(ratios(got))
    out: dict[str, Any] = {"rounds": rounds, "per_round": per_round}
    for key in per_round[0]:
        known = [r[key] for r in per_round if r[key] is not None]
        out[key] = statistics.median(known) if known else None
    out["runs"] = {a: ray_summary(rows[a], len(trace), lags[a]) for a in urls}
    return out


def _sockets_vs_handles(
    args,
    port: int,
    sockets: tuple[str, str],
    uri: str,
    trace: list[list[int]],
    params: GenerationParams,
    k: int,
    slots: int,
    threads: int,
    rounds: int = 2,
) -> dict[str, Any]:
    """K editors on the 2-replica deployment (`sockets`: the ingress sends generations on the
    engine replicas' own sockets) and on a second one beside it whose ingress goes through
    Serve's handles (the replicas' `generate`: how it went before the sockets), taking turns for
    `rounds` rounds (`_take_turns`): the ratios, sockets over handles, of the per-request
    overhead p50 and the suggestion p50 / p95."""
    from ray import serve

    def ratios(got: dict[str, dict]) -> dict[str, float | None]:
        return _over(got["sockets"], got["handles"])

    try:
        handles = _deploy(
            args, port, 2, threads, slots, trace, params, app="handles", replica_sockets=False
        )
        urls = {"sockets": sockets, "handles": handles}
        out = _take_turns(urls, dict.fromkeys(urls, k), uri, trace, params, rounds, ratios)
    finally:
        serve.delete(_app_name("handles"))
    return {"editors": k, **out}


def _scale_out(
    args,
    port: int,
    uri: str,
    trace: list[list[int]],
    params: GenerationParams,
    lo: int,
    hi: int,
    slots: int,
    threads: dict[int, int],
    rounds: int,
) -> dict[str, Any]:
    """The issue's comparison, 2 replicas with 2K editors vs 1 replica with K, with the three
    deployments it needs running side by side and taking turns (`_take_turns`).  The three:
    2 replicas (`two`), 1 replica with all the cores (`one`), and 1 replica with one replica's
    share of them (`one_share`: what adding a machine adds); the ratios: p95 of `two` over
    each of the others."""
    from ray import serve

    arms = {  # name: (replicas, threads, editors)
        "one": (1, threads[1], lo),
        "two": (2, threads[2], hi),
        "one_share": (1, threads[2], lo),
    }

    def ratios(got: dict[str, dict]) -> dict[str, float | None]:
        p95 = {a: s["suggestion_ms"]["p95"] for a, s in got.items()}
        return {
            "p95_2_replicas_over_1": ratio(p95["two"], p95["one"]),
            "p95_2_replicas_over_1_same_cores_per_replica": ratio(p95["two"], p95["one_share"]),
        }

    try:
        urls = {
            a: _deploy(args, port, r, t, slots, trace, params, app=a)
            for a, (r, t, _) in arms.items()
        }
        editors = {a: k for a, (_, _, k) in arms.items()}
        out = _take_turns(urls, editors, uri, trace, params, rounds, ratios)
    finally:
        for a in arms:
            serve.delete(_app_name(a))
    return {"editors": [lo, hi], **out}
