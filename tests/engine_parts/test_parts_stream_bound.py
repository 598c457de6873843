"""The per-stream backlog bound (``server.stream_buffer_bytes`` / ``stream_stall_grace_ms``): a
consumer that stops reading costs at most the bound plus what arrives during the grace period, then
its request is cancelled (logged once) and its lane freed.

Fake clock only with trio-native parts (STACK.md: autojump advances while a worker thread runs): the
writer alone, and the real engine over the trio-native FakeBackend."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from calserve.engine.engine import Engine
from calserve.engine.stream import StreamWriter, token_bytes
from calserve.engine.types import (
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from calserve.testing.fake_device import FakeBackend
from calserve.config import decode_config
from tests.engine.helpers import fake_source

_LP = TokenLogprob(7, -1.0, tuple((i, -float(i)) for i in range(20)))  # 20 top logprobs
_PER_TOKEN = token_bytes("ab", _LP)  # 2,114 bytes


def _writer(limit: int, grace: float = 1.0) -> StreamWriter:
    return StreamWriter(max_bytes=limit, grace_s=grace, name="t")


async def test_a_consumer_that_stops_reading_is_given_up_after_the_grace(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "calserve.engine.stream")
    w = _writer(20 * _PER_TOKEN, grace=1.0)
    gave_up_at = None
    first = trio.current_time()
    for i in range(1000):  # a token every 10 ms, nobody reads
        w.put_token(i, "ab", _LP)
        st = w.statistics()
        if w.abandoned:
            gave_up_at = trio.current_time()
            break
        assert st.backlog_bytes <= 20 * _PER_TOKEN + 100 * _PER_TOKEN + _PER_TOKEN  # bound + grace
        await trio.sleep(0.01)
    assert gave_up_at is not None
    # Over the bound from the 21st token (0.2 s), given up 1 s later.
    assert 1.2 <= gave_up_at - first <= 1.25
    st = w.statistics()
    assert st.overflowed and st.abandoned and st.backlog_bytes == 0 and st.buffered == 0
    # Logged once, with the reason; later tokens are dropped without more lines.
    for i in range(50):
        w.put_token(i, "ab", _LP)
    records = [r for r in caplog.records if "stream cancelled" in r.getMessage()]
    assert len(records) == 1 and "server.stream_buffer_bytes" in records[0].getMessage()
    # The consumer, if it reads again, gets one error event as the end of its stream.
    w.close(FinishEvent(FinishReason.CANCELLED, Usage(1, 2)))
    end = await w.receive_many()
    assert len(end) == 1 and isinstance(end[0], ErrorEvent) and end[0].kind == "slow_consumer"
    assert await w.receive_many() == []


async def test_what_the_consumer_took_and_has_not_sent_counts(
        autojump_clock: trio.testing.MockClock) -> None:
    """The pump took a big batch and is stuck writing it: a few more tokens pass the bound."""
    w = _writer(30 * _PER_TOKEN, grace=0.5)
    for i in range(25):
        w.put_token(i, "ab", _LP)
    (batch,) = await w.receive_many()  # taken, never "sent": the consumer does not read again
    assert isinstance(batch, TokenEvent) and len(batch.token_ids) == 25
    assert w.statistics().backlog_bytes == 25 * _PER_TOKEN
    for i in range(200):
        w.put_token(i, "ab", _LP)
        if w.abandoned:
            break
        await trio.sleep(0.01)
    assert w.abandoned and w.statistics().overflowed
    assert 55 <= i <= 58  # over the bound at the 6th token (0.05 s) + 0.5 s of grace


async def test_a_slow_reader_that_keeps_up_within_the_grace_gets_everything(
        autojump_clock: trio.testing.MockClock) -> None:
    """Reading every 0.4 s (each read takes the whole backlog) with a 0.5 s grace: the backlog is
    over the bound part of the time, never for the whole grace period."""
    w = _writer(10 * _PER_TOKEN, grace=0.5)
    got: list[int] = []

    async def reader() -> None:
        while True:
            evs = await w.receive_many()
            if not evs:
                return
            for ev in evs:
                if isinstance(ev, TokenEvent):
                    got.extend(ev.token_ids)
                else:
                    return
            await trio.sleep(0.4)  # "sending" what it took

    async with trio.open_nursery() as n:
        n.start_soon(reader)
        for i in range(300):
            w.put_token(i, "ab", _LP)
            await trio.sleep(0.01)
        w.close(FinishEvent(FinishReason.LENGTH, Usage(1, 300)))
    assert got == list(range(300))
    assert not w.statistics().overflowed


def test_unbounded_and_zero_grace() -> None:
    w = StreamWriter()  # max_bytes 0: unbounded (in-process consumers, the default of the class)
    for i in range(5000):
        w.put_token(i, "ab", _LP)
    assert not w.abandoned and w.statistics().backlog_bytes == 5000 * _PER_TOKEN

    async def main() -> None:
        w0 = _writer(3 * _PER_TOKEN, grace=0.0)
        for i in range(3):
            w0.put_token(i, "ab", _LP)
        assert not w0.abandoned
        w0.put_token(3, "ab", _LP)  # over the bound with no grace: given up at once
        assert w0.abandoned

    trio.run(main)
    with pytest.raises(ValueError):
        StreamWriter(max_bytes=-1)


async def test_engine_cancels_a_never_read_stream_and_frees_its_lane(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    """The real engine (fake device, 1 ms steps): a logprob stream nobody reads ends as cancelled
    shortly after its backlog passed the bound + grace, not at max_tokens; its lane comes back."""
    caplog.set_level(logging.WARNING, "calserve.engine.stream")
    cfg = decode_config({"server": {"stream_buffer_bytes": 50 * 2200,
                                    "stream_stall_grace_ms": 200}})
    be = FakeBackend("calrt-0.7.6")
    src = fake_source(profiles=(1,), max_seq=4096, max_sequences=4)
    async with Engine.open(cfg, backend=be, sources={"qwen3": src}) as eng:
        t0 = trio.current_time()
        sp = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True, logprobs=20)
        h = await eng.submit(GenerateRequest((1, 2, 3), sp))
        (first,) = await h.receive_many()  # the pump took the first token ...
        assert isinstance(first, TokenEvent)
        # ... and is stuck writing it: nothing reads. The request must end on its own.
        with trio.fail_after(30):
            while eng.statistics().requests_running or eng.statistics().requests_waiting:
                await trio.sleep(0.05)
        took = trio.current_time() - t0
        assert took < 2.0, took  # ~50 tokens + 0.2 s of grace, not 4,000 tokens
        assert [r for r in caplog.records if "stream cancelled" in r.getMessage()]
        end = await h.receive_many()
        assert len(end) == 1 and isinstance(end[0], ErrorEvent) and end[0].kind == "slow_consumer"
        # The lane came back: a new request runs to its end.
        h2 = await eng.submit(GenerateRequest((4, 5), SamplingParams(temperature=0.0, max_tokens=5)))
        evs = [ev async for ev in h2.events()]
        assert isinstance(evs[-1], FinishEvent) and evs[-1].reason is FinishReason.LENGTH


async def test_while_others_wait_for_a_lane_there_is_no_grace(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "calserve.engine.stream")
    waiting: list[int] = []
    w = StreamWriter(max_bytes=10 * _PER_TOKEN, grace_s=60.0, contended=lambda: bool(waiting),
                     name="t")
    for i in range(30):  # over the bound, nobody waits: the grace (60 s) runs
        w.put_token(i, "ab", _LP)
        await trio.sleep(0.01)
    assert not w.abandoned
    waiting.append(1)  # a request now waits for admission
    w.put_token(30, "ab", _LP)
    assert w.abandoned and w.statistics().overflowed
    (rec,) = [r for r in caplog.records if "stream cancelled" in r.getMessage()]
    assert "other requests wait for its lane" in rec.getMessage()


async def test_under_the_bound_contention_changes_nothing(
        autojump_clock: trio.testing.MockClock) -> None:
    w = StreamWriter(max_bytes=10 * _PER_TOKEN, grace_s=0.5, contended=lambda: True, name="t")
    for i in range(10):
        w.put_token(i, "ab", _LP)
    assert not w.abandoned  # at the bound, not over it
