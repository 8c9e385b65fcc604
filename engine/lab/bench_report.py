"""What `spark-lsp bench engine` prints: the table of runners, per precision and per precision
class, with the decode shares of the DRAM bound; and ``plot_results``, which the engine, edit
and wafer benches share for ``--plot``.  Measuring is ``engine.lab.bench``'s."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

#: Issue target 2: quantised decode at least this many times our fp32 decode ...
TARGET_SPEEDUP = 2.0
#: ... with at least this share of greedy tokens agreeing with fp32.
TARGET_AGREEMENT = 0.95


def format_precisions(res: dict[str, Any]) -> list[str]:
    """The per-precision rows of the table (empty when only fp32 ran)."""
    rows = res.get("precisions")
    if not rows:
        return []
    peers = [n for n, p in res["peers"].items() if "skipped" not in p]
    short = {n: n.replace("onnxruntime-genai", "ort-genai") for n in peers}
    width = {n: max(17, len(short[n]) + 5) for n in peers}
    head = (
        f"{'precision':<12}{'prefill tok/s':>15}{'decode tok/s':>15}{'vs fp32':>9}"
        + "".join(f"{'vs ' + short[n]:>{width[n]}}" for n in peers)
        + "  greedy agreement with fp32"
    )
    lines = [
        "",
        "our engine per precision (decode ratios; agreement: teacher-forced tokens over all prompts, "
        "identical prefix when generating freely)",
        head,
    ]
    for x, row in rows.items():
        rt = row["ratios"]
        meets = (
            x != "fp32"
            and rt["decode_tok_s_vs_fp32"] >= TARGET_SPEEDUP
            and row["greedy_agreement_rate"] >= TARGET_AGREEMENT
        )
        lines.append(
            f"{x:<12}{row['prefill_tok_s']:>15.0f}{row['decode_tok_s']:>15.0f}"
            f"{rt['decode_tok_s_vs_fp32']:>8.2f}x"
            + "".join(f"{rt[f'decode_tok_s_vs_{n}']:>{width[n] - 1}.2f}x" for n in peers)
            + f"  {row['greedy_agreement']} ({100 * row['greedy_agreement_rate']:.1f}%), "
            f"identical prefix {row['identical_prefix']}"
            + (f"  [>= {TARGET_SPEEDUP:g}x and >= {100 * TARGET_AGREEMENT:.0f}%]" if meets else "")
        )
    auto = res.get("precision_auto")
    if auto:
        lines.append(
            f"auto: {auto['precision']} ({auto['reason']}{', cached decision' if auto.get('cached') else ''})"
        )
    return lines


def _bound_source(res: dict[str, Any]) -> str:
    """Where the class table's bandwidth bound came from (:func:`memory_bound`)."""
    by = res.get("bandwidth_bound_by", "reader")
    if by == "reader":
        return "the larger of two samples, before and after the runs; "
    samples = ", ".join(f"{b:.1f}" for b in res.get("bandwidth_samples_gb_s", []))
    return f"what {by}'s decode streamed, more than the reader's samples ({samples}); "


def format_classes(res: dict[str, Any]) -> list[str]:
    """Every runner by precision class (32-, 8-, 4-bit weights): rates, resident memory, and decode
    against the DRAM bound (measured bandwidth / weight bytes read per token)."""
    rows = [(f"spark-lsp {x}", r) for x, r in res.get("ours", {}).items()]
    rows += [(n, p) for n, p in res["peers"].items() if "skipped" not in p]
    if not rows:
        return []
    lines = [
        "",
        f"by precision class (DRAM read bandwidth {res['bandwidth_gb_s']:.1f} GB/s: "
        + _bound_source(res)
        + "RSS: resident memory the runner added by its load and warm-up, approximate: one process; "
        "KV MB: our KV cache for one prompt and its new tokens, which that RSS does not hold)",
        f"{'bits':<6}{'runner':<26}{'prefill tok/s':>14}{'decode tok/s':>13}{'TTFT ms':>10}{'RSS MB':>9}"
        f"{'KV MB':>7}{'MB/token':>10}{'% of bound':>11}{'decode vs llama.cpp':>21}",
    ]
    for bits in (32, 16, 8, 4):
        group = [(n, r) for n, r in rows if r.get("bits", 32) == bits]
        llama = [r["decode_tok_s"] for n, r in group if n.startswith("llama.cpp")]
        for n, r in group:
            pct = f"{r['bandwidth_pct']:.0f}%" if "bandwidth_pct" in r else "-"
            mb = f"{r['weight_mb_per_token']:.0f}" if "weight_mb_per_token" in r else "-"
            vs = (
                f"{r['decode_tok_s'] / max(llama):.2f}x"
                if llama and n.startswith("spark-lsp")
                else ""
            )
            kv = f"{r['kv_mb']:.1f}" if "kv_mb" in r else "-"
            lines.append(
                f"{bits:<6}{n:<26}{r['prefill_tok_s']:>14.0f}{r['decode_tok_s']:>13.1f}{r['ttft_ms']:>10.0f}"
                f"{r.get('rss_mb', 0):>9.0f}{kv:>7}{mb:>10}{pct:>11}{vs:>21}"
            )
    lines += _sleeping_runs(res)
    return lines


def _sleeping_runs(res: dict[str, Any]) -> list[str]:
    """A line for each of our runners that decoded some runs without spinning threads: under
    ``spinning: auto`` the engine stops spinning while the CPU is contended, which a peer's turn
    just before can make it look (llama.cpp's threads spin regardless)."""
    out = []
    why = (
        "--no-spinning" if res.get("spinning") is False else "spinning: auto saw the CPU contended"
    )
    for x, r in res.get("ours", {}).items():
        spun, runs = r.get("spinning_runs") or (0, 0)
        if runs and spun < runs:
            out.append(
                f"spark-lsp {x} decoded {runs - spun} of {runs} runs without spinning threads "
                f"({why}); --spinning compares it spinning, as llama.cpp's threads do"
            )
    return out


def format_table(res: dict[str, Any]) -> str:
    """The benchmark as a table for people."""
    e = res["engine"]
    lines = [
        f"model: {res['model']} ({res['architecture']}, {res['parameters'] / 1e6:.1f}M params)",
        f"prompt {res['prompt_tokens']} tokens, {res['new_tokens']} new tokens (greedy), medians of "
        f"{res['repeats']}, {res['threads']} threads, emitter {res['emitter']}",
        f"machine load average {res['load_average_start']} -> {res['load_average_end']} on {res['cpus']} CPUs"
        + (
            "  (busy machine: figures are noisy; the runners take turns so ratios stay comparable)"
            if max(res["load_average_start"], res["load_average_end"]) > 0.5 * (res["cpus"] or 1)
            else ""
        ),
        "",
        f"{'runner':<20}{'prefill tok/s':>15}{'decode tok/s':>15}{'TTFT ms':>10}{'ours/peer':>14}  notes",
        f"{'spark-lsp':<20}{e['prefill_tok_s']:>15.0f}{e['decode_tok_s']:>15.0f}{e['ttft_cold_ms']:>10.1f}"
        f"{'1.00':>14}",
    ]
    for name, p in res["peers"].items():
        if "skipped" in p:
            lines.append(f"{name:<20}{'skipped':>15}  {p['skipped']}")
            continue
        ratio = e["decode_tok_s"] / p["decode_tok_s"]
        lines.append(
            f"{name:<20}{p['prefill_tok_s']:>15.0f}{p['decode_tok_s']:>15.0f}{p['ttft_ms']:>10.1f}"
            f"{ratio:>13.2f}x  greedy agreement {p['greedy_agreement']}; {p['version']}"
        )
    lines += [
        "",
        f"TTFT cold {e['ttft_cold_ms']:.2f} ms; last token changed (reused {e['reused_tokens']} tokens): "
        f"{e['ttft_reused_ms']:.2f} ms = {100 * e['reused_over_cold']:.1f}% of cold",
    ]
    for phase in ("decode", "prefill"):
        c = e.get(f"cancel_{phase}")
        if c:
            lines.append(
                f"cancel latency during {phase}: median {c['median_ms']:.2f} ms, p95 {c['p95_ms']:.2f} ms "
                f"({c['cancelled']}/{c['n']} cancelled)"
            )
    if res["ratios"]:
        lines.append("ours/peer: " + ", ".join(f"{k} {v:.2f}x" for k, v in res["ratios"].items()))
    best = res.get("best")
    if best:
        lines.append(
            f"best decode at any precision: spark-lsp {best['ours']} {best['ours_decode_tok_s']:.1f} "
            f"tok/s vs {best['peer']} {best['peer_decode_tok_s']:.1f} tok/s: {best['ratio']:.2f}x"
        )
    lines += format_classes(res)
    lines += format_precisions(res)
    return "\n".join(lines)


def plot_results(
    plot: Callable[[dict, str], Any] | None, res: dict, path: str | None, name: str
) -> int:
    """Draw ``res`` into ``path`` when asked; 0, or 2 with the reason on stderr.

    Shared by the benchmarks that run behind ``spark-lsp bench`` (edits, wafer, lsp)."""
    if not path:
        return 0
    if plot is None:
        print(
            f"spark-lsp bench {name}: --plot is drawn by spark-lsp: run `spark-lsp bench {name} --plot FILE`",
            file=sys.stderr,
        )
        return 2
    try:
        print(f"plot: {plot(res, path)}", file=sys.stderr)
    except (RuntimeError, OSError) as e:
        print(f"spark-lsp bench {name}: --plot: {e}", file=sys.stderr)
        return 2
    return 0
