"""The engine thread that waits for device jobs (calserve.engine.backend._EngineThread).

Its contract on the hot path: a call always returns its result (or exception) through the
doorbell, a cancelled caller still drains the call before the cancellation surfaces, and the
thread is reusable afterwards (the doorbell is cleared, one call at a time)."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from calserve.engine.backend import _EngineThread


async def test_results_and_exceptions_come_back_in_order() -> None:
    et = _EngineThread("test-engine-thread")
    try:
        for i in range(50):  # the doorbell is cleared after every call
            assert await et.run(lambda i=i: i * i) == i * i
        with pytest.raises(ZeroDivisionError):
            await et.run(lambda: 1 // 0)
        assert await et.run(lambda: "still usable") == "still usable"
    finally:
        et.close()


async def test_cancelled_caller_drains_the_call_first() -> None:
    et = _EngineThread("test-engine-thread")
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def job() -> int:
        started.set()
        release.wait(10)
        finished.set()
        return 1

    seen: list[str] = []
    scopes: list[trio.CancelScope] = []

    async def caller() -> None:
        with trio.CancelScope() as cs:
            scopes.append(cs)
            try:
                await et.run(job)
            except trio.Cancelled:
                # Re-raised only after the call finished on the thread (strict drain).
                seen.append("cancelled after drain" if finished.is_set() else "cancelled early")
                raise
            seen.append("returned")

    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller)
                await trio.to_thread.run_sync(started.wait)
                scopes[0].cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert seen == []  # still draining: the cancel did not abandon the call
                release.set()
            assert seen == ["cancelled after drain"]
            assert await et.run(lambda: 2) == 2  # reusable, no stale ring left behind
    finally:
        release.set()
        et.close()
