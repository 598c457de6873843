"""The model control plane under random interleavings (hypothesis, fake device, fake clock): loads,
replacements, unloads, rollbacks and requests on two aliases, overlapping, on a co-resident
(sim-next) and a single-resident (calrt-0.7.6) runtime. Whatever happens, every accepted request
ends with exactly one terminal event, every refusal is a calserve error, and afterwards no job is on
the device, every listed generation is idle with all its KV lanes free, every alias points at a
listed generation, and every calbin not listed was released."""

from __future__ import annotations

import dataclasses
from typing import Any

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.core.model_state import ModelState
from calserve.engine.engine import Engine
from calserve.engine.types import ErrorEvent, FinishEvent, GenerateRequest, SamplingParams, TokenEvent
from calserve.errors import CalserveError
from calserve.testing.fake_device import FakeBackend

from .helpers import config, fake_source

ALIASES = ("qwen3", "m2")
Op = tuple[Any, ...]

ops_strategy = st.lists(st.one_of(
    st.tuples(st.just("load"), st.sampled_from(ALIASES), st.sampled_from(["a", "b"])),
    st.tuples(st.just("unload"), st.sampled_from(ALIASES), st.sampled_from([0.0, 0.005, 1.0])),
    st.tuples(st.just("rollback"), st.sampled_from(ALIASES)),
    st.tuples(st.just("req"), st.sampled_from(ALIASES), st.integers(1, 30), st.integers(1, 6)),
    st.tuples(st.just("req"), st.sampled_from(ALIASES), st.integers(1, 30), st.integers(1, 6)),
    st.tuples(st.just("sleep"), st.sampled_from([0.0, 0.001, 0.01])),
), min_size=1, max_size=24)


async def _run(ops: list[Op], profile: str) -> None:
    be = FakeBackend(profile)
    cfg = config(admission={"max_sequences": 4})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(profiles=(1,))}) as eng:
        ctl = eng.control

        def open_source(alias: str, package: str, timing: str | None) -> tuple[Any, Any]:
            src = fake_source(profiles=(1,), alias=alias, max_sequences=4)
            return dataclasses.replace(src, sha256=package * 64), None

        ctl.open_source = open_source  # in-memory packages "a" / "b"
        ctl.plan = lambda *a, **k: None
        terminals: list[list[Any]] = []

        async def admin(op: Op) -> None:
            try:
                if op[0] == "load":
                    await ctl.load(op[1], op[2], 0.05)
                elif op[0] == "unload":
                    await ctl.unload(op[1], op[2])
                else:
                    await ctl.rollback(op[1], 0.05)
            except CalserveError:
                pass  # refused (busy, unknown, no previous): a valid answer

        async def request(alias: str, n: int) -> None:
            try:
                h = await eng.submit(GenerateRequest((1, 2, 3), SamplingParams(
                    temperature=0.0, max_tokens=n, ignore_eos=True), model=alias))
            except CalserveError:
                return  # refused at admission (404 / 429 / 503)
            ends: list[Any] = []
            terminals.append(ends)
            async for ev in h.events():
                if not isinstance(ev, TokenEvent):
                    ends.append(ev)

        async with trio.open_nursery() as n:
            for op in ops:
                if op[0] == "sleep":
                    await trio.sleep(op[1])
                elif op[0] == "req":
                    for _ in range(op[3]):
                        n.start_soon(request, op[1], op[2])
                else:
                    n.start_soon(admin, op)
        with trio.fail_after(120):
            while ctl.unloader.retiring or ctl.switching:
                await trio.sleep(0.01)
        await trio.sleep(0.05)  # the last releases
        for ends in terminals:
            assert len(ends) == 1 and isinstance(ends[0], (FinishEvent, ErrorEvent)), ends
        assert eng.core.inflight_jobs() == 0
        listed = list(eng.model_manager.generations.values())
        for g in listed:
            assert g.state in (ModelState.READY, ModelState.FAILED), g.state
            assert ctl.unloader.load_of(g) == (0, 0)
            kv = g.kv.statistics()
            assert kv.free == kv.num_lanes, kv  # every lane came back
            assert not g.lane_seq, g.lane_seq
        for alias, gid in eng.model_manager.aliases.items():
            assert gid in eng.model_manager.generations, alias
        listed_calbins = {id(cb) for g in listed for cb in g.calbins.values()}
        assert {id(cb) for cb in be._calbins} <= listed_calbins  # the rest were released


@settings(max_examples=60, deadline=None)
@given(ops=ops_strategy, profile=st.sampled_from(["sim-next", "calrt-0.7.6"]))
def test_random_lifecycle_interleavings(ops: list[Op], profile: str) -> None:
    trio.run(_run, ops, profile, clock=trio.testing.MockClock(autojump_threshold=0))
