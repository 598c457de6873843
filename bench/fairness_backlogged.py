"""The ``fairness-backlogged`` scenario: fairness measured the way VTC measures it (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI '24).

Open-loop Poisson tenants whose combined demand exceeds what the server can serve for the whole run,
VTC's request shape (256 prompt tokens, 256 output tokens) and VTC's cost units (input tokens + 2 x
output tokens, calserve's ``output_token_cost`` 2). Cases, each with ``fairness.policy`` wfq and fcfs
on the same arrival plan (same seed), the two servers side by side at the same time (both on core 0,
so a shared box loads both alike and their throughputs compare):

- ``2c``: two clients, equal weights, arrival rates 1:2 (VTC's 1.5 and 3 requests/s);
- ``8c``: eight clients, equal weights, rates 1:1:1:1:2:2:2:2;
- ``2c-weighted``: two clients with weights 2:1, the heavier-weighted one sending at half the rate.

Rates are scaled to the timing profile (``bench-step-32000``: a 32 ms B16 decode step, prefill 16 ms
+ 160 µs/token, so one 256/256 request takes 567 ms of device time at full batches: C = 1.76
requests/s = 1,354 cost units/s, about VTC's server: their FCFS gap grew by 156,699 in 360 s, which at
FCFS's 1:2 split is a third of ~1,300 cost units/s), so that every tenant sends ``MARGIN`` x its
weighted fair share of C: each stays backlogged under a fair scheduler, and under FCFS too (FCFS
serves in proportion to the arrival rates). Every tenant also sends a burst at t = 0 (its fair share
of the running slots, B16 x ``max_tpot_steps`` 3 = 48, plus ``QUEUE_AT_START`` more, interleaved),
so its queue is non-empty from the start; after that the backlog grows by itself. The queue,
deadline and request-timeout limits are raised so that nothing is refused or expires during the run
(a full global queue would refuse the slower tenant's arrivals too and empty its queue). The slow
step also keeps the server's own CPU small (~500 tokens/s to stream), so that on a shared box the
host does not become the bottleneck of either policy.

Measured from the server's own counters, scraped every 0.25 s from ``/metrics``:
``calserve_tenant_service_tokens_total`` (delivered cost units per tenant: prefill tokens + 2 x decode
tokens) and ``calserve_tenant_waiting_requests`` (the tenant's admission queue: ``backlogged_from_s`` is
the first sample at which every tenant has a request waiting, ``min_waiting`` each queue's minimum
from then to the end; backlogged = it never reaches 0 again). Per case and policy: the maximum gap
of cumulative weighted service ``max_t (max_i S_i(t)/w_i - min_i S_i(t)/w_i)`` over the run from t = 0
(VTC's figure), the gap's slope over the last half (cost units/s: ~0 = not growing), each tenant's share
of the service in the last ``SHARE_WINDOW_S`` against its weighted fair share, total throughput (cost
units/s and output tokens/s) and each tenant's TTFT P99 (client side; requests still queued when the
run ends have none). A plot per case: cumulative weighted service per tenant over time, WFQ and FCFS.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from bench.loadgen import LoadSpec, RunResult, headline, run_load, save_run
from bench.scenario_lib import calserve_config, sat_prefill_us, workload_limit, write_json
from bench.scrape import metric_value
from bench.server import Server
from bench.summary import latency_stats
from bench.workload import Lengths, TenantSpec, TraceEntry

__all__ = ["CASES", "capacity_req_s", "plan", "analyse", "run", "VTC_PUBLISHED"]

STEP_US = 32000
TIMING = f"bench-step-{STEP_US}"
PROMPT, OUTPUT = 256, 256
OUT_COST = 2.0
B = 16
RUNNING_SLOTS = B * 3  # admission.max_tpot_steps (default 3) x the largest profile
MARGIN = 1.5  # each tenant sends this multiple of its weighted fair share of the capacity
QUEUE_AT_START = 8  # requests per tenant queued beyond its share of the running slots at t = 0
SHARE_WINDOW_S = 60.0
POLICIES = ("wfq", "fcfs")
SCRAPE_S = 0.25
BURST_GAP_S = 0.02  # between the start-up burst's requests: the load generator keeps their order
BACKLOG_FROM_S = 1.5  # Poisson arrivals start here (after the burst); throughput is counted from it

# (name, weights, relative arrival rates)
CASES: list[tuple[str, dict[str, float], dict[str, float]]] = [
    ("2c", {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 2.0}),
    ("8c", {f"c{i}": 1.0 for i in range(8)}, {f"c{i}": 1.0 if i < 4 else 2.0 for i in range(8)}),
    ("2c-weighted", {"a": 2.0, "b": 1.0}, {"a": 1.0, "b": 2.0}),
]

# VTC's published figures (max service gap over 360 s, cost units input + 2 x output).
VTC_PUBLISHED = {"2c": {"vtc": 8061, "fcfs": 156699}, "8c": {"vtc": 3839, "fcfs": 23898}}


def capacity_req_s() -> float:
    """Requests/s the timing model serves at full B16 batches (each request's prefill included)."""
    base, per_tok = sat_prefill_us(STEP_US)
    return workload_limit(B, STEP_US, PROMPT, OUTPUT, base, per_tok) / OUTPUT


def rates(weights: Mapping[str, float], rel: Mapping[str, float], cap: float) -> dict[str, float]:
    """Absolute rates in the ``rel`` ratios, scaled so the tenant closest to its weighted fair share
    sends ``MARGIN`` x that share."""
    wsum = sum(weights.values())
    k = MARGIN * cap * max((weights[n] / wsum) / rel[n] for n in weights)
    return {n: k * rel[n] for n in weights}


def plan(weights: Mapping[str, float], rate: Mapping[str, float], duration: float,
         seed: int = 19) -> list[TraceEntry]:
    """The arrival plan: each tenant's burst at t ~ 0 (its share of the running slots plus
    ``QUEUE_AT_START``), interleaved in proportion to the burst sizes so that the free slots, which
    admission fills in arrival order (nothing competes yet), go to each tenant by its weighted share;
    then Poisson arrivals at its rate."""
    wsum = sum(weights.values())
    names = sorted(weights)
    slots = {n: math.ceil(RUNNING_SLOTS * weights[n] / wsum) for n in names}
    order = sorted(((i + 0.5) / slots[n], k, n) for k, n in enumerate(names) for i in range(slots[n]))
    extras = [n for _ in range(QUEUE_AT_START) for n in names]
    # 20 ms apart: at 1 ms the requests' connections raced and one tenant's burst arrived first
    # (the weight-1 tenant took 24 of the 48 slots instead of 16); the queued extras 5 ms apart
    out = [TraceEntry(prompt_len=PROMPT, output_len=OUTPUT, tenant=n, at=(j + 1) * BURST_GAP_S)
           for j, (_, _, n) in enumerate(order)]
    t_end = len(out) * BURST_GAP_S
    out += [TraceEntry(prompt_len=PROMPT, output_len=OUTPUT, tenant=n, at=t_end + (j + 1) * 0.005)
            for j, n in enumerate(extras)]
    assert (out[-1].at or 0.0) < BACKLOG_FROM_S
    for n in names:
        rng = random.Random(f"{seed}:{n}")
        at = BACKLOG_FROM_S
        while True:
            at += rng.expovariate(rate[n])
            if at >= duration:
                break
            out.append(TraceEntry(prompt_len=PROMPT, output_len=OUTPUT, tenant=n, at=at))
    out.sort(key=lambda e: (e.at or 0.0))
    return out


def _slope(pts: Sequence[tuple[float, float]]) -> float:
    if len(pts) < 2:
        return math.nan
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    den = sum((t - mt) ** 2 for t, _ in pts)
    return sum((t - mt) * (v - mv) for t, v in pts) / den if den else math.nan


def analyse(samples: Sequence[dict[str, Any]], weights: Mapping[str, float], duration: float,
            share_window_s: float = SHARE_WINDOW_S) -> dict[str, Any]:
    """The figures of one run from its ``/metrics`` samples (``{"t", "values"}``, t from the start).

    Service is counted from the first sample (before the load), up to ``duration`` (when sending
    stops; the drain is not part of the run)."""
    names = sorted(weights)
    pts = [s for s in samples if "values" in s and s["t"] <= duration + 1e-9]
    if len(pts) < 3:
        return {"error": f"only {len(pts)} /metrics samples"}

    def svc(s: dict[str, Any], n: str) -> float:
        return metric_value(s["values"], "calserve_tenant_service_tokens_total", tenant=n) or 0.0

    base = {n: svc(pts[0], n) for n in names}
    t0 = pts[0]["t"]
    series: list[tuple[float, dict[str, float]]] = [
        (s["t"] - t0, {n: svc(s, n) - base[n] for n in names}) for s in pts]
    gaps = []
    for t, v in series:
        norm = [v[n] / weights[n] for n in names]
        gaps.append((t, max(norm) - min(norm)))
    end = series[-1][0]
    i_max = max(range(len(gaps)), key=lambda i: gaps[i][1])
    half = [(t, g) for t, g in gaps if t >= end / 2]
    # shares over the last share_window_s (or the last half when the run is shorter)
    w0 = max(end - share_window_s, end / 2) if end < share_window_s + BACKLOG_FROM_S else end - share_window_s
    a = min(series, key=lambda p: abs(p[0] - w0))
    b = series[-1]
    delta = {n: b[1][n] - a[1][n] for n in names}
    total = sum(delta.values())
    wsum = sum(weights.values())
    shares = {n: delta[n] / total if total else math.nan for n in names}
    fair = {n: weights[n] / wsum for n in names}
    rel_err = {n: shares[n] / fair[n] - 1.0 for n in names}
    # backlog: each tenant's admission queue from the first sample at which all have one
    def queued(s: dict[str, Any], n: str) -> float:
        return metric_value(s["values"], "calserve_tenant_waiting_requests", tenant=n) or 0.0
    first = next((i for i, s in enumerate(pts) if all(queued(s, n) >= 1 for n in names)), None)
    min_q = {n: (min(queued(s, n) for s in pts[first:]) if first is not None else None)
             for n in names}
    # throughput after the burst (cost units/s from the tenants' counters, output tokens/s)
    c = min(series, key=lambda p: abs(p[0] - BACKLOG_FROM_S))

    def comp(s: dict[str, Any]) -> float:
        return metric_value(s["values"], "calserve_completion_tokens_total") or 0.0
    ca = min(pts, key=lambda s: abs(s["t"] - t0 - BACKLOG_FROM_S))
    span = b[0] - c[0]
    return {
        "max_gap": round(gaps[i_max][1], 1),
        "max_gap_at_s": round(gaps[i_max][0], 2),
        "gap_at_end": round(gaps[-1][1], 1),
        "gap_slope_last_half_per_s": round(_slope(half), 2),
        "share_window_s": round(b[0] - a[0], 1),
        "shares": {n: round(v, 4) for n, v in shares.items()},
        "fair_shares": {n: round(v, 4) for n, v in fair.items()},
        "share_rel_error": {n: round(v, 4) for n, v in rel_err.items()},
        "max_share_rel_error": round(max(abs(v) for v in rel_err.values()), 4),
        "cost_throughput": round(sum(b[1][n] - c[1][n] for n in names) / span, 1) if span > 0 else None,
        "output_tok_s": round((comp(pts[-1]) - comp(ca)) / span, 1) if span > 0 else None,
        "backlogged_from_s": round(pts[first]["t"] - t0, 2) if first is not None else None,
        "min_waiting": min_q,
        "backlogged": all(q is not None and q >= 1 for q in min_q.values()),
        "series": {"t": [round(t, 3) for t, _ in series],
                   **{n: [round(v[n] / weights[n], 1) for _, v in series] for n in names}},
    }


def _side_by_side(servers: Mapping[str, Server], specs: tuple[TenantSpec, ...],
                  trace: tuple[TraceEntry, ...], duration: float) -> dict[str, RunResult]:
    """The same load against every server at the same time (one trio run): on a shared box both
    policies see the same machine load, so their throughputs compare."""
    async def both() -> dict[str, RunResult]:
        out: dict[str, RunResult] = {}

        async def one(policy: str, srv: Server, progress: bool) -> None:
            out[policy] = await run_load(LoadSpec(
                base_url=srv.url, tenants=specs, duration_s=duration, drain_timeout_s=2.0,
                trace=trace, request_timeout_s=duration + 60.0, scrape_interval_s=SCRAPE_S,
                steady_start_s=BACKLOG_FROM_S, server_pid=srv.pid, progress=progress))
        async with trio.open_nursery() as n:
            for i, (policy, srv) in enumerate(servers.items()):
                n.start_soon(one, policy, srv, i == 0)
        return out
    return trio.run(both)


def _server_config(tenants_cfg: dict[str, Any], policy: str) -> dict[str, Any]:
    return calserve_config(
        profiles=[B], timing=TIMING, tenants=tenants_cfg, fairness={"policy": policy},
        admission={"max_waiting_requests": 8192, "max_waiting_prompt_tokens": 8192 * PROMPT,
                   "deadline_default_ms": 3_600_000})


def run(out: Path, quick: bool) -> dict[str, Any]:
    """Every case under WFQ and FCFS, the two side by side on the same arrival plan at the same time;
    figures, plots and the VTC comparison."""
    from bench import plots

    duration = 30.0 if quick else 120.0
    cap = capacity_req_s()
    results: dict[str, Any] = {}
    for name, weights, rel in CASES:
        rate = rates(weights, rel, cap)
        trace = tuple(plan(weights, rate, duration))
        tenants_cfg = {t: {"api_keys": [f"key-{t}"], "weight": w} for t, w in weights.items()}
        specs = tuple(TenantSpec(t, f"key-{t}", rate[t], None, Lengths(PROMPT, PROMPT),
                                 Lengths(OUTPUT, OUTPUT)) for t in sorted(weights))
        case: dict[str, Any] = {"weights": weights, "rates_req_s": {n: round(r, 3) for n, r in rate.items()},
                                "demand_over_capacity": round(sum(rate.values()) / cap, 3),
                                "requests_planned": len(trace)}
        series: dict[str, dict[str, list[float]]] = {}
        with contextlib.ExitStack() as stack:
            servers = {p: stack.enter_context(Server.calserve(_server_config(tenants_cfg, p),
                                                              out / f"server-{name}-{p}"))
                       for p in POLICIES}
            runs = _side_by_side(servers, specs, trace, duration)
        for policy in POLICIES:
            res = runs[policy]
            save_run(res, out / f"{name}-{policy}")
            print(f"--- {name}-{policy}\n{headline(res.summary)}", flush=True)
            fig = analyse(res.metrics, weights, duration)
            series[policy] = fig.pop("series", {})
            # TTFT of every request that got its first token (most are still streaming or queued
            # when sending stops and are cut after the short drain)
            fig["ttft_p99_ms"] = {
                n: latency_stats([r.ttft for r in res.records if r.tenant == n and r.ttft is not None]
                                 ).get("p99") for n in sorted(weights)}
            fig["first_tokens"] = {n: sum(1 for r in res.records if r.tenant == n and r.ttft is not None)
                                   for n in sorted(weights)}
            fig["outcomes"] = res.summary["outcomes"]
            fig["server_cpu_s"] = (res.summary.get("server_proc") or {}).get("cpu_s")
            case[policy] = fig
        w, f = case["wfq"], case["fcfs"]
        for key, out_key in (("output_tok_s", "throughput_wfq_over_fcfs"),
                             ("cost_throughput", "cost_throughput_wfq_over_fcfs")):
            if w.get(key) and f.get(key):
                case[out_key] = round(w[key] / f[key], 4)
        write_json(out / f"series_{name}.json", series)
        plots.cumulative_weighted_service(series, out / f"service_{name}.png",
            f"{name}: weights {weights}, rates {case['rates_req_s']} req/s (capacity {cap:.2f})")
        results[name] = case
    plots.cumulative_weighted_service_grid(
        [(n, json.loads((out / f"series_{n}.json").read_text())) for n in results],
        out / "service_all.png")
    keys = ("max_gap", "gap_slope_last_half_per_s", "max_share_rel_error", "output_tok_s",
            "cost_throughput", "backlogged", "backlogged_from_s")
    summary = {n: {p: {k: c[p].get(k) for k in keys} for p in POLICIES}
               | {"throughput_wfq_over_fcfs": c.get("throughput_wfq_over_fcfs")}
               for n, c in results.items()}
    return {"timing": TIMING, "capacity_req_s": round(cap, 3),
            "capacity_cost_units_s": round(cap * (PROMPT + OUT_COST * OUTPUT), 1),
            "duration_s": duration, "policies_side_by_side": True, "summary": summary,
            "vtc_published": VTC_PUBLISHED,
            "goals": {"2c_max_gap": 4000, "8c_max_gap": 2000, "share_rel_error": 0.05,
                      "throughput_vs_fcfs": 0.02},
            "cases": results}
