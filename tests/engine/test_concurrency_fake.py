"""Spec §17.3 on the fake clock against the trio-native fake device (seeded jittered completions)."""

from __future__ import annotations

import pytest

from calserve.engine.engine import Engine
from calserve.testing.fake_device import FakeBackend
from calserve.runtime.types import JobEngine

from .churn import run_churn
from .helpers import config, fake_greedy, fake_source


def assert_nothing_leaked(eng: Engine, be: FakeBackend) -> None:
    assert eng.registry.live == {}
    assert eng.leaked_at_close == 0
    for gen in eng.model_manager.generations.values():
        k = gen.kv.statistics()
        assert (k.free, k.tokens_reserved, k.tokens_committed) == (k.num_lanes, 0, 0), k
        gen.kv.check_invariants()
        assert gen.calbin.leaked_at_release == 0  # type: ignore[attr-defined]
        q = eng.core.requests.queues(gen)
        assert not q.holders and not q.waiting and not q.decode_ready and not q.releases
        assert gen.admission.statistics().active_sequences == 0
        assert gen.admission.statistics().waiting_requests == 0
    for e in JobEngine:
        assert be.counters(e).inflight == 0
    assert eng.core.inflight_jobs() == 0


@pytest.mark.parametrize(
    "batch,inflight", [(8, 2), (1, 1)], ids=["B8-pingpong", "B1"]
)
async def test_churn_1000_fake_clock(autojump_clock: object, batch: int, inflight: int) -> None:
    be = FakeBackend("sim-next", seed=11, jitter_s=0.003)
    cfg = config(
        batch={"profiles": [batch]},
        executor={"max_inflight": inflight},
        # Churn, not overload policy: keep the many concurrent sequences (no expected-wait refusals,
        # no running cap) so every ending is exercised under time-sharing.
        admission={"max_waiting_requests": 600, "max_expected_wait_ms": None, "max_tpot_steps": None},
    )
    src = fake_source(max_sequences=24, step_us=3000.0)
    res, eng = await run_churn(
        Engine.open(cfg, backend=be, sources={"qwen3": src}),
        n=1000, seed=5, vocab=128, reference=fake_greedy,
        shutdown_after_s=1.2, arrival_span_s=2.0, time_scale=0.1,
    )
    assert res.submitted + res.refused == 1000
    assert sum(res.terminals.values()) == res.submitted
    # the mix really exercised every ending
    for key in ("length", "cancelled", "deadline", "error:shutdown"):
        assert res.terminals.get(key, 0) > 0, res.terminals
    assert res.refused > 0  # arrivals after the shutdown are refused, never lost
    assert res.checked_outputs > 100
    print(res)
    assert_nothing_leaked(eng, be)
