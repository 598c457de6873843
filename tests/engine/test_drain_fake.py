"""The engine's server-wide drain (calserve.engine.drain) on the fake device and fake clock."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from calserve.engine.engine import Engine
from calserve.engine.types import ErrorEvent, FinishEvent, FinishReason
from calserve.errors import UnavailableError
from calserve.testing.fake_device import FakeBackend

from .helpers import collect, config, fake_source


def _engine(step_us: float = 1000.0) -> tuple[FakeBackend, dict[str, Any]]:
    return FakeBackend("sim-next"), {"qwen3": fake_source(step_us=step_us, max_seq=512)}


async def test_admitted_finish_new_refused(autojump_clock: object) -> None:
    be, src = _engine()
    async with Engine.open(config(batch={"profiles": [4]}), backend=be, sources=src) as eng:
        ends: list[object] = []

        async def one(n: int) -> None:
            ends.append((await collect(eng, (1, 2, 3), n, ignore_eos=True))[1])

        async with trio.open_nursery() as nursery:
            for n in (50, 100, 200, 300, 20, 10):  # 6 requests on 4 lanes: two wait in the queue
                nursery.start_soon(one, n)
            await trio.sleep(0.02)
            report_box: list[object] = []

            async def drain() -> None:
                report_box.append(await eng.drain(30.0))

            nursery.start_soon(drain)
            await trio.testing.wait_all_tasks_blocked()  # the drain has begun
            assert eng.registry.draining is not None
            with pytest.raises(UnavailableError, match="draining") as ei:
                await _submit(eng)
            assert ei.value.retry_after is not None and ei.value.retry_after >= 1
        report = report_box[0]
        assert all(isinstance(e, FinishEvent) and e.reason is FinishReason.LENGTH for e in ends)
        assert len(ends) == 6 and report.admitted >= 4  # type: ignore[attr-defined]
        assert report.finished == report.admitted and report.cut == 0  # type: ignore[attr-defined]
        assert not report.shortened  # type: ignore[attr-defined]
        assert eng.statistics().executor_inflight_jobs == 0


async def _submit(eng: Engine) -> object:
    from calserve.engine.types import GenerateRequest, SamplingParams

    return await eng.submit(GenerateRequest((1, 2), SamplingParams(max_tokens=4)))


@pytest.mark.parametrize("hurry_at", [None, 0.05])
async def test_the_rest_end_with_the_drain_error(autojump_clock: object,
                                                 hurry_at: float | None) -> None:
    be, src = _engine()
    async with Engine.open(config(batch={"profiles": [4]}), backend=be, sources=src) as eng:
        ends: list[object] = []

        async def one() -> None:
            ends.append((await collect(eng, (1, 2, 3), 400, ignore_eos=True))[1])

        hurry = trio.Event()
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
            await trio.sleep(0.02)
            start = trio.current_time()
            if hurry_at is not None:
                async def later() -> None:
                    await trio.sleep(hurry_at)
                    hurry.set()
                nursery.start_soon(later)
            report = await eng.drain(0.2, hurry)
            waited = trio.current_time() - start
        assert report.cut == 3 and report.finished == 0
        assert report.shortened is (hurry_at is not None)
        assert waited == pytest.approx(hurry_at or 0.2, abs=0.01)
        for e in ends:
            assert isinstance(e, ErrorEvent) and e.kind == "shutdown"
            assert "the server stopped while this request was running" in e.message
            assert ("second stop signal" in e.message) is (hurry_at is not None)
        assert eng.statistics().executor_inflight_jobs == 0
