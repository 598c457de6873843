"""The fairness-backlogged scenario's plan and figures, on synthetic /metrics samples (no server)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.fairness_backlogged import (CASES, MARGIN, PROMPT, QUEUE_AT_START, RUNNING_SLOTS,
                                       analyse, capacity_req_s, plan, rates)


def sample(t: float, svc: dict[str, float], waiting: dict[str, float], tokens: float) -> dict[str, Any]:
    values = {f"calserve_tenant_service_tokens_total{{tenant={n}}}": v for n, v in svc.items()}
    values |= {f"calserve_tenant_waiting_requests{{tenant={n}}}": v for n, v in waiting.items()}
    values["calserve_completion_tokens_total{alias=qwen3,tenant=a}"] = tokens
    return {"t": t, "values": values}


def test_capacity_and_rates_keep_every_tenant_over_its_fair_share() -> None:
    cap = capacity_req_s()
    assert cap == pytest.approx(1e6 / (16000 + 160 * 256 + 255 * 2000), rel=1e-9)  # 567 ms each
    for _, weights, rel in CASES:
        r = rates(weights, rel, cap)
        wsum = sum(weights.values())
        over = [r[n] / (weights[n] / wsum * cap) for n in weights]
        assert min(over) == pytest.approx(MARGIN) and all(o >= MARGIN - 1e-9 for o in over)
        k = {r[n] / rel[n] for n in weights}
        assert max(k) == pytest.approx(min(k))  # the rate ratios are kept


def test_plan_bursts_by_fair_share_then_poisson() -> None:
    weights = {"a": 2.0, "b": 1.0}
    p = plan(weights, {"a": 1.0, "b": 2.0}, duration=200.0)
    assert all(e.prompt_len == PROMPT and e.output_len == 256 for e in p)
    burst = [e for e in p if (e.at or 0) < 1.5]
    head = [e.tenant for e in burst][:RUNNING_SLOTS]
    assert abs(head.count("a") - 2 * RUNNING_SLOTS / 3) <= 1  # interleaved by weighted share
    assert [e.tenant for e in plan({"a": 1, "b": 1}, {"a": 1, "b": 2}, 10.0)][:4] == ["a", "b"] * 2
    assert sum(e.tenant == "a" for e in burst) == math.ceil(RUNNING_SLOTS * 2 / 3) + QUEUE_AT_START
    late = [e for e in p if (e.at or 0) >= 1.5]
    n_b = sum(e.tenant == "b" for e in late)
    assert 2 * 200 * 0.8 < n_b < 2 * 200 * 1.2  # Poisson at 2/s
    assert p == plan(weights, {"a": 1.0, "b": 2.0}, duration=200.0)  # seeded


def test_analyse_gap_slope_shares_backlog() -> None:
    # b is served twice as fast as a; both have something waiting from 0.25 s on, but a at 10 s
    samples = [sample(0.0, {"a": 100.0, "b": 100.0}, {"a": 0, "b": 0}, 0.0)]
    for i in range(1, 81):
        t = i * 0.25
        samples.append(sample(t, {"a": 100 + 100 * t, "b": 100 + 200 * t},
                              {"a": 0 if t == 10.0 else 3, "b": 5}, 300 * t))
    f = analyse(samples, {"a": 1.0, "b": 1.0}, duration=20.0, share_window_s=10.0)
    assert f["max_gap"] == pytest.approx(2000.0)  # 100/s x 20 s, from the first sample
    assert f["gap_slope_last_half_per_s"] == pytest.approx(100.0)
    assert f["shares"] == {"a": pytest.approx(1 / 3, abs=1e-3), "b": pytest.approx(2 / 3, abs=1e-3)}
    assert f["max_share_rel_error"] == pytest.approx(1 / 3, abs=1e-3)
    assert f["min_waiting"] == {"a": 0, "b": 5} and f["backlogged"] is False
    assert f["backlogged_from_s"] == 0.25
    assert f["cost_throughput"] == pytest.approx(300.0)
    assert f["output_tok_s"] == pytest.approx(300.0)
    # weights 1:2 make the same service fair: no gap
    g = analyse(samples, {"a": 1.0, "b": 2.0}, duration=20.0, share_window_s=10.0)
    assert g["max_gap"] == pytest.approx(0.0) and g["max_share_rel_error"] < 1e-3
