"""Several aliases on a co-resident runtime share the device by weight (issue 14): a short request to
one alias is not held behind a flood of long requests to another; the pure share decisions
(core/model_share.py) under hypothesis."""

from __future__ import annotations

from typing import Any

import trio
from hypothesis import given
from hypothesis import strategies as st

from calserve.core.model_share import ModelShare, may_take_engine

from .model_control_util import Packages, control_app, control_config, packages, wait_until

__all__ = ["packages"]


async def test_short_request_is_not_held_behind_another_models_flood(packages: Packages) -> None:
    cfg = control_config(packages, timing="sat-4k",
                         models={"big": {"package": "a", "timing": "sat-4k"},
                                 "small": {"package": "b", "timing": "sat-4k"}})
    async with control_app(cfg) as h:
        flood_done: list[float] = []
        t0 = trio.current_time()

        async def long_one() -> None:
            s, _, _ = await h.complete("x " * 50, 200, model="big", ignore_eos=True)
            assert s == 200
            flood_done.append(trio.current_time() - t0)

        short_s: list[float] = []
        async with trio.open_nursery() as n:
            for _ in range(32):  # two full B16 batches: both job engines busy with the flood
                n.start_soon(long_one)
            await wait_until(lambda: _decoding(h, "big", 32))
            t1 = trio.current_time()
            s, body, _ = await h.complete("hi", 5, model="small", ignore_eos=True)
            assert s == 200 and body["usage"]["completion_tokens"] == 5
            short_s.append(trio.current_time() - t1)
        flood = max(flood_done)
        assert flood > 0.8  # 2 x 200 steps of 4 ms: the flood really occupies the device
        assert short_s[0] < flood / 4, (short_s, flood)
        share = h.real.core.planner.share
        assert share.charged_s  # the share was consulted and charged


async def _decoding(h: Any, alias: str, n: int) -> bool:
    e = await h.entry(alias)
    return e is not None and sum(g["active_requests"] for g in e["generations"]) >= n


def test_engine_cap() -> None:
    assert may_take_engine(1, 2, others_have_work=False)
    assert not may_take_engine(1, 2, others_have_work=True)
    assert may_take_engine(0, 2, others_have_work=True)
    assert may_take_engine(3, 1, others_have_work=True)  # one engine: the order alone decides


@given(w=st.lists(st.floats(0.25, 4.0), min_size=2, max_size=4),
       cost=st.lists(st.floats(1e-4, 1e-2), min_size=2, max_size=4))
def test_backlogged_generations_get_device_time_by_weight(w: list[float], cost: list[float]) -> None:
    n = min(len(w), len(cost))
    share = ModelShare()
    got = [0.0] * n
    for _ in range(4000):
        g = share.order(range(n))[0]
        share.charge(g, w[g], cost[g])
        got[g] += cost[g]
    total_w = sum(w[:n])
    total = sum(got)
    for i in range(n):  # within one job's worth of the fair share
        assert abs(got[i] / total - w[i] / total_w) < 0.05


def test_an_idle_generation_gets_no_credit_and_is_served_next() -> None:
    share = ModelShare()
    for _ in range(100):
        share.charge(1, 1.0, 0.01)  # generation 1 alone for a second
    assert share.order([1, 2]) == [2, 1]  # 2 arrives: served first...
    share.charge(2, 1.0, 0.01)
    share.charge(1, 1.0, 0.01)
    # ...but it does not get a second of catch-up: they alternate from here
    firsts = []
    for _ in range(10):
        g = share.order([1, 2])[0]
        firsts.append(g)
        share.charge(g, 1.0, 0.01)
    assert firsts.count(1) == 5 and firsts.count(2) == 5
