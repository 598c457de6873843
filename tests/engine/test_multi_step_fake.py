"""Multi-step decode in the engine (``scheduler.batch.multi_step``, runtime capability multi_step).

A decode job whose lanes are all plain greedy runs up to N steps on the device, each lane's argmax
fed back. Nothing a client sees may change: the same workload (greedy requests ending on EOS, stop
token ids, stop strings and lengths; sampled and logprobs requests beside them, which keep their jobs at one step;
arrivals at random instants) gives the same tokens and the same finish reasons with N = 1 and
N > 1, every request ends with exactly one terminal event and every KV lane comes back. Multi-step
jobs must actually run (``decode_steps_total`` above ``batches_total``), faults inside them stay
transparent, cancels and deadlines end their requests once, and without the capability nothing
changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calserve.core.kv import KvLaneManager
from calserve.engine import actor as actor_mod
from calserve.engine.batches import decode_steps
from calserve.engine.completion import ends, ends_run
from calserve.engine.engine import Engine
from calserve.engine.fault_watch import FaultWatch
from calserve.engine.types import ErrorEvent, FinishEvent, FinishReason, GenerateRequest, SamplingParams, TokenEvent
from calserve.runtime.types import RUNTIME_PROFILES, FaultKind, JobEngine, JobStatus, RuntimeCapabilities
from calserve.testing.fake_device import FakeBackend, FakeCalbin

from .helpers import config, fake_greedy, fake_source

EOS = (5,)
# multi-step decodes driven by the host (runtime.host_multi_step): runs the engine may end early
HOST = dataclasses.replace(RUNTIME_PROFILES["calrt-0.7.6"], batch_profiles=True, multi_step=True,
                           host_multi_step=True)

# (arrival offset s, prompt, max_tokens, kind) with kind: greedy | stop_ids | stop_str | sampled | logprobs |
# ignore_eos
Req = tuple[float, tuple[int, ...], int, str]


def _params(kind: str, max_tokens: int, i: int) -> SamplingParams:
    if kind == "sampled":
        return SamplingParams(temperature=0.8, seed=100 + i, max_tokens=max_tokens)
    if kind == "logprobs":
        return SamplingParams(temperature=0.0, logprobs=2, max_tokens=max_tokens)
    if kind == "stop_ids":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=frozenset({7, 40, 99}))
    if kind == "stop_str":  # the actor's stop strings (CharTokenizer: token 2 is "#", 6 is "'")
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=("#", "'*"), ignore_eos=True)
    if kind == "ignore_eos":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


async def _serve(work: Sequence[Req], multi_step: int, profiles: Sequence[int] = (1, 4, 8, 16),
                 capability: str | RuntimeCapabilities = "sim-next", faults: Sequence[tuple[FaultKind, int]] = (),
                 max_seq: int = 512, executor: dict[str, Any] | None = None,
                 ) -> tuple[dict[int, tuple[list[int], Any]], Engine, Any]:
    """Run ``work`` on a fake sim-next device; request i -> (its tokens, its one terminal event)."""
    be = FakeBackend(capability, seed=3, jitter_s=0.0003)
    cfg = config(batch={"profiles": list(profiles), "multi_step": multi_step},
                 executor={"max_inflight": 2, **(executor or {})})
    out: dict[int, tuple[list[int], Any]] = {}
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(profiles=profiles, eos=EOS,
                                                                              max_seq=max_seq)}) as eng:
        for kind, nth in faults:
            be.inject_fault(kind, JobEngine.PING, nth, lane=1)
        t0 = trio.current_time()

        async def one(i: int, at: float, prompt: tuple[int, ...], n: int, kind: str) -> None:
            await trio.sleep_until(t0 + at)
            out[i] = await _read_once(eng, GenerateRequest(prompt, _params(kind, n, i)), None)

        async with trio.open_nursery() as nursery:
            for i, (at, prompt, n, kind) in enumerate(work):
                nursery.start_soon(one, i, at, prompt, n, kind)
        await trio.sleep(0.5)  # sequences are freed after their terminal events
        k = eng.generation().kv.statistics()
        assert k.unknown == 0 and k.free == k.num_lanes, k
        stats = eng.statistics()
    return out, eng, stats


def _same(a: dict[int, tuple[list[int], Any]], b: dict[int, tuple[list[int], Any]]) -> None:
    assert a.keys() == b.keys()
    for i in a:
        (ta, ea), (tb, eb) = a[i], b[i]
        assert ta == tb, f"request {i}"
        assert type(ea) is type(eb) and getattr(ea, "reason", None) == getattr(eb, "reason", None), (i, ea, eb)


_reqs = st.lists(
    st.tuples(st.floats(0.0, 0.04), st.lists(st.integers(0, 127), min_size=1, max_size=5).map(tuple),
              st.integers(1, 30), st.sampled_from(["greedy", "greedy", "stop_ids", "stop_str", "ignore_eos",
                                                   "sampled", "logprobs"])),
    min_size=1, max_size=24)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(work=_reqs, n=st.sampled_from([2, 3, 8]), host=st.booleans())
def test_outputs_equal_single_step(work: list[Req], n: int, host: bool) -> None:
    """``host``: the runs are driven by the host, and the engine ends them early when a prompt
    arrives, a sequence becomes ready or one of theirs ends early (Planner.stop_runs)."""
    async def main() -> None:
        one, _, s1 = await _serve(work, 1)
        multi, _, sn = await _serve(work, n, capability=HOST if host else "sim-next")
        _same(one, multi)
        assert sum(s1.decode_steps_total.values()) == sum(s1.batches_total.values())
        greedy_long = any(kind != "sampled" and kind != "logprobs" and m >= 3 for _, _, m, kind in work)
        if greedy_long and all(kind != "sampled" and kind != "logprobs" for *_, kind in work):
            # every job plain greedy: the lanes' steps run several to a job
            assert sum(sn.decode_steps_total.values()) > sum(sn.batches_total.values())

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_greedy_load_runs_several_steps_a_job(autojump_clock: object,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """24 greedy requests of 40 tokens at once (the common served load): the tokens of the fault-free
    solo reference; one step a job while prompts wait for their prefill, then 8 (a length limit can
    cut a lane's last job); a fraction of the single-step run's jobs; a lane's tokens of a job in
    one actor message."""
    work = [(0.0, (i + 1, 2 * i + 3, 9), 40, "ignore_eos") for i in range(24)]
    one, _, s1 = await _serve(work, 1)
    runs: list[int] = []  # the tokens of each TokenRun an actor rendered
    singles = [0]  # Tokens messages (prefills, one-step jobs)
    run_plain, step_plain = actor_mod._TokenStep._run_plain, actor_mod._TokenStep._step_plain

    def counting_run(self: Any, msg: Any) -> bool:
        runs.append(len(msg.token_ids))
        return run_plain(self, msg)

    def counting_step(self: Any, msg: Any) -> bool:
        singles[0] += 1
        return step_plain(self, msg)

    monkeypatch.setattr(actor_mod._TokenStep, "_run_plain", counting_run)
    monkeypatch.setattr(actor_mod._TokenStep, "_step_plain", counting_step)
    multi, _, s8 = await _serve(work, 8)
    _same(one, multi)
    for i, (toks, fin) in multi.items():
        assert isinstance(fin, FinishEvent) and fin.reason is FinishReason.LENGTH
        assert toks == fake_greedy(work[i][1], 40)
    jobs1, jobs8 = sum(s1.batches_total.values()), sum(s8.batches_total.values())
    steps8 = sum(s8.decode_steps_total.values())
    # a lane's tokens of a multi-step job reach its actor as one message (one detokenizer step and
    # one stream write for all of them): far fewer actor steps than tokens
    assert runs and sum(runs) == sum(len(t) for t, _ in multi.values()) - singles[0]
    assert len(runs) + singles[0] < steps8 * 16 // 3 and max(runs) == 8
    prefill_phase = [n for n in s8.decode_steps_total.values()]
    assert steps8 >= 3 * jobs8, (steps8, jobs8, prefill_phase)
    assert jobs8 * 2 < jobs1


@pytest.mark.parametrize("host", [False, True], ids=["device-runs", "host-runs"])
@pytest.mark.parametrize("kind", [FaultKind.CCU_FAULT, FaultKind.CROSSTALK, FaultKind.TIMEOUT, FaultKind.DMA_UNKNOWN])
async def test_fault_in_a_multi_step_job_is_transparent(autojump_clock: object, kind: FaultKind, host: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in a multi-step job costs the clients nothing: every request is re-prefilled from
    what it had and its output equals the fault-free one. With runs the host drives, half the
    requests end on stop token ids or EOS, so lanes end inside runs around the fault."""
    failed: list[tuple[str, int]] = []
    observe = FaultWatch.observe

    def record(self: FaultWatch, engine: Any, job: Any, outcome: Any, t_submit: float, now: float) -> None:
        r = outcome.result
        if r is not None and (r.status is not JobStatus.OK or outcome.timed_out or kind is FaultKind.CROSSTALK):
            failed.append((job.kind, job.steps))
        observe(self, engine, job, outcome, t_submit, now)

    monkeypatch.setattr(FaultWatch, "observe", record)
    work = [(0.0, (i + 1, 2 * i + 3, 9), 30, "stop_ids" if host and i % 2 else "ignore_eos") for i in range(8)]
    cap = HOST if host else "sim-next"
    clean, _, _ = await _serve(work, 6, capability=cap)
    failed.clear()
    # the fault goes to the second multi-step job submitted (trio's scheduling order varies: a
    # count of jobs per engine would not say which job that is)
    submit = FakeCalbin.submit_decode_wait
    multi_jobs = 0

    async def faulting(self: FakeCalbin, *a: Any, steps: int = 1, **kw: Any) -> Any:
        nonlocal multi_jobs
        if steps > 1:
            multi_jobs += 1
            if multi_jobs == 2:
                self._dev.inject_fault(kind, a[4], 1, lane=1)
        return await submit(self, *a, steps=steps, **kw)

    monkeypatch.setattr(FakeCalbin, "submit_decode_wait", faulting)
    faulted, eng, st_ = await _serve(work, 6, capability=cap, executor={"wait_timeout_ms": 200})
    _same(clean, faulted)
    if host:  # lanes ended inside runs: some request ended short of its 30 tokens
        assert any(len(toks) < 30 for toks, _ in clean.values()), clean
    assert st_.resets_total == 1 and sum(st_.faults_total.values()) == 1
    if kind is not FaultKind.CROSSTALK:
        assert any(k == "decode" and n > 1 for k, n in failed), failed  # the fault hit a multi-step job


async def _lanes_back(eng: Engine) -> None:
    """Every KV lane is free again (sequences are freed after their terminal events)."""
    await trio.sleep(0.5)
    k = eng.generation().kv.statistics()
    assert k.unknown == 0 and k.free == k.num_lanes, k


async def _read_once(eng: Engine, req: GenerateRequest, cancel_at: int | None) -> tuple[list[int], Any]:
    """Stream ``req``: its tokens and its one terminal event; cancelled once ``cancel_at`` tokens
    arrived (None: never)."""
    h = await eng.submit(req)
    toks: list[int] = []
    terms: list[Any] = []
    async for ev in h.events():
        if isinstance(ev, TokenEvent):
            assert not terms, "a token after the terminal event"
            toks.extend(ev.token_ids)
            if cancel_at is not None and len(toks) >= cancel_at:
                eng.cancel(h.request_id)
        else:
            terms.append(ev)
    assert len(terms) == 1, terms
    return toks, terms[0]


@pytest.mark.parametrize("host", [False, True], ids=["device-runs", "host-runs"])
async def test_cancels_and_deadlines_end_once(autojump_clock: object, host: bool) -> None:
    """Many streams, a third cancelled at staggered instants while multi-step jobs run, a third with
    a deadline that passes mid-stream: each ends exactly once (cancelled / DEADLINE), the rest
    finish as single-step would, and every lane comes back. With runs the host drives, a deadline
    that passes mid-run ends the run with its step in flight: the request's end comes a step (1
    ms) after its deadline at most, not at the run's end."""
    be = FakeBackend(HOST if host else "sim-next", seed=5, jitter_s=0.0003)
    cfg = config(batch={"profiles": [1, 4, 8, 16], "multi_step": 8}, executor={"max_inflight": 2})
    ends: dict[int, Any] = {}
    late: list[float] = []
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(eos=EOS)}) as eng:
        async def one(i: int) -> None:
            deadline = 0.15 + 0.002 * i if i % 3 == 1 else None
            req = GenerateRequest((i + 1, 9), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
                                  deadline_s=deadline)
            t0 = trio.current_time()
            toks, term = await _read_once(eng, req, 5 + i if i % 3 == 0 else None)
            ends[i] = (len(toks), term)
            if deadline is not None:
                late.append(trio.current_time() - t0 - deadline)

        async with trio.open_nursery() as nursery:
            for i in range(30):
                nursery.start_soon(one, i)
        await _lanes_back(eng)
        stats = eng.statistics()
    for i, (n, term) in ends.items():
        if i % 3 == 0:
            assert isinstance(term, FinishEvent) and term.reason is FinishReason.CANCELLED, term
        elif i % 3 == 1:
            assert isinstance(term, FinishEvent) and term.reason is FinishReason.DEADLINE, term
            assert n < 200
        else:
            assert isinstance(term, FinishEvent) and term.reason is FinishReason.LENGTH and n == 200
    if host:
        assert stats.decode_runs_stopped_total >= 10, stats.decode_runs_stopped_total
        assert max(late) <= 0.0015, late  # a 1 ms step (+ the fake device's jitter)
    else:
        assert stats.decode_runs_stopped_total == 0


async def test_without_the_capability_one_step_a_job(autojump_clock: object) -> None:
    work = [(0.0, (i + 1, 4), 20, "ignore_eos") for i in range(3)]
    out, _, s = await _serve(work, 8, profiles=(1,), capability="calrt-0.7.6")
    assert s.decode_steps_total == s.batches_total
    for i, (toks, _) in out.items():
        assert toks == fake_greedy(work[i][1], 20)


async def test_steps_stop_at_the_kv_reservation(autojump_clock: object) -> None:
    """A request whose context fills the profile's max_seq: the steps never pass the reservation,
    it ends by length where single-step ends it."""
    work = [(0.0, tuple(range(1, 11)), 22, "ignore_eos"), (0.0, (3, 4), 13, "ignore_eos")]
    one, _, _ = await _serve(work, 1, max_seq=32)
    multi, _, _ = await _serve(work, 8, max_seq=32)
    _same(one, multi)
    assert len(multi[0][0]) == 32 - 10 and multi[0][1].reason is FinishReason.LENGTH


@settings(max_examples=400, deadline=None)
@given(toks=st.lists(st.integers(0, 9), min_size=1, max_size=12), generated=st.integers(0, 12),
       position=st.integers(3, 30), max_tokens=st.integers(1, 24), room=st.integers(1, 16),
       min_tokens=st.integers(0, 6), stop_ids=st.frozensets(st.integers(0, 9), max_size=2),
       ignore_eos=st.booleans(), deadline=st.sampled_from([None, 0.5, 1.0, 2.0]))
def test_ends_run_is_ends_token_by_token(toks: list[int], generated: int, position: int, max_tokens: int,
                                         room: int, min_tokens: int, stop_ids: frozenset[int],
                                         ignore_eos: bool, deadline: float | None) -> None:
    """The finish rule of a multi-step job's run is :func:`ends` applied to each token in turn,
    stopping at the first that ends the sequence: the same tokens kept and the same reason (STOP
    before LENGTH before DEADLINE on one token), also past a limit or a deadline already."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                        stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    s: Any = type("S", (), {})()
    s.req, s.deadline = GenerateRequest((1,), sp), deadline
    s.lease = type("L", (), {"reserved_len": position + room})()
    now, eos = 1.0, frozenset(EOS)
    want: tuple[int, FinishReason | None] = (len(toks), None)
    for i, tok in enumerate(toks):
        reason = ends(s, tok, generated + i + 1, position + i + 1, now, eos)
        if reason is not None:
            want = (i + 1, reason)
            break
    assert ends_run(s, toks, generated, position, now, eos) == want


def test_decode_steps_rule() -> None:
    """The per-job step count: 1 unless every lane is plain greedy and not scoring; then each lane
    the least of the limit, its tokens left and its KV room (after the pending tokens of the fast
    path), and the job the most of those."""
    kv = KvLaneManager(4, 64, 256)

    class _S:
        def __init__(self, generated: int, position: int, max_tokens: int, reserved: int, **kw: Any) -> None:
            self.generated, self.position, self.score_upto = generated, position, None
            self.req = GenerateRequest((1,), SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, **kw}))
            self.lease = type("L", (), {"reserved_len": reserved})()

    a, b = _S(3, 10, 100, 64), _S(0, 5, 4, 64)
    assert decode_steps(8, [a]) == (8, None)
    assert decode_steps(8, [a, b]) == (8, [8, 4])  # b has 4 tokens left: its own 4 steps
    assert decode_steps(8, [a, b], pending=1) == (8, [8, 3])
    assert decode_steps(8, [a, b], pending=[0, 2]) == (8, [8, 2])
    assert decode_steps(8, [a], positions=[61]) == (3, None)  # 3 KV slots left
    assert decode_steps(8, [b, b]) == (4, None)
    assert decode_steps(1, [a]) == (1, None)
    assert decode_steps(8, [a, _S(0, 5, 50, 64, logprobs=1)]) == (1, None)
    assert decode_steps(8, [a, _S(0, 5, 50, 64, temperature=0.5)]) == (1, None)
    assert decode_steps(8, [a, _S(0, 5, 50, 64, presence_penalty=0.5)]) == (1, None)
    c = _S(0, 5, 50, 64)
    c.score_upto = 2
    assert decode_steps(8, [a, c]) == (1, None)
    assert decode_steps(8, [_S(0, 5, 1, 64)]) == (1, None)
    assert decode_steps(8, [a, _S(0, 5, 1, 64)]) == (8, [8, 1])
    del kv


async def test_one_step_while_a_prompt_waits_for_its_prefill(autojump_clock: object,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode job decided while an admitted prompt waits for its prefill runs one step, so the
    prefill is not held behind N steps (time to first token); the others run several."""
    seen: list[tuple[int, bool]] = []
    submit = FakeCalbin.submit_decode_wait

    async def record(self: FakeCalbin, *a: Any, steps: int = 1, **kw: Any) -> Any:
        eng_ = engines[0]
        gen = eng_.generation()
        seen.append((steps, eng_.core.requests.prefill_waiting(gen)))
        return await submit(self, *a, steps=steps, **kw)

    monkeypatch.setattr(FakeCalbin, "submit_decode_wait", record)
    engines: list[Engine] = []
    be = FakeBackend("sim-next", seed=3)
    cfg = config(batch={"profiles": [1, 4, 8, 16], "multi_step": 8}, executor={"max_inflight": 2})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(eos=EOS)}) as eng:
        engines.append(eng)

        async def one(i: int) -> None:
            await trio.sleep(0.004 * i)  # arrivals while the first ones decode
            toks: list[int] = []
            h = await eng.submit(GenerateRequest((i + 1, 7), SamplingParams(temperature=0.0, max_tokens=60,
                                                                          ignore_eos=True)))
            async for ev in h.events():
                if isinstance(ev, TokenEvent):
                    toks.extend(ev.token_ids)
            assert toks == fake_greedy((i + 1, 7), 60)

        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(one, i)
    assert any(n > 1 for n, _ in seen)
    # the waiting flag as of the submit (the job was decided just before it, in the same step)
    assert all(n == 1 for n, waiting in seen if waiting), seen


async def _arrivals(capability: str | RuntimeCapabilities, prompts: int = 10) -> tuple[list[float], Any]:
    """Four long greedy streams decode in 16-step jobs (max_inflight 1: one engine, 1 ms a step);
    then a prompt arrives every 7 ms: each one's time to first token, and the statistics."""
    be = FakeBackend(capability, seed=3)
    cfg = config(batch={"profiles": [1, 4, 8, 16], "multi_step": 16}, executor={"max_inflight": 1})
    ttft: list[float] = []
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(eos=EOS)}) as eng:
        async def one(i: int, at: float, n: int) -> None:
            await trio.sleep(at)
            t0 = trio.current_time()
            h = await eng.submit(GenerateRequest((i + 1, 7), SamplingParams(temperature=0.0, max_tokens=n,
                                                                          ignore_eos=True)))
            toks: list[int] = []
            async for ev in h.events():
                if isinstance(ev, TokenEvent):
                    if not toks and i >= 4:
                        ttft.append(trio.current_time() - t0)
                    toks.extend(ev.token_ids)
            assert toks == fake_greedy((i + 1, 7), n)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i, 0.0, 300)
            for k in range(prompts):
                nursery.start_soon(one, 4 + k, 0.05 + 0.007 * k, 20)
        await _lanes_back(eng)
        return ttft, eng.statistics()


async def test_a_prompt_ends_a_host_run_early(autojump_clock: object) -> None:
    """A prompt that arrives while a multi-step decode runs waits for all its steps when the device
    runs them (up to 16 ms here); when the host drives the run, the engine ends it with the step
    in flight, so the prompt's prefill waits one step at most: its time to first token is a prefill
    and about a step, the outputs the same (greedy), the steps saved counted."""
    dev_ttft, dev = await _arrivals("sim-next")
    host_ttft, host = await _arrivals(HOST)
    assert dev.decode_runs_stopped_total == 0 == dev.decode_steps_cut_total
    assert host.decode_runs_stopped_total >= 10 and host.decode_steps_cut_total > 0
    prefill = 200e-6 + 2e-6 * 2  # the fake timing: 200 µs + 2 µs a token, a 1 ms step
    assert max(host_ttft) <= prefill + 1e-3 + 1e-4, host_ttft
    assert max(dev_ttft) > prefill + 4e-3, dev_ttft  # behind the device's run
    # a stopped run is the job of the steps it ran: every step is accounted for once
    assert sum(host.decode_steps_total.values()) < sum(dev.decode_steps_total.values()) + 10 * 16


async def test_a_cancel_ends_a_host_run_early(autojump_clock: object) -> None:
    """A request cancelled while in a host-driven run: the run ends with its step in flight, the
    request ends once (cancelled), the others go on to their full outputs, every lane comes back."""
    be = FakeBackend(HOST, seed=5)
    cfg = config(batch={"profiles": [1, 4, 8, 16], "multi_step": 16}, executor={"max_inflight": 1})
    ends: dict[int, Any] = {}
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(eos=EOS)}) as eng:
        async def one(i: int) -> None:
            req = GenerateRequest((i + 1, 9), SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
            ends[i] = await _read_once(eng, req, 20 + 18 * i if i % 2 == 0 else None)  # in three runs

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
        await _lanes_back(eng)
        stats = eng.statistics()
    assert stats.decode_runs_stopped_total >= 3 and stats.decode_steps_cut_total > 0
    for i, (toks, term) in ends.items():
        want = fake_greedy((i + 1, 9), 120)
        assert toks == want[:len(toks)]
        if i % 2 == 0:
            assert isinstance(term, FinishEvent) and term.reason is FinishReason.CANCELLED, term
        else:
            assert isinstance(term, FinishEvent) and term.reason is FinishReason.LENGTH and toks == want


def _first_new(toks: list[int], at: int) -> int:
    """The first index >= ``at`` whose token did not occur before it (a stop token id that ends
    the sequence there and not earlier), avoiding the fake model's EOS."""
    for i in range(at, len(toks)):
        if toks[i] not in toks[:i] and toks[i] not in EOS:
            return i
    raise AssertionError(f"no new token after {at} in {toks}")


async def _ending(capability: str | RuntimeCapabilities, multi_step: int, prompts: Sequence[tuple[int, ...]],
                  stops: Sequence[int]) -> tuple[list[tuple[list[int], Any, float]], Any]:
    """Greedy requests (one engine, 1 ms a step), request i ending on its stop token id stops[i]:
    each one's tokens, terminal event and the time of that event; the statistics."""
    be = FakeBackend(capability, seed=3)
    cfg = config(batch={"profiles": [1, 4, 8, 16], "multi_step": multi_step}, executor={"max_inflight": 1})
    out: list[tuple[list[int], Any, float]] = [([], None, 0.0)] * len(prompts)
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(eos=EOS)}) as eng:
        t0 = trio.current_time()

        async def one(i: int) -> None:
            sp = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=frozenset({stops[i]}))
            toks, term = await _read_once(eng, GenerateRequest(prompts[i], sp), None)
            out[i] = (toks, term, trio.current_time() - t0)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        await _lanes_back(eng)
        return out, eng.statistics()


async def test_an_end_token_ends_its_lane_in_a_host_run(autojump_clock: object) -> None:
    """A lane of a host-driven run that draws its end token (here a stop token id; EOS alike) ends
    with that step (``completion.run_ends``, the binding's ``hs_start_ends``): its request's last
    event comes a step after the token instead of at the run's end, and once no lane runs the run
    ends. The device's own runs cannot: the steps after the token run for nothing. Outputs equal
    single-step."""
    prompt = (3, 11)
    greedy = fake_greedy(prompt, 40)
    k = _first_new(greedy, 10)  # token k comes from the 2nd 8-step run (token 0 from the prefill)
    stop = greedy[k]
    one, s1 = await _ending("sim-next", 1, [prompt], [stop])
    dev, sd = await _ending("sim-next", 8, [prompt], [stop])
    host, sh = await _ending(HOST, 8, [prompt], [stop])
    for toks, term, _ in (one[0], dev[0], host[0]):
        assert toks == one[0][0] and isinstance(term, FinishEvent) and term.reason is FinishReason.STOP
    assert len(one[0][0]) in (k, k + 1)  # (whether the stop token's id is shown is the actor's rule)
    steps = [sum(s.decode_steps_total.values()) for s in (s1, sd, sh)]
    assert steps[0] == k and steps[2] == k and steps[1] == 16, steps  # the host's run ended at the token
    assert sh.decode_steps_cut_total == 16 - k
    prefill = 200e-6 + 2e-6 * len(prompt)
    assert host[0][2] <= prefill + k * 1e-3 + 5e-4 < dev[0][2], (host[0][2], dev[0][2])
    # Four lanes in one run, each ending on its own token: the run ends after the last of them
    prompts = [(i + 1, 13) for i in range(4)]
    stops = []
    for p in prompts:
        g = fake_greedy(p, 40)
        stops.append(g[_first_new(g, 3)])
    one4, _ = await _ending("sim-next", 1, prompts, stops)
    host4, sh4 = await _ending(HOST, 8, prompts, stops)
    for (a, ta, _), (b, tb, _) in zip(one4, host4):
        assert a == b and ta.reason is tb.reason is FinishReason.STOP
    assert sh4.decode_steps_cut_total > 0
