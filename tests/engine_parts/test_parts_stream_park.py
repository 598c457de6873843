"""Parking (engine/parking.py, StreamWriter "Parking"): while others wait for admission, a stream
whose client is behind gives its running slot up at once and is resumed when its client caught up,
or cancelled after ``server.stream_parked_cut_ms`` parked. A client that reads in bursts is paused,
never cut; one that never reads costs its slot only until it is first seen behind.

Fake clock, trio-native parts only: the writer alone, a simulated client (hypothesis), and the real
engine over the trio-native FakeBackend."""

from __future__ import annotations

import math

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calserve.config import decode_config
from calserve.engine.engine import Engine
from calserve.engine.stream import StreamWriter, token_bytes
from calserve.engine.types import (
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
    Usage,
)
from calserve.testing.fake_device import FakeBackend
from tests.engine.helpers import fake_source

_TOK = token_bytes("ab", None)


def _writer(waiting: list[int], calls: list[bool | None], *, cut: float = 0.5,
            limit: int = 100 * _TOK, watch: bool = True) -> StreamWriter:
    w = StreamWriter(max_bytes=limit, grace_s=60.0, contended=lambda: bool(waiting),
                     stall_s=0.025, name="t", park=calls.append, park_cut_s=cut)
    if watch:
        w.parking.watch()
    return w


async def test_behind_while_others_wait_parks_and_catching_up_resumes(
        autojump_clock: trio.testing.MockClock) -> None:
    waiting = [1]
    calls: list[bool | None] = []
    w = _writer(waiting, calls, watch=False)
    told: list[bool] = []  # the watcher's callback: once per park, while parked
    w.parking.watch(on_parked=lambda: told.append(w.parking.parked))
    w.put_token(0, "ab")
    await w.receive_many()
    w.report_written()
    w.report_unread(3000, 0.03)  # stalled past 25 ms while others wait
    assert calls == [True] and w.parking.parked and not w.abandoned and told == [True]
    w.report_unread(3000, 0.2)  # still behind, parked for less than the cut time
    assert calls == [True] and not w.abandoned and told == [True]
    await trio.sleep(0.3)
    w.report_unread(0, None)  # it read everything: resumed (others may still wait)
    assert calls == [True, False] and not w.parking.parked
    w.report_unread(3000, 0.03)  # behind again: parked again, told again
    assert calls == [True, False, True] and told == [True, True]
    w.report_unread(0, None)
    assert calls == [True, False, True, False]
    for i in range(5):  # and it gets every token after
        w.put_token(i + 1, "ab")
    (ev,) = await w.receive_many()
    assert isinstance(ev, TokenEvent) and ev.token_ids == (1, 2, 3, 4, 5)
    # Nobody waiting: a stalled client is not parked (the byte bound and its grace apply).
    waiting.clear()
    w.report_unread(3000, 5.0)
    assert calls == [True, False, True, False]


async def test_parked_past_the_cut_time_is_given_up_and_its_request_stopped(
        autojump_clock: trio.testing.MockClock) -> None:
    waiting = [1]
    calls: list[bool | None] = []
    w = _writer(waiting, calls, cut=0.5)
    w.put_token(0, "ab")
    await w.receive_many()
    w.report_written()
    got: list[object] = []

    async def consumer() -> None:  # the pump, waiting for tokens that do not come while parked
        got.extend(await w.receive_many())

    async with trio.open_nursery() as n:
        n.start_soon(consumer)
        await trio.sleep(0.01)
        w.report_unread(3000, 0.03)
        assert w.parking.parked
        waiting.clear()  # whether or not others still wait
        await trio.sleep(0.49)
        w.report_unread(3000, 0.52)
        assert not w.abandoned
        await trio.sleep(0.02)
        w.report_unread(3000, 0.54)  # 0.51 s parked: given up
        assert w.abandoned and w.statistics().overflowed
    assert calls == [True, None]  # None: stop the request (no token comes for its actor)
    assert len(got) == 1 and isinstance(got[0], ErrorEvent) and got[0].kind == "slow_consumer"
    assert "server.stream_parked_cut_ms" in got[0].message


async def test_over_the_bound_or_a_stuck_write_parks_too_and_unwatched_streams_are_cut(
        autojump_clock: trio.testing.MockClock) -> None:
    waiting = [1]
    calls: list[bool | None] = []
    w = _writer(waiting, calls, limit=10 * _TOK)
    for i in range(11):  # over the byte bound while others wait
        w.put_token(i, "ab")
    assert calls == [True] and not w.abandoned
    await w.receive_many()  # the pump takes it all and writes it
    w.report_written()
    w.report_unread(0, None)
    assert calls == [True, False]
    w.put_token(20, "ab")
    await w.receive_many()  # taken, and the write does not complete
    await trio.sleep(0.6)
    w.put_token(21, "ab")  # a write stuck past 0.5 s while others wait
    assert calls == [True, False, True] and not w.abandoned
    w.report_unread(0, None)  # the window shows nothing unread, but the write is still stuck
    assert w.parking.parked
    w.report_written()
    w.report_unread(0, None)
    assert calls[-1] is False
    # A stream nobody watches while parked (no socket probe) is cut as before.
    calls2: list[bool | None] = []
    u = _writer(waiting, calls2, watch=False)
    u.report_unread(3000, 0.03)
    assert u.abandoned and calls2 == []


class _Client:
    """A simulated client and the kernel between: every ``period`` s it reads everything (never:
    ``period`` inf). What the socket probe would report: the bytes written and not read, stalled
    (how long since it last caught up) once that is over the 25 ms threshold."""

    def __init__(self, period: float, phase: float) -> None:
        self.period, self.next_read, self.unread, self.caught_up = period, phase, 0, 0.0

    def advance(self, now: float) -> None:
        while self.next_read <= now:
            self.unread = 0
            self.caught_up = self.next_read
            self.next_read += self.period

    def sample(self, now: float) -> tuple[int, float | None]:
        self.advance(now)
        if not self.unread:
            self.caught_up = now
        behind = now - self.caught_up
        return self.unread, behind if self.unread and behind >= 0.025 else None


async def _run_stream(period: float, phase: float, step: float, contended: bool,
                      tokens: int = 300) -> tuple[bool, int, float]:
    """One stream under the writer's parking with the HTTP layer's watcher (polls 10 ms doubling
    to 100 ms while parked): (given up, tokens delivered, parked time)."""
    waiting = [1] if contended else []
    parked_at: list[float] = []
    parked_total = 0.0
    state = {"parked": False}

    def park(on: bool | None) -> None:
        nonlocal parked_total
        if on:
            state["parked"] = True
            parked_at.append(trio.current_time())
        else:
            if state["parked"]:
                parked_total += trio.current_time() - parked_at[-1]
            state["parked"] = False

    w = StreamWriter(max_bytes=64 * 1024, grace_s=1.0, contended=lambda: bool(waiting),
                     stall_s=0.025, name="sim", park=park, park_cut_s=0.5)
    parked = [trio.Event()]  # set by each park (the watch's callback, as the HTTP side has)
    w.parking.watch(on_parked=lambda: parked[0].set())
    client = _Client(period, phase)
    delivered = 0

    async def producer() -> None:  # the engine: a token every ``step`` unless parked
        for i in range(tokens):
            while state["parked"] and not w.abandoned:
                await trio.sleep(0.001)
            if w.abandoned:
                return
            w.put_token(i, "x" * 1400)
            await trio.sleep(step)
        w.close(FinishEvent(FinishReason.LENGTH, Usage(1, tokens)))

    async def pump() -> None:
        nonlocal delivered
        while True:
            batch = await w.receive_many()
            if not batch:
                return
            for ev in batch:
                if not isinstance(ev, TokenEvent):
                    return
                delivered += len(ev.token_ids)
                w.report_unread(*client.sample(trio.current_time()))
                client.unread += len(ev.text)
                w.report_written()

    async def watcher() -> None:
        while not (w.closed or w.abandoned):
            await parked[0].wait()
            parked[0] = trio.Event()
            poll = 0.01
            while w.parking.parked:
                await trio.sleep(poll)
                poll = min(2 * poll, 0.1)
                w.report_unread(*client.sample(trio.current_time()))

    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            n.start_soon(producer)
            n.start_soon(watcher)
            await pump()  # until the terminal event or the overflow
            n.cancel_scope.cancel()
    return w.abandoned, delivered, parked_total


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=30,
          deadline=None)
@given(period=st.floats(0.001, 0.2), phase=st.floats(0.0, 0.2), step=st.floats(0.0005, 0.01),
       contended=st.booleans())
async def test_a_client_that_reads_at_least_every_200ms_is_never_cut(
        autojump_clock: trio.testing.MockClock, period: float, phase: float, step: float,
        contended: bool) -> None:
    cut, delivered, _ = await _run_stream(period, phase, step, contended)
    assert not cut and delivered == 300


async def test_a_client_that_never_reads_is_parked_at_once_and_cut_after_the_cut_time(
        autojump_clock: trio.testing.MockClock) -> None:
    t0 = trio.current_time()
    cut, delivered, _ = await _run_stream(math.inf, math.inf, 0.002, True)
    assert cut
    # Behind after its first write; parked 25 ms later: ~13 tokens of its slot, not 300.
    assert delivered <= 20, delivered
    assert trio.current_time() - t0 < 1.0


async def test_engine_parks_a_behind_stream_so_a_waiting_request_runs_then_resumes_it(
        autojump_clock: trio.testing.MockClock) -> None:
    """The real engine (fake device, one running slot): a behind stream is parked, the waiting
    request is admitted into its slot and finishes; the parked one resumes when its client catches
    up and finishes too. One terminal event each, every lane back."""
    cfg = decode_config({"scheduler": {"admission": {"max_tpot_steps": 1}}})
    src = fake_source(profiles=(1,), max_seq=4096, max_sequences=4)
    async with Engine.open(cfg, backend=FakeBackend("calrt-0.7.6"), sources={"qwen3": src}) as eng:
        sp = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        a = await eng.submit(GenerateRequest((1, 2, 3), sp))
        a.watch()
        (first,) = await a.receive_many()
        assert isinstance(first, TokenEvent)
        a.report_written()  # the pump wrote it
        b = await eng.submit(GenerateRequest((4, 5), SamplingParams(temperature=0.0,
                                                                      max_tokens=5)))
        await trio.sleep(0.01)
        assert eng.statistics().requests_waiting == 1  # one slot, a holds it
        a.report_unread(5000, 0.1)  # a's client is behind while b waits: parked
        with trio.fail_after(5):
            evs_b = [ev async for ev in b.events()]
        assert isinstance(evs_b[-1], FinishEvent) and evs_b[-1].reason is FinishReason.LENGTH
        assert a.parked
        a.report_unread(0, None)  # caught up: resumed
        got = len(first.token_ids)
        with trio.fail_after(10):
            while True:
                batch = await a.receive_many()
                got += sum(len(ev.token_ids) for ev in batch if isinstance(ev, TokenEvent))
                if isinstance(batch[-1], FinishEvent):
                    break
        assert got == 400 and batch[-1].reason is FinishReason.LENGTH
        assert await a.receive_many() == []
        with trio.fail_after(5):
            while eng.statistics().requests_running:
                await trio.sleep(0.01)
        assert eng.core.parking.parked() == 0 and eng.core.parking.parks_total == 1


async def test_engine_cuts_a_parked_stream_that_never_catches_up_and_frees_its_lane(
        autojump_clock: trio.testing.MockClock) -> None:
    cfg = decode_config({"scheduler": {"admission": {"max_tpot_steps": 1}},
                         "server": {"stream_parked_cut_ms": 500}})
    src = fake_source(profiles=(1,), max_seq=4096, max_sequences=4)
    async with Engine.open(cfg, backend=FakeBackend("calrt-0.7.6"), sources={"qwen3": src}) as eng:
        sp = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
        a = await eng.submit(GenerateRequest((1, 2, 3), sp))
        a.watch()
        await a.receive_many()
        a.report_written()
        b = await eng.submit(GenerateRequest((4, 5), SamplingParams(temperature=0.0,
                                                                      max_tokens=5)))
        await trio.sleep(0.01)
        a.report_unread(5000, 0.1)
        t0 = trio.current_time()
        while not a.parked or trio.current_time() - t0 < 0.6:
            await trio.sleep(0.05)
            a.report_unread(5000, 0.1 + trio.current_time() - t0)  # never catches up
            if not a.parked:
                break
        (end,) = await a.receive_many()
        assert isinstance(end, ErrorEvent) and end.kind == "slow_consumer"
        evs_b = [ev async for ev in b.events()]
        assert isinstance(evs_b[-1], FinishEvent)
        with trio.fail_after(5):
            while eng.statistics().requests_running or eng.statistics().requests_waiting:
                await trio.sleep(0.01)
        assert eng.core.parking.parked() == 0
