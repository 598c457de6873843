"""The per-batch shortcuts of the per-token path (issue 18) decide what the general code decides.

- :func:`calserve.engine.batch_fast.single_tenant_lanes` (the one-tenant decode batch picked
  straight from the ready sequences) against :func:`calserve.core.decode.build_decode_batch` over
  the candidates the job builder makes of the same ready set: same lanes in the same order, same
  skip reasons, and None whenever the ready set is not the plain case;
- the whole core with both shortcuts (that pick and the step handler's per-batch decode
  bookkeeping, ``StepHandler._ok_decode``) against the same core with both off, driven through the
  same random history (requests with EOS, stop tokens, ``min_tokens``, deadlines, one or several
  tenants; completions on either engine, device faults, cancels, time): every request gets the
  same messages in the same order (tokens, hidden flags, the finish reason: the finish and stop
  decisions per batch equal the per-lane ones), the device gets the same jobs with the same lanes.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.core.admission import Outcome, WorkItem
from calserve.core.decode import BatchProfile, DecodeCandidate, LaneOrder, build_decode_batch
from calserve.core.prefill import classify
from calserve.engine.batch_fast import earliest_deadline, single_tenant_lanes
from calserve.engine.state import Seq
from calserve.engine.types import FinishReason, GenerateRequest, SamplingParams
from calserve.runtime.types import JobEngine

from .test_core_machine import VOCAB, CoreMachine, Recorder

_seq = st.fixed_dictionaries({
    "ready_since": st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0]),  # ties are common: rid decides
    "position": st.integers(0, 70),
    "deadline": st.one_of(st.none(), st.sampled_from([3.0, 4.5, 10.0, 100.0])),
    "pending": st.sampled_from([None] * 9 + [FinishReason.CANCELLED]),
    "tenant": st.sampled_from(["a"] * 6 + ["b"]),
})


@settings(max_examples=400, deadline=None)
@given(specs=st.lists(_seq, min_size=0, max_size=24), b=st.sampled_from([1, 4, 8, 16]),
       share=st.sampled_from([1.0, 0.5, 0.25]), now=st.sampled_from([0.0, 2.0, 5.0]),
       urgency=st.sampled_from([0.0, 2.0]), rids=st.randoms(use_true_random=False))
def test_single_tenant_pick_equals_the_fair_builder(specs: list[dict[str, Any]], b: int,
                                                     share: float, now: float, urgency: float,
                                                     rids: Any) -> None:
    max_seq = 64
    ids = rids.sample(range(1, 1000), len(specs))
    ready = {rid: types.SimpleNamespace(rid=rid, req=types.SimpleNamespace(tenant=sp["tenant"]),
                                        position=sp["position"], deadline=sp["deadline"],
                                        ready_since=sp["ready_since"],
                                        pending_reason=sp["pending"])
             for rid, sp in zip(ids, specs, strict=True)}
    # the candidates JobBuilder.decode_batch makes of the same ready set (generation 1)
    cands = [DecodeCandidate(s.rid, s.rid + 5000, s.req.tenant, 1, 7, s.position, s.deadline,
                             s.ready_since, s.pending_reason is not None, None, 0.0)
             for s in ready.values()]
    order = LaneOrder(urgency_s=urgency, tenant_vt={"a": 3.0, "b": 1.0})
    full = build_decode_batch(BatchProfile(b, max_seq), cands, now, 1, share, order)
    fast = single_tenant_lanes(ready, now, b, max_seq, urgency, share, earliest_deadline(ready.values()))
    plain = (bool(ready) and len({s.req.tenant for s in ready.values()}) == 1
             and all(s.pending_reason is None and s.position < max_seq
                     and (s.deadline is None or s.deadline > now + urgency) for s in ready.values()))
    assert (fast is not None) == plain
    if fast is None:
        return
    chosen, why = fast
    assert [s.rid for s in chosen] == [c.request_id for c in full.lanes if c is not None]
    skipped = {s.rid: why for s in ready.values() if s not in chosen}
    assert skipped == dict(full.skipped)


class _Twin:
    """One core of the comparison: :class:`CoreMachine`'s world (pure-Python device, recorded
    inboxes), with the shortcuts on or off."""

    def __init__(self, fast: bool, two_engines: bool) -> None:
        m = CoreMachine()
        m.setup(two_engines=two_engines, fcfs=False)
        m.core.builder.fast = fast
        m.core.steps.fast = fast
        self.m = m
        # every job handed to an engine, as the device sees it (the arrays and the echo expected)
        self.jobs: list[tuple[Any, ...]] = []
        hand_over = m.core.planner.hand_over

        def recording(engine: JobEngine, job: Any) -> None:
            if job.kind == "decode":
                self.jobs.append((engine, job.tokens.tolist(), job.positions.tolist(),
                                  job.valid.tolist(), job.seq_ids.tolist(), list(job.expect),
                                  list(job.active), [s.rid for s in job.seqs]))
            hand_over(engine, job)

        m.core.planner.hand_over = recording  # type: ignore[method-assign]

    def submit(self, prompt: list[int], sp: SamplingParams, tenant: str, deadline: float) -> None:
        m = self.m
        rid = next(m.rids)
        req = GenerateRequest(tuple(prompt), sp, tenant=tenant)
        dl = m.now + deadline
        item = WorkItem(rid, tenant, len(prompt), sp.max_tokens, m.now, dl, 1)
        if m.gen.admission.offer(item, m.now, True).outcome is not Outcome.QUEUE:
            return
        inbox = Recorder()
        seq = Seq(rid=rid, req=req, gen=m.gen, arrival=m.now, deadline=dl, seed=rid,
                  prompt=np.asarray(prompt, np.int32),
                  qclass=classify(len(prompt), m.cfg.scheduler.queues), inbox=inbox)
        m.seqs[rid] = seq
        m.inboxes[rid] = inbox
        m.apply(m.core.add(seq, m.now))

    def act(self, op: tuple[Any, ...]) -> None:
        m = self.m
        kind = op[0]
        if kind == "submit":
            self.submit(*op[1:])
        elif kind == "answer":
            busy = [e for e, j in m.core.slots.items() if j is not None]
            if busy:
                m.complete(busy[op[1] % len(busy)], op[2])
        elif kind == "cancel":
            if m.seqs:
                rid = sorted(m.seqs)[op[1] % len(m.seqs)]
                m.apply(m.core.abort(m.seqs[rid], FinishReason.CANCELLED, m.now))
        elif kind == "time":
            m.now += op[1]
            m.apply(m.core.tick(m.now))
        if m.faults:
            m.recover()

    def record(self) -> tuple[Any, ...]:
        m = self.m
        msgs = {rid: [(type(x).__name__, getattr(x, "token_id", None), getattr(x, "hidden", None),
                       getattr(x, "first", None), getattr(x, "reason", None)) for x in b.msgs]
                for rid, b in m.inboxes.items()}
        return (msgs, list(m.core.requests.trace), self.jobs,
                {rid: s.passed_over for rid, s in m.seqs.items()},
                m.core.stats.starvation_events_total)


_sampling = st.builds(
    lambda mx, mn, stop, ign: SamplingParams(temperature=0.0, max_tokens=mx, min_tokens=min(mn, mx),
                                             stop_token_ids=stop, ignore_eos=ign),
    st.integers(1, 10), st.integers(0, 3),
    st.lists(st.integers(0, VOCAB - 1), max_size=24).map(tuple), st.booleans())
_op = st.one_of(
    st.tuples(st.just("submit"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
              _sampling, st.sampled_from(["a"] * 4 + ["b"]),
              st.sampled_from([600.0, 600.0, 0.03, 3.0])),
    st.tuples(st.just("answer"), st.integers(0, 1),
              st.sampled_from(["ok"] * 14 + ["crosstalk", "busy"])),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("time"), st.sampled_from([0.001, 0.01, 0.05])),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_op, max_size=60), two_engines=st.booleans())
def test_core_with_batch_shortcuts_equals_core_without(ops: list[tuple[Any, ...]],
                                                       two_engines: bool) -> None:
    twins = [_Twin(True, two_engines), _Twin(False, two_engines)]
    for op in ops:
        for t in twins:
            t.act(op)
    for t in twins:  # drain: every job answered
        for _ in range(1000):
            busy = [e for e, j in t.m.core.slots.items() if j is not None]
            if not busy:
                break
            t.m.complete(busy[0], "ok")
            if t.m.faults:
                t.m.recover()
    fast, slow = (t.record() for t in twins)
    assert fast == slow
    assert JobEngine.PING in twins[0].m.core.slots
