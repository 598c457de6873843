"""Four behaviours that every other test let break unnoticed (each was injected alone and the whole
suite stayed green); each test here fails when its behaviour breaks:

1. text held back as a possible stop-string prefix is flushed when the stream ends without a match
   (``stop=["\\n\\n"]`` and output ending in one ``"\\n"``: the client must get that ``"\\n"``);
2. the lane verification compares the echoed position, not only job and sequence (C and Python);
3. a consumer that closes its StreamWriter without calling cancel makes the actor cancel the request;
4. a repeated cancel/stop, or a stop after the end, never queues a second ``End``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import trio

from calserve.engine.backend import BackendCalbin
from calserve.engine.engine import Engine
from calserve.engine.state import ActorMsg, Admitted, End, Tokens
from calserve.engine.types import (FinishEvent, FinishReason, GenerateRequest, SamplingParams,
                                   TokenEvent)
from calserve.runtime.binding import logits_checksum, verify_lanes
from calserve.runtime.types import JobEngine, JobResult, JobStatus
from calserve.testing.fake_device import FakeBackend

from tests.engine.helpers import CharTokenizer, config, fake_source
from tests.engine.test_core_machine import CoreMachine
from tests.engine_parts.test_parts_actor import _run


def _text(events: Sequence[object]) -> str:
    toks = "".join(e.text for e in events if isinstance(e, TokenEvent))
    term = events[-1]
    assert isinstance(term, FinishEvent)
    return toks + term.text


# ------------------------------------------------------------------ 1. held-back stop prefix
@pytest.mark.parametrize("inline", [False, True], ids=["channel", "inline"])
@pytest.mark.parametrize("out,stop", [("ab\n", "\n\n"), ("abXY", "XYZ"), ("a\n\nb\n", "\n\n\n")])
async def test_held_back_stop_prefix_is_sent_when_the_stream_ends_without_a_match(
        inline: bool, out: str, stop: str) -> None:
    ids = CharTokenizer().encode(out)
    msgs: list[ActorMsg] = [Admitted(0.0), *(Tokens(t, None, i == 0) for i, t in enumerate(ids))]
    events, _ = await _run([*msgs, End(FinishReason.LENGTH)], stop=(stop,), inline=inline)
    assert _text(events) == out
    term = events[-1]
    assert isinstance(term, FinishEvent) and term.reason is FinishReason.LENGTH


# ------------------------------------------------------------------ 2. echoed position verified
def _result(job_id: int, echo: list[list[int]]) -> JobResult:
    logits = np.arange(2 * 16, dtype=np.float32).reshape(2, 16) / 7.0
    sums = np.array([logits_checksum(row) for row in logits], dtype=np.uint64)
    return JobResult(job_id, JobEngine.PING, JobStatus.OK, logits, np.array(echo, np.int64),
                     sums, 0.0)


class _PyCalbin(BackendCalbin):
    """The protocol's default ``verify_lanes`` (the fake device's), checksums all good."""

    def checksum_ok(self, result: JobResult, lanes: Sequence[int]) -> list[bool]:
        return [True] * len(lanes)


@pytest.mark.parametrize("impl", ["c", "python"])
def test_lane_verification_compares_job_sequence_and_position(impl: str) -> None:
    def check(r: JobResult, job_id: int, expect: list[tuple[int, int]]) -> list[int]:
        if impl == "c":
            return verify_lanes(r, job_id, [0, 1], expect)
        return _PyCalbin().verify_lanes(r, job_id, [0, 1], expect)

    r = _result(7, [[7, 3, 10], [7, 4, 20]])
    assert check(r, 7, [(3, 10), (4, 20)]) == []
    assert check(r, 7, [(3, 11), (4, 20)]) == [0]  # same job and sequence, another position
    assert check(r, 7, [(3, 10), (4, 19)]) == [1]
    assert check(r, 7, [(5, 10), (4, 20)]) == [0]  # another sequence
    assert check(r, 8, [(3, 10), (4, 20)]) == [0, 1]  # another job


async def test_a_lane_echoing_a_wrong_position_is_a_crosstalk_fault(
        autojump_clock: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine: one result whose echo has the right job and sequence but another
    position fails the job (crosstalk, recovered), and the request still completes correctly."""
    from calserve.testing import fake_device

    real = fake_device.FakeCalbin._finish
    seen = {"ok": 0, "shifted": 0}

    def finish(self: fake_device.FakeCalbin, job: object, aborted: bool) -> JobResult:
        r = real(self, job, aborted)  # type: ignore[arg-type]
        if r.status is JobStatus.OK and r.echo[0, 1] >= 0:
            seen["ok"] += 1
            if seen["ok"] == 3:  # a decode step: right job and sequence, another position
                seen["shifted"] += 1
                r.echo[0, 2] += 1
        return r

    monkeypatch.setattr(fake_device.FakeCalbin, "_finish", finish)
    async with Engine.open(config(), backend=FakeBackend("calrt-0.7.6", seed=1),
                           sources={"qwen3": fake_source(profiles=(1,))}) as eng:
        h = await eng.submit(GenerateRequest((7, 8), SamplingParams(temperature=0.0,
                                                                    max_tokens=6,
                                                                    ignore_eos=True)))
        events = [ev async for ev in h.events()]
        assert isinstance(events[-1], FinishEvent)
        st = eng.statistics()
    assert seen["shifted"] == 1
    assert st.faults_total == {"crosstalk": 1}


# ------------------------------------------------------------------ 3. writer closed, no cancel
async def test_actor_cancels_when_its_consumer_closes_the_writer() -> None:
    from calserve.engine.actor import run_actor
    from calserve.engine.stream import StreamWriter
    from tests.engine_parts.test_parts_actor import _Registry, _seq

    w = StreamWriter(1)
    reg = _Registry()
    send, recv = trio.open_memory_channel[ActorMsg](100)
    send.send_nowait(Admitted(0.0))
    send.send_nowait(Tokens(CharTokenizer().encode("a")[0], None, True))
    await w.aclose()  # the consumer is gone; nobody called cancel
    send.send_nowait(Tokens(CharTokenizer().encode("b")[0], None, False))
    send.send_nowait(End(FinishReason.CANCELLED))
    await run_actor(_seq(), recv, w, CharTokenizer(), reg)  # type: ignore[arg-type]
    assert reg.sched.stops and set(reg.sched.stops) == {FinishReason.CANCELLED}  # idempotent
    assert reg.outcomes == ["cancelled"]


async def test_engine_request_ends_when_its_stream_is_closed_without_cancel(
        autojump_clock: object) -> None:
    async with Engine.open(config(), backend=FakeBackend("calrt-0.7.6", seed=1),
                           sources={"qwen3": fake_source(profiles=(1,))}) as eng:
        h = await eng.submit(GenerateRequest((7,), SamplingParams(temperature=0.0, max_tokens=400,
                                                                  ignore_eos=True)))
        got = 0
        while got < 2:
            got += sum(len(ev.token_ids) for ev in await h.receive_many()
                       if isinstance(ev, TokenEvent))
        await h._writer.aclose()  # the consumer's side only: no h.cancel(), no h.aclose()
        with trio.fail_after(1.0):  # 400 tokens would take 0.4 s of fake device time
            while eng.statistics().requests_total.get("cancelled", 0) != 1:
                await trio.sleep(0.001)
        assert eng.statistics().requests_running == 0


# ------------------------------------------------------------------ 4. one End, whatever repeats
def _machine() -> CoreMachine:
    m = CoreMachine()
    m.setup(two_engines=False, fcfs=False)
    return m


def _ends(m: CoreMachine, rid: int) -> int:
    return sum(isinstance(x, End) for x in m.inboxes[rid].msgs)


def test_repeated_cancel_of_a_waiting_request_sends_one_end() -> None:
    m = _machine()
    for _ in range(5):  # fill the lanes so the last one waits for admission
        m.submit([1, 2, 3], 8, "a", None)
    rid = max(m.seqs)
    for reason in (FinishReason.CANCELLED, FinishReason.CANCELLED, FinishReason.STOP):
        m.apply(m.core.abort(m.seqs[rid], reason, m.now))
    assert _ends(m, rid) == 1
    assert m.inboxes[rid].msgs[-1].reason is FinishReason.CANCELLED  # the first reason wins


def test_repeated_cancel_with_a_job_on_the_device_sends_one_end() -> None:
    m = _machine()
    m.submit([1, 2, 3], 8, "a", None)
    rid = max(m.seqs)
    engine = next(e for e, j in m.core.slots.items() if j is not None)  # its prefill is out
    for reason in (FinishReason.CANCELLED, FinishReason.STOP, FinishReason.CANCELLED):
        m.apply(m.core.abort(m.seqs[rid], reason, m.now))
    assert _ends(m, rid) == 0  # pending until the job drains
    m.complete(engine, "ok")
    m.apply(m.core.abort(m.seqs[rid], FinishReason.CANCELLED, m.now))
    assert _ends(m, rid) == 1


def test_stop_after_the_end_sends_no_second_end() -> None:
    m = _machine()
    m.submit([1, 2], 2, "a", None)
    rid = max(m.seqs)
    for _ in range(20):
        busy = [e for e, j in m.core.slots.items() if j is not None]
        if not busy:
            break
        m.complete(busy[0], "ok")
    assert _ends(m, rid) == 1
    for reason in (FinishReason.STOP, FinishReason.CANCELLED):
        m.apply(m.core.abort(m.seqs[rid], reason, m.now))
    assert _ends(m, rid) == 1


# ------------------------------------------------------------------ the serving path's own check
def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


@pytest.mark.parametrize("profiles,runtime,why", [
    ([4], "sim-next", "$.scheduler.batch.profiles: B4 is not a profile of package 'qwen3'"),
    ([4], "calrt-0.7.6", "$.scheduler.batch.profiles: B4 is not a profile of package 'qwen3'"),
])
async def test_engine_refuses_profiles_its_model_sources_lack(
        autojump_clock: object, profiles: list[int], runtime: str, why: str) -> None:
    """In-memory sources (no package, no manifest) are checked where the generation is built."""
    from calserve.errors import ConfigError

    with pytest.raises(BaseException) as info:
        async with Engine.open(config(batch={"profiles": profiles}),
                               backend=FakeBackend(runtime, seed=1),
                               sources={"qwen3": fake_source(profiles=(1,))}):
            pass
    err = _leaf(info.value)
    assert isinstance(err, ConfigError) and why in str(err), err


async def test_engine_refuses_a_batch_profile_the_runtime_cannot_run(autojump_clock: object) -> None:
    from calserve.errors import ConfigError

    with pytest.raises(BaseException) as info:
        async with Engine.open(config(batch={"profiles": [4]}),
                               backend=FakeBackend("calrt-0.7.6", seed=1),
                               sources={"qwen3": fake_source(profiles=(1, 4))}):
            pass
    err = _leaf(info.value)
    assert isinstance(err, ConfigError)
    assert "B4 needs batch profiles, which runtime calrt-0.7.6 does not have" in str(err)
