"""The floor app's event pace (``bench.floor_app.EventPace``, ``--events-per-s``): the HTTP floor at
calserve's own event rate (bench/http_floor.py's third floor). Turns go out at the rate, in the order
they were asked for, a cancelled waiter costs no turn, and nothing is banked while nobody waits."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from bench.floor_app import EventPace, FloorApp, FloorOptions, serve_floor


async def test_turns_follow_the_rate_in_order(autojump_clock: trio.abc.Clock) -> None:
    pace = EventPace(rate=100.0)  # one turn per 10 ms, ticks of 1 ms
    got: list[tuple[int, float]] = []
    t0 = trio.current_time()

    async def stream(i: int) -> None:
        await pace.turn()
        got.append((i, trio.current_time() - t0))

    async with trio.open_nursery() as n:
        for i in range(20):
            n.start_soon(stream, i)
            await trio.sleep(0)  # asked in this order
    assert [i for i, _ in got] == list(range(20))
    times = [t for _, t in got]
    for k, t in enumerate(times, start=1):  # the k-th turn once k turns were due (one tick late at most)
        assert k / 100.0 - 1e-9 <= t <= k / 100.0 + 0.0011, (k, t)
    assert pace.turns == 20


async def test_a_cancelled_waiter_costs_no_turn_and_idle_time_is_not_banked(
        autojump_clock: trio.abc.Clock) -> None:
    pace = EventPace(rate=100.0)
    order: list[str] = []

    async def stream(name: str) -> None:
        await pace.turn()
        order.append(name)

    gone = trio.CancelScope()
    async with trio.open_nursery() as n:
        n.start_soon(stream, "first")
        await trio.sleep(0)
        n.start_soon(_cancelled_turn, pace, gone)
        await trio.sleep(0)
        n.start_soon(stream, "third")
        await trio.sleep(0)
        gone.cancel()  # the second waiter leaves before its turn
    assert order == ["first", "third"] and pace.turns == 2
    await trio.sleep(1.0)  # nobody waits for a second: no 100 turns saved up
    t0 = trio.current_time()
    for _ in range(3):
        await pace.turn()
    assert trio.current_time() - t0 >= 0.02  # the 2nd and 3rd turns waited for the rate


async def _cancelled_turn(pace: EventPace, scope: trio.CancelScope) -> None:
    with scope:
        await pace.turn()
        raise AssertionError("a cancelled waiter got a turn")


def test_rate_must_be_positive() -> None:
    with pytest.raises(ValueError):
        EventPace(0.0)


async def test_paced_floor_streams_every_event() -> None:
    """The real app on 127.0.0.1: a paced stream delivers all its tokens, one turn per event."""
    app = FloorApp(FloorOptions(events_per_s=2000.0, tokens_per_event=4.0))
    async with trio.open_nursery() as n:
        port = await n.start(serve_floor, app)
        body = {"model": "floor", "prompt": "x", "max_tokens": 32, "stream": True}
        text = ""
        events = 0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        text += chunk["choices"][0]["text"] if chunk["choices"] else ""
                        events += 1
        n.cancel_scope.cancel()
    assert text == "a" * 32
    assert app._pace is not None and app._pace.turns == 8  # 32 tokens in events of 4
    assert events == 9  # 8 content events and the finish
