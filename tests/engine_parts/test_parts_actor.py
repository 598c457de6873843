"""The request actor's token hot path (issue 7 item 5 / issue 5 items 5-6): coalescing for a slow
consumer keeps every guarantee — tokens, text and logprobs aligned, a stop string split across
coalesced tokens never shown, exactly one terminal event, a disconnect cancels the request — and the
lifecycle replay from the transition cache still refuses an illegal message sequence."""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing

from calserve.engine import registry as registry_mod
from calserve.engine.actor import ActorInbox, open_actor_inbox, run_actor
from calserve.engine.engine import Engine
from calserve.testing.fake_device import FakeBackend
from calserve.engine.state import ActorMsg, Admitted, End, TokenRun, Tokens
from calserve.engine.stream import StreamWriter
from calserve.engine.types import (
    ErrorEvent,
    Event,
    FinishEvent,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
)

from tests.engine.helpers import CharTokenizer, config, fake_greedy, fake_source


def _token_events(events: list[Event]) -> list[TokenEvent]:
    return [e for e in events if isinstance(e, TokenEvent)]


@pytest.fixture(params=["channel", "inline"])
def inbox_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run an engine test with ActorInboxes (the registry's default: the inline token step), then
    with plain trio memory channels (the actor task runs every message)."""
    if request.param == "channel":
        monkeypatch.setattr(registry_mod, "open_inbox",
                            lambda: trio.open_memory_channel[ActorMsg](math.inf))
    yield str(request.param)


async def test_slow_consumer_coalesced_events_keep_stop_text_hidden_and_logprobs_aligned(
    autojump_clock: object, inbox_kind: str,
) -> None:
    prompt = (1, 2, 3)
    ref = fake_greedy(prompt, 60)
    ref_text = CharTokenizer().decode(ref)
    stop = ref_text[20:23]  # three tokens: split across coalesced tokens
    first = ref_text.find(stop)
    async with Engine.open(config(), backend=FakeBackend("calrt-0.7.6", seed=1),
                           sources={"qwen3": fake_source(profiles=(1,))}) as eng:
        sp = SamplingParams(temperature=0.0, max_tokens=60, stop=(stop,), ignore_eos=True,
                            logprobs=2)
        h = await eng.submit(GenerateRequest(prompt, sp))
        inbox = eng.registry.live[h.request_id].inbox
        assert isinstance(inbox, ActorInbox) == (inbox_kind == "inline")
        await trio.sleep(5.0)  # the client reads nothing while every token is produced
        events = [ev async for ev in h.events()]
    toks = _token_events(events)
    # Everything produced while the consumer slept arrives as one event, then the terminal.
    assert len(toks) == 1 and len(events) == 2
    ids = [t for e in toks for t in e.token_ids]
    assert ids == ref[: len(ids)] and len(ids) >= first + 1
    for e in toks:  # logprobs aligned with their tokens inside the coalesced event
        assert e.logprobs is not None and [lp.token_id for lp in e.logprobs] == list(e.token_ids)
        assert all(len(lp.top) == 2 for lp in e.logprobs)
    term = events[-1]
    assert isinstance(term, FinishEvent) and term.reason is FinishReason.STOP
    shown = "".join(e.text for e in toks) + term.text
    assert shown == ref_text[:first] and stop not in shown
    assert sum(not isinstance(e, TokenEvent) for e in events) == 1


async def test_consumer_reading_as_tokens_arrive_gets_them_one_by_one(
    autojump_clock: object, inbox_kind: str
) -> None:
    """No waiting on purpose: a consumer that keeps up sees each token as its own event."""
    prompt = (4, 5)
    async with Engine.open(config(), backend=FakeBackend("calrt-0.7.6", seed=1),
                           sources={"qwen3": fake_source(profiles=(1,))}) as eng:
        h = await eng.submit(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                                                    ignore_eos=True)))
        inbox = eng.registry.live[h.request_id].inbox
        assert isinstance(inbox, ActorInbox) == (inbox_kind == "inline")
        events = [ev async for ev in h.events()]
    toks = _token_events(events)
    assert [e.token_ids for e in toks] == [(t,) for t in fake_greedy(prompt, 20)]
    assert isinstance(events[-1], FinishEvent) and events[-1].usage.completion_tokens == 20


async def test_disconnect_mid_stream_cancels_the_request(autojump_clock: object, inbox_kind: str) -> None:
    async with Engine.open(config(), backend=FakeBackend("calrt-0.7.6", seed=1),
                           sources={"qwen3": fake_source(profiles=(1,))}) as eng:
        h = await eng.submit(GenerateRequest((7,), SamplingParams(temperature=0.0, max_tokens=400,
                                                                  ignore_eos=True)))
        got = 0
        while got < 3:
            for ev in await h.receive_many():
                assert isinstance(ev, TokenEvent)
                got += len(ev.token_ids)
        await h.aclose()  # the client went away
        with trio.fail_after(1.0):  # 400 tokens would take 0.4 s of fake device time
            while eng.statistics().requests_total.get("cancelled", 0) != 1:
                await trio.sleep(0.001)
        assert eng.statistics().requests_total == {"cancelled": 1}


class _Sched:
    def __init__(self) -> None:
        self.stops: list[FinishReason] = []

    def stop(self, seq: object, reason: FinishReason) -> None:
        self.stops.append(reason)


class _Registry:
    """The actor's sink (``ActorSink``): records stops (``sched.stops``) and outcomes."""

    def __init__(self) -> None:
        self.sched = _Sched()
        self.outcomes: list[str] = []

    def stop(self, seq: object, reason: FinishReason) -> None:
        self.sched.stop(seq, reason)

    def done(self, seq: object, outcome: str) -> None:
        self.outcomes.append(outcome)


def _seq(stop: tuple[str, ...] = ()) -> types.SimpleNamespace:
    sp = types.SimpleNamespace(stop=stop, min_tokens=0, include_stop_str=False,
                               skip_special_tokens=True)
    return types.SimpleNamespace(req=types.SimpleNamespace(sampling=sp), prompt=(1, 2),
                                 arrival=0.0, admitted_at=0.0, first_token_at=0.0)


async def _run(msgs: list[ActorMsg], stop: tuple[str, ...] = (), *, inline: bool = False
               ) -> tuple[list[Event], _Registry]:
    """Run an actor over ``msgs``. ``inline``: an ActorInbox, the messages sent one by one while
    the actor task is parked (the inline step runs them), with a checkpoint after each."""
    w = StreamWriter(1)
    reg = _Registry()
    if not inline:
        send, recv = trio.open_memory_channel[ActorMsg](100)
        for m in msgs:
            send.send_nowait(m)
        await run_actor(_seq(stop), recv, w, CharTokenizer(), reg)  # type: ignore[arg-type]
        return [ev async for ev in w], reg
    box, rbox = open_actor_inbox()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_actor, _seq(stop), rbox, w, CharTokenizer(), reg)
        for m in msgs:
            await trio.testing.wait_all_tasks_blocked()
            box.send_nowait(m)
    return [ev async for ev in w], reg


@pytest.mark.parametrize("inline", [False, True], ids=["channel", "inline"])
async def test_actor_replays_the_lifecycle_and_writes_one_terminal(inline: bool) -> None:
    events, reg = await _run([Admitted(0.0), Tokens(10, None, True), Tokens(11, None, False),
                              Tokens(12, None, False, hidden=True), End(FinishReason.STOP)],
                             inline=inline)
    assert [e.token_ids for e in _token_events(events)] == [(10, 11)]  # the hidden one: usage only
    term = events[-1]
    assert isinstance(term, FinishEvent) and term.usage.completion_tokens == 3
    assert reg.outcomes == ["completed"]


@pytest.mark.parametrize("inline", [False, True], ids=["channel", "inline"])
async def test_actor_stop_string_across_tokens_tells_the_scheduler_and_hides_the_text(
    inline: bool,
) -> None:
    tok = CharTokenizer()
    ids = tok.encode("abXYZcd")
    msgs: list[ActorMsg] = [Admitted(0.0)]
    msgs += [Tokens(t, None, i == 0) for i, t in enumerate(ids)]
    events, reg = await _run([*msgs, End(FinishReason.LENGTH)], stop=("XYZ",), inline=inline)
    assert "".join(e.text for e in _token_events(events)) == "ab"
    term = events[-1]
    assert isinstance(term, FinishEvent) and term.reason is FinishReason.STOP and term.text == ""
    assert reg.sched.stops == [FinishReason.STOP]
    # usage counts the tokens up to the one completing the match; later (in-flight) ones are dropped
    assert term.usage.completion_tokens == len("abXYZ")


@pytest.mark.parametrize("inline", [False, True], ids=["channel", "inline"])
@pytest.mark.parametrize("stop", [(), ("XYZ",), ("c",), ("g",)], ids=["plain", "across", "one", "last"])
@pytest.mark.parametrize("cuts", [(1,), (3, 5), (2, 3, 4, 7), (9,)])
@pytest.mark.parametrize("hidden", [False, True])
async def test_token_runs_render_as_their_tokens_one_by_one(
    inline: bool, stop: tuple[str, ...], cuts: tuple[int, ...], hidden: bool,
) -> None:
    """A multi-step job's tokens come as one TokenRun per lane and job: the stream a client sees
    (ids, text, stop strings cut where they complete, the hidden EOS, usage, the terminal) and
    what the scheduler is told are those of the same tokens sent one by one."""
    ids = CharTokenizer().encode("abXYZcdefg")
    last = len(ids) - 1
    one: list[ActorMsg] = [Tokens(t, None, i == 0, hidden and i == last) for i, t in enumerate(ids)]
    bounds = [0, *cuts, len(ids)]
    runs: list[ActorMsg] = [TokenRun(ids[a:b], a == 0, hidden and b == len(ids))
                            for a, b in zip(bounds, bounds[1:])]
    got = []
    for msgs in (one, runs):
        events, reg = await _run([Admitted(0.0), *msgs, End(FinishReason.LENGTH)], stop, inline=inline)
        toks = _token_events(events)
        term = events[-1]
        assert isinstance(term, FinishEvent)
        got.append(([t for e in toks for t in e.token_ids], "".join(e.text for e in toks) + term.text,
                    term.reason, term.usage, reg.sched.stops, reg.outcomes))
    assert got[0] == got[1]
    assert len(got[1][0]) < len(ids) or not hidden  # the hidden token is never shown


class _BrokenTokenizer(CharTokenizer):
    """An actor bug stand-in: decoding token 1 raises."""

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        if 1 in list(ids):
            raise RuntimeError("broken detokenizer")
        return super().decode(ids, skip_special_tokens)


async def test_an_actor_bug_ends_its_stream_once_with_an_error() -> None:
    # The actor only renders (the lifecycle is the engine core's): a bug while rendering a token
    # raises in the actor task, and the stream still ends exactly once.
    await _run([Admitted(0.0), Tokens(2, None, True), Tokens(3, None, False), End(FinishReason.LENGTH)])
    send, recv = trio.open_memory_channel[ActorMsg](10)
    w = StreamWriter(1)
    reg = _Registry()
    send.send_nowait(Admitted(0.0))
    send.send_nowait(Tokens(1, None, True))
    with pytest.raises(RuntimeError, match="broken detokenizer"):
        await run_actor(_seq(), recv, w, _BrokenTokenizer(), reg)  # type: ignore[arg-type]
    events = [ev async for ev in w]
    assert len(events) == 1 and isinstance(events[0], ErrorEvent) and events[0].kind == "shutdown"
    assert reg.outcomes == ["shutdown"]


async def test_inline_step_runs_in_the_senders_call_and_the_task_tells_the_scheduler() -> None:
    """With an ActorInbox the token is written during send_nowait (no task hop); a stop string
    match is told to the scheduler by the actor task afterwards, never from inside send_nowait."""
    tok = CharTokenizer()
    box, rbox = open_actor_inbox()
    w = StreamWriter(1)
    reg = _Registry()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_actor, _seq(("cd",)), rbox, w, tok, reg)
        await trio.testing.wait_all_tasks_blocked()
        box.send_nowait(Admitted(0.0))  # queued: not a token
        await trio.testing.wait_all_tasks_blocked()
        box.send_nowait(Tokens(tok.encode("a")[0], None, True))
        assert w.statistics().tokens_put == 1 and box.statistics() == 0  # done inline
        box.send_nowait(Tokens(tok.encode("c")[0], None, False))
        box.send_nowait(Tokens(tok.encode("d")[0], None, False))  # completes the stop string
        assert reg.sched.stops == []  # not from inside the sender's call
        await trio.testing.wait_all_tasks_blocked()
        assert reg.sched.stops == [FinishReason.STOP]
        box.send_nowait(End(FinishReason.LENGTH))
    events = [ev async for ev in w]
    assert "".join(e.text for e in _token_events(events)) == "a"
    assert isinstance(events[-1], FinishEvent) and events[-1].reason is FinishReason.STOP


async def test_inline_step_error_is_raised_by_the_actor_task() -> None:
    box, rbox = open_actor_inbox()
    w = StreamWriter(1)
    reg = _Registry()
    with pytest.RaisesGroup(RuntimeError):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_actor, _seq(), rbox, w, _BrokenTokenizer(), reg)
            await trio.testing.wait_all_tasks_blocked()
            box.send_nowait(Tokens(1, None, True))  # the step raises inline: not raised here
    events = [ev async for ev in w]
    assert len(events) == 1 and isinstance(events[0], ErrorEvent) and reg.outcomes == ["shutdown"]
    box.send_nowait(Tokens(2, None, False))  # the actor is gone: queued, nothing runs
    assert box.statistics() == 1
