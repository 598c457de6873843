"""Engine behaviour on the fake device and fake clock: the request lifecycle rules of spec §4,
stop conditions (§ issue item 6), submit-time refusals, PING/PONG, deadlines, streaming."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio

from calserve.engine.engine import Engine
from calserve.testing.fake_device import FakeBackend, fake_logits, history_hash
from calserve.engine.types import (
    ErrorEvent,
    Event,
    FinishEvent,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
)
from calserve.errors import CapacityError, RequestError, UnknownModel
from calserve.runtime.types import JobEngine

from .helpers import CharTokenizer, config, fake_greedy, fake_source


async def drain(h: object) -> list[Event]:
    return [ev async for ev in h.events()]  # type: ignore[attr-defined]


def tokens(events: list[Event]) -> list[int]:
    return [t for ev in events if isinstance(ev, TokenEvent) for t in ev.token_ids]


def text(events: list[Event]) -> str:
    return "".join(ev.text for ev in events if isinstance(ev, (TokenEvent, FinishEvent)))


def greedy(sp: dict[str, object] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, **(sp or {}))  # type: ignore[arg-type]


async def test_submit_refusals_name_the_field(autojump_clock: object) -> None:
    be = FakeBackend("calrt-0.7.6")
    cfg = config(admission={"max_waiting_requests": 2, "max_sequences": 1})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(profiles=(1,), max_seq=64)}) as eng:
        cases = [
            (GenerateRequest(()), "prompt"),
            (GenerateRequest((1, 999)), "prompt"),
            (GenerateRequest((1,), SamplingParams(max_tokens=0)), "max_tokens"),
            (GenerateRequest((1,), SamplingParams(max_tokens=100)), "max_tokens"),  # > context
            (GenerateRequest((1,), SamplingParams(top_p=0.0)), "top_p"),
            (GenerateRequest((1,), SamplingParams(temperature=-1.0)), "temperature"),
            (GenerateRequest((1,), SamplingParams(min_tokens=5, max_tokens=2)), "min_tokens"),
        ]
        for req, param in cases:
            with pytest.raises(RequestError) as ei:
                await eng.submit(req)
            assert ei.value.param == param, (req, ei.value)
        with pytest.raises(UnknownModel):
            await eng.submit(GenerateRequest((1,), model="nope"))
        # queue full -> CapacityError with retry_after (requests queue synchronously at submit)
        first = await eng.submit(GenerateRequest((1, 2), greedy({"max_tokens": 30})))
        await trio.sleep(0.001)  # admitted into the only lane
        hs = [first] + [await eng.submit(GenerateRequest((1, 2), greedy({"max_tokens": 3}))) for _ in range(2)]
        with pytest.raises(CapacityError) as ce:
            await eng.submit(GenerateRequest((1, 2)))
        assert ce.value.retry_after is not None
        for h in hs:
            assert isinstance((await drain(h))[-1], FinishEvent)
        assert eng.statistics().rejected_total == {"invalid": 7, "capacity": 1}


async def test_cancel_waiting_ready_running_is_idempotent(autojump_clock: object) -> None:
    be = FakeBackend("calrt-0.7.6", seed=1)
    cfg = config(admission={"max_sequences": 1})  # one lane: the second request waits
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(profiles=(1,))}) as eng:
        running = await eng.submit(GenerateRequest((3, 4), greedy({"max_tokens": 500})))
        waiting = await eng.submit(GenerateRequest((5, 6), greedy({"max_tokens": 5})))
        got: list[Event] = []
        async for ev in running.events():
            got.append(ev)
            if len(got) == 3:
                waiting.cancel()
                running.cancel()
                running.cancel()
                eng.cancel(running.request_id)
        w = await drain(waiting)
        assert len(w) == 1 and isinstance(w[0], FinishEvent) and w[0].reason is FinishReason.CANCELLED
        assert w[0].usage.completion_tokens == 0
        assert isinstance(got[-1], FinishEvent) and got[-1].reason is FinishReason.CANCELLED
        assert [type(e) for e in got[:-1]] == [TokenEvent] * (len(got) - 1)
        assert tokens(got) == fake_greedy((3, 4), len(tokens(got)))
        eng.cancel(running.request_id)  # after the end: no-op
        eng.cancel(12345)  # unknown id: no-op
        assert eng.statistics().requests_total == {"cancelled": 2}


async def test_stop_strings_eos_min_tokens(autojump_clock: object) -> None:
    tok = CharTokenizer()
    prompt = (1, 2, 3)
    ref = fake_greedy(prompt, 40)
    ref_text = tok.decode(ref)
    be = FakeBackend("calrt-0.7.6", seed=1)
    eos = (ref[5],)
    src = fake_source(profiles=(1,), eos=eos)
    async with Engine.open(config(), backend=be, sources={"qwen3": src}) as eng:
        # stop string: text before it is emitted, the stop text never
        stop = ref_text[10:12]
        first = ref_text.find(stop)
        ev = await drain(await eng.submit(GenerateRequest(prompt, greedy({"max_tokens": 40, "stop": (stop,), "ignore_eos": True}))))
        assert isinstance(ev[-1], FinishEvent) and ev[-1].reason is FinishReason.STOP
        assert text(ev) == ref_text[:first]
        # EOS from the package ends with STOP and is not shown
        ev = await drain(await eng.submit(GenerateRequest(prompt, greedy({"max_tokens": 40}))))
        assert ev[-1].reason is FinishReason.STOP  # type: ignore[union-attr]
        assert tokens(ev) == ref[: ref.index(eos[0])]
        assert ev[-1].usage.completion_tokens == ref.index(eos[0]) + 1  # type: ignore[union-attr]
        # ignore_eos / min_tokens keep going
        ev = await drain(await eng.submit(GenerateRequest(prompt, greedy({"max_tokens": 12, "ignore_eos": True}))))
        assert tokens(ev) == ref[:12] and ev[-1].reason is FinishReason.LENGTH  # type: ignore[union-attr]
        ev = await drain(await eng.submit(GenerateRequest(prompt, greedy({"max_tokens": 12, "min_tokens": 8}))))
        stop_at = next(i for i, t in enumerate(ref) if t in eos and i >= 8) if any(
            t in eos for t in ref[8:12]) else None
        assert tokens(ev)[:6] == ref[:6]
        if stop_at is None:
            assert ev[-1].reason is FinishReason.LENGTH  # type: ignore[union-attr]
        # stop token ids from the request
        ev = await drain(await eng.submit(GenerateRequest(prompt, greedy({"max_tokens": 40, "stop_token_ids": (ref[2],), "ignore_eos": True}))))
        assert tokens(ev) == ref[:2] and ev[-1].reason is FinishReason.STOP  # type: ignore[union-attr]


async def test_logprobs_from_raw_logits(autojump_clock: object) -> None:
    be = FakeBackend("calrt-0.7.6", seed=1)
    async with Engine.open(config(), backend=be, sources={"qwen3": fake_source(profiles=(1,))}) as eng:
        prompt = (9, 8)
        ev = await drain(await eng.submit(GenerateRequest(
            prompt, SamplingParams(temperature=0.7, seed=42, max_tokens=4, logprobs=3))))
        toks = tokens(ev)
        lps = [lp for e in ev if isinstance(e, TokenEvent) for lp in (e.logprobs or ())]
        assert len(lps) == 4
        hist = list(prompt)
        for t, lp in zip(toks, lps):
            raw = fake_logits(history_hash(hist), 128).astype("float64")
            lse = raw.max() + math.log(sum(math.exp(x - raw.max()) for x in raw))
            assert lp.token_id == t
            assert abs(lp.logprob - (raw[t] - lse)) < 1e-4
            assert len(lp.top) == 3 and lp.top[0][0] == int(raw.argmax())
            hist.append(t)
        # same seed + prompt -> same output, whatever the batch-mates
        again = await drain(await eng.submit(GenerateRequest(
            prompt, SamplingParams(temperature=0.7, seed=42, max_tokens=4))))
        assert tokens(again) == toks


async def test_deadline_while_running(autojump_clock: object) -> None:
    be = FakeBackend("calrt-0.7.6", seed=1)
    async with Engine.open(config(), backend=be, sources={"qwen3": fake_source(profiles=(1,), step_us=10_000)}) as eng:
        t0 = trio.current_time()
        ev = await drain(await eng.submit(GenerateRequest((1,), greedy({"max_tokens": 400}), deadline_s=0.5)))
        assert isinstance(ev[-1], FinishEvent) and ev[-1].reason is FinishReason.DEADLINE
        assert 30 <= len(tokens(ev)) <= 50  # ~10 ms per token
        assert trio.current_time() - t0 < 0.6


@pytest.mark.parametrize("fixed", [False, True])
async def test_pingpong_uses_both_engines_unless_fixed(autojump_clock: object, fixed: bool) -> None:
    be = FakeBackend("sim-next", seed=4, jitter_s=0.001)
    cfg = config(batch={"profiles": [4]}, executor={"max_inflight": 2, "fixed_engine": fixed})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source()}) as eng:
        assert [ex.engine for ex in eng.executors] == ([JobEngine.PING] if fixed else [JobEngine.PING, JobEngine.PONG])
        out: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            out[i] = tokens(await drain(await eng.submit(GenerateRequest((i, 1), greedy({"max_tokens": 10})))))

        async with trio.open_nursery() as n:
            for i in range(12):
                n.start_soon(one, i)
        for i in range(12):
            assert out[i] == fake_greedy((i, 1), 10)
        pong = be.counters(JobEngine.PONG).submitted
        assert (pong == 0) if fixed else (pong > 0)


async def test_slow_consumer_gets_coalesced_tokens(autojump_clock: object) -> None:
    be = FakeBackend("calrt-0.7.6", seed=1)
    cfg = config()
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(profiles=(1,))}) as eng:
        h = await eng.submit(GenerateRequest((7,), greedy({"max_tokens": 200})))
        await trio.sleep(5.0)  # the client reads nothing while all tokens are produced
        ev = await drain(h)
        assert tokens(ev) == fake_greedy((7,), 200)
        assert len(ev) <= cfg.server.stream_buffer_events + 1
        assert isinstance(ev[-1], FinishEvent)


async def test_engine_exit_ends_everything_with_one_terminal(autojump_clock: object) -> None:
    be = FakeBackend("sim-next", seed=1)
    handles = []
    async with Engine.open(config(batch={"profiles": [4]}, admission={"max_sequences": 4}),
                           backend=be, sources={"qwen3": fake_source()}) as eng:
        for i in range(10):
            handles.append(await eng.submit(GenerateRequest((i + 1,), greedy({"max_tokens": 300}))))
        await trio.sleep(0.05)
    assert not eng.ready()
    for h in handles:
        ev = await drain(h)
        term = [e for e in ev if not isinstance(e, TokenEvent)]
        assert len(term) == 1 and isinstance(term[0], ErrorEvent) and term[0].kind == "shutdown"
    assert be.closed is False  # injected backends belong to the caller
    assert be.live_sequences() == 0


async def test_batching_window_timer_set_by_the_inline_tick_fires(autojump_clock: object) -> None:
    """After a completion the executor runs the scheduling pass itself; when that pass decides to
    wait for the batching window (one ready lane of four), the scheduler task, asleep with no
    timer, must be woken to re-arm at the window's end, else the lone request would stall."""
    be = FakeBackend("sim-next", seed=2)
    cfg = config(batch={"profiles": [4], "batching_window_us": 20_000})
    src = fake_source(profiles=(4,), step_us=1_000)
    async with Engine.open(cfg, backend=be, sources={"qwen3": src}) as eng:
        t0 = trio.current_time()
        with trio.fail_after(5):
            ev = await drain(await eng.submit(GenerateRequest((5, 6), greedy({"max_tokens": 5}))))
        assert tokens(ev) == fake_greedy((5, 6), 5)
        assert isinstance(ev[-1], FinishEvent) and ev[-1].reason is FinishReason.LENGTH
        # 4 decode steps, each waiting out the 20 ms window first (then ~1 ms of device time)
        assert 0.08 <= trio.current_time() - t0 < 0.1


@pytest.mark.parametrize("inline", [True, False])
async def test_full_lane_table_turnover(autojump_clock: object, inline: bool) -> None:
    """With every lane taken (``max_sequences`` = the running set), a request that ends frees its
    lane and the next waiting request is admitted and prefilled in the same scheduling pass when the
    runtime frees inline; otherwise through the scheduler task. Either way its tokens are exact and
    every lane comes back."""
    be = FakeBackend("calrt-0.7.6", seed=1, frees_inline=inline)
    cfg = config(admission={"max_sequences": 1})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(profiles=(1,))}) as eng:
        core = eng.core
        first = await eng.submit(GenerateRequest((3, 4), greedy({"max_tokens": 4})))
        second = await eng.submit(GenerateRequest((5, 6), greedy({"max_tokens": 3})))
        ticks: dict[str, int] = {}
        orig_admit = core.requests.admit

        def admit(gen: Any, now: float) -> None:
            q = core.requests.queues(gen)
            before = len(q.waiting)
            orig_admit(gen, now)
            if before and not q.waiting:
                ticks["admitted_at_task_tick"] = core.stats.passes

        core.requests.admit = admit  # type: ignore[method-assign]
        ticks_at_end: list[int] = []
        events: list[Event] = []
        async for ev in first.events():
            events.append(ev)
        ticks_at_end.append(core.stats.passes)
        assert tokens(events) == fake_greedy((3, 4), 4)
        assert tokens(await drain(second)) == fake_greedy((5, 6), 3)
        released = [i for i, (k, r) in enumerate(core.requests.trace) if k == "released" and r == (first.request_id,)]
        admitted = [i for i, (k, r) in enumerate(core.requests.trace) if k == "admit" and r == (second.request_id,)]
        assert released and admitted and released[0] < admitted[0]
        if inline:
            # admitted by the executor's pass right after the completion, before the task woke
            assert ticks["admitted_at_task_tick"] <= ticks_at_end[0]
            assert core.requests.trace[admitted[0] - 1] == ("released", (first.request_id,))
        await trio.sleep(0.05)
        st = eng.statistics()
        assert st.kv_tokens_reserved == 0
