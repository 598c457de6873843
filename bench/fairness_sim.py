"""Fairness simulation of the admission controller (issue 4; spec §5.3): WFQ vs FCFS on one trace.

Workload of the VTC paper (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24):
every request has 256 prompt and 256 output tokens; the server holds at most M = 10,000 KV tokens
(each request reserves prompt + max_tokens = 512); one decode step per ``STEP_S`` emits one token for
every running request; a newly admitted request is prefilled in the step it is admitted. Service is
counted in cost units: input tokens x1, output tokens x2 (``output_token_cost``).

Scenarios (all tenants backlogged after a few seconds; Poisson arrivals, fixed seed):

- ``2x-equal``: 2 tenants, weight 1:1, tenant t0 arrives at twice t1's rate.
- ``8x-equal``: 8 tenants, weight 1, t0 at twice the others' rate.
- ``2x-weighted``: 2 tenants, weight 2:1, equal rates.

Reported per scenario and policy: the maximum gap in weighted delivered service between two tenants
over any interval in which both are backlogged (VTC's measure: with ``D = S_i/w_i - S_j/w_j``, the
spread ``max D - min D`` over each joint backlog period; service received while a tenant was not
backlogged is not owed back, that is the "no banked credit" rule), each tenant's share of the service in 60 s
windows against its weight share (worst deviation), and throughput (tokens/s). Targets (issue 4): WFQ
gap <= 4,000 with throughput within 2 % of FCFS.

Run: ``.venv/bin/python bench/fairness_sim.py`` (~30 s). Writes ``bench/out/fairness_sim.json``.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from calserve.core.admission import AdmissionController, CapacityBudget, TenantPolicy, WorkItem

PROMPT, OUTPUT, M = 256, 256, 10_000
STEP_S = 0.025  # one decode step (all running requests emit one token)
DURATION_S = 600.0
WINDOW_S = 60.0
OUT_COST = 2.0


@dataclass(frozen=True)
class Scenario:
    name: str
    weights: tuple[float, ...]
    rates: tuple[float, ...]  # requests/s per tenant


# Capacity: M // 512 = 19 running requests, each needing 256 steps (6.4 s): ~3 requests/s in total.
SCENARIOS = [
    Scenario("2x-equal", (1.0, 1.0), (4.0, 2.0)),
    Scenario("8x-equal", (1.0,) * 8, (2.0,) + (1.0,) * 7),
    Scenario("2x-weighted", (2.0, 1.0), (3.0, 3.0)),
]


def trace(sc: Scenario, seed: int = 7) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    arrivals: list[tuple[float, int]] = []
    for t, rate in enumerate(sc.rates):
        now = 0.0
        while True:
            now += rng.expovariate(rate)
            if now >= DURATION_S:
                break
            arrivals.append((now, t))
    arrivals.sort()
    return arrivals


def simulate(sc: Scenario, policy: str) -> dict[str, object]:
    names = [f"t{i}" for i in range(len(sc.weights))]
    tenants = {n: TenantPolicy(weight=w) for n, w in zip(names, sc.weights, strict=True)}
    budget = CapacityBudget(max_sequences=1000, max_kv_tokens=M, max_waiting_requests=10**6,
                            max_waiting_prompt_tokens=10**9, max_inflight_jobs=1)
    adm = AdmissionController(budget, max_seq=PROMPT + OUTPUT, tenants=tenants,
                              output_token_cost=OUT_COST, policy=policy)  # type: ignore[arg-type]
    arrivals = trace(sc)
    ai = 0
    running: dict[int, tuple[str, int]] = {}  # request id -> (tenant, tokens left)
    kv_used = 0
    service = dict.fromkeys(names, 0.0)
    window_service = dict.fromkeys(names, 0.0)
    window_backlogged = dict.fromkeys(names, True)
    share_dev = 0.0
    windows: list[dict[str, float]] = []
    max_gap = 0.0
    pair_range: dict[tuple[str, str], tuple[float, float]] = {}
    gap_at = 0.0
    tokens = 0
    now = 0.0
    next_window = WINDOW_S
    steps = int(DURATION_S / STEP_S)
    for step in range(steps):
        now = step * STEP_S
        while ai < len(arrivals) and arrivals[ai][0] <= now:
            t_arr, ti = arrivals[ai]
            adm.offer(WorkItem(ai, names[ti], PROMPT, OUTPUT, t_arr, None, 0), now, True)
            ai += 1
        for w in adm.pop_admissible(now, 1000, M - kv_used):
            kv_used += w.kv_tokens
            running[w.request_id] = (w.tenant, OUTPUT)
            adm.charge(w.tenant, prefill_tokens=PROMPT, request_id=w.request_id)
            service[w.tenant] += PROMPT
            window_service[w.tenant] += PROMPT
            tokens += PROMPT
        done = []
        for rid, (tn, left) in running.items():
            adm.charge(tn, decode_tokens=1, request_id=rid)
            service[tn] += OUT_COST
            window_service[tn] += OUT_COST
            tokens += 1
            if left == 1:
                done.append(rid)
            else:
                running[rid] = (tn, left - 1)
        for rid in done:
            del running[rid]
            kv_used -= PROMPT + OUTPUT
            adm.release(rid)
        stats = adm.statistics().tenants
        backlogged = [n for n in names if n in stats and stats[n].waiting_requests > 0]
        for n in names:
            if n not in backlogged:
                window_backlogged[n] = False
        # Gap over any interval in which a pair is continuously backlogged (VTC's definition):
        # with D(t) = S_i(t)/w_i - S_j(t)/w_j, it is max D - min D over the joint backlog period.
        bset = set(backlogged)
        for pair in list(pair_range):
            if not (pair[0] in bset and pair[1] in bset):
                del pair_range[pair]
        for i, a in enumerate(backlogged):
            for b in backlogged[i + 1:]:
                d = service[a] / tenants[a].weight - service[b] / tenants[b].weight
                lo, hi = pair_range.get((a, b), (d, d))
                lo, hi = min(lo, d), max(hi, d)
                pair_range[(a, b)] = (lo, hi)
                if hi - lo > max_gap:
                    max_gap, gap_at = hi - lo, now
        if now + STEP_S >= next_window:
            total = sum(window_service.values())
            wsum = sum(tenants[n].weight for n in names)
            shares = {n: window_service[n] / total if total else 0.0 for n in names}
            if all(window_backlogged.values()) and next_window > WINDOW_S:  # skip warm-up window
                for n in names:
                    share_dev = max(share_dev, abs(shares[n] - tenants[n].weight / wsum))
            windows.append(shares)
            window_service = dict.fromkeys(names, 0.0)
            window_backlogged = dict.fromkeys(names, True)
            next_window += WINDOW_S
    return {
        "policy": policy,
        "max_service_gap": round(max_gap, 1),
        "gap_at_s": round(gap_at, 2),
        "max_window_share_deviation": round(share_dev, 4),
        "throughput_tokens_per_s": round(tokens / DURATION_S, 2),
        "service": {n: round(s, 1) for n, s in service.items()},
        "window_shares": [{n: round(v, 4) for n, v in w.items()} for w in windows],
    }


def main() -> int:
    results = []
    t0 = time.perf_counter()
    print(f"{'scenario':<12} {'policy':<5} {'max gap':>10} {'share dev':>10} {'tok/s':>9} "
          f"{'thr ratio':>9}")
    ok = True
    for sc in SCENARIOS:
        fcfs = simulate(sc, "fcfs")
        wfq = simulate(sc, "wfq")
        ratio = float(wfq["throughput_tokens_per_s"]) / float(fcfs["throughput_tokens_per_s"])  # type: ignore[arg-type]
        for r in (fcfs, wfq):
            print(f"{sc.name:<12} {r['policy']:<5} {r['max_service_gap']:>10} "
                  f"{r['max_window_share_deviation']:>10} {r['throughput_tokens_per_s']:>9} "
                  f"{ratio if r is wfq else 1.0:>9.4f}")
        target = float(wfq["max_service_gap"]) <= 4000 and abs(ratio - 1) <= 0.02  # type: ignore[arg-type]
        ok &= target
        results.append({"scenario": sc.name, "weights": sc.weights, "rates": sc.rates,
                        "fcfs": fcfs, "wfq": wfq, "throughput_ratio_wfq_over_fcfs": ratio,
                        "meets_target": target})
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "fairness_sim.json").write_text(json.dumps(
        {"workload": {"prompt": PROMPT, "output": OUTPUT, "M": M, "step_s": STEP_S,
                      "duration_s": DURATION_S, "output_token_cost": OUT_COST},
         "results": results}, indent=1))
    print(f"targets met: {ok}  ({time.perf_counter() - t0:.1f} s)  -> bench/out/fairness_sim.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
