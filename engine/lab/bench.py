"""`spark-lsp bench engine`: our engine against transformers and onnxruntime-genai on the same weights.

Measured in one process, on one model folder, with the same prompt (random token ids), the same
number of new tokens (greedy, eos ignored), the same intra-op thread count, after a warm-up run:

- prefill: time to the first token of a cold prompt (``T1``), as tokens/s;
- decode: ``(N - 1) / (T_N - T_1)`` where ``T_N`` is the time to N new tokens — the same formula for
  every runner, so per-runner overheads (session setup, sampling) are charged alike;
- TTFT cold vs. reused: the same prompt with ONE token changed at the end, prefix-reused;
- cancel latency: ms from ``cancel()`` (another thread) until the consuming iterator stops,
  during decode and during a prefill;
- with ``--precision fp32,int8,int4``: our engine once per precision, all taking turns with the
  peers; per precision the rates, the ratios to our fp32 and to each peer, and the greedy agreement
  with our fp32 tokens (teacher-forced: the variant reads fp32's sequence and we count the positions
  where its argmax is fp32's token — the criterion of ``engine.lab.tune.choose_precision``).

``synthetic-8m`` names a reference model: a random-initialised fp32 Llama (d=256, 4 layers,
d_ff=768, vocab 8192, untied: ~7.6M parameters) written with numpy into a cache folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelError, load_config
from ..engine import Engine
from ..generate import GenerationParams
from ..graph_cache import emitter_key
from ..linears import PRECISIONS
from ..runtime import physical_cores
from ..weights import expected_shapes, weights_digest
from . import peers as peer_mod
from .bandwidth import (
    bandwidth_share,
    gguf_bytes_per_token,
    graph_bytes_per_token,
    memory_bound,
    read_bandwidth,
)
from .bench_report import format_table, plot_results
from .llama_cpp import GGUF_TYPES, LlamaCppPeer, gguf_file
from .models import bench_root, resolve_model
from .tune import choose_precision

#: Peers by name, in the order they take their turns.
PEERS = ("transformers", "onnxruntime-genai", "llama.cpp")


@dataclass
class BenchOptions:
    prompt_tokens: int = 1000
    new_tokens: int = 128
    repeats: int = 5
    cancels: int = 10
    threads: int | None = None
    peers: bool = True
    wafer: bool = True
    grid: tuple[int, int] | None = None
    spinning: bool | None = None  # None: the engine's auto mode (spin while the CPU is calm)
    seed: int = 0
    precisions: tuple[str, ...] = ("fp32",)  # see parse_precisions; fp32 is always first
    peer_names: tuple[str, ...] = PEERS  # which peers run (when ``peers``)
    gguf: tuple[str, ...] = tuple(GGUF_TYPES)  # llama.cpp's files, one runner each
    genai: tuple[str, ...] = (
        peer_mod.GENAI_PRECISIONS
    )  # onnxruntime-genai's models, one runner each
    kv_caches: tuple[str, ...] = ("auto",)  # our KV cache types, one runner each (variant_names)


#: ``--kv-cache`` values: Engine.load's ``kv_cache``.
KV_CACHES = ("auto", "float32", "float16")


def variant_names(precisions: tuple[str, ...], kv_caches: tuple[str, ...]) -> list[str]:
    """A runner per precision and KV cache type, named by the precision alone for the engine's
    own choice (``auto``), else with `` kv16`` / `` kv32`` after it (``int4 kv32``: int4 weights
    over a float32 cache)."""
    suffix = {"auto": "", "float16": " kv16", "float32": " kv32"}
    return [x + suffix[kv] for x in precisions for kv in kv_caches]


def parse_variant(name: str) -> tuple[str, str]:
    """A :func:`variant_names` name -> (precision, kv_cache)."""
    x, _, kv = name.partition(" kv")
    return x, {"": "auto", "16": "float16", "32": "float32"}[kv]


def parse_list(spec: str, known, what: str) -> tuple[str, ...]:
    """``"a,b"`` -> ('a', 'b'), each checked against ``known`` (case as given in ``known``)."""
    by_lower = {k.lower(): k for k in known}
    names = [x.strip() for x in str(spec).split(",") if x.strip()]
    if not names:
        raise ValueError(f"{what}: expected a comma-separated list of {', '.join(known)}")
    for x in names:
        if x.lower() not in by_lower:
            raise ValueError(f"{what}: unknown {x!r}; known: {', '.join(known)}")
    return tuple(dict.fromkeys(by_lower[x.lower()] for x in names))


def _rss() -> int:
    """Resident bytes of this process now (Linux; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def parse_precisions(spec: str) -> tuple[str, ...]:
    """``--precision fp32,int8,int4`` -> ('fp32', 'int8', 'int4').

    fp32 is always measured (first) because every other precision is compared with it; 'auto' is the
    precision ``engine.lab.tune.choose_precision`` picks for this model and machine.
    """
    names = [x.strip().lower() for x in str(spec).split(",") if x.strip()]
    if not names:
        raise ValueError("--precision: expected a comma-separated list, e.g. fp32,int8,int4")
    for x in names:
        if x not in PRECISIONS and x != "auto":
            raise ValueError(
                f"--precision: unknown precision {x!r}; known: {', '.join(PRECISIONS)}, auto"
            )
    return tuple(dict.fromkeys(["fp32", *names]))


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _p95(xs: list[float]) -> float:
    return float(np.percentile(np.asarray(xs), 95))


class _Ours:
    """Our engine behind the peers' ``timed`` interface (each call cold: nothing reused)."""

    name = "spark-lsp"

    def __init__(self, eng, name: str = "spark-lsp") -> None:

        self.eng = eng
        self.name = name
        self._params = GenerationParams
        self.version = "spark-lsp engine"
        self.stats: list[dict] = []
        # whether the last run decoded on the spinning session (``spinning: auto`` picks it per
        # generation: only while the CPU is calm)
        self.last_spinning: bool | None = None

    def run(self, prompt: list[int], new_tokens: int, slot: Any = "bench"):
        gen = self.eng.generate(
            prompt, self._params(max_new_tokens=new_tokens, ignore_eos=True), slot=slot
        )
        for _ in gen:
            pass
        return gen

    def timed(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float | None]:
        self.eng.reset()  # cold: no prefix to reuse (the KV buffers stay allocated)
        t0 = time.perf_counter()
        gen = self.run(prompt, new_tokens)
        dt = time.perf_counter() - t0
        self.last_spinning = bool(self.eng.runtime.target.spinning)
        if gen.stats["reused_tokens"]:
            raise RuntimeError("a cold run reused a prefix; the benchmark would be unfair")
        self.stats.append(dict(gen.stats))
        rate = gen.stats.get("decode_tok_s")
        return list(gen.tokens), dt, (len(gen.tokens) - 1) / rate if rate else None


#: Pause before every timed run: threads a runner leaves spinning (torch's OpenMP pool waits
#: ~200 ms, ORT's a few ms) must not land in the next runner's measurement.
SETTLE_S = 0.3


def _rates(runners: list, prompts: list[list[int]], n: int) -> list[dict[str, Any]]:
    """Per runner: median T1 (time to 1 new token: the prefill) and decode tok/s.

    Decode is timed inside each runner's own loop, from its first new token to its last
    (``timed`` returns that span, or None when a run could not time it; then ``(n - 1) / (TN -
    T1)`` from medians of separate runs is used, which other runners' leftover threads can skew:
    a T1 slowed by them made decode look faster).  The runners take turns within each repeat, so
    a change in machine load hits all of them alike.  ``tokens``: the n tokens of the first
    prompt; ``all_tokens``: those of every prompt (agreement over the run).
    """
    t1s: list[list[float]] = [[] for _ in runners]
    tns: list[list[float]] = [[] for _ in runners]
    spans: list[list[float | None]] = [[] for _ in runners]
    tokens: list[list[list[int]]] = [[] for _ in runners]
    spinning: list[list[bool]] = [[] for _ in runners]  # ours: each decode run's session
    for p in prompts:
        for i, runner in enumerate(runners):
            time.sleep(SETTLE_S)
            t1s[i].append(runner.timed(p, 1)[1])
            time.sleep(SETTLE_S)
            toks, tn, span = runner.timed(p, n)
            tns[i].append(tn)
            spans[i].append(span)
            tokens[i].append(toks)
            if getattr(runner, "last_spinning", None) is not None:
                spinning[i].append(runner.last_spinning)
    out = []
    for i in range(len(runners)):
        t1, tn = _median(t1s[i]), _median(tns[i])
        in_loop = all(spans[i])
        decode = (n - 1) / (_median(spans[i]) if in_loop else max(tn - t1, 1e-9))
        out.append(
            {
                "ttft_ms": t1 * 1e3,
                "prefill_tok_s": len(prompts[0]) / t1,
                "decode_tok_s": decode,
                "decode_timed": "in-loop" if in_loop else "TN-T1",
                "tokens": tokens[i][0],
                "all_tokens": tokens[i],
                **({"spinning_runs": [sum(spinning[i]), len(spinning[i])]} if spinning[i] else {}),
            }
        )
    return out


def _teacher_forced(eng, prompts: list[list[int]], refs: list[list[int]]) -> tuple[int, int]:
    """(positions where ``eng``'s argmax is the reference token, positions) when ``eng`` reads
    each prompt followed by its reference continuation in one pass."""
    agree = total = 0
    for p, ref in zip(prompts, refs):
        logits = eng.forward_logits(list(p) + list(ref[:-1]))[len(p) - 1 :]
        agree += int((logits[:, : eng.sample_vocab].argmax(-1) == np.asarray(ref)).sum())
        total += len(ref)
    return agree, total


def _cancel_latency(
    eng,
    prompt_for: Callable[[int], list[int]],
    count: int,
    phase: str,
    cold_ms: float,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Cancel from the main thread while another thread iterates; ms until the iterator stops."""

    lat, reasons = [], []
    for k in range(count):
        prompt = prompt_for(k)
        eng.reset()
        room = eng.context - len(prompt) - 1
        gen = eng.generate(
            prompt, GenerationParams(max_new_tokens=room, ignore_eos=True), slot="bench"
        )
        started = threading.Event()
        want = int(rng.integers(2, 20))
        stopped: list[float] = []

        def consume():
            n = 0
            for _ in gen:
                n += 1
                if n == want:
                    started.set()
            stopped.append(time.perf_counter())
            started.set()

        th = threading.Thread(target=consume, daemon=True)
        th.start()
        if phase == "decode":
            started.wait()
        else:  # somewhere inside the prefill
            time.sleep(float(rng.uniform(0.1, 0.8)) * cold_ms / 1e3)
        t_cancel = time.perf_counter()
        gen.cancel()
        th.join(timeout=30)
        if not stopped:
            raise RuntimeError("a cancelled generation did not stop within 30 s")
        lat.append(max(0.0, stopped[0] - t_cancel) * 1e3)
        reasons.append(gen.finish_reason)
    return {
        "median_ms": _median(lat),
        "p95_ms": _p95(lat),
        "n": len(lat),
        "cancelled": sum(r == "cancelled" for r in reasons),
    }


def _agree(a: list[int] | None, b: list[int] | None) -> int:
    n = 0
    for x, y in zip(a or [], b or []):
        if x != y:
            break
        n += 1
    return n


def bench_engine(
    model: str | Path | None, opts: BenchOptions, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the whole engine benchmark; returns the figures (see ``format_table``)."""
    if opts.repeats < 1 or opts.new_tokens < 2 or opts.prompt_tokens < 2 or opts.cancels < 0:
        raise ValueError(
            "--repeats must be >= 1, --new-tokens >= 2, --prompt-tokens >= 2, --cancels >= 0"
        )
    folder = resolve_model(str(model) if model is not None else None)
    threads = opts.threads or physical_cores()
    cfg = load_config(folder)
    precisions, auto = list(dict.fromkeys(["fp32", *opts.precisions])), None
    if "auto" in precisions:
        auto = choose_precision(
            folder, wafer=opts.wafer, grid=opts.grid, threads=threads, log_fn=log
        )
        log(f"auto precision: {auto.precision} ({auto.reason})")
        precisions = list(dict.fromkeys(auto.precision if x == "auto" else x for x in precisions))
    # Measured before the runners and again after them, and the larger kept: a machine whose
    # speed drifts, or a neighbour's load, can only lower a sample, and a bound taken too low
    # would credit every runner with more than its share.
    bandwidth_samples = [read_bandwidth(threads)]
    log(f"DRAM read bandwidth ({threads} threads): {bandwidth_samples[0] / 1e9:.1f} GB/s")
    rss: dict[str, int] = {}

    def load(name: str):
        before = _rss()
        x, kv = parse_variant(name)
        e = Engine.load(
            folder,
            threads=threads,
            wafer=opts.wafer,
            grid=opts.grid,
            spinning=opts.spinning,
            precision=x,
            kv_cache=kv,
        )
        warm = [16 + i % max(1, e.sample_vocab - 16) for i in range(64)]
        for _ in e.generate(
            warm, GenerationParams(max_new_tokens=8, ignore_eos=True), slot="warm-up"
        ):
            pass  # every weight page a step reads is resident now, as for the peers after their warm-up
        rss[name] = max(0, _rss() - before)
        return e

    eng = load("fp32")
    names = ["fp32", *variant_names(tuple(precisions[1:]), opts.kv_caches)]
    variants = {x: load(x) for x in names[1:]}
    n_new = opts.new_tokens
    plen = opts.prompt_tokens
    if plen + n_new + 1 > eng.context:
        raise ModelError(
            f"--prompt-tokens {plen} + --new-tokens {n_new} exceed the model context ({eng.context})"
        )

    rng = np.random.default_rng(opts.seed)
    avoid = set(eng.tokenizer.special_tokens.values()) | set(eng.eos_ids)
    pool = np.array([t for t in range(eng.sample_vocab) if t not in avoid])

    def prompt_for(k: int) -> list[int]:
        r = np.random.default_rng(opts.seed * 1000 + k)
        return [int(t) for t in r.choice(pool, plen)]

    prompts = [prompt_for(k) for k in range(opts.repeats)]
    n_params = int(sum(np.prod(s) for s in expected_shapes(cfg).values()))
    result: dict[str, Any] = {
        "model": str(folder),
        "architecture": cfg.architecture,
        "parameters": n_params,
        "prompt_tokens": plen,
        "new_tokens": n_new,
        "repeats": opts.repeats,
        "threads": threads,
        "emitter": emitter_key(eng.linear),
        "spinning": opts.spinning,
        "load_average_start": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    log(
        f"model {folder} ({cfg.architecture}, {n_params / 1e6:.1f}M parameters), prompt {plen} tokens, "
        f"{n_new} new tokens, {opts.repeats} repeats, {threads} threads"
        + (f", precisions {', '.join(names)}" if len(names) > 1 else "")
    )

    ours = _Ours(eng)
    runners: list = [ours, *(_Ours(e, f"spark-lsp {x}") for x, e in variants.items())]
    n_ours_all = len(runners)
    peers: dict[str, Any] = {}
    if opts.peers:
        factories = {
            "transformers": lambda: peer_mod.TransformersPeer(folder, threads),
        }
        for g in opts.genai:
            factories["onnxruntime-genai" + ("" if g == "fp32" else f" {g}")] = lambda g=g: (
                peer_mod.GenaiPeer(
                    folder, threads, weights_digest(folder), bench_root(), log, precision=g
                )
            )
        for t in opts.gguf:
            factories[f"llama.cpp {t}"] = lambda t=t: LlamaCppPeer(
                folder,
                threads,
                weights_digest(folder),
                bench_root(),
                t,
                cfg.architecture,
                plen + n_new + 16,
                log,
            )
        for name, make in factories.items():
            if name.split(" ")[0] not in opts.peer_names:
                continue
            before = _rss()
            try:
                runner = make()
                runner.timed(prompts[0], 8)  # warm-up (and every page it touches, in its RSS)
            except peer_mod.PeerUnavailable as e:
                log(f"{name}: skipped: {e}")
                peers[name] = {"skipped": str(e)}
                continue
            rss[runner.name] = max(0, _rss() - before)
            runners.append(runner)
    for runner in runners[:n_ours_all]:
        runner.timed(prompts[0], 8)  # warm-up
    ours.stats.clear()
    rates = _rates(runners, prompts, n_new)
    bandwidth_samples.append(read_bandwidth(threads))
    log(f"DRAM read bandwidth after the runs: {bandwidth_samples[-1] / 1e9:.1f} GB/s")
    r = rates[0]
    internal = [s["decode_tok_s"] for s in ours.stats if s["new_tokens"] == n_new]
    n_ours = 1 + len(variants)
    variant_rates = dict(zip(names, rates[:n_ours]))
    engines = {"fp32": eng, **variants}
    # weight bytes a decode step reads, per runner: ours from the graph, llama.cpp's from its GGUF
    step_bytes = {x: graph_bytes_per_token(e.graph_path) for x, e in engines.items()}
    peer_bytes = {
        runner.name: gguf_bytes_per_token(runner.path)
        for runner in runners[n_ours:]
        if isinstance(runner, LlamaCppPeer)
    }
    bandwidth, result["bandwidth_bound_by"] = memory_bound(
        bandwidth_samples,
        {
            **{
                f"spark-lsp {x}": variant_rates[x]["decode_tok_s"] * b
                for x, b in step_bytes.items()
            },
            **{
                runner.name: pr["decode_tok_s"] * peer_bytes[runner.name]
                for runner, pr in zip(runners[n_ours:], rates[n_ours:])
                if runner.name in peer_bytes
            },
        },
    )
    result["bandwidth_gb_s"] = bandwidth / 1e9
    result["bandwidth_samples_gb_s"] = [round(b / 1e9, 2) for b in bandwidth_samples]
    for runner, pr in zip(runners[n_ours:], rates[n_ours:]):
        peers[runner.name] = {
            "version": runner.version,
            "prefill_tok_s": pr["prefill_tok_s"],
            "decode_tok_s": pr["decode_tok_s"],
            "ttft_ms": pr["ttft_ms"],
            "greedy_agreement": f"{_agree(r['tokens'], pr['tokens'])}/{n_new}",
            "rss_mb": rss.get(runner.name, 0) / 1e6,
            "bits": getattr(runner, "bits", 32),
        }
        if isinstance(runner, LlamaCppPeer):
            peers[runner.name].update(
                bandwidth_share(pr["decode_tok_s"], peer_bytes[runner.name], bandwidth)
            )
            runner.close()
        log(
            f"{runner.name}: prefill {pr['prefill_tok_s']:.0f} tok/s, decode {pr['decode_tok_s']:.0f} tok/s"
        )
    del runners
    precision_rows = None
    if variants or auto is not None:
        measured = {n: p for n, p in peers.items() if "skipped" not in p}
        precision_rows = _precision_rows(engines, variant_rates, prompts, measured, log)
    for x, e in engines.items():
        row = {
            "prefill_tok_s": variant_rates[x]["prefill_tok_s"],
            "decode_tok_s": variant_rates[x]["decode_tok_s"],
            "ttft_ms": variant_rates[x]["ttft_ms"],
            "rss_mb": rss[x] / 1e6,
            "bits": {"fp32": 32, "int8": 8, "int8-rowq": 8, "int4": 4}.get(parse_variant(x)[0], 32),
            "kv_cache": str(e.runtime.kv_dtype),
            # not in the RSS above (measured after a short warm-up): the cache a generation of
            # this run's length fills, in the type this runner keeps it in
            "kv_mb": e.runtime.kv_bytes(plen + n_new) / 1e6,
            # [runs that decoded with spinning threads, runs]
            "spinning_runs": variant_rates[x].get("spinning_runs"),
            **bandwidth_share(variant_rates[x]["decode_tok_s"], step_bytes[x], bandwidth),
        }
        result.setdefault("ours", {})[x] = row
    del variants

    # TTFT cold vs. the same prompt with the last token changed (prefix reused).
    cold, warm, reused = [], [], []
    for p in prompts:
        eng.reset()
        g = ours.run(p, 1)
        cold.append(g.stats["ttft_ms"])
        p2 = p[:-1] + [int(pool[(np.searchsorted(pool, p[-1]) + 1) % len(pool)])]
        g = ours.run(p2, 1)
        warm.append(g.stats["ttft_ms"])
        reused.append(g.stats["reused_tokens"])
    engine_res = {
        "prefill_tok_s": r["prefill_tok_s"],
        "decode_tok_s": r["decode_tok_s"],
        "decode_tok_s_internal": _median(internal) if internal else None,
        "ttft_cold_ms": _median(cold),
        "ttft_reused_ms": _median(warm),
        "reused_tokens": int(_median(reused)),
        "reused_over_cold": _median(warm) / _median(cold),
        "load_s": eng.load_s,
    }
    log(
        f"spark-lsp: prefill {r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.0f} tok/s, "
        f"TTFT cold {engine_res['ttft_cold_ms']:.1f} ms / reused {engine_res['ttft_reused_ms']:.2f} ms"
    )
    if opts.cancels:
        engine_res["cancel_decode"] = _cancel_latency(
            eng, prompt_for, opts.cancels, "decode", 0.0, rng
        )
        engine_res["cancel_prefill"] = _cancel_latency(
            eng,
            lambda k: prompt_for(100 + k),
            opts.cancels,
            "prefill",
            engine_res["ttft_cold_ms"],
            rng,
        )
    result["engine"] = engine_res

    result["peers"] = peers
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    result["ratios"] = {
        f"{k}_vs_{name}": engine_res[k] / p[k]
        for name, p in peers.items()
        if "skipped" not in p
        for k in ("decode_tok_s", "prefill_tok_s")
    }
    result["best"] = _best(result["ours"], peers)
    if precision_rows is not None:
        result["precisions"] = precision_rows
        if auto is not None:
            result["precision_auto"] = auto.to_dict()
    return result


def _best(ours: dict[str, dict], peers: dict[str, dict]) -> dict[str, Any] | None:
    """Our fastest decode at any precision against the fastest peer at any of its precisions."""
    measured = {n: p for n, p in peers.items() if "skipped" not in p}
    if not ours or not measured:
        return None
    x = max(ours, key=lambda k: ours[k]["decode_tok_s"])
    n = max(measured, key=lambda k: measured[k]["decode_tok_s"])
    a, b = ours[x]["decode_tok_s"], measured[n]["decode_tok_s"]
    return {"ours": x, "ours_decode_tok_s": a, "peer": n, "peer_decode_tok_s": b, "ratio": a / b}


def _precision_rows(
    engines: dict[str, Any],
    rates: dict[str, dict],
    prompts: list[list[int]],
    peers: dict[str, dict],
    log: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """Per precision: rates, ratios to our fp32 and to each peer, greedy agreement with fp32."""

    ref = rates["fp32"]["all_tokens"]
    rows = {}
    for x, eng in engines.items():
        pr = rates[x]
        agree, total = _teacher_forced(eng, prompts, ref)
        same = sum(_agree(a, b) for a, b in zip(ref, pr["all_tokens"]))
        ratios = {
            f"{k}_vs_fp32": pr[k] / rates["fp32"][k] for k in ("decode_tok_s", "prefill_tok_s")
        }
        ratios.update(
            {
                f"{k}_vs_{name}": pr[k] / p[k]
                for name, p in peers.items()
                for k in ("decode_tok_s", "prefill_tok_s")
            }
        )
        rows[x] = {
            "prefill_tok_s": pr["prefill_tok_s"],
            "decode_tok_s": pr["decode_tok_s"],
            "ttft_ms": pr["ttft_ms"],
            "emitter": emitter_key(eng.linear),
            "load_s": eng.load_s,
            "ratios": ratios,
            "greedy_agreement": f"{agree}/{total}",
            "greedy_agreement_rate": agree / max(total, 1),
            "identical_prefix": f"{same}/{total}",
        }
        log(
            f"spark-lsp {x}: prefill {pr['prefill_tok_s']:.0f} tok/s, decode {pr['decode_tok_s']:.0f} tok/s "
            f"({ratios['decode_tok_s_vs_fp32']:.2f}x fp32), greedy agreement {agree}/{total}"
        )
    return rows


def main(argv: list[str] | None = None, plot: Callable[[dict, str], Any] | None = None) -> int:
    """``python -m engine.lab.bench`` — same as ``spark-lsp bench engine`` (``plot``: see ``run``)."""

    p = argparse.ArgumentParser(prog="spark-lsp bench engine", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv), plot=plot)


def add_arguments(p) -> None:
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="model folder, or a synthetic model: synthetic-8m, synthetic-qwen2.5-coder-0.5b, "
        "synthetic-qwen2.5-coder-1.5b, synthetic-qwen2.5-coder-3b (default: the bundled model)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--prompt-tokens", type=int, default=1000, metavar="N")
    p.add_argument("--new-tokens", type=int, default=128, metavar="N")
    p.add_argument("--repeats", type=int, default=5, metavar="R")
    p.add_argument(
        "--cancels",
        type=int,
        default=10,
        metavar="N",
        help="cancels per phase for the latency figures",
    )
    p.add_argument(
        "--threads", type=int, default=None, metavar="N", help="intra-op threads for every runner"
    )
    p.add_argument(
        "--precision",
        default="fp32",
        metavar="LIST",
        help="our engine's weights, comma-separated: fp32, int8, int8-rowq, int4, auto (the measured "
        "choice); each is loaded once and takes turns with the peers; fp32 always runs "
        "(the peers' weights, the agreement reference; default: fp32)",
    )
    p.add_argument(
        "--kv-cache",
        default="auto",
        metavar="LIST",
        help="our KV cache's element type for each precision after fp32, comma-separated: auto "
        "(the engine's choice: float16 for int8/int4), float32, float16; more than one gives each "
        "precision a runner per type, named e.g. 'int4 kv32' (default: auto)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also draw the headline figures into a PNG (spark-lsp bench; needs matplotlib)",
    )
    p.add_argument("--no-peers", action="store_true", help="skip every peer")
    p.add_argument(
        "--peers",
        default=",".join(PEERS),
        metavar="LIST",
        help=f"peers to run, comma-separated (default: {','.join(PEERS)}); a missing one is skipped",
    )
    p.add_argument(
        "--gguf",
        default=",".join(GGUF_TYPES),
        metavar="LIST",
        help=f"llama.cpp's GGUF types, one runner each (default: {','.join(GGUF_TYPES)})",
    )
    p.add_argument(
        "--genai",
        default=",".join(peer_mod.GENAI_PRECISIONS),
        metavar="LIST",
        help="onnxruntime-genai's builder precisions, one runner each (default: "
        f"{','.join(peer_mod.GENAI_PRECISIONS)})",
    )
    p.add_argument(
        "--prepare",
        action="store_true",
        help="only build what the same command would build on first use (the model, our graphs, "
        "the peers' GGUFs and onnxruntime-genai models), so the run itself only measures",
    )
    p.add_argument(
        "--verify-cost",
        action="store_true",
        help="measure only what a speculative verification pass (1 + 8 drafted tokens) costs in "
        "single decode steps after --prompt-tokens, for each --precision (fp32 only if listed), "
        "and the speed-up that implies at --acceptance rates",
    )
    p.add_argument(
        "--acceptance",
        default=None,
        metavar="LIST",
        help="with --verify-cost: acceptance rates to print the implied speed-up for, e.g. the "
        "ones `spark-lsp bench edits` prints (default: 0.5,0.7,0.8,0.9)",
    )
    p.add_argument(
        "--no-wafer", action="store_true", help="plain MatMuls instead of the partitioned emitter"
    )
    p.add_argument(
        "--grid", default=None, metavar="RxC", help="emulated PE grid (default: the wafer default)"
    )
    spin = p.add_mutually_exclusive_group()
    spin.add_argument(
        "--spinning",
        dest="spinning",
        action="store_const",
        const=True,
        default=None,
        help="force ORT threads to spin between steps (default: the engine's auto mode, "
        "which spins only while the CPU is calm)",
    )
    spin.add_argument(
        "--no-spinning",
        dest="spinning",
        action="store_const",
        const=False,
        help="never spin (leaves the CPU to the editor)",
    )


def run(args, plot: Callable[[dict, str], Any] | None = None) -> int:
    """Parse, measure, print; with ``--plot FILE`` hand the results to ``plot(results, FILE)``.

    The drawing lives in ``spark_lsp.bench.plot`` (the engine never imports ``spark_lsp``), so the
    ``spark-lsp bench`` dispatcher passes it in; ``plot`` may raise RuntimeError with a message.
    """

    grid = None
    try:
        if args.grid:
            try:
                r, c = (int(x) for x in str(args.grid).lower().split("x"))
                assert r > 0 and c > 0
            except (ValueError, AssertionError):
                raise ValueError(
                    f"--grid {args.grid!r}: expected RxC with positive integers, e.g. 4x4"
                ) from None
            grid = (r, c)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads={args.threads} must be a positive integer")
        if getattr(args, "plot", None) and plot is None:
            raise ValueError(
                "--plot is drawn by spark-lsp: run `spark-lsp bench engine --plot FILE`"
            )
        opts = BenchOptions(
            prompt_tokens=args.prompt_tokens,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            cancels=args.cancels,
            threads=args.threads,
            peers=not args.no_peers,
            wafer=not args.no_wafer,
            grid=grid,
            spinning=args.spinning,
            precisions=parse_precisions(getattr(args, "precision", "fp32")),
            kv_caches=parse_list(getattr(args, "kv_cache", "auto"), KV_CACHES, "--kv-cache"),
            peer_names=parse_list(getattr(args, "peers", ",".join(PEERS)), PEERS, "--peers"),
            gguf=parse_list(getattr(args, "gguf", ",".join(GGUF_TYPES)), GGUF_TYPES, "--gguf"),
            genai=parse_list(
                getattr(args, "genai", ",".join(peer_mod.GENAI_PRECISIONS)),
                peer_mod.GENAI_PRECISIONS,
                "--genai",
            ),
        )
        log = (
            (lambda m: print(m, file=sys.stderr)) if args.json else (lambda m: print(m, flush=True))
        )
        if getattr(args, "verify_cost", False):
            return _verify_cost(args, opts, log)
        if getattr(args, "prepare", False):
            prepare(args.model, opts, log)
            return 0
        res = bench_engine(args.model, opts, log=log)
    except (ModelError, ValueError, OSError) as e:
        print(f"spark-lsp bench engine: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print()
        print(format_table(res))
    return plot_results(plot, res, getattr(args, "plot", None), "engine")


def prepare(model: str | None, opts: BenchOptions, log: Callable[[str], None] = print) -> None:
    """Build what a run with ``opts`` would build on its first use, and nothing else: the model
    (a synthetic one is written), our graph per precision, the peers' files (llama.cpp's GGUFs,
    onnxruntime-genai's models). A later run then only measures."""
    folder = resolve_model(str(model) if model is not None else None)
    cfg = load_config(folder)
    log(f"model {folder}")
    precisions = tuple(x for x in dict.fromkeys(["fp32", *opts.precisions]) if x != "auto")
    for x in ["fp32", *variant_names(precisions[1:], opts.kv_caches)]:
        t0 = time.perf_counter()
        prec, kv = parse_variant(x)
        e = Engine.load(
            folder,
            threads=opts.threads,
            wafer=opts.wafer,
            grid=opts.grid,
            precision=prec,
            kv_cache=kv,
        )
        log(f"spark-lsp {x}: graph {e.graph_path} ({time.perf_counter() - t0:.0f} s)")
        del e
    if not opts.peers:
        return
    digest = weights_digest(folder)
    if "llama.cpp" in opts.peer_names:
        for t in opts.gguf:
            try:
                log(
                    f"llama.cpp {t}: {gguf_file(folder, digest, t, bench_root(), cfg.architecture, log)}"
                )
            except peer_mod.PeerUnavailable as e:
                log(f"llama.cpp {t}: skipped: {e}")
    if "onnxruntime-genai" in opts.peer_names:
        for g in opts.genai:
            try:
                log(
                    f"onnxruntime-genai {g}: {peer_mod.genai_model_dir(folder, digest, bench_root(), log, g)}"
                )
            except peer_mod.PeerUnavailable as e:
                log(f"onnxruntime-genai {g}: skipped: {e}")


def _verify_cost(args, opts: BenchOptions, log: Callable[[str], None]) -> int:
    """``--verify-cost``: the pass cost per precision (as listed: fp32 is not forced here)."""
    from . import verify_cost

    rates = verify_cost.DEFAULT_ACCEPTANCE
    if args.acceptance:
        try:
            extra = tuple(float(a) for a in str(args.acceptance).split(",") if a.strip())
        except ValueError:
            raise ValueError(
                f"--acceptance {args.acceptance!r}: expected numbers, e.g. 0.8,0.9"
            ) from None
        if not all(0.0 <= a <= 1.0 for a in extra):
            raise ValueError("--acceptance: rates are between 0 and 1")
        rates = tuple(dict.fromkeys(extra + rates))
    listed = [x.strip().lower() for x in str(args.precision).split(",") if x.strip()]
    names = variant_names(tuple(dict.fromkeys(listed)), opts.kv_caches)  # fp32 only if listed
    res = verify_cost.bench_verify_cost(
        args.model,
        {x: parse_variant(x) for x in names},
        opts.prompt_tokens,
        opts.threads,
        wafer=opts.wafer,
        seed=opts.seed,
        log=log,
    )
    res["acceptance"] = list(rates)
    for row in res["verify_cost"].values():
        row["implied_speedup"] = verify_cost.implied(row, rates)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print("\n".join(verify_cost.format_rows(res["verify_cost"], rates)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
