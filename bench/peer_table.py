"""The ``peer`` scenario's figures from its per-run rows: means over the repeats, the calserve /
llama-server ratio of each row, the markdown table and the two figures (no servers here: pure logic,
tested with fake rows in ``tests/bench/test_bench_peer.py``).

A run row (one load point against one server) carries ``model``, ``streams``, ``arm`` (``calserve-*``
or ``llama-server``), ``rep``, ``tok_s`` (output tokens/s), ``ttft_p50_ms``, ``ttft_p99_ms``,
``tpot_p50_ms``, ``failed`` and optionally ``prefill_tok_s`` (one-wave runs: prompt tokens / the
time of the last first token), ``cpu_ms_per_token`` / ``host_cpu_ms_per_token`` /
``device_cpu_ms_per_token`` (server CPU per output token; calserve splits its software NPU's
``calrt-sim-*`` threads from the rest).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["PEER_ARM", "METRICS", "aggregate", "ratio_rows", "markdown_table", "plot_rows",
           "plot_diagnostics"]

PEER_ARM = "llama-server"
METRICS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "prefill_tok_s", "cpu_ms_per_token",
           "host_cpu_ms_per_token", "device_cpu_ms_per_token")


def _finite(xs: Iterable[Any]) -> list[float]:
    return [float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def aggregate(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, Any]]:
    """(model, streams, arm) -> mean of each metric over the repeats, with ``<metric>_min`` /
    ``_max`` and ``reps``; failed requests summed (``failed``)."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["model"]), int(r["streams"]), str(r["arm"])), []).append(r)
    out: dict[tuple[str, int, str], dict[str, Any]] = {}
    for key, rs in groups.items():
        agg: dict[str, Any] = {"model": key[0], "streams": key[1], "arm": key[2], "reps": len(rs),
                               "failed": sum(int(r.get("failed") or 0) for r in rs)}
        for m in METRICS:
            xs = _finite(r.get(m) for r in rs)
            agg[m] = _mean(xs)
            agg[f"{m}_min"] = min(xs) if xs else math.nan
            agg[f"{m}_max"] = max(xs) if xs else math.nan
        out[key] = agg
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def ratio_rows(agg: dict[tuple[str, int, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per calserve arm and (model, streams) that llama-server also ran: both sides' means and
    the ratios calserve / llama-server (``tok_s_ratio`` >= 1 is the target; for the latencies < 1 is
    better). Sorted by model, streams, arm."""
    rows = []
    for (model, streams, arm), a in sorted(agg.items()):
        if arm == PEER_ARM:
            continue
        p = agg.get((model, streams, PEER_ARM))
        if p is None:
            continue
        row: dict[str, Any] = {"model": model, "streams": streams, "calserve": arm,
                               "reps": min(a["reps"], p["reps"]),
                               "failed": a["failed"] + p["failed"]}
        for m in METRICS:
            row[f"calserve_{m}"] = a[m]
            row[f"llama_{m}"] = p[m]
        row["calserve_tok_s_range"] = (a["tok_s_min"], a["tok_s_max"])
        row["llama_tok_s_range"] = (p["tok_s_min"], p["tok_s_max"])
        for m in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "prefill_tok_s",
                  "cpu_ms_per_token"):
            row[f"{m}_ratio"] = _ratio(a[m], p[m])
        row["meets_target"] = bool(row["tok_s_ratio"] >= 1.0) if math.isfinite(row["tok_s_ratio"]) \
            else None
        rows.append(row)
    return rows


def _f(x: Any, nd: int = 0) -> str:
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "–"
    return f"{x:,.{nd}f}"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The headline table: one line per ratio row."""
    head = ("| model | streams | calserve config | calserve tok/s | llama-server tok/s | ratio | "
            "TTFT p50 ms (cs / llama) | TTFT p99 ms (cs / llama) | TPOT p50 ms (cs / llama) | "
            "prefill tok/s, one wave (cs / llama) | "
            "CPU ms/token (cs host + NPU sim / llama) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        # requests that did not complete (refused, failed, timed out) over the repeats: the row
        # then compares less work on that side
        bad = f" ({r['failed']} not ok)" if r.get("failed") else ""
        lo, hi = r["calserve_tok_s_range"]
        plo, phi = r["llama_tok_s_range"]
        cpu = (f"{_f(r['calserve_host_cpu_ms_per_token'], 2)} + "
               f"{_f(r['calserve_device_cpu_ms_per_token'], 2)} / {_f(r['llama_cpu_ms_per_token'], 2)}")
        lines.append(
            f"| {r['model']} | {r['streams']} | {r['calserve']} | {_f(r['calserve_tok_s'])} "
            f"({_f(lo)}–{_f(hi)}) | {_f(r['llama_tok_s'])} ({_f(plo)}–{_f(phi)}) | "
            f"**{_f(r['tok_s_ratio'], 2)}×**{bad} | {_f(r['calserve_ttft_p50_ms'])} / "
            f"{_f(r['llama_ttft_p50_ms'])} | {_f(r['calserve_ttft_p99_ms'])} / "
            f"{_f(r['llama_ttft_p99_ms'])} | {_f(r['calserve_tpot_p50_ms'], 1)} / "
            f"{_f(r['llama_tpot_p50_ms'], 1)} | {_f(r['calserve_prefill_tok_s'])} / "
            f"{_f(r['llama_prefill_tok_s'])} | {cpu} |")
    return "\n".join(lines) + "\n"


def _pyplot() -> Any:
    import bench.plots  # noqa: F401  (selects the Agg backend)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_rows(agg: dict[tuple[str, int, str], dict[str, Any]], path: Path) -> Path:
    """Output tok/s (mean, min–max bars) and TTFT p50/p99 per (model, streams), one bar per server."""
    plt = _pyplot()

    groups = sorted({(k[0], k[1]) for k in agg})
    arms = sorted({k[2] for k in agg}, key=lambda a: (a == PEER_ARM, a))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    width = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        xs, ys, lo, hi, p50, p99 = [], [], [], [], [], []
        for g, (model, streams) in enumerate(groups):
            a = agg.get((model, streams, arm))
            if a is None:
                continue
            xs.append(g + (i - (len(arms) - 1) / 2) * width)
            ys.append(a["tok_s"])
            lo.append(max(0.0, a["tok_s"] - a["tok_s_min"]))
            hi.append(max(0.0, a["tok_s_max"] - a["tok_s"]))
            p50.append(a["ttft_p50_ms"])
            p99.append(a["ttft_p99_ms"])
        axes[0].bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=arm)
        axes[1].bar(xs, p50, width, label=arm)
        axes[2].bar(xs, p99, width, label=arm)
    for ax, title in zip(axes, ("output tokens/s (min–max over repeats)", "TTFT p50 (ms)",
                                "TTFT p99 (ms)")):
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{m}\n{s} streams" for m, s in groups], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    for ax in axes:  # the two models are ~50x apart
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def plot_diagnostics(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Where calserve loses: (left) the ratios calserve / llama-server of throughput, TTFT p50 and
    TPOT p50 per row (TTFT = prefill + queueing, TPOT = decode); (right) server CPU per output token,
    calserve split into its host work and the software NPU's kernel threads, beside llama-server's."""
    import numpy as np

    plt = _pyplot()

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(15, 4.4))
    labels = [f"{r['model']} {r['streams']}s\n{r['calserve'].removeprefix('calserve-')}" for r in rows]
    x = np.arange(len(rows))
    w = 0.27
    for j, (m, name) in enumerate((("tok_s_ratio", "tok/s"), ("ttft_p50_ms_ratio", "TTFT p50"),
                                   ("tpot_p50_ms_ratio", "TPOT p50"))):
        a1.bar(x + (j - 1) * w, [r[m] for r in rows], w, label=name)
    a1.axhline(1.0, color="k", lw=0.8)
    a1.set_yscale("log")
    a1.set_title("calserve / llama-server (tok/s: higher is better; TTFT, TPOT: lower)", fontsize=9)
    llama = [r["llama_cpu_ms_per_token"] for r in rows]
    host = [_ratio(r["calserve_host_cpu_ms_per_token"], p) for r, p in zip(rows, llama)]
    dev = [_ratio(r["calserve_device_cpu_ms_per_token"], p) for r, p in zip(rows, llama)]
    a2.bar(x, host, 0.5, label="calserve host (Python, HTTP, engine)")
    a2.bar(x, dev, 0.5, bottom=host, label="calserve software NPU kernels (calrt-sim threads)")
    a2.axhline(1.0, color="k", lw=0.8, label="llama-server (all threads) = 1")
    for xi, (h, d, p) in enumerate(zip(host, dev, llama)):
        a2.text(xi, h + d, f"{p:.2g} ms", ha="center", va="bottom", fontsize=6)
    a2.set_title("server CPU per output token, calserve / llama-server (label: llama's ms)", fontsize=9)
    for ax in (a1, a2):
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    return _save(fig, path)
