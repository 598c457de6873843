"""Spec §14 degradation and the reset budget on the fake device (fake clock): a crosstalk on PONG
moves new jobs to PING while the submitted ones drain, and PING/PONG comes back after its
probation (or never, by config); DeviceBusy streaks degrade too; spending the reset budget
degrades (one engine, smallest profile, admission cool-down) before it fails; a reset that
raises or leaves the device faulted is an uncertain recovery (retried, then Failed: requests end
with a clear error, no crash, no hang); a hung job is detected from the timing model, not after
the fixed 30 s."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio

from calserve.engine.engine import Engine
from calserve.engine.types import ErrorEvent, FinishEvent, FinishReason, GenerateRequest
from calserve.errors import UnavailableError
from calserve.runtime.types import FaultKind, JobEngine
from calserve.testing.fake_device import FakeBackend

from .helpers import collect, config, fake_greedy, fake_source


def pp_config(**over: Any) -> Any:
    sched: dict[str, Any] = {
        "batch": {"profiles": [1, 4, 8]},
        "executor": {"max_inflight": 2, **over.pop("executor", {})},
        "recovery": {"max_request_retries": 3, **over.pop("recovery", {})},
    }
    sched.update(over)
    return config(**sched)


async def run_many(eng: Engine, n: int, max_tokens: int = 10, first: int = 0) -> list[tuple[list[int], object]]:
    out: list[tuple[list[int], object]] = [([], None)] * n

    async def one(i: int) -> None:
        out[i] = await collect(eng, (first + i + 1, 2 * i + 3, 7), max_tokens, ignore_eos=True)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return out


def assert_exact(results: list[tuple[list[int], object]], max_tokens: int = 10, first: int = 0) -> None:
    for i, (toks, term) in enumerate(results):
        assert isinstance(term, FinishEvent) and term.reason is FinishReason.LENGTH, term
        assert toks == fake_greedy((first + i + 1, 2 * i + 3, 7), max_tokens)


async def test_crosstalk_moves_new_jobs_to_one_engine_then_probation_reenables(
        autojump_clock: object, caplog: pytest.LogCaptureFixture) -> None:
    be = FakeBackend("sim-next", seed=3)
    cfg = pp_config(executor={"degrade": {"probation_s": 30.0}})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        assert eng.statistics().pingpong_state == "dual"
        be.inject_fault(FaultKind.CROSSTALK, JobEngine.PONG, 3)
        assert_exact(await run_many(eng, 12))  # nobody noticed
        st = eng.statistics()
        assert st.pingpong_state == "single" and st.pingpong_degradations_total == {"crosstalk": 1}
        assert st.faults_total == {"crosstalk": 1}
        lines = [r.getMessage() for r in caplog.records if "degraded to one engine" in r.getMessage()]
        assert len(lines) == 1 and "reason=crosstalk" in lines[0]
        pong = be.counters(JobEngine.PONG).submitted
        assert_exact(await run_many(eng, 8, first=50), first=50)
        assert be.counters(JobEngine.PONG).submitted == pong  # new jobs only on PING
        assert be.counters(JobEngine.PONG).inflight == 0  # what PONG held drained
        await trio.sleep(31.0)  # the probation passed without a trigger
        assert eng.statistics().pingpong_state == "dual"
        assert_exact(await run_many(eng, 12, first=100), first=100)
        assert be.counters(JobEngine.PONG).submitted > pong  # PONG serves again


async def test_never_reenabled_when_probation_is_null(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=3)
    cfg = pp_config(executor={"degrade": {"probation_s": None}})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        be.inject_fault(FaultKind.CROSSTALK, JobEngine.PING, 3)
        assert_exact(await run_many(eng, 8))
        await trio.sleep(3600.0)
        assert eng.statistics().pingpong_state == "single"


async def test_busy_streak_degrades_without_a_reset(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=3)
    async with Engine.open(pp_config(), backend=be, sources={"qwen3": fake_source()}) as eng:
        for nth in range(1, 5):  # the first job on PONG is refused busy on all 4 attempts
            be.inject_fault(FaultKind.DEVICE_BUSY, JobEngine.PONG, nth)
        assert_exact(await run_many(eng, 6))
        st = eng.statistics()
        assert st.pingpong_degradations_total == {"busy": 1} and st.resets_total == 0


async def test_consecutive_timeouts_degrade(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=3)
    cfg = pp_config(recovery={"max_resets_per_10min": 10})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        be.inject_fault(FaultKind.TIMEOUT, JobEngine.PING, 1)
        be.inject_fault(FaultKind.TIMEOUT, JobEngine.PING, 2)  # the re-prefill hangs too
        toks, term = await collect(eng, (9, 9, 9), 5, ignore_eos=True)
        assert isinstance(term, FinishEvent) and toks == fake_greedy((9, 9, 9), 5)
        st = eng.statistics()
        assert st.pingpong_degradations_total == {"faults": 1} and st.resets_total == 2


async def test_hung_job_detected_from_the_timing_model_not_after_30s(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=3)
    cfg = config(recovery={"max_request_retries": 2})  # executor.wait_timeout_ms: 30000 (default)
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        be.inject_fault(FaultKind.TIMEOUT, JobEngine.PING, 3)
        t0 = trio.current_time()
        toks, term = await collect(eng, (4, 5, 6), 6, ignore_eos=True)
        took = trio.current_time() - t0
        assert isinstance(term, FinishEvent) and toks == fake_greedy((4, 5, 6), 6)
        assert 1.0 <= took < 2.0, took  # executor.hang_min_ms (1 s): the modeled step is 1 ms
        assert eng.statistics().faults_total == {"timeout": 1}


async def test_reset_budget_degrades_then_fails(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=3)
    cfg = pp_config(recovery={"max_resets_per_10min": 1, "degraded_resets_per_10min": 1,
                              "degraded_admit_cooldown_ms": 2000})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 2)
        assert_exact(await run_many(eng, 4))
        st = eng.statistics()
        assert st.reset_budget_level == "ok" and st.pingpong_state == "dual"
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 2)
        assert_exact(await run_many(eng, 4))  # the second reset: over the budget, degraded
        st = eng.statistics()
        assert st.reset_budget_level == "degraded" and st.resets_in_window == 2
        assert st.pingpong_state == "single" and "reset_budget" in st.pingpong_degradations_total
        before = dict(st.batches_total)
        pong = be.counters(JobEngine.PONG).submitted
        t0 = trio.current_time()
        await trio.sleep(0)
        # degraded: served on one engine at the smallest profile, admitted after the cool-down
        res = await run_many(eng, 6, first=20)
        assert_exact(res, first=20)
        after = eng.statistics().batches_total
        assert {b: n - before.get(b, 0) for b, n in after.items() if n != before.get(b, 0)}.keys() == {1}
        assert be.counters(JobEngine.PONG).submitted == pong
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 2)
        results = await run_many(eng, 4, first=40)  # the third reset: Failed
        assert all(isinstance(t, ErrorEvent) and t.kind == "unavailable" for _, t in results)
        assert "reset budget" in results[0][1].message  # type: ignore[union-attr]
        await trio.sleep(0.5)
        assert eng.failed.is_set() and not eng.ready()
        assert eng.statistics().reset_budget_level == "failed"
        with pytest.raises(UnavailableError):
            await eng.submit(GenerateRequest((1, 2)))
        del t0


async def test_degraded_budget_ends_when_resets_age_out(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=3)
    cfg = pp_config(recovery={"max_resets_per_10min": 0, "degraded_resets_per_10min": 5})
    eng_cm = Engine.open(cfg, backend=be, sources={"qwen3": fake_source()})
    async with eng_cm as eng:
        clock = [1000.0]
        eng.driver.recovery.budget.clock = lambda: clock[0] + trio.current_time()
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 2)
        assert_exact(await run_many(eng, 3))
        assert eng.statistics().reset_budget_level == "degraded"
        await trio.sleep(601.0)
        st = eng.statistics()
        assert st.reset_budget_level == "ok" and st.resets_in_window == 0
        await trio.sleep(61.0)  # and PING/PONG after its probation
        assert eng.statistics().pingpong_state == "dual"


@pytest.mark.parametrize("exit_on_failed", [True, False])
async def test_reset_that_keeps_failing_fails_the_model_without_crash_or_hang(
        autojump_clock: object, exit_on_failed: bool) -> None:
    be = FakeBackend("sim-next", seed=3)
    cfg = pp_config(recovery={"exit_on_failed": exit_on_failed, "reset_attempts": 2})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        be.reset_failures = 10
        be.inject_fault(FaultKind.TIMEOUT, JobEngine.PING, 3)  # a hung job that never drains
        t0 = trio.current_time()
        results = await run_many(eng, 4)
        assert trio.current_time() - t0 < 10.0  # no hang: every request ended
        for _, term in results:
            assert isinstance(term, ErrorEvent) and term.kind == "unavailable", term
            assert "could not be recovered" in term.message
        await trio.sleep(0.5)
        st = eng.statistics()
        assert st.models["qwen3"][1] == "Failed" and st.uncertain_recoveries_total == 1
        assert not eng.ready()
        assert eng.failed.is_set() is exit_on_failed
        with pytest.raises(UnavailableError):
            await eng.submit(GenerateRequest((1, 2)))
    # the engine closed (no executor stuck on the lost job)


async def test_reset_failing_once_is_uncertain_but_recovers(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=3)
    async with Engine.open(pp_config(), backend=be, sources={"qwen3": fake_source()}) as eng:
        be.reset_failures = 1
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 3)
        assert_exact(await run_many(eng, 4))
        st = eng.statistics()
        assert st.models["qwen3"][1] == "Ready" and st.resets_total == 1
        assert st.pingpong_degradations_total == {"uncertain": 1}


async def test_device_that_stays_faulted_fails_the_model(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=3)
    async with Engine.open(pp_config(), backend=be, sources={"qwen3": fake_source()}) as eng:
        be.stays_faulted = True
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 3)
        results = await run_many(eng, 3)
        assert all(isinstance(t, ErrorEvent) and t.kind == "unavailable" for _, t in results)
        await trio.sleep(0.5)
        assert eng.failed.is_set() and eng.statistics().models["qwen3"][1] == "Failed"
        be.stays_faulted = False  # let the close path drain


async def test_hung_job_without_timing_detected_from_observed_p99(autojump_clock: object) -> None:
    """Timing ``none``: before 32 observed steps the fixed bound (wait_timeout_ms) applies; after,
    20 x the recent P99 of the profile, at least hang_min_ms."""
    be = FakeBackend("sim-next", seed=3)
    src = dataclasses.replace(fake_source(profiles=(1,)), timing={})  # the device still takes 1 ms
    cfg = config(recovery={"max_request_retries": 2},
                 executor={"wait_timeout_ms": 10000, "hang_min_ms": 1500})
    async with Engine.open(cfg, backend=be, sources={"qwen3": src}) as eng:
        toks, term = await collect(eng, (1, 2, 3), 40, ignore_eos=True)  # 39 decode steps observed
        assert isinstance(term, FinishEvent)
        assert eng.driver.watch.times.p99("decode", 1) is not None
        be.inject_fault(FaultKind.TIMEOUT, JobEngine.PING, 3)
        t0 = trio.current_time()
        toks, term = await collect(eng, (4, 5, 6), 6, ignore_eos=True)
        took = trio.current_time() - t0
        assert isinstance(term, FinishEvent) and toks == fake_greedy((4, 5, 6), 6)
        assert 1.5 <= took < 3.0, took  # not the 10 s bound: 1 ms steps -> hang_min_ms
