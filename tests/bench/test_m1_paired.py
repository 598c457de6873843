"""The M1 closed loop's P99 verdict per group of adjacent pairs (bench/m1_async_vs_sync.py)."""

from __future__ import annotations

from bench.m1_async_vs_sync import paired_p99
from bench.sync_baseline import BaselineRecord
from calserve.engine.types import FinishReason


def _rec(rid: int, gaps_ms: list[float]) -> BaselineRecord:
    t, times = 0.0, []
    for g in [1.0, *gaps_ms]:
        t += g / 1e3
        times.append(t)
    return BaselineRecord(request_id=rid, tokens=tuple(range(len(times))),
                          finish_reason=FinishReason.LENGTH, arrival_s=0.0, start_s=0.0,
                          token_times_s=tuple(times), finish_s=t, error=None)


def test_one_group_hit_by_a_burst_does_not_set_the_verdict() -> None:
    steady = [4.0] * 200
    burst = [4.0] * 190 + [12.0] * 10  # a neighbour's burst lands in one group of one side
    s_blocks = [[_rec(i, steady)] for i in range(5)]
    a_blocks = [[_rec(i, burst if i == 2 else steady)] for i in range(5)]
    out = paired_p99(s_blocks, a_blocks)
    per = out["tpot_p99_degradation_per_pair"]
    assert len(per) == 5 and per[2] > 1.0 and all(abs(x) < 1e-9 for i, x in enumerate(per) if i != 2)
    assert abs(out["tpot_p99_degradation_paired_median"]) < 1e-9


def test_a_slower_side_in_every_group_shows() -> None:
    s_blocks = [[_rec(i, [4.0] * 200)] for i in range(4)]
    a_blocks = [[_rec(i, [4.4] * 200)] for i in range(4)]
    assert abs(paired_p99(s_blocks, a_blocks)["tpot_p99_degradation_paired_median"] - 0.1) < 1e-6
