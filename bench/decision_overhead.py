"""Decision overhead of the scheduling core (issue 4): microseconds per decode decision at B16 with
10,000 waiting requests across 1,000 tenants. Target: <= 200 µs median.

One *decode decision* is what the engine's scheduler does per decode tick:
``admission.expire(now)`` + ``admission.pop_admissible(...)`` to refill the lanes freed by the last
step (1 per tick here, a sequence finishes and a waiting one is admitted) + ``select_profile`` +
``batching_window`` + ``build_decode_batch`` over the ready set (``READY`` sequences holding KV,
bounded by the KV lanes, not by the waiting queue) + charging the 16 decoded tokens.
Also reported: ``build_decode_batch`` alone for ready sets of 16/64/256, and ``offer`` per request.

Run: ``.venv/bin/python bench/decision_overhead.py`` (~10 s). Writes ``bench/out/decision_overhead.json``.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

from calserve.config import ProfileSelection
from calserve.core.admission import AdmissionController, CapacityBudget, TenantPolicy, WorkItem
from calserve.core.decode import BatchProfile, DecodeCandidate, batching_window, build_decode_batch
from calserve.core.decode import select_profile

TENANTS, WAITING, B, READY, DECISIONS = 1000, 10_000, 16, 64, 3000


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    rng = random.Random(1)
    tenants = {f"t{i}": TenantPolicy(weight=rng.choice([1.0, 2.0, 4.0]), max_active_sequences=8)
               for i in range(TENANTS)}
    budget = CapacityBudget(max_sequences=READY, max_kv_tokens=10**7, max_waiting_requests=10**6,
                            max_waiting_prompt_tokens=10**9, max_inflight_jobs=1)
    adm = AdmissionController(budget, 4096, tenants)
    names = list(tenants)
    t0 = time.perf_counter_ns()
    rid = 0
    for _ in range(WAITING + READY + DECISIONS):
        adm.offer(WorkItem(rid, rng.choice(names), rng.randint(16, 1024), rng.randint(16, 512),
                           0.0, 1e9, 1), 0.0, True)
        rid += 1
    offer_us = (time.perf_counter_ns() - t0) / 1000 / rid
    profile = BatchProfile(B, 4096, inactive_token_id=0)
    sel = ProfileSelection()

    def cand(w: WorkItem) -> DecodeCandidate:
        return DecodeCandidate(w.request_id, w.request_id, w.tenant, 1, 1, w.prompt_tokens,
                               w.deadline, adm.virtual_finish(w.tenant), False)

    ready = [cand(w) for w in adm.pop_admissible(0.0, READY, 10**7)]
    if "--gc-freeze" in sys.argv:
        gc.collect()
        gc.freeze()  # what a server does after start-up: long-lived objects leave the GC scan
    assert len(ready) == READY and len(adm) >= WAITING
    times: list[float] = []
    now = 0.0
    for _ in range(DECISIONS):
        now += 0.004
        t = time.perf_counter_ns()
        done = ready.pop(0)  # a sequence finished in the last step: its lane is refilled
        adm.release(done.request_id)
        adm.expire(now)
        for w in adm.pop_admissible(now, 1, 10**7):
            ready.append(cand(w))
        b = select_profile(len(ready), 0.0, (1, 4, 8, 16), sel)
        fire, _ = batching_window(now, len(ready), b, now, None, 0)
        batch = build_decode_batch(profile, ready, now, 1, tenant_max_lane_share=0.5)
        for c in batch.lanes:
            if c is not None:
                adm.charge(c.tenant, decode_tokens=1, request_id=c.request_id)
        times.append((time.perf_counter_ns() - t) / 1000)
        assert fire and batch.active == B
    build_only: dict[int, float] = {}
    for n in (16, 64, 256):
        cands = [DecodeCandidate(i, i, f"t{i % 100}", 1, 1, 10, 1e9 + rng.random(), rng.random())
                 for i in range(n)]
        ts = []
        for _ in range(500):
            t = time.perf_counter_ns()
            build_decode_batch(profile, cands, 0.0, 1, 0.5)
            ts.append((time.perf_counter_ns() - t) / 1000)
        build_only[n] = statistics.median(ts)
    res = {
        "tenants": TENANTS, "waiting": len(adm), "compiled_batch": B, "ready": READY,
        "decisions": DECISIONS,
        "decision_us": {"median": statistics.median(times), "p90": pct(times, 0.9),
                        "p99": pct(times, 0.99), "max": max(times)},
        "build_decode_batch_only_median_us": build_only,
        "offer_us_mean": offer_us,
        "target_median_us": 200,
        "meets_target": statistics.median(times) <= 200,
    }
    print(f"decode decision @B{B}, {len(adm)} waiting / {TENANTS} tenants, {READY} ready:")
    d = res["decision_us"]
    assert isinstance(d, dict)
    print(f"  median {d['median']:.1f} µs  p90 {d['p90']:.1f}  p99 {d['p99']:.1f}  max {d['max']:.1f}")
    for n, v in build_only.items():
        print(f"  build_decode_batch alone, {n:>3} ready: median {v:.1f} µs")
    print(f"  offer: {offer_us:.1f} µs/request   target met: {res['meets_target']}")
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "decision_overhead.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
