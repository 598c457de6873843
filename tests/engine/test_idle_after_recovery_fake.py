"""After a device recovery an idle engine is idle: the scheduler waits instead of running pass
after pass.

The bug this pins: ``EngineCore.resume`` set ``wake`` on the output of its pass, and when that
pass asked nothing the output was the core's shared empty answer (``NOTHING``), so from then on
every call that asked nothing asked for a pass — a busy loop on the trio thread for the rest of
the process (under a fake clock: virtual time never advanced, and a later test that waited on it
never ended). The shared answer is now read-only (``engine/state.py`` ``NO_OUTPUT``)."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from calserve.engine.core import NOTHING
from calserve.engine.engine import Engine
from calserve.engine.state import CoreOutput
from calserve.engine.types import FinishEvent
from calserve.runtime.types import FaultKind, JobEngine
from calserve.testing.fake_device import FakeBackend

from .helpers import collect, config, fake_source


def test_the_shared_empty_output_is_read_only() -> None:
    with pytest.raises(AttributeError):
        NOTHING.wake = True
    with pytest.raises(AttributeError):
        NOTHING.jobs.append(None)  # type: ignore[arg-type]
    assert [getattr(NOTHING, f.name) for f in dataclasses.fields(CoreOutput)] == [
        (), (), (), (), False, float("inf")]


async def test_an_idle_engine_after_a_recovery_waits(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=2)
    # no re-admission: the faulted request ends with an error, so the resume pass has nothing to do
    cfg = config(batch={"profiles": [4]}, executor={"wait_timeout_ms": 200},
                 recovery={"max_request_retries": 0})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        be.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 3)
        toks, term = await collect(eng, (1, 5), 6)  # its second decode step faults
        assert term is not None and not isinstance(term, FinishEvent), term
        await trio.sleep(1.0)  # recovery over
        assert eng.statistics().resets_total == 1
        assert NOTHING.wake is False
        for _ in range(2):  # an idle pass asks for nothing (the bug: wake=True every time)
            out = eng.core.tick(trio.current_time())
            assert not out.wake and not out.jobs, out
        before = eng.core.stats.passes
        await trio.sleep(5.0)
        assert eng.core.stats.passes - before < 20, eng.core.stats.passes - before
        # and it still serves
        toks, term = await collect(eng, (9, 9), 4)
        assert len(toks) == 4, term
