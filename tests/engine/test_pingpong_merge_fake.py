"""PING/PONG must not split a running set that fits one batch into two half-full jobs.

With two engines and ready < B, the free engine used to take the partial batch while the other
engine's job was on the device; the two halves then alternated for good (fill 0.5, every sequence a
token every two steps on a device that serialises its engines). The scheduler now holds a partial
batch for the one step it takes the running job to hand its sequences back (engine/scheduler.py
``_hold_partial_decode``).
"""

from __future__ import annotations

import trio

from calserve.engine.engine import Engine
from calserve.engine.fake_device import FakeBackend
from calserve.engine.types import FinishEvent, FinishReason

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
