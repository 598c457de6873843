"""Multi-step decode's time to first token: one step a job, the device's runs, the host's runs.

A multi-step decode job keeps its engine for all its steps, so a prompt that arrives meanwhile
waits for them (time to first token), and so does a sequence whose prefill just finished (its
second token). The device's own runs (sim-next ``multi_step``) cannot be cut short; the runs the
host drives (``runtime.host_multi_step``) can, at a step's end, and the engine ends them when other
work waits (``Planner.stop_runs``). This scenario puts the three side by side under the same
open-loop Poisson load on the same timed device (sim-next B16, PING/PONG, the ``bench-step-<µs>``
timing of ``bench/serve_entry.py``, the software runtime computing the demo model):

- ``one_step``: ``multi_step`` 1 (the default);
- ``device_multi_step``: ``multi_step`` N, the device's own runs;
- ``host_multi_step``: ``multi_step`` N driven by the host, ended early when a prompt arrives.

The servers take turns (A B C, then C B A; ``--rounds``), so the box's drift falls on all three.
``--eos``: the requests end on their EOS (``max_tokens`` the output length as a cap) instead of at a
pinned length: the end-to-end latency shows what a lane that ends inside a run costs (the device's
runs step on to their ends; the host's end with the step of the last lane's end token).
Per variant: TTFT p50/p99, TPOT p50/p99, output tokens/s (steady window), the runs stopped and the
device steps that saved (``calserve_decode_runs_stopped_total``, ``calserve_decode_steps_cut_total``),
the decode steps a job. ``python -m bench.multi_step_ttft [--quick]``, or the ``multi-step-ttft``
scenario of ``bench.scenarios``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench.scenario_lib import BENCH_OUT, calserve_config, run_point, workload_limit, write_json
from bench.scrape import metric_value, parse_metrics
from bench.server import Server, pin_self

__all__ = ["run", "main", "VARIANTS"]

VARIANTS = ("one_step", "device_multi_step", "host_multi_step")
STEP_PREFIX = "bench-step-"


def variant_config(name: str, step_us: int, steps: int, max_inflight: int = 2) -> dict[str, Any]:
    """The server config of one variant (sim-next B16, PING/PONG unless ``max_inflight`` 1, the
    timed step)."""
    cfg = calserve_config(profiles=[16], timing=f"{STEP_PREFIX}{step_us}", max_inflight=max_inflight)
    if name != "one_step":
        cfg["scheduler"]["batch"]["multi_step"] = steps
    if name == "host_multi_step":
        cfg["runtime"]["host_multi_step"] = True
    return cfg


def _counters(srv: Server) -> dict[str, float]:
    status, body = srv.get("/metrics")
    if status != 200:
        return {}
    m = parse_metrics(body.decode())
    names = {"runs_stopped": "calserve_decode_runs_stopped_total",
             "steps_cut": "calserve_decode_steps_cut_total",
             "decode_steps": "calserve_decode_steps_total",
             "decode_jobs": "calserve_batches_total"}
    return {k: metric_value(m, n) or 0.0 for k, n in names.items()}


def _point(out: Path, name: str, rnd: int, step_us: int, steps: int, rate: float, duration: float,
           prompt: str, output: str, max_inflight: int, eos: bool = False) -> dict[str, Any]:
    cfg = variant_config(name, step_us, steps, max_inflight)
    with Server.calserve(cfg, out / f"server-{name}-{rnd}") as srv:
        run_point(srv, out / f"{name}-{rnd}-warmup", concurrency=8, duration=1.0, prompt=prompt,
                  output=output, progress=False)
        before = _counters(srv)
        res = run_point(srv, out / f"{name}-{rnd}", rate=rate, duration=duration, prompt=prompt,
                        output=output, seed=100 + rnd, ignore_eos=not eos)
        after = _counters(srv)
    s = res.summary
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {
        "variant": name, "round": rnd,
        "ttft_p50_ms": s["ttft_ms"].get("p50"), "ttft_p99_ms": s["ttft_ms"].get("p99"),
        "tpot_p50_ms": s["tpot_ms"].get("p50"), "tpot_p99_ms": s["tpot_ms"].get("p99"),
        "itl_p99_ms": s.get("itl_ms", {}).get("p99"),
        "e2e_p50_ms": s["e2e_ms"].get("p50"), "e2e_p99_ms": s["e2e_ms"].get("p99"),
        "tokens_per_request": s["output_tokens"] / ok if (ok := s["outcomes"].get("ok")) else None,
        "output_tok_s": (s.get("window") or {}).get("output_throughput") or s["output_throughput"],
        "outcomes": s["outcomes"],
        "runs_stopped": d.get("runs_stopped", 0.0), "steps_cut": d.get("steps_cut", 0.0),
        "steps_per_job": d["decode_steps"] / d["decode_jobs"] if d.get("decode_jobs") else None,
    }


def run(out: Path, quick: bool = False, step_us: int = 4000, steps: int = 8, load: float = 0.6,
        rounds: int | None = None, max_inflight: int = 2, eos: bool = False) -> dict[str, Any]:
    """Each variant ``rounds`` times (A B C / C B A ...), Poisson arrivals at ``load`` of the bound
    the timing model allows for the workload (prompt 16, output 128 at B16). With PING/PONG
    (``max_inflight`` 2) a prompt finds an engine free more often (and the host's one-step jobs
    let another engine's prefill in between two steps, the device's multi-step job does not);
    with 1 every prompt that arrives during a run waits for it, unless it is ended early."""
    prompt, output = "16", "128"
    base, per_tok = 2000.0 * step_us / 4000.0, 20.0 * step_us / 4000.0  # sat-4k's prefill, scaled
    bound_tok_s = workload_limit(16, step_us, 16, 128, base, per_tok)
    rate = load * bound_tok_s / 128
    duration = 6.0 if quick else 12.0
    rounds = rounds or (1 if quick else 2)
    rows = []
    for rnd in range(rounds):
        order = VARIANTS if rnd % 2 == 0 else tuple(reversed(VARIANTS))
        for name in order:
            rows.append(_point(out, name, rnd, step_us, steps, rate, duration, prompt, output, max_inflight, eos))
    table = {}
    for name in VARIANTS:
        mine = [r for r in rows if r["variant"] == name]

        def med(key: str, mine: list[dict[str, Any]] = mine) -> float | None:
            vals = [r[key] for r in mine if r[key] is not None]
            return statistics.median(vals) if vals else None

        table[name] = {k: med(k) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                                           "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "tokens_per_request",
                                           "output_tok_s", "runs_stopped", "steps_cut", "steps_per_job")}
    one = table["one_step"]
    ratios: dict[str, dict[str, float | None]] = {}
    for name in VARIANTS[1:]:
        t = table[name]
        ratios[name] = {}
        for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p50_ms", "output_tok_s"):
            a, b = t[k], one[k]
            ratios[name][k] = a / b if a is not None and b else None
    doc = {"step_us": step_us, "multi_step": steps, "max_inflight": max_inflight, "rate_req_s": rate, "bound_tok_s": bound_tok_s,
           "load": load, "prompt": prompt, "output": output, "rounds": rounds, "eos": eos,
           "by_variant": table, "vs_one_step": ratios, "rows": rows}
    write_json(out / "summary.json", doc)
    _write_table(out / "table.md", doc)
    return doc


def _fmt(v: Any, nd: int = 1) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def _write_table(path: Path, doc: dict[str, Any]) -> None:
    lines = [f"B16, {doc['step_us'] / 1000:g} ms step, max_inflight {doc.get('max_inflight', 2)}, "
             f"multi_step {doc['multi_step']}, Poisson "
             f"{doc['rate_req_s']:.1f} req/s ({doc['load']:.0%} of {doc['bound_tok_s']:.0f} tok/s), "
             f"prompt {doc['prompt']}, output {doc['output']}"
             f"{' (ends on EOS, a cap)' if doc.get('eos') else ''}, medians of {doc['rounds']} round(s)", "",
             "| variant | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p99 ms | E2E p50 ms | "
             "E2E p99 ms | tokens a request | tok/s | steps a job | runs stopped | steps cut |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in doc["by_variant"].items():
        lines.append(f"| {name} | {_fmt(t['ttft_p50_ms'])} | {_fmt(t['ttft_p99_ms'])} | "
                     f"{_fmt(t['tpot_p50_ms'], 2)} | {_fmt(t['tpot_p99_ms'], 2)} | {_fmt(t['itl_p99_ms'])} | "
                     f"{_fmt(t.get('e2e_p50_ms'))} | {_fmt(t.get('e2e_p99_ms'))} | "
                     f"{_fmt(t.get('tokens_per_request'))} | "
                     f"{_fmt(t['output_tok_s'], 0)} | {_fmt(t['steps_per_job'], 2)} | "
                     f"{_fmt(t['runs_stopped'], 0)} | {_fmt(t['steps_cut'], 0)} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--step-us", type=int, default=4000, help="the B16 step (a bench-step-<µs> timing)")
    ap.add_argument("--multi-step", type=int, default=8)
    ap.add_argument("--load", type=float, default=0.6, help="Poisson load, share of the workload bound")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--max-inflight", type=int, default=2, choices=(1, 2),
                    help="executor.max_inflight: 2 = PING/PONG (configs/sim-next.yaml), 1 = one engine")
    ap.add_argument("--eos", action="store_true",
                    help="requests end on their EOS (the output length a cap), not at a pinned length")
    ap.add_argument("--out", type=Path, default=BENCH_OUT / "multi-step-ttft")
    a = ap.parse_args(argv)
    pin_self(1)  # the load generator on core 1, the server on core 0 (as bench.scenarios)
    doc = run(a.out, a.quick, a.step_us, a.multi_step, a.load, a.rounds, a.max_inflight, a.eos)
    print((a.out / "table.md").read_text())
    return 0 if all(r["outcomes"].get("ok", 0) > 0 for r in doc["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
