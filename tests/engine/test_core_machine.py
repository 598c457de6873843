"""The engine core without trio: a hypothesis state machine drives ``EngineCore`` with a pure-Python
fake device (completions on either engine in any order, device faults and resets, cancels, deadlines,
new requests at any time) and checks after every step:

- every accepted request ends with exactly one terminal message (``End``), the last it gets, and
  its messages keep their order (``Admitted`` before tokens, the first token flagged first);
- no lane or runtime sequence leaks: once every request ended and nothing is on the device, every
  lane is Free, no runtime sequence exists and nothing waits for a release;
- a lane a fault left Unknown is never reserved again before the reset that clears it;
- the greedy output of a request that completed equals its solo output (the fake model is a pure
  function of the sequence's history, so batching, PING/PONG and the fast path must not change it).
"""

from __future__ import annotations

import collections
import itertools
import math
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from calserve.core.admission import Outcome
from calserve.core.kv import KvLaneManager
from calserve.core.kv_state import KvSequenceState
from calserve.core.model_state import ModelState
from calserve.core.prefill import classify
from calserve.core.request_state import RUNNING, TERMINAL, RequestState
from calserve.engine.core import EngineCore
from calserve.engine.generations import Generation, make_admission
from calserve.engine.registry import work_item
from calserve.engine.state import Admitted, CoreOutput, DeviceJob, End, JobOutcome, Scored, Seq, Tokens
from calserve.engine.types import ErrorEvent, FinishReason, GenerateRequest, SamplingParams, TokenLogprob
from calserve.runtime.types import DeviceFaulted, JobEngine, JobResult, JobStatus, ProfileSpec
from calserve.testing.fake_device import fake_logits, history_hash

from .helpers import config, fake_greedy, fake_source

VOCAB = 128
MAX_SEQ = 48
LANES = 6


def row_sums(logits: np.ndarray) -> np.ndarray:
    return np.array([hash(r.tobytes()) & 0xFFFFFFFF for r in logits], dtype=np.uint64)


class SyncCalbin:
    """A synchronous fake calbin: sequences are token lists, logits a pure function of them."""

    frees_inline = True

    def __init__(self, B: int) -> None:
        self.spec = ProfileSpec(B, MAX_SEQ, LANES)
        self.seqs: dict[int, list[int]] = {}
        self._ids = itertools.count(1)
        self._jobs = itertools.count(1)

    def create(self) -> int:
        sid = next(self._ids)
        self.seqs[sid] = []
        return sid

    def free_sequences_now(self, sids: Sequence[int]) -> None:
        for s in sids:
            self.seqs.pop(int(s), None)

    def run(self, job: DeviceJob, status: JobStatus = JobStatus.OK, corrupt: bool = False) -> JobResult:
        job.job_id = next(self._jobs)
        B = len(job.lanes)
        logits = np.zeros((B, VOCAB), np.float32)
        echo = np.full((B, 3), -1, np.int64)
        echo[:, 0] = job.job_id
        if status is JobStatus.OK:
            if job.kind == "prefill":
                seq = job.seqs[0]
                assert seq.seq_id is not None
                toks = self.seqs[seq.seq_id]
                assert len(toks) == seq.position  # the core's committed length is the device's
                toks.extend(int(t) for t in job.tokens)
                logits[0] = fake_logits(history_hash(toks), VOCAB)
                echo[0, 1:] = (seq.seq_id, len(toks) - 1)
            else:
                for lane in job.active:
                    sid = int(job.seq_ids[lane])  # type: ignore[index]
                    toks = self.seqs[sid]
                    assert len(toks) == int(job.positions[lane])
                    toks.append(int(job.tokens[lane]))
                    logits[lane] = fake_logits(history_hash(toks), VOCAB)
                    echo[lane, 1:] = (sid, int(job.positions[lane]))
        sums = row_sums(logits)
        if corrupt:
            sums = sums ^ np.uint64(1)
        return JobResult(job.job_id, JobEngine.PING, status, logits, echo, sums, 0.0)

    def verify_lanes(self, r: JobResult, job_id: int, lanes: Sequence[int],
                     expect: Sequence[tuple[int, int]]) -> list[int]:
        echo = r.echo.tolist()
        ok = (row_sums(r.logits[list(lanes)]) == r.checksum[list(lanes)]).tolist()
        return [k for k, (lane, (sq, pos)) in enumerate(zip(lanes, expect, strict=True))
                if not (ok[k] and echo[lane] == [job_id, sq, pos])]


def check_scores(prompt: list[int], scores: Sequence[TokenLogprob], k: int) -> None:
    """``scores`` are the fake model's logprobs of ``prompt``'s tokens (the first NaN)."""
    assert [sc.token_id for sc in scores] == prompt
    assert math.isnan(scores[0].logprob) and not scores[0].top
    for i in range(1, len(prompt)):
        x = fake_logits(history_hash(prompt[:i]), VOCAB).astype(np.float64)
        lse = x.max() + np.log(np.exp(x - x.max()).sum())
        assert abs(scores[i].logprob - (x[prompt[i]] - lse)) < 1e-6
        top = sorted(range(VOCAB), key=lambda t: (-x[t], t))[:k]
        assert [t for t, _ in scores[i].top] == top


class Recorder:
    """A request's inbox: records every message in order."""

    def __init__(self) -> None:
        self.msgs: list[Any] = []

    def send_nowait(self, msg: Any) -> None:
        self.msgs.append(msg)


class CoreMachine(RuleBasedStateMachine):
    @initialize(two_engines=st.booleans(), fcfs=st.booleans())
    def setup(self, two_engines: bool, fcfs: bool) -> None:
        self.cfg = config(batch={"profiles": [4], "batching_window_us": 0},
                          executor={"max_inflight": 2 if two_engines else 1},
                          fairness={"policy": "fcfs" if fcfs else "wfq"},
                          admission={"deadline_default_ms": 600_000})
        self.cb = SyncCalbin(4)
        src = fake_source(profiles=(4,), max_seq=MAX_SEQ, max_sequences=LANES)
        kv = KvLaneManager(LANES, MAX_SEQ, LANES * MAX_SEQ)
        adm = make_admission(self.cfg, LANES, LANES * MAX_SEQ, MAX_SEQ)
        self.gen = Generation(1, "qwen3", src, self.cb.spec, self.cb, adm, kv,  # type: ignore[arg-type]
                              state=ModelState.READY)
        self.models = types.SimpleNamespace(generations={1: self.gen})
        engines = [JobEngine.PING, JobEngine.PONG] if two_engines else [JobEngine.PING]
        self.core = EngineCore(self.cfg, self.models, engines)  # type: ignore[arg-type]
        self.now = 0.0
        self.rids = itertools.count(1)
        self.checked_scores: set[int] = set()  # scored requests whose scores were checked
        self.seqs: dict[int, Seq] = {}
        self.inboxes: dict[int, Recorder] = {}
        self.faults: list[Any] = []
        self.unknown: set[int] = set()  # lanes Unknown since the last reset
        self.lane_of: dict[int, int] = {}  # request -> the lane it was last seen holding
        self.steps = 0

    # ------------------------------------------------------------------------------ shell
    def apply(self, out: CoreOutput) -> None:
        self.faults.extend(out.faults)
        for gen in out.release_gens:
            batch = self.core.take_releases(gen)
            self.cb.free_sequences_now([r.seq_id for r in batch])
            self.apply(self.core.confirm_released(gen, batch, self.now))
        # jobs in out.jobs are in the core's slots: the "executors" run them when a rule says so
        self.core.flush()  # the shell flushes deferred messages after the submit

    def outcome(self, job: DeviceJob, kind: str) -> JobOutcome:
        if job.epoch != self.core.epoch:
            return JobOutcome(submit_error=DeviceFaulted("the device was reset"))
        if job.kind == "prefill":
            sid = self.cb.create() if job.seqs[0].seq_id is None else None
            if not self.core.begin_prefill(job, sid):
                if sid is not None:
                    self.cb.free_sequences_now([sid])
                return JobOutcome(submit_error=DeviceFaulted("KV lane lost"))
        if kind == "ok":
            return JobOutcome(result=self.cb.run(job))
        if kind == "crosstalk":
            return JobOutcome(result=self.cb.run(job, corrupt=True))
        if kind == "busy":
            from calserve.runtime.types import DeviceBusy
            return JobOutcome(submit_error=DeviceBusy("busy"))
        status = JobStatus.CCU_FAULT if kind == "ccu" else JobStatus.DMA_UNKNOWN
        return JobOutcome(result=self.cb.run(job, status))

    def complete(self, engine: JobEngine, kind: str) -> CoreOutput | None:
        """The device answers ``engine``'s job; the completion's output (None: a continuation was
        submitted first, the fast path)."""
        core = self.core
        job = core.slots[engine]
        assert job is not None
        outcome = self.outcome(job, kind)
        fast = core.fast_decode(engine, job, outcome, self.now)
        if fast is not None and fast.nxt is not None:
            assert core.slots[engine] is fast.nxt  # submitted first ...
            self.apply(core.finish_fast(fast))  # ... its predecessor's bookkeeping right after
            return None
        out = core.on_completion(engine, job, outcome, self.now, fast)
        self.apply(out)
        if not out.wake:
            # No wake asked for: the completion's own pass did what the scheduler task's would
            # (a request that ended there freed its lane and admission slot; core.on_completion
            # runs that pass itself instead of waking the task for a second). A pass now finds
            # nothing new to start.
            before = dict(core.slots)
            again = core.tick(self.now)
            assert not again.jobs and dict(core.slots) == before, (before, again)
            self.apply(again)
        return out

    # ------------------------------------------------------------------------------ rules
    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
          max_tokens=st.integers(0, 12), tenant=st.sampled_from(["a", "b", "c"]),
          deadline=st.one_of(st.none(), st.floats(0.001, 0.05)),
          scored=st.one_of(st.none(), st.integers(0, 3)))
    def submit(self, prompt: list[int], max_tokens: int, tenant: str, deadline: float | None,
               scored: int | None = None) -> None:
        """A request; ``scored``: it scores its prompt (echo + logprobs) with that many top
        alternatives, and may then generate nothing (``max_tokens`` 0)."""
        rid = next(self.rids)
        if scored is None:
            max_tokens = max(1, max_tokens)
        req = GenerateRequest(tuple(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                            ignore_eos=True,
                                                            prompt_logprobs=scored), tenant=tenant)
        dl = self.now + (deadline if deadline is not None else 600.0)
        item = work_item(rid, req, self.now, dl, 1)
        d = self.gen.admission.offer(item, self.now, True)
        if d.outcome is not Outcome.QUEUE:
            return
        inbox = Recorder()
        seq = Seq(rid=rid, req=req, gen=self.gen, arrival=self.now, deadline=dl, seed=rid,
                  prompt=np.asarray(prompt, np.int32),
                  qclass=classify(len(prompt), self.cfg.scheduler.queues), inbox=inbox)
        self.seqs[rid] = seq
        self.inboxes[rid] = inbox
        self.apply(self.core.add(seq, self.now))

    @precondition(lambda self: any(j is not None for j in self.core.slots.values()))
    @rule(data=st.data(), kind=st.sampled_from(["ok"] * 12 + ["crosstalk", "ccu", "dma", "busy"]))
    def device_answers(self, data: st.DataObject, kind: str) -> None:
        busy = [e for e, j in self.core.slots.items() if j is not None]
        engine = data.draw(st.sampled_from(busy))
        self.complete(engine, kind)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.apply(self.core.abort(self.seqs[rid], FinishReason.CANCELLED, self.now))

    @rule(dt=st.floats(0.0005, 0.02))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.apply(self.core.tick(self.now))

    @precondition(lambda self: bool(self.faults))
    @rule()
    def recover(self) -> None:
        """The recovery task: new epoch, reset (every job on the device ends ABORTED), then the lost
        KV, the lane table, resume."""
        core = self.core
        core.begin_recovery()
        self.faults.clear()
        for engine, job in list(core.slots.items()):
            if job is not None:
                r = self.cb.run(job, JobStatus.ABORTED)
                self.apply(core.on_completion(engine, job, JobOutcome(result=r), self.now))
        assert core.inflight_jobs() == 0
        err = ErrorEvent("device reset", "device_error")
        reserved_only, sids = core.lose_kv_after_reset(self.gen, err, self.now)
        self.cb.free_sequences_now(sids)
        core.clear_lanes_after_reset(self.gen, reserved_only)
        core.end_recovery(self.gen, False, reserved_only, self.now)
        self.unknown.clear()
        self.apply(core.resume(self.now))

    # ------------------------------------------------------------------------------ invariants
    @invariant()
    def messages_in_order_and_one_end(self) -> None:
        if not hasattr(self, "core"):
            return
        for rid, box in self.inboxes.items():
            msgs = box.msgs
            ends = [i for i, m in enumerate(msgs) if isinstance(m, End)]
            assert len(ends) <= 1, (rid, msgs)
            if ends:
                assert ends[0] == len(msgs) - 1, (rid, msgs)
            toks = [m for m in msgs if isinstance(m, Tokens)]
            if toks:
                assert toks[0].first and not any(t.first for t in toks[1:]), (rid, msgs)
                adm = [i for i, m in enumerate(msgs) if isinstance(m, Admitted)]
                assert adm and adm[0] < msgs.index(toks[0]), (rid, msgs)

    @invariant()
    def prompts_scored_once_before_tokens_and_exactly(self) -> None:
        """A scoring request gets one Scored message, before its first token, whose scores are
        the fake model's (its logits are a pure function of the history: computed here from
        scratch); a request that completed was scored; others never get one."""
        if not hasattr(self, "core"):
            return
        for rid, box in self.inboxes.items():
            seq = self.seqs[rid]
            k = seq.req.sampling.prompt_logprobs
            at = [i for i, m in enumerate(box.msgs) if isinstance(m, Scored)]
            if k is None:
                assert not at, rid
                continue
            assert len(at) <= 1, (rid, box.msgs)
            toks = [i for i, m in enumerate(box.msgs) if isinstance(m, Tokens)]
            if toks:
                assert at and at[0] < toks[0], (rid, box.msgs)
            done = box.msgs and isinstance(box.msgs[-1], End) and box.msgs[-1].reason is \
                FinishReason.LENGTH
            if done:
                assert at, (rid, box.msgs)
            if not at:
                continue
            if rid not in self.checked_scores:
                self.checked_scores.add(rid)
                check_scores(list(seq.prompt), box.msgs[at[0]].logprobs, k)

    @invariant()
    def lifecycle_is_the_table_state(self) -> None:
        """The lifecycle decisions read is ``Seq.state``: a job in flight <=> a Running state;
        in the admission queue <=> WaitingAdmission; ended <=> the End message was sent."""
        if not hasattr(self, "core"):
            return
        q = self.core.requests.queues(self.gen)
        for rid, seq in self.seqs.items():
            assert (seq.inflight is not None) == (seq.state in RUNNING), (rid, seq.state)
            assert (rid in q.waiting) == (seq.state is RequestState.WAITING_ADMISSION), rid
            ended = bool(self.inboxes[rid].msgs) and isinstance(self.inboxes[rid].msgs[-1], End)
            assert seq.ended == ended and seq.ended == (seq.state in TERMINAL), (rid, seq.state)
            if seq.state in (RequestState.DECODE_READY,):
                # decode-ready, or parked (engine/parking.py, engine/timeslice.py)
                assert q.decode_ready.get(rid) is seq or q.parked.get(rid) is seq, rid

    @invariant()
    def unknown_lanes_are_not_reused(self) -> None:
        if not hasattr(self, "core"):
            return
        kv = self.gen.kv
        for lane in range(LANES):
            info = kv.info(lane)
            if info.state is KvSequenceState.UNKNOWN:
                self.unknown.add(lane)
            elif lane in self.unknown and info.state in (KvSequenceState.RESERVED,
                                                         KvSequenceState.ACTIVE,
                                                         KvSequenceState.UPDATING):
                raise AssertionError(f"lane {lane} reused while Unknown (before a reset)")
        kv.check_invariants()

    @invariant()
    def greedy_outputs_equal_solo(self) -> None:
        if not hasattr(self, "core"):
            return
        for rid, box in self.inboxes.items():
            msgs = box.msgs
            if msgs and isinstance(msgs[-1], End) and msgs[-1].reason is FinishReason.LENGTH:
                seq = self.seqs[rid]
                toks = [m.token_id for m in msgs if isinstance(m, Tokens)]
                if len(toks) == seq.max_new:
                    assert toks == fake_greedy(list(seq.prompt), len(toks), VOCAB), rid

    @invariant()
    def nothing_leaks_at_rest(self) -> None:
        if not hasattr(self, "core"):
            return
        live = [r for r, b in self.inboxes.items() if not (b.msgs and isinstance(b.msgs[-1], End))]
        if live or self.core.inflight_jobs() or self.faults:
            return
        k = self.gen.kv.statistics()
        assert k.free == k.num_lanes, k
        assert not self.cb.seqs, self.cb.seqs
        assert not self.gen.lane_seq
        q = self.core.requests.queues(self.gen)
        assert not q.holders and not q.waiting and not q.decode_ready and not q.releases

    def teardown(self) -> None:
        """Drain: cancel everything, let the device answer every job, recover a pending fault;
        every accepted request must then have ended exactly once, and nothing may leak."""
        if not hasattr(self, "core"):
            return
        for rid in sorted(self.seqs):
            self.apply(self.core.abort(self.seqs[rid], FinishReason.CANCELLED, self.now))
        for _ in range(10_000):
            if self.faults:
                self.recover()
                continue
            busy = [e for e, j in self.core.slots.items() if j is not None]
            if not busy:
                break
            self.complete(busy[0], "ok")
        self.now += 1.0
        self.apply(self.core.tick(self.now))
        for rid, box in self.inboxes.items():
            assert sum(isinstance(m, End) for m in box.msgs) == 1, (rid, box.msgs)
        self.messages_in_order_and_one_end()
        self.nothing_leaks_at_rest()
        counts = collections.Counter(type(m).__name__ for b in self.inboxes.values() for m in b.msgs)
        assert counts["End"] == len(self.inboxes)


CoreMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=80, deadline=None)
test_engine_core_state_machine = CoreMachine.TestCase


def test_a_move_the_lifecycle_table_does_not_allow_raises() -> None:
    """One table, one writer: the request table moves ``Seq.state`` only through
    ``core.request_state.fire``, so an out-of-order move raises where it happens."""
    from calserve.core.fsm import IllegalTransition
    from calserve.core.request_state import RequestEvent
    from calserve.engine.requests import RequestTable, terminal_state

    m = CoreMachine()
    m.setup(two_engines=False, fcfs=False)
    table = RequestTable()
    seq = Seq(rid=1, req=GenerateRequest((1, 2)), gen=m.gen, arrival=0.0, deadline=None, seed=1,
              prompt=np.asarray([1, 2], np.int32), qclass=classify(2, m.cfg.scheduler.queues),
              inbox=Recorder())
    try:
        table.set_ready(seq, 0.0, RequestEvent.DECODE_DONE)  # never submitted: illegal
    except IllegalTransition as e:
        assert "DECODE_DONE is illegal in state NEW" in str(e)
    else:
        raise AssertionError("an illegal move was accepted")
    table.enqueue(seq)
    assert seq.queued and seq.state is RequestState.WAITING_ADMISSION
    # how each ending lands: a deadline before admission fails it, a cancel cancels it
    assert terminal_state(RequestState.WAITING_ADMISSION, FinishReason.DEADLINE, None) is RequestState.FAILED
    assert terminal_state(RequestState.DECODE_READY, FinishReason.DEADLINE, None) is RequestState.COMPLETED
    assert terminal_state(RequestState.DECODE_RUNNING, FinishReason.CANCELLED, None) is RequestState.CANCELLED
    assert terminal_state(RequestState.PREFILL_READY, None, ErrorEvent("x", "device_error")) is RequestState.FAILED
    try:
        terminal_state(RequestState.COMPLETED, FinishReason.STOP, None)  # ended twice
    except IllegalTransition:
        pass
    else:
        raise AssertionError("a second ending was accepted")


def test_a_request_ending_in_a_completion_asks_for_no_second_pass() -> None:
    """The completion's pass frees the ended request's lane and admits into it; the scheduler task
    is not woken for a second pass that would find nothing (cold code before the client's last
    token on an idle server), and nothing is left undone."""
    m = CoreMachine()
    m.setup(two_engines=False, fcfs=False)
    m.submit([1, 2, 3], 2, "a", None)
    m.submit([4, 5], 2, "b", None)
    core = m.core
    wakes = []
    while any(j is not None for j in core.slots.values()):
        out = m.complete(next(e for e, j in core.slots.items() if j is not None), "ok")
        if out is not None:
            wakes.append(out.wake)
    assert all(isinstance(b.msgs[-1], End) for b in m.inboxes.values())
    assert wakes and not any(wakes)
    m.nothing_leaks_at_rest()
