"""``scheduler.admission.max_inflight_jobs`` bounds the jobs on the device at once (the capacity
plan's in-flight budget), below what the enabled job engines would allow."""

from __future__ import annotations

from typing import Any

import trio

from calserve.engine.engine import Engine
from calserve.testing.fake_device import FakeBackend

from .helpers import collect, config, fake_source


async def _peak(cfg: Any) -> int:
    be = FakeBackend("sim-next")
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(profiles=(1,))}) as eng:
        peak = 0
        done = trio.Event()

        async def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, eng.core.inflight_jobs())
                await trio.sleep(0.0001)

        async with trio.open_nursery() as n:
            n.start_soon(watch)
            async with trio.open_nursery() as m:
                for i in range(4):
                    m.start_soon(collect, eng, (1 + i, 2, 3), 30)
            done.set()
        return peak


async def test_max_inflight_jobs_bounds_the_jobs_on_the_device(autojump_clock: Any) -> None:
    assert await _peak(config(executor={"max_inflight": 2})) == 2  # PING and PONG both used
    assert await _peak(config(executor={"max_inflight": 2},
                              admission={"max_inflight_jobs": 1})) == 1
