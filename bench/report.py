"""``python -m bench.report RUN_DIR [RUN_DIR...] [--out DIR]``: a markdown table + PNGs for runs.

A run directory is what ``python -m bench.loadgen --out`` (or a scenario) wrote: ``records.jsonl``,
``summary.json``, ``metrics.jsonl``. Several runs are shown side by side (one column each; one CDF line
each), so two servers or two configurations compare at a glance. Writes ``report.md`` and PNGs into
``--out`` (default: the first run directory) and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.scrape import derive_series
from bench.summary import read_records

__all__ = ["load_run", "table", "report", "main"]


def load_run(d: Path) -> dict[str, Any]:
    metrics = []
    mp = d / "metrics.jsonl"
    if mp.exists():
        metrics = [json.loads(line) for line in mp.read_text().splitlines() if line.strip()]
    return {"name": d.name, "dir": d, "summary": json.loads((d / "summary.json").read_text()),
            "records": read_records(d / "records.jsonl"), "metrics": metrics}


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def table(summaries: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """Rows = metrics, columns = runs."""
    rows: list[tuple[str, Any]] = [
        ("sent", lambda s: s["sent"]),
        ("ok", lambda s: s["outcomes"]["ok"]),
        ("rejected (429/503)", lambda s: s["outcomes"]["rejected"]),
        ("failed", lambda s: s["outcomes"]["failed"]),
        ("disconnected", lambda s: s["outcomes"]["disconnected"]),
        ("timeout", lambda s: s["outcomes"]["timeout"]),
        ("duration (s)", lambda s: s["duration_s"]),
        ("requests/s", lambda s: s["request_throughput"]),
        ("output tokens/s", lambda s: s["output_throughput"]),
        ("output tokens/s (steady window)", lambda s: s["window"]["output_throughput"]),
        ("goodput (req/s)", lambda s: s["goodput"]),
    ]
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for q in ("mean", "p50", "p90", "p99"):
            rows.append((f"{m[:-3].upper()} {q} (ms)", lambda s, m=m, q=q: s[m].get(q)))
    rows.append(("batch fill (mean)", lambda s: (s.get("batch_fill") or {}).get("mean")))
    rows.append(("queue depth (mean)", lambda s: (s.get("queue_depth") or {}).get("mean")))
    rows.append(("server CPU (s)", lambda s: (s.get("server_proc") or {}).get("cpu_s")))
    head = "| metric | " + " | ".join(n for n, _ in summaries) + " |"
    sep = "|---|" + "---|" * len(summaries)
    lines = [head, sep]
    for label, f in rows:
        vals = []
        for _, s in summaries:
            try:
                vals.append(_fmt(f(s)))
            except (KeyError, TypeError):
                vals.append("–")
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def report(run_dirs: Sequence[Path], out: Path, title: str = "") -> str:
    from bench import plots

    runs = [load_run(d) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# {title or 'Benchmark report'}", "", table([(r["name"], r["summary"]) for r in runs]), ""]
    p = plots.latency_cdfs([(r["name"], r["records"]) for r in runs], out / "latency_cdf.png")
    md.append(f"![latency CDFs]({p.name})")
    series = [(r["name"], derive_series(r["metrics"])) for r in runs]
    if any(s["batch_fill"] or s["queue_depth"] for _, s in series):
        p = plots.batch_fill(series, out / "batch_fill.png")
        md.append(f"![batch fill]({p.name})")
    for r in runs:
        if len(r["summary"]["tenants"]) > 1:
            p = plots.tenant_service(r["summary"], out / f"service_{r['name']}.png", r["name"])
            md.append(f"![service {r['name']}]({p.name})")
    text = "\n".join(md) + "\n"
    (out / "report.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--title", default="")
    a = ap.parse_args(argv)
    for d in a.runs:
        if not (d / "summary.json").exists():
            print(f"error: {d} has no summary.json (not a run directory)")
            return 2
    print(report(a.runs, a.out or a.runs[0], a.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
