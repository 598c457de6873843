"""StreamWriter: bounded, coalescing, never blocking, never dropping, one terminal (issue 5 item 5)."""

from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from calserve.engine.stream import StreamStatistics, StreamWriter
from calserve.engine.types import ErrorEvent, FinishEvent, FinishReason, TokenEvent, TokenLogprob, Usage

_FIN = FinishEvent(reason=FinishReason.STOP, usage=Usage(3, 5))


def _put(w: StreamWriter, ev: TokenEvent) -> None:
    w.put_tokens(ev.token_ids, ev.text, ev.logprobs)


def _tok(i: int, with_lp: bool = True) -> TokenEvent:
    lp = (TokenLogprob(i, -float(i)),) if with_lp else None
    return TokenEvent(token_ids=(i,), text=f"<{i}>", logprobs=lp)


@given(
    n_tokens=st.integers(0, 60),
    max_events=st.integers(1, 8),
    read_every=st.integers(1, 20),
    with_lp=st.booleans(),
)
def test_slow_consumer_gets_every_token_in_order_and_one_terminal(
    n_tokens: int, max_events: int, read_every: int, with_lp: bool
) -> None:
    async def main() -> None:
        w = StreamWriter(max_events)
        got: list[object] = []

        async def consumer() -> None:
            async for ev in w:
                got.append(ev)
                await trio.sleep(read_every * 0.001)  # slower than the producer

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            for i in range(n_tokens):
                _put(w, _tok(i, with_lp))
                assert w.statistics().buffered <= max_events  # Invariant: bounded in events
                await trio.sleep(0.001)
            w.close(_FIN)

        tokens = [e for e in got if isinstance(e, TokenEvent)]
        assert got[-1] is _FIN and sum(isinstance(e, FinishEvent) for e in got) == 1
        assert [t for e in tokens for t in e.token_ids] == list(range(n_tokens))
        assert "".join(e.text for e in tokens) == "".join(f"<{i}>" for i in range(n_tokens))
        if with_lp:
            assert [lp.token_id for e in tokens for lp in (e.logprobs or ())] == list(range(n_tokens))
        else:
            assert all(e.logprobs is None for e in tokens)
        st_ = w.statistics()
        assert st_.tokens_put == n_tokens
        assert st_.events_delivered == len(got)
        assert st_.coalesced == n_tokens - len(tokens)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_put_never_blocks_and_coalesces_everything_pending() -> None:
    w = StreamWriter(2)
    for i in range(10):
        _put(w, _tok(i))  # synchronous: no consumer at all
    w.close(_FIN)
    s = w.statistics()
    assert (s.buffered, s.coalesced, s.closed) == (1, 9, True)
    evs = [ev async for ev in w]
    assert len(evs) == 2
    assert isinstance(evs[0], TokenEvent) and evs[0].token_ids == tuple(range(10))
    assert evs[0].text == "".join(f"<{i}>" for i in range(10))
    assert [lp.token_id for lp in evs[0].logprobs or ()] == list(range(10))
    assert evs[1] is _FIN
    # Iteration is over for good.
    assert [ev async for ev in w] == []


async def test_receive_many_returns_everything_deliverable_as_one_token_event() -> None:
    w = StreamWriter(4)
    _put(w, _tok(1))
    _put(w, _tok(2))
    assert [e.token_ids for e in await w.receive_many() if isinstance(e, TokenEvent)] == [(1, 2)]
    _put(w, _tok(3))
    err = ErrorEvent(message="device fault", kind="device_error")
    w.close(err)
    batch = await w.receive_many()
    assert len(batch) == 2 and isinstance(batch[0], TokenEvent) and batch[0].token_ids == (3,)
    assert batch[-1] is err
    assert await w.receive_many() == []


@given(st.lists(st.tuples(st.integers(0, 999), st.text(max_size=3), st.booleans()), max_size=30),
       st.lists(st.integers(0, 30), max_size=6))
def test_put_token_event_carries_every_token_text_and_logprob_in_order(
    toks: list[tuple[int, str, bool]], reads: list[int]
) -> None:
    """Whatever the consumer finds pending becomes ONE TokenEvent: ids, the concatenated text and
    the logprobs (of the tokens that have one) in put order; reading at arbitrary points between
    puts loses, duplicates or reorders nothing."""
    async def main() -> None:
        w = StreamWriter(1)
        got: list[TokenEvent] = []
        for i, (tid, text, has_lp) in enumerate(toks):
            w.put_token(tid, text, TokenLogprob(tid, -1.0 - i) if has_lp else None)
            if i in reads:
                for ev in await w.receive_many():
                    assert isinstance(ev, TokenEvent)
                    got.append(ev)
        w.close(_FIN)
        rest = await w.receive_many()
        assert rest[-1] is _FIN
        got.extend(e for e in rest if isinstance(e, TokenEvent))
        assert [t for e in got for t in e.token_ids] == [t for t, _, _ in toks]
        assert "".join(e.text for e in got) == "".join(x for _, x, _ in toks)
        lps = [(lp.token_id, lp.logprob) for e in got for lp in (e.logprobs or ())]
        assert lps == [(t, -1.0 - i) for i, (t, _, has) in enumerate(toks) if has]
        assert all(len(e.token_ids) >= 1 for e in got)
        s = w.statistics()
        assert (s.tokens_put, s.coalesced, s.events_delivered) == (len(toks), len(toks) - len(got),
                                                                   len(got) + 1)

    trio.run(main)


@given(st.lists(st.lists(st.tuples(st.integers(0, 999), st.text(max_size=3)), max_size=6), max_size=12),
       st.lists(st.integers(0, 12), max_size=4), st.integers(0, 400))
def test_put_tokens_is_put_token_of_each(runs: list[list[tuple[int, str]]], reads: list[int],
                                         bound: int) -> None:
    """A multi-step job's run (``put_tokens``: its ids and their text at once) leaves a writer as
    putting each token with its text would: the same events read at the same points, the same
    counts, the same byte estimate and the same bound crossed (``bound``: max_bytes, 0 = none).
    The differences are an overflow's: its message gives the backlog when it was seen (after the
    whole run, not after its first token over the bound), and the run's tokens count as coalesced."""
    async def main() -> None:
        a, b = StreamWriter(1, max_bytes=bound), StreamWriter(1, max_bytes=bound)
        seen: list[tuple[list[object], list[object]]] = []
        for i, run in enumerate(runs):
            ids = [t for t, _ in run]
            assert a.put_tokens(ids, "".join(x for _, x in run)) == any(
                [b.put_token(t, x) for t, x in run] or [b.abandoned])
            assert (a._bytes, a.abandoned) == (b._bytes, b.abandoned)
            assert a.statistics().buffered == b.statistics().buffered
            if i in reads and b.statistics().buffered and not b.abandoned:
                seen.append((list(await a.receive_many()), list(await b.receive_many())))
        a.close(_FIN)
        b.close(_FIN)
        seen.append((list(await a.receive_many()), list(await b.receive_many())))
        for x, y in seen:  # (an overflow's message names the bytes when it crossed: a run's all)
            assert [(e.kind, e.usage) if isinstance(e, ErrorEvent) else e for e in x] == [
                (e.kind, e.usage) if isinstance(e, ErrorEvent) else e for e in y]
        sa, sb = a.statistics(), b.statistics()
        if sb.overflowed:  # one by one, the tokens after the one over the bound are not coalesced
            sa = dataclasses.replace(sa, coalesced=sb.coalesced)
        assert sa == sb

    trio.run(main)


async def test_consumer_cancelled_while_waiting_then_reads_again() -> None:
    """A consumer parked in receive_many is cancellable; a put after that cancel must not touch the
    cancelled task, and a later read gets the token."""
    w = StreamWriter(1)
    with trio.move_on_after(0.01) as cs:
        await w.receive_many()
    assert cs.cancelled_caught
    w.put_token(5, "x")
    batch = await w.receive_many()
    assert len(batch) == 1 and isinstance(batch[0], TokenEvent) and batch[0].token_ids == (5,)


async def test_two_concurrent_readers_are_a_bug() -> None:
    w = StreamWriter(1)
    got: list[object] = []

    async def first() -> None:
        got.extend(await w.receive_many())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RuntimeError, match="one consumer"):
            await w.receive_many()
        w.close(_FIN)  # the first reader is still served
    assert got == [_FIN]


async def test_put_token_after_close_raises_and_after_abandon_is_dropped() -> None:
    w = StreamWriter(1)
    w.put_token(1, "a")
    await w.aclose()
    w.put_token(2, "b")  # the producer may race the disconnect: dropped, counted
    assert w.statistics().tokens_put == 2 and w.statistics().buffered == 0
    await w.wait_abandoned()  # already abandoned: returns at once
    w.close(_FIN)
    with pytest.raises(RuntimeError, match="after close"):
        w.put_token(3, "c")
    assert await w.receive_many() == []


async def test_consumer_waits_for_the_producer(autojump_clock: trio.testing.MockClock) -> None:
    w = StreamWriter(4)

    async def produce() -> None:
        await trio.sleep(5)
        _put(w, _tok(7))
        await trio.sleep(5)
        w.close(_FIN)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        t0 = trio.current_time()
        first = await w.__anext__()
        assert isinstance(first, TokenEvent) and trio.current_time() - t0 == pytest.approx(5)
        assert await w.__anext__() is _FIN


async def test_close_exactly_once_and_no_put_after_close() -> None:
    w = StreamWriter(1)
    w.close(_FIN)
    with pytest.raises(RuntimeError, match="twice"):
        w.close(ErrorEvent(message="x", kind="internal"))
    with pytest.raises(RuntimeError, match="after close"):
        _put(w, _tok(1))
    with pytest.raises(ValueError, match="max_events"):
        StreamWriter(0)


async def test_consumer_abandon_is_visible_to_the_producer(autojump_clock: trio.testing.MockClock) -> None:
    w = StreamWriter(3)
    _put(w, _tok(1))
    seen = trio.Event()

    async def producer() -> None:
        await w.wait_abandoned()
        assert w.abandoned
        _put(w, _tok(2))  # discarded, not an error: the producer may race the disconnect
        w.close(_FIN)
        seen.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        async for ev in w:
            assert isinstance(ev, TokenEvent)
            await w.aclose()
        await seen.wait()
    s = w.statistics()
    assert s == StreamStatistics(buffered=0, coalesced=0, tokens_put=2, events_delivered=1, closed=True, abandoned=True)
    assert [ev async for ev in w] == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.buffered = 5  # type: ignore[misc]


async def test_aclose_after_terminal_is_not_an_abandon() -> None:
    w = StreamWriter(1)
    w.close(_FIN)
    assert [ev async for ev in w] == [_FIN]
    await w.aclose()
    assert not w.abandoned


async def test_consumer_blocked_in_iteration_is_released_by_aclose() -> None:
    w = StreamWriter(1)
    done = trio.Event()

    async def consume() -> None:
        async for _ in w:
            pass
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        await w.aclose()
    assert done.is_set()
