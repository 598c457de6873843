"""Per-tick batch-profile selection over a shared-KV calbin group (spec §8), on the fake device.

With ``shared_kv`` and several configured profiles the engine loads them all as one KV group and
picks the decode profile by ready count (``scheduler.batch.selection``): B1 at low load, B16 with
>= ``b16_min_ready`` ready sequences. Without shared KV (or with ``batch.instance_pool``) it serves
one pool as before. Also: the fake device's group contract, per-member reconfigure after
DMA_UNKNOWN, and nothing leaked.
"""

from __future__ import annotations

import dataclasses

import pytest
import trio

from calserve.engine.engine import Engine
from calserve.testing.fake_device import FakeBackend, FakeCalbin
from calserve.engine.types import ErrorEvent, FinishEvent, FinishReason
from calserve.runtime.types import RUNTIME_PROFILES, FaultKind, InvalidArgument, JobEngine, NotSupported, ProfileSpec

from .helpers import collect, config, fake_greedy, fake_source

ALL = [1, 4, 8, 16]


async def run_many(eng: Engine, n: int, max_tokens: int, base: int = 0) -> None:
    async def one(i: int) -> None:
        prompt = (base + i + 1, 2 * i + 3, 7)
        toks, term = await collect(eng, prompt, max_tokens, ignore_eos=True)
        assert isinstance(term, FinishEvent) and term.reason is FinishReason.LENGTH, term
        assert toks == fake_greedy(prompt, max_tokens), f"request {i}"

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)


def assert_nothing_leaked(eng: Engine, be: FakeBackend) -> None:
    gen = eng.generation()
    k = gen.kv.statistics()
    assert (k.free, k.tokens_reserved) == (k.num_lanes, 0), k
    assert be.live_sequences() == 0 and not gen.lane_seq


async def test_low_load_b1_high_load_b16_both_over_time(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=1)
    cfg = config(batch={"profiles": ALL}, executor={"max_inflight": 1})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        gen = eng.generation()
        members = gen.calbins
        assert sorted(members) == ALL and gen.calbin is members[1]  # smallest B owns the KV group
        assert all(isinstance(cb, FakeCalbin) and cb.group is members[1].group for cb in members.values())  # type: ignore[attr-defined]
        assert len(be._calbins) == 4

        # low load: two requests at a time (< b4_min_ready = 3) -> B1 batches only
        await run_many(eng, 2, 10)
        st = eng.statistics()
        assert set(st.batches_total) == {1} and st.batches_total[1] >= 2 * 9
        await trio.sleep(0.05)  # sequences are freed after their requests' terminal events
        assert_nothing_leaked(eng, be)

        # high load: 24 long requests build up >= b16_min_ready = 12 ready sequences -> mostly B16
        # batches; the ramp up (one prefill at a time) and the tail use the smaller profiles
        await run_many(eng, 24, 60, base=100)
        st = eng.statistics()
        assert st.batches_total[16] > st.batches_total[8] + st.batches_total[4]
        assert st.batches_total[1] > 2 * 9 and st.batches_total[4] and st.batches_total[8]
        for b, n in st.batches_total.items():
            assert st.lanes_total[b] == b * n  # each batch was built for (and ran on) its member
        assert st.lanes_active_total[16] > 12 * st.batches_total[16]  # really full
        await trio.sleep(0.05)
        assert_nothing_leaked(eng, be)
        calbins = list(be._calbins)
    # shutdown released every member; the group's KV went with the last one, empty
    assert not be._calbins and all(cb.released for cb in calbins)
    assert all(cb.leaked_at_release == 0 for cb in calbins)


@pytest.mark.parametrize("how", ["no_shared_kv", "instance_pool"])
async def test_one_pool_without_shared_kv_or_with_instance_pool(autojump_clock: object, how: str) -> None:
    if how == "no_shared_kv":
        be = FakeBackend(dataclasses.replace(RUNTIME_PROFILES["sim-next"], shared_kv=False))
        cfg = config(batch={"profiles": ALL})
        pool = 16
    else:
        be = FakeBackend("sim-next")
        cfg = config(batch={"profiles": ALL, "instance_pool": 4})
        pool = 4
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        gen = eng.generation()
        assert list(gen.calbins) == [pool] and not gen.selecting and len(be._calbins) == 1
        await run_many(eng, 2, 6)
        assert set(eng.statistics().batches_total) == {pool}


async def test_dma_unknown_reconfigures_every_member(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=3)
    cfg = config(batch={"profiles": ALL}, executor={"wait_timeout_ms": 200},
                 recovery={"max_request_retries": 0})  # re-admission off: the batch fails
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        be.inject_fault(FaultKind.DMA_UNKNOWN, JobEngine.PING, 3)  # 2 prefills, then a B1 decode
        results: list[object] = []

        async def one(i: int) -> None:
            results.append((await collect(eng, (i + 1, 5), 8, ignore_eos=True))[1])

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(one, i)
        assert all(isinstance(t, ErrorEvent) and t.kind == "device_error" for t in results), results
        await trio.sleep(1.0)  # let recovery finish
        assert be.resets == 1 and not be.needs_reconfigure
        assert [cb.reconfigures for cb in eng.generation().calbins.values()] == [1, 1, 1, 1]  # type: ignore[attr-defined]
        await run_many(eng, 16, 40, base=50)  # the group serves again, B16 included
        assert eng.statistics().batches_total[16] >= 1
        await trio.sleep(0.05)  # sequences are freed after their requests' terminal events
        assert_nothing_leaked(eng, be)


async def test_fake_group_contract() -> None:
    be = FakeBackend("sim-next")
    src = fake_source()
    w = src.weights
    owner = await be.load_calbin(src.model_config, w, src.profiles[1])
    with pytest.raises(InvalidArgument, match="max_sequences"):
        await be.load_calbin(src.model_config, w, ProfileSpec(4, 512, 31), kv_owner=owner)
    with pytest.raises(InvalidArgument, match="weights"):
        await be.load_calbin(src.model_config, dict(w), src.profiles[4], kv_owner=owner)
    member = await be.load_calbin(src.model_config, w, src.profiles[4], kv_owner=owner)
    sid = await owner.create_sequence()
    assert sid != await member.create_sequence()  # one id space
    assert be.live_sequences() == 2  # the group counts once
    await member.free_sequences([sid])
    assert be.live_sequences() == 1
    await owner.release()  # any order: the member keeps the group's KV
    assert be.live_sequences() == 1 and owner.leaked_at_release == 0
    await member.release()
    assert member.leaked_at_release == 1 and be.live_sequences() == 0
    plain = FakeBackend(dataclasses.replace(RUNTIME_PROFILES["sim-next"], shared_kv=False))
    o2 = await plain.load_calbin(src.model_config, w, src.profiles[1])
    with pytest.raises(NotSupported):
        await plain.load_calbin(src.model_config, w, src.profiles[4], kv_owner=o2)
