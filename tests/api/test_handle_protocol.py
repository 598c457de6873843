"""The engine handle contract (calserve.api.protocol.HandleLike) holds for the real engine's handle
and for both fake handles the HTTP tests use: every member is there, ``receive_many`` ends with the
terminal event and answers ``[]`` after it, ``aclose`` cancels a running request. (mypy checks the
real engine's signatures against the protocol: calserve.api.state._default_factory.)"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from calserve.api.protocol import HandleLike
from calserve.engine.types import ErrorEvent, Event, FinishEvent, GenerateRequest, SamplingParams

from .conftest import make_config
from .fake_engine import FakeCoalescingHandle, FakeEngine, FakeHandle
from .real_engine import real_app


async def _drain(h: HandleLike) -> list[Event]:
    got: list[Event] = []
    while True:
        batch = await h.receive_many()
        if not batch:
            return got
        got.extend(batch)


def _request(max_tokens: int = 3) -> GenerateRequest:
    return GenerateRequest(prompt_tokens=(1, 2, 3), sampling=SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("coalesce", [False, True], ids=["one_by_one", "receive_many"])
async def test_fake_handles_are_complete(autojump_clock: Any, coalesce: bool) -> None:
    async with FakeEngine.open(make_config(), token_delay=0.01, coalesce=coalesce) as eng:
        h = await eng.submit(_request())
        assert isinstance(h, HandleLike)
        assert isinstance(h, FakeCoalescingHandle if coalesce else FakeHandle)
        got = await _drain(h)
        assert isinstance(got[-1], FinishEvent)
        assert not any(isinstance(e, (FinishEvent, ErrorEvent)) for e in got[:-1])
        assert await h.receive_many() == []  # still [] after the terminal event
        one_by_one = [e async for e in (await eng.submit(_request())).events()]
        assert isinstance(one_by_one[-1], FinishEvent) and len(one_by_one) == 4
        h = await eng.submit(_request(400))
        await h.aclose()  # the consumer is gone: cancelled once, nothing more handed out
        await h.aclose()
        assert eng.cancelled_ids.count(h.request_id) == 1
        assert await h.receive_many() == []
        await trio.sleep(0.05)
        assert h.request_id not in eng.active


async def test_the_real_engine_handle_is_complete(autojump_clock: Any) -> None:
    async with real_app(make_config()) as rh:
        eng = rh.real_engine
        h = await eng.submit(_request())
        assert isinstance(h, HandleLike)
        got = await _drain(h)
        assert isinstance(got[-1], FinishEvent)
        assert await h.receive_many() == []
        h = await eng.submit(_request(200))
        await h.aclose()
        with trio.fail_after(5):
            while eng.statistics().requests_running:
                await trio.sleep(0.01)
