"""What a stream's consumer reports counts against its client (README "Per-request limits and slow
readers"): the socket's unread bytes count in the backlog bound, a client the socket shows stalled
is given up while others wait for its lane, and so is one whose last write has not completed
(``server.stream_contended_stall_ms``). Fake clock, the writer alone."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from calserve.engine.stream import WRITE_STALL_MIN_S, StreamWriter, token_bytes
from calserve.engine.types import ErrorEvent, FinishEvent, FinishReason, TokenEvent, Usage

_TOK = token_bytes("ab", None)


def _writer(waiting: list[int], *, limit: int = 100 * _TOK, stall: float = 0.05,
            grace: float = 60.0) -> StreamWriter:
    return StreamWriter(max_bytes=limit, grace_s=grace, contended=lambda: bool(waiting),
                        stall_s=stall, name="t")


async def test_unread_bytes_below_count_in_the_bound(autojump_clock: trio.testing.MockClock
                                                     ) -> None:
    waiting: list[int] = []
    w = _writer(waiting, limit=100 * _TOK)
    w.put_token(0, "ab")
    assert len(await w.receive_many()) == 1
    w.report_unread(90 * _TOK)  # the socket holds 90 tokens' worth unread
    assert w.statistics().backlog_bytes == 91 * _TOK  # what the pump took + what is below
    for i in range(9):
        w.put_token(i, "ab")
    assert not w.abandoned  # 100 tokens' worth: at the bound
    waiting.append(1)
    w.put_token(10, "ab")
    assert w.abandoned and w.statistics().overflowed
    (end,) = await w.receive_many()
    assert isinstance(end, ErrorEvent) and end.kind == "slow_consumer"


async def test_the_client_catching_up_clears_the_bound(autojump_clock: trio.testing.MockClock
                                                       ) -> None:
    w = _writer([1], limit=10 * _TOK)
    w.report_unread(50 * _TOK)  # over on its own, while others wait: given up at once
    assert w.abandoned
    w2 = _writer([1], limit=10 * _TOK)
    w2.report_unread(9 * _TOK)
    w2.report_unread(0)  # it read everything
    for i in range(10):
        w2.put_token(i, "ab")
    assert not w2.abandoned


async def test_a_stalled_client_is_given_up_only_while_others_wait(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "calserve.engine.stream")
    waiting: list[int] = []
    w = _writer(waiting)
    w.report_unread(100, 0.2)  # stalled, few bytes, nobody waits: nothing happens
    assert not w.abandoned
    waiting.append(1)
    w.report_unread(100, None)  # not stalled (not yet past the threshold)
    assert not w.abandoned
    w.report_unread(100, 0.06)
    assert w.abandoned and w.statistics().overflowed
    end = await w.receive_many()
    assert len(end) == 1 and isinstance(end[0], ErrorEvent) and end[0].kind == "slow_consumer"
    (rec,) = [r for r in caplog.records if "stream cancelled" in r.getMessage()]
    assert "stream_contended_stall_ms" in rec.getMessage()


async def test_a_write_that_does_not_complete_is_a_stall_while_others_wait(
        autojump_clock: trio.testing.MockClock) -> None:
    waiting = [1]
    w = _writer(waiting, stall=0.05)
    w.put_token(0, "ab")
    await w.receive_many()  # the pump took it and writes it...
    await trio.sleep(WRITE_STALL_MIN_S - 0.01)
    w.put_token(1, "ab")
    assert not w.abandoned  # past stall_s, not past the floor of a write stall
    await trio.sleep(0.02)
    w.put_token(2, "ab")
    assert w.abandoned  # and the write has not completed
    # The same with the write reported complete: the hold before the next read is not a stall.
    w2 = _writer(waiting, stall=0.05)
    w2.put_token(0, "ab")
    await w2.receive_many()
    w2.report_written()
    await trio.sleep(1.0)
    w2.put_token(1, "ab")
    assert not w2.abandoned
    # Nobody waiting: a write may take its time (the byte bound and its grace still apply).
    w3 = _writer([], stall=0.05)
    w3.put_token(0, "ab")
    await w3.receive_many()
    await trio.sleep(1.0)
    w3.put_token(1, "ab")
    assert not w3.abandoned


async def test_stall_off_and_a_reader_that_keeps_up(autojump_clock: trio.testing.MockClock
                                                    ) -> None:
    w = _writer([1], stall=0.0)  # 0: off
    w.put_token(0, "ab")
    await w.receive_many()
    await trio.sleep(10.0)
    w.put_token(1, "ab")
    assert not w.abandoned
    # A reader that writes each batch within the threshold gets every token and the end.
    r = _writer([1], stall=0.05)
    got = 0
    for i in range(200):
        r.put_token(i, "ab")
        batch = await r.receive_many()
        got += sum(len(ev.token_ids) for ev in batch if isinstance(ev, TokenEvent))
        r.report_unread(0, None)
        await trio.sleep(0.01)  # the write
        r.report_written()
    r.close(FinishEvent(FinishReason.LENGTH, Usage(1, 200), ""))
    assert got == 200 and not r.abandoned
    assert isinstance((await r.receive_many())[-1], FinishEvent)


async def test_the_watchers_given_up_callback_fires_on_a_cut_only(
        autojump_clock: trio.testing.MockClock) -> None:
    """What the HTTP layer closes a too-slow client's connection on: ``parking.watch(
    on_given_up=...)`` is called once the writer cuts its consumer (at once for a watcher that
    registers after the cut), never when the consumer left by itself."""
    w = _writer([1], limit=10 * _TOK)
    told: list[str] = []
    w.parking.watch(on_given_up=lambda: told.append("cut"))
    await trio.sleep(0.1)
    w.report_unread(50 * _TOK)  # cut
    assert told == ["cut"]
    late: list[str] = []
    w.parking.watch(on_given_up=lambda: late.append("cut"))
    assert late == ["cut"]
    closed = _writer([1])
    closed.parking.watch(on_given_up=lambda: told.append("closed"))
    await closed.aclose()  # the consumer left by itself: not a cut
    assert told == ["cut"]
