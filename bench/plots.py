"""PNG plots of benchmark runs (matplotlib, Agg backend; imported lazily so the load generator stays
lean). Each function takes run directories' data and writes one PNG, returning its path."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.summary import Record  # noqa: E402

__all__ = ["latency_cdfs", "sweep_plot", "tenant_service", "cumulative_weighted_service",
           "cumulative_weighted_service_grid", "batch_fill", "proc_series"]


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def latency_cdfs(runs: Sequence[tuple[str, list[Record]]], path: Path) -> Path:
    """TTFT, TPOT, ITL and E2E CDFs, one line per run."""
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for label, recs in runs:
        ok = [r for r in recs if r.outcome == "ok"]
        series = {
            "TTFT (ms)": [r.ttft * 1000 for r in ok if r.ttft is not None],
            "TPOT (ms)": [t * 1000 for t in (r.tpot for r in ok) if t is not None],
            "ITL (ms)": [(b - a) * 1000 for r in ok for a, b in zip(r.token_times, r.token_times[1:])],
            "E2E (ms)": [r.e2e * 1000 for r in ok if r.e2e is not None],
        }
        for ax, (name, xs) in zip(axes, series.items()):
            if xs:
                a = np.sort(np.asarray(xs))
                ax.plot(a, np.arange(1, a.size + 1) / a.size, label=label)
            ax.set_xlabel(name)
            ax.set_ylabel("fraction")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def sweep_plot(points: Sequence[dict[str, Any]], x: str, path: Path, *, xlabel: str,
               limit: float | None = None, logx: bool = False) -> Path:
    """Output throughput and TTFT (p50/p99) against a swept parameter (rate or concurrency)."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    groups: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault(str(p.get("series", "")), []).append(p)
    for name, pts in groups.items():
        pts = sorted(pts, key=lambda p: p[x])
        xs = [p[x] for p in pts]
        ys = [p.get("window_output_throughput") or p["output_throughput"] for p in pts]
        a1.plot(xs, ys, marker="o", label=name or "output tok/s (steady window)")
        a2.plot(xs, [p["ttft_p50_ms"] for p in pts], marker="o", label=f"{name} p50".strip())
        a2.plot(xs, [p["ttft_p99_ms"] for p in pts], marker="x", ls="--",
                label=f"{name} p99".strip())
    if limit:
        a1.axhline(limit, color="grey", ls=":", label="device-bound limit")
    for ax in (a1, a2):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if logx:
            ax.set_xscale("log", base=2)
    a1.set_ylabel("output tokens/s")
    a2.set_ylabel("TTFT (ms)")
    a2.set_yscale("log")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    return _save(fig, path)


def tenant_service(summary: dict[str, Any], path: Path, title: str = "") -> Path:
    """Delivered output tokens/s per tenant over time."""
    sot = summary["service_over_time"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, row in sorted(sot["tokens_per_s"].items()):
        ax.plot(np.arange(len(row)) * sot["bin_s"], row, label=name)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens/s delivered")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def _service_row(axes: Sequence[Any], by_policy: dict[str, dict[str, list[float]]], title: str) -> None:
    for ax, (policy, series) in zip(axes, by_policy.items()):
        t = series.get("t", [])
        names = sorted(k for k in series if k != "t")
        for n in names:
            ax.plot(t, series[n], label=n, lw=1)
        ax.set_title(f"{title} {policy}: cumulative service / weight", fontsize=9)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("cost units / weight")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        if names and t:
            gap = [max(series[n][i] for n in names) - min(series[n][i] for n in names)
                   for i in range(len(t))]
            axes[-1].plot(t, gap, label=policy)
    axes[-1].set_title(f"{title} gap: max - min of service / weight", fontsize=9)
    axes[-1].set_xlabel("time (s)")
    axes[-1].set_ylabel("cost units")
    axes[-1].set_yscale("symlog", linthresh=100)
    axes[-1].grid(alpha=0.3)
    axes[-1].legend(fontsize=7)


def cumulative_weighted_service(by_policy: dict[str, dict[str, list[float]]], path: Path,
                                title: str = "") -> Path:
    """Cumulative weighted service per tenant over time (cost units / weight), one panel per
    policy, and the gap (max - min across tenants) of every policy in a third panel.
    ``by_policy``: policy -> ``{"t": [...], tenant: [...]}``."""
    fig, axes = plt.subplots(1, len(by_policy) + 1, figsize=(5 * (len(by_policy) + 1), 3.8))
    _service_row(axes, by_policy, "")
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def cumulative_weighted_service_grid(cases: Sequence[tuple[str, dict[str, dict[str, list[float]]]]],
                                     path: Path) -> Path:
    """:func:`cumulative_weighted_service` for several cases, one row each, in one PNG."""
    cols = max(len(bp) for _, bp in cases) + 1
    fig, axes = plt.subplots(len(cases), cols, figsize=(4.6 * cols, 3.3 * len(cases)), squeeze=False)
    for row, (title, by_policy) in zip(axes, cases):
        _service_row(row, by_policy, title)
    return _save(fig, path)


def batch_fill(series: Sequence[tuple[str, dict[str, list[tuple[float, float]]]]], path: Path) -> Path:
    """Batch fill ratio and queue depth over time (from ``/metrics`` samples), one line per run."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    for label, s in series:
        if s.get("batch_fill"):
            t, v = zip(*s["batch_fill"])
            a1.plot(t, v, label=label)
        if s.get("queue_depth"):
            t, v = zip(*s["queue_depth"])
            a2.plot(t, v, label=label)
    a1.set_ylabel("batch fill ratio")
    a1.set_ylim(0, 1.05)
    a2.set_ylabel("requests waiting")
    for ax in (a1, a2):
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def proc_series(proc: Sequence[dict[str, Any]], path: Path, marks: Sequence[float] = ()) -> Path:
    """Server RSS, open fds and CPU utilisation over time (soak)."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.4))
    t = [p["t"] for p in proc]
    axes[0].plot(t, [p["rss_bytes"] / 2**20 for p in proc])
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].plot(t, [p["open_fds"] for p in proc])
    axes[1].set_ylabel("open fds")
    cpu = [0.0] + [(b["cpu_s"] - a["cpu_s"]) / max(1e-9, b["t"] - a["t"])
                   for a, b in zip(proc, proc[1:])]
    axes[2].plot(t, cpu)
    axes[2].set_ylabel("CPU (cores)")
    for ax in axes:
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
        for m in marks:
            ax.axvline(m, color="grey", ls=":")
    return _save(fig, path)
