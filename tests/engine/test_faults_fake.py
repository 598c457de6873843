"""Fault handling on the fake device. With re-admission off (``max_request_retries: 0``) a fault
during a full B8 decode batch ends every request of the batch with an explicit error, quarantines
their KV, resets, and the next requests succeed; the reset budget turns the model Failed (new
requests: UnavailableError). With re-admission on (the default) the same faults cost the clients
nothing: every request is re-prefilled from its prompt + generated tokens after the reset and its
greedy output equals the fault-free one; past its retries a request ends with a retryable error."""

from __future__ import annotations

import pytest
import trio

from calserve.engine.engine import Engine
from calserve.testing.fake_device import FakeBackend
from calserve.engine.types import ErrorEvent, FinishEvent, FinishReason, GenerateRequest
from calserve.errors import UnavailableError
from calserve.runtime.types import FaultKind, JobEngine

from .helpers import collect, config, fake_greedy, fake_source


def b8_config(retries: int = 0, **extra: object) -> object:
    recovery = dict(extra.pop("recovery", {}))  # type: ignore[call-overload]
    recovery.setdefault("max_request_retries", retries)
    return config(
        batch={"profiles": [8], "batching_window_us": 1_000_000},
        executor={"wait_timeout_ms": 200},
        recovery=recovery,
        **extra,
    )


async def run_batch(eng: Engine, n: int = 8, max_tokens: int = 12) -> list[tuple[list[int], object]]:
    out: list[tuple[list[int], object]] = [([], None)] * n

    async def one(i: int) -> None:
        out[i] = await collect(eng, (i + 1, 2 * i + 3, 7), max_tokens)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return out


@pytest.mark.parametrize("kind", [FaultKind.TIMEOUT, FaultKind.CCU_FAULT, FaultKind.CROSSTALK, FaultKind.DMA_UNKNOWN])
async def test_fault_in_b8_batch_recovers(autojump_clock: object, kind: FaultKind) -> None:
    be = FakeBackend("sim-next", seed=2)
    async with Engine.open(b8_config(), backend=be, sources={"qwen3": fake_source()}) as eng:
        # jobs 1-8 are the prefills, 9 the first full decode batch, 10 the second one
        be.inject_fault(kind, JobEngine.PING, 10, lane=3)
        results = await run_batch(eng)
        for toks, term in results:
            assert isinstance(term, ErrorEvent), term
            assert term.kind == "device_error"
            assert len(toks) == 2  # prefill token + first decode token reached the client
        await trio.sleep(1.0)  # fake clock: let recovery finish (the errors are sent before it ends)
        st = eng.statistics()
        assert st.resets_total == 1
        assert st.quarantined_kv_total == 8
        assert sum(st.faults_total.values()) == 1
        assert st.models["qwen3"][1] == "Ready"
        assert be.resets == 1 and not be.needs_reconfigure
        # the next requests succeed, with the right tokens
        again = await run_batch(eng, n=3, max_tokens=6)
        for i, (toks, term) in enumerate(again):
            assert isinstance(term, FinishEvent) and term.reason is FinishReason.LENGTH
            assert toks == fake_greedy((i + 1, 2 * i + 3, 7), 6)
        await trio.sleep(0.05)  # sequences are freed after their requests' terminal events
        k = eng.generation().kv.statistics()
        assert k.unknown == 0 and k.free == k.num_lanes


async def test_unknown_dma_without_restart_fails_model(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=2)
    cfg = b8_config(recovery={"restart_on_unknown_dma": False})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        be.inject_fault(FaultKind.DMA_UNKNOWN, JobEngine.PING, 10)
        results = await run_batch(eng)
        assert all(isinstance(t, ErrorEvent) for _, t in results)
        await trio.sleep(1.0)
        assert eng.failed.is_set() and not eng.ready()
        with pytest.raises(UnavailableError):
            await eng.submit(GenerateRequest((1, 2)))


async def test_reset_budget_enforced(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=2)
    cfg = b8_config(recovery={"max_resets_per_10min": 1, "degraded_resets_per_10min": 0})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 10)
        await run_batch(eng)
        await trio.sleep(1.0)
        assert eng.ready()
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 10)  # counted from now: same shape
        results = await run_batch(eng)
        assert all(isinstance(t, ErrorEvent) and t.kind == "device_error" for _, t in results)
        await trio.sleep(1.0)
        st = eng.statistics()
        assert st.resets_total == 2  # the job still had to drain: the device was reset anyway
        assert st.models["qwen3"][1] == "Failed"
        assert eng.failed.is_set() and not eng.ready()
        with pytest.raises(UnavailableError):
            await eng.submit(GenerateRequest((1, 2)))


async def test_busy_is_retried_not_fatal(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=2)
    async with Engine.open(b8_config(), backend=be, sources={"qwen3": fake_source()}) as eng:
        be.inject_fault(FaultKind.DEVICE_BUSY, JobEngine.PING, 3)
        results = await run_batch(eng, n=4, max_tokens=5)
        for i, (toks, term) in enumerate(results):
            assert isinstance(term, FinishEvent)
            assert toks == fake_greedy((i + 1, 2 * i + 3, 7), 5)
        assert be.counters(JobEngine.PING).busy == 1
        assert eng.statistics().resets_total == 0


@pytest.mark.parametrize("kind", [FaultKind.TIMEOUT, FaultKind.CCU_FAULT, FaultKind.CROSSTALK, FaultKind.DMA_UNKNOWN])
async def test_fault_in_b8_batch_is_transparent_with_readmission(autojump_clock: object,
                                                                  kind: FaultKind) -> None:
    """The same fault as above with re-admission on: no client notices; every greedy output equals
    its fault-free solo output; the KV the fault left unknown is quarantined until the reset."""
    be = FakeBackend("sim-next", seed=2)
    async with Engine.open(b8_config(retries=2), backend=be, sources={"qwen3": fake_source()}) as eng:
        be.inject_fault(kind, JobEngine.PING, 10, lane=3)
        results = await run_batch(eng)
        for i, (toks, term) in enumerate(results):
            assert isinstance(term, FinishEvent) and term.reason is FinishReason.LENGTH, term
            assert toks == fake_greedy((i + 1, 2 * i + 3, 7), 12)
        await trio.sleep(1.0)
        st = eng.statistics()
        assert st.resets_total == 1 and sum(st.faults_total.values()) == 1
        assert st.quarantined_kv_total == 8
        assert eng.core.statistics(trio.current_time()).readmitted_total == 8
        assert st.models["qwen3"][1] == "Ready"
        k = eng.generation().kv.statistics()
        assert k.unknown == 0 and k.free == k.num_lanes


async def test_readmission_gives_up_after_its_retries_with_a_retryable_error(autojump_clock: object) -> None:
    """A request that keeps faulting with no token in between ends after max_request_retries
    re-admissions with a retryable error (kind ``device_unavailable``); the others recover."""
    be = FakeBackend("sim-next", seed=2)
    cfg = b8_config(retries=1, recovery={"max_resets_per_10min": 100})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        # a lone request: its prefill is job 1, then its re-prefill after the reset is job 2
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 1)
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 2)
        toks, term = await collect(eng, (5, 6, 7), 4)
        assert isinstance(term, ErrorEvent) and term.kind == "device_unavailable", term
        assert toks == []
        await trio.sleep(1.0)
        toks, term = await collect(eng, (5, 6, 7), 4)  # the next one is served
        assert isinstance(term, FinishEvent) and toks == fake_greedy((5, 6, 7), 4)


async def test_reset_budget_spent_ends_readmitted_requests_as_unavailable(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=2)
    cfg = b8_config(retries=2, recovery={"max_resets_per_10min": 0,
                                                "degraded_resets_per_10min": 0})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 10)
        results = await run_batch(eng)
        assert all(isinstance(t, ErrorEvent) and t.kind == "unavailable" for _, t in results), results
        await trio.sleep(1.0)
        assert eng.failed.is_set() and not eng.ready()


@pytest.mark.parametrize("kind", [FaultKind.TIMEOUT, FaultKind.CCU_FAULT, FaultKind.CROSSTALK,
                                  FaultKind.DMA_UNKNOWN, FaultKind.DEVICE_BUSY])
async def test_a_fault_while_the_lanes_rotate_is_transparent(autojump_clock: object,
                                                             kind: FaultKind) -> None:
    """12 streams over B4 lanes with PING/PONG: the next batch is decided before each completion's
    bookkeeping (engine/rotation.py). A fault (or a refused submit) in the middle of that rotation
    costs the clients nothing with re-admission on: every request ends once, by LENGTH, with its
    fault-free greedy tokens, and every lane comes back."""
    be = FakeBackend("sim-next", seed=3)
    cfg = config(batch={"profiles": [4], "batching_window_us": 0},
                 executor={"max_inflight": 2, "wait_timeout_ms": 200},
                 recovery={"max_request_retries": 2})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(profiles=(4,))}) as eng:
        be.inject_fault(kind, JobEngine.PING, 18, lane=1)  # past the prefills: a rotated batch
        results = await run_batch(eng, n=12, max_tokens=20)
        for i, (toks, term) in enumerate(results):
            assert isinstance(term, FinishEvent) and term.reason is FinishReason.LENGTH, term
            assert toks == fake_greedy((i + 1, 2 * i + 3, 7), 20)
        await trio.sleep(1.0)  # fake clock: recovery, and the ended requests' sequences freed
        core = eng.core.statistics(trio.current_time())
        assert core.rotations_total > 0
        st = eng.statistics()
        if kind is FaultKind.DEVICE_BUSY:
            assert be.counters(JobEngine.PING).busy == 1 and st.resets_total == 0
        else:
            assert st.resets_total == 1 and sum(st.faults_total.values()) == 1
        assert st.models["qwen3"][1] == "Ready"
        k = eng.generation().kv.statistics()
        assert k.unknown == 0 and k.free == k.num_lanes
