"""The trace shows what the timing model lets the two job engines overlap: on the software runtime
(real threads, real time) with PING/PONG, two engines' run spans overlap about not at all when the
profile serialises them (``sat-4k``, overlap 0) and substantially when it lets half of each job run
beside the other (``fast``, overlap 0.5). The run span is the runtime's ``device_us`` (from the
job's start on the engine, after its wait for the other engine's serialised share)."""

from __future__ import annotations

import dataclasses

import pytest

from calserve.config import decode_config
from calserve.engine.engine import Engine
from calserve.engine.trace import chrome_trace, overlap_fraction
from calserve.models.source import ModelSource
from calserve.models.timing import timing_profile

from .helpers import greedy_concurrently


async def _overlap(source: ModelSource, timing: str) -> float:
    cfg = decode_config({
        "runtime": {"profile": "sim-next"},
        "scheduler": {"batch": {"profiles": [1, 4]}, "executor": {"max_inflight": 2}},
    })
    source = dataclasses.replace(source, timing={b: timing_profile(timing) for b in source.profiles})
    async with Engine.open(cfg, sources={"qwen3": source}) as eng:
        # two B4 batches: one per engine
        await greedy_concurrently(eng, [(11 + i, 22, 33) for i in range(8)], [24] * 8)
        return overlap_fraction(chrome_trace(eng.trace_events()))["overlap"]


@pytest.mark.timeout(120)
async def test_trace_overlap_follows_the_timing_model(demo_source: ModelSource) -> None:
    serial = await _overlap(demo_source, "sat-4k")
    half = await _overlap(demo_source, "fast")
    assert serial < 0.1, serial
    assert half > 0.25, half
