"""The decode continuation shortcut (Scheduler.continue_decode) decides what a full tick would.

When the sequences of a decode job that came back are all the work there is, the executor builds the
next job from the previous one instead of running the full scheduling pass (spec §19 M1 per-token
overhead). These tests run the same seeded workload with the shortcut on and off (fake device, fake
clock): same outputs, same timings, the same set of sequences in every job, and the shortcut is
taken exactly when nothing else competes.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

from calserve.core.kv import KvLaneManager
from calserve.engine import core as core_module
from calserve.core.prefill import QueueClass, ServiceRoundRobin
from calserve.engine.core import EngineCore
from calserve.engine.fault_watch import FaultWatch
from calserve.engine.planner import Planner
from calserve.engine.timeslice import TimeSlice
from calserve.engine.engine import Engine
from calserve.testing.fake_device import FakeBackend
from calserve.engine.types import FinishEvent, FinishReason, GenerateRequest, SamplingParams, TokenEvent

from .helpers import config, fake_greedy, fake_source

# (arrival offset s, prompt, max_tokens, tenant)
Workload = Sequence[tuple[float, tuple[int, ...], int, str]]


async def _run(
    monkeypatch: pytest.MonkeyPatch, mode: str, work: Workload, batch: int, inflight: int,
    lanes: int = 32, **sched: Any,
) -> dict[str, Any]:
    """``mode``: "fast" (next job decided before the completion's bookkeeping, the default),
    "after" (decided after it: the core's continuation after a completion only) or "off" (full ticks only)."""
    if mode in ("after", "off"):
        monkeypatch.setattr(EngineCore, "fast_decode", lambda self, engine, job, outcome, now: None)
    if mode == "off":
        monkeypatch.setattr(Planner, "continue_decode", lambda self, done, now: None)
    seen: list[tuple[str, str, int, frozenset[int], float, float, str]] = []
    observe = FaultWatch.observe
    passed: list[tuple[int, int]] = []  # (request, its passed-over count) at every count
    count_passed = Planner._passed_over

    def log_passed(self: Planner, seqs: Any) -> None:
        seqs = list(seqs)
        count_passed(self, seqs)
        passed.extend((s.rid, s.passed_over) for s in seqs)

    monkeypatch.setattr(Planner, "_passed_over", log_passed)

    def record(self: FaultWatch, engine: Any, job: Any, outcome: Any, t_submit: float, now: float) -> None:
        r = outcome.result
        seen.append((engine.name, job.kind, job.calbin.spec.compiled_batch, frozenset(s.rid for s in job.seqs),
                     t_submit, now, "refused" if r is None else r.status.name))
        observe(self, engine, job, outcome, t_submit, now)

    monkeypatch.setattr(FaultWatch, "observe", record)
    be = FakeBackend("sim-next", seed=7, jitter_s=0.0005)
    cfg = config(batch={"profiles": [batch]}, executor={"max_inflight": inflight}, **sched)
    out: dict[int, tuple[list[int], list[float], object]] = {}
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(profiles=(batch,), max_sequences=lanes)}) as eng:
        t0 = trio.current_time()

        async def one(i: int, at: float, prompt: tuple[int, ...], n: int, tenant: str) -> None:
            await trio.sleep_until(t0 + at)
            h = await eng.submit(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                        ignore_eos=True), tenant=tenant))
            toks: list[int] = []
            times: list[float] = []
            term = None
            async for ev in h.events():
                if isinstance(ev, TokenEvent):
                    toks.extend(ev.token_ids)
                    times.extend([trio.current_time() - t0] * len(ev.token_ids))
                else:
                    term = ev
            out[i] = (toks, times, term)

        async with trio.open_nursery() as nursery:
            for i, (at, prompt, n, tenant) in enumerate(work):
                nursery.start_soon(one, i, at, prompt, n, tenant)
        await trio.sleep(0.05)  # the last requests' sequences are freed after their terminal events
        jobs = [(kind, frozenset(rids)) for kind, rids in eng.core.requests.trace]
        sched = eng.core.statistics(trio.current_time())
        return {"out": out, "jobs": jobs, "observed": seen,
                "step_times": dict(eng.driver.watch.times.snapshot()), "continuations": sched.continuations_total,
                "fast": sched.fast_steps_total, "rotations": sched.rotations_total,
                "parks": (sched.parks_total, sched.timeslices_total),
                "passed_over": (sched.starvation_events_total,
                                sorted(passed)),
                "batches": dict(sched.batches_total), "lanes": dict(sched.lanes_active_total)}


def _run_fresh(monkeypatch: pytest.MonkeyPatch, mode: str, work: Workload, batch: int, inflight: int,
               lanes: int = 32, **sched: Any) -> dict[str, Any]:
    """:func:`_run` in a trio run of its own with a fresh fake clock starting at 0, so that both runs
    of a comparison see bit-identical times (a second run on the same clock would start later and
    round its sums differently)."""
    try:
        return trio.run(functools.partial(_run, monkeypatch, mode, work, batch, inflight, lanes, **sched),
                        clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        monkeypatch.undo()


def _same_streams(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same tokens at the same times."""
    assert a["out"].keys() == b["out"].keys()
    for i, (toks, times, _) in a["out"].items():
        toks2, times2, _ = b["out"][i]
        assert toks == toks2, i
        assert times == times2, i


def _check_outputs(res: dict[str, Any], work: Workload) -> None:
    for i, (_, prompt, n, _) in enumerate(work):
        toks, _, term = res["out"][i]
        assert isinstance(term, FinishEvent) and term.reason is FinishReason.LENGTH
        assert toks == fake_greedy(prompt, n)


@pytest.mark.parametrize("mode", ["fast", "after"])
@pytest.mark.parametrize("batch,inflight", [(1, 1), (4, 1), (4, 2)], ids=["B1", "B4", "B4-pingpong"])
def test_shortcut_makes_the_same_decisions(
    monkeypatch: pytest.MonkeyPatch, batch: int, inflight: int, mode: str
) -> None:
    # Phases: one stream alone (shortcut), then arrivals while it runs (full ticks), two tenants,
    # staggered finishes (shrinking set), and a late lone stream again.
    work: Workload = [
        (0.0, (1, 2, 3), 40, "a"),
        (0.012, (4, 5), 25, "b"),
        (0.013, (6,), 30, "a"),
        (0.030, (7, 8, 9, 10), 12, "b"),
        (0.300, (11, 12), 30, "c"),
    ]
    on = _run_fresh(monkeypatch, mode, work, batch, inflight)
    off = _run_fresh(monkeypatch, "off", work, batch, inflight)
    _check_outputs(on, work)
    _check_outputs(off, work)
    assert on["continuations"] > 0 and off["continuations"] == 0
    assert (on["fast"] > 0) == (mode == "fast") and off["fast"] == 0
    # the same tokens at the same (fake) times, the same sequences in every job, the same counters
    _same_streams(on, off)
    assert on["jobs"] == off["jobs"]
    assert (on["batches"], on["lanes"]) == (off["batches"], off["lanes"])
    # The fault watch saw every job exactly once with the same times, whether the executor recorded
    # it before deciding the next job or (fast steps) right after that job's submit.
    def by_time(o: tuple[Any, ...]) -> tuple[float, str]:
        return o[5], o[0]
    assert sorted(on["observed"], key=by_time) == sorted(off["observed"], key=by_time)
    assert len(on["observed"]) == sum(on["batches"].values()) + len(work)  # decode jobs + prefills
    assert on["step_times"] == off["step_times"]


@pytest.mark.parametrize("mode", ["fast", "after"])
def test_shortcut_with_requests_waiting_for_a_lane(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # Every KV lane is held (4 lanes, B4): requests waiting for admission cannot be admitted by a
    # tick, so the running four still continue by the shortcut; each waiting one gets the first
    # lane that frees up, exactly as with full ticks.
    work: Workload = [(1e-4 * i, (i + 1, 2 * i + 3), 12 + 5 * i, "ab"[i % 2]) for i in range(7)]
    on = _run_fresh(monkeypatch, mode, work, 4, 1, lanes=4)
    off = _run_fresh(monkeypatch, "off", work, 4, 1, lanes=4)
    monkeypatch.setattr(KvLaneManager, "free_lanes", lambda self: 1)  # as if a lane were always free
    no_relax = _run_fresh(monkeypatch, mode, work, 4, 1, lanes=4)
    _check_outputs(on, work)
    assert on["continuations"] > no_relax["continuations"] > 0  # some continued while others waited
    _same_streams(on, off)
    assert on["jobs"] == off["jobs"]


@pytest.mark.parametrize("batch,inflight,lanes,streams,sched", [
    (1, 1, 32, 5, {}), (4, 1, 32, 11, {}), (4, 2, 32, 14, {}), (4, 2, 12, 14, {}), (1, 2, 3, 6, {}),
    (1, 1, 32, 6, {"admission": {"max_tpot_steps": 2}, "timeslice_ms": 4, "timeslice_wait_ms": 6}),
], ids=["B1", "B4", "B4-pingpong", "B4-pingpong-lanes-full", "B1-pingpong-lanes-full",
        "B1-running-cap-timeslices"])
def test_rotation_makes_the_same_decisions(
    monkeypatch: pytest.MonkeyPatch, batch: int, inflight: int, lanes: int, streams: int,
    sched: dict[str, Any],
) -> None:
    """More running sequences than the batch holds: the lanes rotate through the ready set, and
    the next batch is decided before the completion's bookkeeping (``EngineCore._rotate``). The
    same tokens at the same (fake) times, the same sequences in every job and the same counters as
    with full passes only — with requests waiting for a lane (``lanes`` < ``streams``) or for a
    running slot while the time-slicer parks and resumes, and staggered lengths so that the set
    grows and shrinks. (Arrivals at distinct instants: trio runs tasks woken at the same instant
    in a random order.)"""
    work: Workload = [(1.37e-4 * i + 1.1e-5, (i + 1, 2 * i + 3, 7), 9 + 3 * (i % 5), "a")
                      for i in range(streams)]
    on = _run_fresh(monkeypatch, "fast", work, batch, inflight, lanes=lanes, **sched)
    off = _run_fresh(monkeypatch, "off", work, batch, inflight, lanes=lanes, **sched)
    _same_as_full_passes(on, off, work)


def _same_as_full_passes(on: dict[str, Any], off: dict[str, Any], work: Workload) -> None:
    """The rotation's run ``on`` against full passes only: the same tokens at the same times, jobs,
    counters, parks and passed-over counts."""
    _check_outputs(on, work)
    _check_outputs(off, work)
    assert on["rotations"] > 0 and off["rotations"] == 0
    _same_streams(on, off)
    assert on["jobs"] == off["jobs"]
    assert (on["batches"], on["lanes"]) == (off["batches"], off["lanes"])
    assert on["step_times"] == off["step_times"]
    assert (on["parks"], on["passed_over"]) == (off["parks"], off["passed_over"])


@pytest.mark.parametrize("batch,inflight", [(1, 1), (4, 1), (4, 2)], ids=["B1", "B4", "B4-pingpong"])
def test_rotation_with_prefills_queued(monkeypatch: pytest.MonkeyPatch, batch: int, inflight: int) -> None:
    """Requests keep arriving while the lanes rotate (a closed loop's steady state), so prompts
    wait for their prefill at many completions: the rotation asks the service round robin whose
    turn it is (``ServiceRoundRobin.peek``), goes on when it is decode's — granting the turn among
    the same classes as the pass would, so the credits stay the pass's — and leaves the prefill's
    turns to the pass. Same decisions as full passes only; and it did go on past queued prompts."""
    work: Workload = [(0.0021 * i + 1.1e-5 * (i % 7), tuple(range(1, 3 + (i * 5) % 40)), 15 + 4 * (i % 6), "a")
                      for i in range(24)]
    past_prompts: list[int] = []
    peek = ServiceRoundRobin.peek

    def watched(self: ServiceRoundRobin, available: Any) -> Any:
        c = peek(self, available)
        if len(available) > 1 and c is QueueClass.DECODE:
            past_prompts.append(len(available))
        return c

    monkeypatch.setattr(ServiceRoundRobin, "peek", watched)
    on = _run_fresh(monkeypatch, "fast", work, batch, inflight)
    off = _run_fresh(monkeypatch, "off", work, batch, inflight)
    _same_as_full_passes(on, off, work)
    assert len(past_prompts) >= (1 if inflight == 2 else 5)


def test_rotation_while_a_park_is_due_but_nobody_ran_a_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue behind the running cap (two running on B1, ten waiting): the oldest waiter is past
    ``timeslice_wait_ms`` long before any running request has had a whole ``timeslice_ms``, so
    the time-slicer parks nobody and only reports when the first will have run a slice — the
    default profile under 32 streams of short requests (issue 18). The lanes rotate through those
    steps too, with the same decisions, times and parks as full passes (whose time-slicer timer
    counts the finished job's sequences, ready only after the bookkeeping the rotation runs
    first); later requests do run a whole slice and are parked, and the lanes rotate while they
    wait parked too (every running slot taken: none can resume)."""
    work: Workload = [(1.37e-4 * i + 1.1e-5, (i + 1, 2 * i + 3, 7), 9 + 3 * (i % 5) + 20 * (i % 3), "a")
                      for i in range(12)]
    sched: dict[str, Any] = {"admission": {"max_tpot_steps": 2}, "timeslice_ms": 30, "timeslice_wait_ms": 3}
    due_quiet: list[float] = []  # instants the rotation went on with a park due
    sliced_quiet: list[float] = []  # ... with time-sliced requests parked (every running slot taken)
    quiet = TimeSlice.quiet

    def watched(self: TimeSlice, gen: Any, now: float, also: Sequence[Any] = (), admitting: bool = True) -> bool:
        r = quiet(self, gen, now, also, admitting)
        q = self._requests.queues(gen)
        due = self._park_due(gen, next(iter(q.waiting.values()), None), self._running(q),
                             gen.admission.max_running)
        if r and due is not None and now >= due:
            due_quiet.append(now)
        if r and self._parking.sliced_queue(q.parked, gen.id):
            sliced_quiet.append(now)
        return r

    def logged(log: list[tuple[float, float, bool]]) -> Any:
        housekeeping = core_module._housekeeping

        def wrapped(st: Any, reqs: Any, ts: Any, gen: Any, now: float, also: Sequence[Any] = ()) -> float:
            timer = housekeeping(st, reqs, ts, gen, now, also)
            log.append((now, timer, bool(also)))  # also: the rotation's replay
            return timer
        return wrapped

    on_timers: list[tuple[float, float, bool]] = []
    off_timers: list[tuple[float, float, bool]] = []
    monkeypatch.setattr(TimeSlice, "quiet", watched)
    monkeypatch.setattr(core_module, "_housekeeping", logged(on_timers))
    on = _run_fresh(monkeypatch, "fast", work, 1, 1, **sched)
    monkeypatch.setattr(core_module, "_housekeeping", logged(off_timers))
    off = _run_fresh(monkeypatch, "off", work, 1, 1, **sched)
    _same_as_full_passes(on, off, work)
    assert len(due_quiet) >= 10 and on["parks"][0] > 0 and len(sliced_quiet) >= 10
    # The timer each replay reports is the one the pass after that completion reported, though the
    # finished job's sequences were not ready yet when it ran (the time-slicer's next instant).
    passes: dict[float, set[float]] = collections.defaultdict(set)
    for now, timer, _ in off_timers:
        passes[now].add(timer)
    replays = [(now, timer) for now, timer, replay in on_timers if replay]
    assert len(replays) >= 10 and all(timer in passes[now] for now, timer in replays)


async def test_shortcut_only_when_nothing_else_competes(
    autojump_clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # B1, two concurrent streams (20 and 30 tokens): while both run the one lane alternates between
    # them (fair time-share), so no step may be a continuation; once the short one ended the long
    # one is all the work there is and continues by the shortcut.
    work: Workload = [(0.0, (1, 2), 20, "a"), (0.0, (3, 4), 30, "b")]
    res = await _run(monkeypatch, "fast", work, 1, 1)
    _check_outputs(res, work)
    firsts = [next(iter(rids)) for kind, rids in res["jobs"] if kind == "decode"]
    assert len(firsts) == 19 + 29  # the first token of each comes from its prefill
    both = firsts[: 2 * 19]
    # fair time-share while both run (by tenant service: at most two steps in a row for one)
    assert not any(x == y == z for x, y, z in zip(both, both[1:], both[2:]))
    assert sum(x != y for x, y in zip(both, both[1:])) >= 2 * 19 - 4
    assert set(firsts[2 * 19:]) == {firsts[-1]}
    assert 8 <= res["continuations"] <= 10  # the survivor's ~10 lone steps (the first: a full tick)


async def test_shortcut_respects_the_batching_window(autojump_clock: object) -> None:
    # With a batching window a partial batch may be held for it: never shortcut a partial batch.
    be = FakeBackend("sim-next", seed=1)
    cfg = config(batch={"profiles": [4], "batching_window_us": 500}, executor={"max_inflight": 1})
    async with Engine.open(cfg, backend=be, sources={"qwen3": fake_source(profiles=(4,))}) as eng:
        h = await eng.submit(GenerateRequest((1, 2, 3), SamplingParams(temperature=0.0, max_tokens=10,
                                                                         ignore_eos=True)))
        toks = [t async for ev in h.events() if isinstance(ev, TokenEvent) for t in ev.token_ids]
        assert toks == fake_greedy((1, 2, 3), 10)
        assert eng.core.statistics(trio.current_time()).continuations_total == 0


@pytest.mark.parametrize("batch,inflight", [(1, 1), (4, 2)], ids=["B1", "B4-pingpong"])
def test_continuations_reuse_the_hang_timeout_they_would_compute(
    monkeypatch: pytest.MonkeyPatch, batch: int, inflight: int
) -> None:
    """A decode job with a modeled step keeps its hung-job timeout and its continuations reuse it
    (no timing lookup on the way to their submit): every job's timeout is still the one computed
    from scratch, and the reuse did happen."""
    from calserve.engine.fault_watch import modeled_s

    seen: list[tuple[bool, float, float]] = []
    orig = FaultWatch.hang_timeout

    def record(self: FaultWatch, job: Any) -> float:
        kept = job.hang_timeout_s is not None
        t = orig(self, job)
        seen.append((kept, t, self.times.timeout(job.kind, job.calbin.spec.compiled_batch,
                                                 modeled_s(job))))
        return t

    monkeypatch.setattr(FaultWatch, "hang_timeout", record)
    work: Workload = [(0.0, (1, 2, 3), 40, "a"), (0.012, (4, 5), 25, "b"), (0.3, (6,), 30, "a")]
    res = _run_fresh(monkeypatch, "fast", work, batch, inflight)
    _check_outputs(res, work)
    assert res["continuations"] > 0
    assert all(t == fresh for _, t, fresh in seen)
    assert sum(kept for kept, _, _ in seen) >= res["continuations"] // 2


@pytest.mark.parametrize("batch", [1, 4])
def test_a_fast_step_applies_the_finish_rule_once_per_token(monkeypatch: pytest.MonkeyPatch,
                                                            batch: int) -> None:
    # The fast step decides that every sequence continues (completion.ends per lane) before the
    # bookkeeping; the bookkeeping then takes that decision instead of applying the rule again.
    import calserve.engine.core as core_mod
    import calserve.engine.steps as steps_mod

    calls = {"core": 0, "steps": 0}
    for name, mod in (("core", core_mod), ("steps", steps_mod)):
        def counted(*args: Any, _ends: Any = mod.ends, _name: str = name) -> Any:
            calls[_name] += 1
            return _ends(*args)
        monkeypatch.setattr(mod, "ends", counted)
    work: Workload = [(0.0, (1, 2, 3), 40, "a"), (0.0, (4, 5), 40, "b")][:2 if batch > 1 else 1]
    res = _run_fresh(monkeypatch, "fast", work, batch, 1)
    _check_outputs(res, work)
    tokens = 40 * len(work)
    assert res["fast"] >= 30
    # once per token; twice only for a request's prefill (its bookkeeping is the general one) and
    # for a lane of the step in which some sequence ends (the fast step stops there and the
    # general bookkeeping applies the rule to the whole step). Applied twice: 2 x tokens.
    assert tokens <= calls["core"] + calls["steps"] <= tokens + 2 * len(work)
