"""Faults on the software runtime (real clock): an injected timeout, CCU fault and crosstalk during
a full B8 decode batch end those requests with an explicit error, quarantine their KV, reset the
device, and the next requests succeed with correct output."""

from __future__ import annotations

import pytest
import trio

from calserve.config import decode_config
from calserve.engine.engine import Engine
from calserve.models.source import ModelSource
from calserve.engine.types import ErrorEvent, FinishEvent, GenerateRequest, SamplingParams, TokenEvent
from calserve.runtime.reference import greedy_generate
from calserve.runtime.types import FaultKind, JobEngine


async def run(eng: Engine, prompts: list[tuple[int, ...]], n: int) -> list[tuple[list[int], object]]:
    out: list[tuple[list[int], object]] = [([], None)] * len(prompts)

    async def one(i: int) -> None:
        h = await eng.submit(GenerateRequest(prompts[i], SamplingParams(temperature=0.0, max_tokens=n,
                                                                        ignore_eos=True)))
        evs = [ev async for ev in h.events()]
        out[i] = ([t for e in evs if isinstance(e, TokenEvent) for t in e.token_ids], evs[-1])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return out


@pytest.mark.parametrize("kind", [FaultKind.TIMEOUT, FaultKind.CCU_FAULT, FaultKind.CROSSTALK],
                         ids=["timeout", "ccu", "crosstalk"])
async def test_fault_in_b8_batch_real_runtime(demo_source: ModelSource, kind: FaultKind) -> None:
    cfg = decode_config({
        "runtime": {"profile": "sim-next"},
        "scheduler": {"batch": {"profiles": [8], "batching_window_us": 50_000},
                      "executor": {"wait_timeout_ms": 150},
                      "recovery": {"max_request_retries": 0}},  # re-admission off: errors
    })
    prompts = [(10 + i, 20 + 3 * i, 30) for i in range(8)]
    async with Engine.open(cfg, sources={"qwen3": demo_source}) as eng:
        eng.backend.inject_fault(kind, JobEngine.PING, 10, 5)  # the 2nd full decode batch
        res = await run(eng, prompts, 10)
        for toks, term in res:
            assert isinstance(term, ErrorEvent) and term.kind == "device_error", term
            assert len(toks) == 2
        with trio.fail_after(5):
            while eng.statistics().resets_total < 1 or not eng.ready():
                await trio.sleep(0.01)
        st = eng.statistics()
        assert st.resets_total == 1 and st.quarantined_kv_total == 8
        assert st.kv_sequences["Unknown"] == 0
        again = await run(eng, prompts[:3], 6)
        for i, (toks, term) in enumerate(again):
            assert isinstance(term, FinishEvent), term
            assert toks == greedy_generate(demo_source.model_config, demo_source.weights,
                                           list(prompts[i]), 6, demo_source.profiles[8].kv_dtype)


@pytest.mark.parametrize("kind", [FaultKind.TIMEOUT, FaultKind.CCU_FAULT, FaultKind.CROSSTALK],
                         ids=["timeout", "ccu", "crosstalk"])
async def test_fault_in_b8_batch_real_runtime_is_transparent(demo_source: ModelSource,
                                                              kind: FaultKind) -> None:
    """Re-admission on (the default) on the real software runtime: the faulted batch's requests are
    re-prefilled from prompt + generated tokens after the reset, and every greedy output equals the
    numpy reference (the prefill and decode kernels agree on the rebuilt KV)."""
    cfg = decode_config({
        "runtime": {"profile": "sim-next"},
        "scheduler": {"batch": {"profiles": [8], "batching_window_us": 50_000},
                      "executor": {"wait_timeout_ms": 150}},
    })
    prompts = [(10 + i, 20 + 3 * i, 30) for i in range(8)]
    async with Engine.open(cfg, sources={"qwen3": demo_source}) as eng:
        eng.backend.inject_fault(kind, JobEngine.PING, 10, 5)  # the 2nd full decode batch
        res = await run(eng, prompts, 10)
        for i, (toks, term) in enumerate(res):
            assert isinstance(term, FinishEvent), term
            assert toks == greedy_generate(demo_source.model_config, demo_source.weights,
                                           list(prompts[i]), 10, demo_source.profiles[8].kv_dtype)
        st = eng.statistics()
        assert st.resets_total == 1
        assert eng.core.statistics(trio.current_time()).readmitted_total == 8


@pytest.mark.timeout(120)
async def test_faults_from_config_under_load_cost_the_clients_nothing(demo_source: ModelSource) -> None:
    """runtime.faults on the software runtime (B8, PING/PONG): a seeded share of jobs faults with
    every kind; with re-admission on, every request completes and its greedy output equals the
    numpy reference; every lane and sequence comes back."""
    cfg = decode_config({
        "runtime": {"profile": "sim-next",
                    "faults": {"rate": 0.04, "seed": 3,
                               "kinds": ["timeout", "ccu", "unknown_dma", "busy", "crosstalk"]}},
        "scheduler": {"batch": {"profiles": [8], "batching_window_us": 2_000},
                      "executor": {"max_inflight": 2, "wait_timeout_ms": 100},
                      # at 4 % of jobs faulting, a reset is due every ~25 jobs: a request can lose
                      # its KV to others' resets a few times in a row before its next token
                      "recovery": {"max_resets_per_10min": 1000, "max_request_retries": 4}},
    })
    prompts = [(5 + i, 11 + 2 * i, 3 + i % 7) for i in range(24)]
    async with Engine.open(cfg, sources={"qwen3": demo_source}) as eng:
        res = await run(eng, prompts, 12)
        plan = eng.backend.faults  # type: ignore[attr-defined]
        # seeded, but which jobs draw a fault depends on the real threads' batch composition
        assert plan is not None and sum(plan.armed.values()) >= 1, plan.armed
        for i, (toks, term) in enumerate(res):
            assert isinstance(term, FinishEvent), (i, term)
            assert toks == greedy_generate(demo_source.model_config, demo_source.weights,
                                           list(prompts[i]), 12, demo_source.profiles[8].kv_dtype), i
        st = eng.statistics()
        resetting = sum(n for k, n in plan.armed.items() if k != "device_busy")
        # a fault armed on a submit that was refused means the device had faulted already
        assert st.resets_total >= 1 or resetting == 0, (st.resets_total, plan.armed)
        with trio.fail_after(5):
            while eng.statistics().kv_tokens_reserved or eng.statistics().executor_inflight_jobs:
                await trio.sleep(0.01)
        assert eng.statistics().requests_running == 0
    assert eng.leaked_at_close == 0
