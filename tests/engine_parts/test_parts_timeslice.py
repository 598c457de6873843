"""Time-slicing (engine/timeslice.py): with one tenant, long streams that fill the running slots
take turns with a request queued behind them, so it gets its first token (and its short answer)
within ~ (N / max_running) x timeslice; nobody ends twice, nobody is cut, every lane comes back;
with no more requests than slots nothing is parked.

Fake clock, the real engine over the trio-native FakeBackend (1 ms steps)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calserve.config import decode_config
from calserve.engine import core as core_module
from calserve.engine.engine import Engine
from calserve.engine.state import Seq
from calserve.engine.timeslice import TimeSlice
from calserve.engine.types import (
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
)
from calserve.testing.fake_device import FakeBackend
from tests.engine.helpers import fake_source

LANES = 32
LONG_TOKENS = 600
SHORT_TOKENS = 5


WAIT_MS = 200  # scheduler.timeslice_wait_ms in these runs (the default is longer)


async def _run(n_long: int, delay: float, slice_ms: int, lanes: int = LANES
               ) -> dict[str, object]:
    # A short parked-cut time: a time-sliced request (parked far longer) must still never be cut.
    cfg = decode_config({"scheduler": {"timeslice_ms": slice_ms, "timeslice_wait_ms": WAIT_MS},
                         "server": {"stream_parked_cut_ms": 20}})
    src = fake_source(profiles=(1,), max_seq=4096, max_sequences=lanes)
    ends: dict[str, list[object]] = {}
    tokens: dict[str, int] = {}
    first: dict[str, float] = {}
    async with Engine.open(cfg, backend=FakeBackend("calrt-0.7.6"), sources={"qwen3": src}) as eng:
        cap = eng.core.models.generations[next(iter(eng.core.models.generations))].admission.max_running
        assert cap == 3

        async def consume(name: str, handle: object) -> None:
            tokens[name] = 0
            ends[name] = []
            async for ev in handle.events():  # type: ignore[attr-defined]
                if isinstance(ev, TokenEvent):
                    if name not in first:
                        first[name] = trio.current_time()
                    tokens[name] += len(ev.token_ids)
                elif isinstance(ev, (FinishEvent, ErrorEvent)):
                    ends[name].append(ev)

        async with trio.open_nursery() as n:
            for i in range(n_long):
                sp = SamplingParams(temperature=0.0, max_tokens=LONG_TOKENS, ignore_eos=True)
                h = await eng.submit(GenerateRequest((1, 2, 3 + i), sp))
                h.watch()  # parking for its client is on (never triggered: it reads everything)
                n.start_soon(consume, f"long{i}", h)
            await trio.sleep(delay)
            t0 = trio.current_time()
            short = await eng.submit(GenerateRequest((4, 5), SamplingParams(
                temperature=0.0, max_tokens=SHORT_TOKENS, ignore_eos=True)))
            n.start_soon(consume, "short", short)
        with trio.fail_after(30):
            while eng.statistics().requests_running or eng.statistics().requests_waiting:
                await trio.sleep(0.01)
        gen = next(iter(eng.core.models.generations.values()))
        with trio.move_on_after(1):  # the last ended request's lane: the runtime's free round trip
            while gen.kv.free_lanes() < lanes:
                await trio.sleep(0.01)
        stats = eng.statistics()  # what /metrics exports (calserve_timeslices_total, ..._parked)
        assert stats.timeslices_total == eng.core.parking.slices_total
        assert stats.requests_parked == 0
        return {"ends": ends, "tokens": tokens, "ttft": first["short"] - t0,
                "slices": eng.core.parking.slices_total, "parked": eng.core.parking.parked(),
                "free_lanes": gen.kv.free_lanes(), "lanes": lanes, "cap": cap}


def _check_common(r: dict[str, object], n_long: int) -> None:
    ends = r["ends"]
    tokens = r["tokens"]
    assert isinstance(ends, dict) and isinstance(tokens, dict)
    assert len(ends) == n_long + 1
    for name, evs in ends.items():
        assert len(evs) == 1, (name, evs)  # exactly one terminal event, never cut
        (ev,) = evs
        assert isinstance(ev, FinishEvent) and ev.reason is FinishReason.LENGTH, (name, ev)
        want = SHORT_TOKENS if name == "short" else LONG_TOKENS
        assert tokens[name] == want, (name, tokens[name])
    assert r["parked"] == 0 and r["free_lanes"] == r["lanes"]


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=8,
          deadline=None)
@given(n_long=st.integers(4, 12), delay=st.floats(0.0, 0.3))
async def test_a_short_request_behind_long_streams_gets_its_turn_within_the_slices(
        autojump_clock: trio.testing.MockClock, n_long: int, delay: float) -> None:
    r = await _run(n_long, delay, 100)
    _check_common(r, n_long)
    ttft = r["ttft"]
    assert isinstance(ttft, float)
    # Its wait: timeslice_wait_ms, then the queue ahead of it, max_running per slice; + slack.
    assert ttft <= WAIT_MS / 1000 + (n_long / 3) * 0.1 + 0.3, r
    assert r["slices"] >= 1


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=4,
          deadline=None)
@given(n_long=st.integers(0, 2), delay=st.floats(0.0, 0.3))
async def test_no_more_requests_than_slots_never_parks(
        autojump_clock: trio.testing.MockClock, n_long: int, delay: float) -> None:
    r = await _run(n_long, delay, 100)
    _check_common(r, n_long)
    assert r["slices"] == 0


async def test_without_time_slicing_the_short_request_waits_for_a_long_one(
        autojump_clock: trio.testing.MockClock) -> None:
    """timeslice_ms 0 (off): the short request waits behind the FIFO queue of long streams (what
    the feature fixes; also shows the first test can fail)."""
    r = await _run(9, 0.05, 0)
    _check_common(r, 9)
    assert r["slices"] == 0
    ttft = r["ttft"]
    assert isinstance(ttft, float) and ttft > WAIT_MS / 1000 + 3 * 0.1 + 0.3, r


async def test_parked_requests_holding_the_lanes_resume_so_the_queue_progresses(
        autojump_clock: trio.testing.MockClock) -> None:
    """5 KV lanes, 8 long streams + the short one: time-sliced requests hold lanes, so the queue's
    head can lack one; then the parked ones resume (never a deadlock) and everyone finishes."""
    r = await _run(8, 0.05, 100, lanes=5)
    _check_common(r, 8)
    assert r["slices"] >= 1


async def test_quiet_means_the_time_slicer_changes_nothing(
        autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TimeSlice.quiet`` (what the rotation shortcut asks before it skips the pass,
    ``Rotation.may``): at every pass's per-generation steps (``core._housekeeping``: ``apply``
    when admitting, admission, ``fill``) of a run that slices and resumes, when quiet held (with no
    park pending, as the shortcut also requires) nobody was parked or resumed; quiet did not hold
    where somebody was; and it held with time-sliced requests parked too (every running slot
    taken: none can resume)."""
    seen: list[tuple[bool, bool, bool]] = []  # (quiet before, parked set changed, sliced present)
    housekeeping = core_module._housekeeping

    def checked(st: Any, reqs: Any, ts: TimeSlice, gen: Any, now: float, also: Sequence[Seq] = ()) -> float:
        q = reqs.queues(gen)
        admitting = not st.paused and gen.admitting and now >= st.admit_after
        quiet = None if ts._parking.wanting else ts.quiet(gen, now, also, admitting)
        sliced = bool(ts._parking.sliced_queue(q.parked, gen.id))
        before = (ts._parking.slices_total, dict(q.parked))
        out = housekeeping(st, reqs, ts, gen, now, also)
        if quiet is not None:
            seen.append((quiet, before != (ts._parking.slices_total, dict(q.parked)), sliced))
        return out

    monkeypatch.setattr(core_module, "_housekeeping", checked)
    r = await _run(9, 0.05, 20)
    _check_common(r, 9)
    assert r["slices"] >= 1
    assert not any(quiet and changed for quiet, changed, _ in seen)
    assert any(changed for _, changed, _ in seen)
    assert any(quiet and sliced for quiet, _, sliced in seen)
