"""PING/PONG stays on when the host is busy, on the software runtime (real threads, real time).

The P99 condition of spec §14 reads the runtime's ``device_us``. When the software runtime counted
its worker's late wake-up on a busy host as device time, a loaded server turned PING/PONG off
within a second (bench/README.md, "The device's clock and the PING/PONG guard"); the device's
clock (tests/runtime/test_device_time.py) keeps a busy host out of it. Here: every CPU busy twice
over while 8 requests decode on a 1 ms B4 step with two engines, well past the guard's 64 steps."""

from __future__ import annotations

import dataclasses

import pytest
from busy_host import busy_host  # tests/busy_host.py (tests/ is on sys.path: its conftest)

from calserve.config import decode_config
from calserve.engine.engine import Engine
from calserve.models.source import ModelSource
from calserve.runtime import Timing

from .helpers import greedy_concurrently


@pytest.mark.timeout(180)
async def test_a_busy_host_does_not_turn_pingpong_off(demo_source: ModelSource) -> None:
    cfg = decode_config({
        "runtime": {"profile": "sim-next"},
        "scheduler": {"batch": {"profiles": [4]}, "executor": {"max_inflight": 2}},
    })
    step = Timing(prefill_base_us=200.0, prefill_us_per_token=5.0, decode_step_us={4: 1000.0},
                  pingpong_overlap=0.0)
    source = dataclasses.replace(demo_source, timing={b: step for b in demo_source.profiles})
    with busy_host(settle_s=0.0):
        async with Engine.open(cfg, sources={"qwen3": source}) as eng:
            # two B4 batches in flight: one per engine
            await greedy_concurrently(eng, [(11 + i, 22, 33) for i in range(8)], [96] * 8)
            st = eng.statistics()
    assert st.pingpong_state == "dual", (st.pingpong_state, st.pingpong_degradations_total)
    assert not st.pingpong_degradations_total, st.pingpong_degradations_total
