"""PING/PONG must not split a running set that fits one batch into two half-full jobs.

With two engines and ready < B, the free engine used to take the partial batch while the other
engine's job was on the device; the two halves then alternated for good (fill 0.5, every sequence a
token every two steps on a device that serialises its engines). The scheduler now holds a partial
batch for the one step it takes the running job to hand its sequences back (engine/scheduler.py
``_hold_partial_decode``).
"""

from __future__ import annotations

import dataclasses

import trio

from calserve.engine.engine import Engine
from calserve.testing.fake_device import FakeBackend
from calserve.engine.types import FinishEvent, FinishReason, GenerateRequest, SamplingParams, TokenEvent

from .helpers import collect, config, fake_greedy, fake_source


async def _run(max_inflight: int, n: int, steps: int) -> tuple[float, dict[int, int]]:
    be = FakeBackend("sim-next", seed=3)
    cfg = config(batch={"profiles": [4]}, executor={"max_inflight": max_inflight})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(profiles=(4,))}) as eng:
        async def one(i: int) -> None:
            prompt = (i + 1, 2 * i + 3, 7)
            toks, term = await collect(eng, prompt, steps, ignore_eos=True)
            assert isinstance(term, FinishEvent) and term.reason is FinishReason.LENGTH
            assert toks == fake_greedy(prompt, steps)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        st = eng.statistics()
        return st.lanes_active_total[4] / st.lanes_total[4], dict(st.batches_total)


async def test_pingpong_keeps_a_set_that_fits_one_batch_together(autojump_clock: object) -> None:
    fill, batches = await _run(max_inflight=2, n=4, steps=60)
    # 4 sequences, B4: after the prefills every decode batch carries all four (ramp-up aside)
    assert fill > 0.9, (fill, batches)
    assert batches[4] < 1.2 * 60  # about one B4 batch per decode step (60 steps), not two halves


async def test_pingpong_still_overlaps_when_the_set_exceeds_a_batch(autojump_clock: object) -> None:
    fill, batches = await _run(max_inflight=2, n=8, steps=40)
    assert fill > 0.9, (fill, batches)


async def _turnover(overlap: float) -> tuple[list[tuple[str, tuple[int, ...]]], int]:
    """Three long requests fill three of four lanes; a fourth arrives while they decode."""
    src = fake_source(profiles=(4,))
    # a prefill lasts three decode steps
    src.timing[4] = dataclasses.replace(src.timing[4], pingpong_overlap=overlap, prefill_base_us=3000.0)
    be = FakeBackend("sim-next", seed=3, shared_time=True)
    cfg = config(batch={"profiles": [4]}, executor={"max_inflight": 2},
                 admission={"max_sequences": 4})
    async with Engine.open(cfg, backend=be, sources={"qwen3": src}) as eng:
        late = -1

        async def one(i: int, steps: int) -> None:
            nonlocal late
            prompt = (i + 1, 2 * i + 3, 7)
            if i == 3:
                await trio.sleep(0.0205)  # mid-step, while the three decode
            h = await eng.submit(GenerateRequest(prompt, SamplingParams(
                temperature=0.0, max_tokens=steps, ignore_eos=True)))
            if i == 3:
                late = h.request_id
            toks = [t async for ev in h.events() if isinstance(ev, TokenEvent) for t in ev.token_ids]
            assert toks == fake_greedy(prompt, steps)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i, 60)
            nursery.start_soon(one, 3, 20)
        return list(eng.core.requests.trace), late


async def test_partial_batch_waits_for_the_prefill_that_fills_it(autojump_clock: object) -> None:
    """Engines that share the device's time (overlap 0): while the new request's prefill is queued
    or running, no 3-lane decode job is dispatched; its first decode step runs with the other
    three. With overlapping engines the three keep decoding during the prefill."""
    for overlap, held in ((0.0, True), (1.0, False)):
        trace, late = await _turnover(overlap)
        start = trace.index(("prefill", (late,)))
        joined = next(i for i, (k, rids) in enumerate(trace) if k == "decode" and late in rids)
        between = [rids for k, rids in trace[start:joined] if k == "decode"]
        if held:
            assert between == [], trace[start - 2:joined + 1]
        else:
            assert between, trace[start - 2:joined + 1]
