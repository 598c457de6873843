"""Planner: the engine core's dispatch decisions (spec §6-§9), on the core's shared state.

Which job each free job engine runs next: the service round robin (decode:short:medium:long)
over the classes that have work, the decode profile of the pass (spec §8), the holds that keep a
partial decode batch back (PING/PONG merge, prefill first on a device whose engines share its
time), and the continuation shortcut (the same sequences again when they are all the work there
is). Owned by :class:`~calserve.engine.core.EngineCore`; no trio, no clock (``now`` is passed).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import TYPE_CHECKING

from calserve.config import CalserveConfig
from calserve.core.decode import batching_window, select_profile
from calserve.core.model_share import ModelShare, may_take_engine
from calserve.core.model_state import serves_jobs
from calserve.core.prefill import QueueClass, ServiceRoundRobin, fair_prefill_index
from calserve.engine.batch_fast import earliest_deadline, single_tenant_lanes
from calserve.engine.batches import JobBuilder
from calserve.engine.core_stats import CoreState, CoreStats
from calserve.engine.requests import PREFILL_CLASSES, GenQueues, RequestTable
from calserve.engine.state import CoreOutput, DeviceJob, Seq
from calserve.engine.types import FinishReason
from calserve.runtime.types import JobEngine

if TYPE_CHECKING:
    from calserve.engine.generations import Generation, ModelManager

__all__ = ["Planner", "STARVATION_PASSES", "fair_prefill_pick", "job_device_s"]

# A starvation event: a decode-ready sequence passed over (lanes full or its tenant at the lane cap)
# by this many consecutive decode batches of its generation. Counted once per streak.
STARVATION_PASSES = 32

log = logging.getLogger("calserve.engine.planner")

_DECODE_ONLY = frozenset((QueueClass.DECODE,))
_RID = attrgetter("rid")
_TENANT = attrgetter("req.tenant")


def fair_prefill_pick(dq: collections.deque[Seq], vt_of: Callable[[str], float]) -> int:
    """The index in a prefill queue (its head live) of the prompt the fair policy runs next: the
    first live one of the tenant with the least delivered service (``vt_of``, the decode lanes'
    VTC counter), :func:`~calserve.core.prefill.fair_prefill_index` over the live prompts. With
    one tenant queued, the common case, that is the head: found with one C-level pass over the
    tenants instead of a state test per queued prompt (~0.5 µs each; 64 queued prompts were ~2 %
    of a short request's server CPU)."""
    if len(set(map(_TENANT, dq))) == 1:
        return 0
    live = [i for i, s in enumerate(dq) if not s.ended and s.inflight is None]
    names = [dq[i].tenant for i in live]
    return live[fair_prefill_index(names, {t: vt_of(t) for t in set(names)})]


def _live_head(dq: collections.deque[Seq]) -> bool:
    """Whether a prefill queue holds a prompt to run, after dropping the ended or already
    dispatched ones in front of it (the head is then the one to run)."""
    while dq and (dq[0].ended or dq[0].inflight is not None):
        dq.popleft()
    return bool(dq)


def job_device_s(gen: Generation, job: DeviceJob) -> float:
    """The modelled device time of ``job`` (the package's timing; without timing figures a
    token-count proxy), what the cross-model share charges."""
    B = len(job.lanes)
    t = gen.source.timing.get(B) or gen.source.timing.get(gen.compiled_batch)
    if job.kind == "prefill":
        n = len(job.tokens)
        if t is not None and (t.prefill_base_us or t.prefill_us_per_token):
            return (t.prefill_base_us + t.prefill_us_per_token * n) * 1e-6
        return 1e-4 + 1e-5 * n
    if t is not None and t.decode_step_us:
        return t.decode_step_us.get(B, max(t.decode_step_us.values())) * 1e-6
    return 1e-4


class Planner:
    def __init__(self, cfg: CalserveConfig, models: ModelManager, requests: RequestTable,
                 builder: JobBuilder, st: CoreState, stats: CoreStats) -> None:
        self.cfg = cfg
        self.models = models
        self.requests = requests
        self.builder = builder
        self.st = st
        self.stats = stats
        self.rr = ServiceRoundRobin.from_config(cfg.scheduler.queues)
        # the device's share between co-resident generations (core/model_share.py)
        self.share = ModelShare()

    def _free_engine(self) -> JobEngine | None:
        """A job engine with no job, unless ``admission.max_inflight_jobs`` jobs are on the device
        already (the capacity plan's in-flight budget; unset = one per enabled engine). Degraded
        (spec §14): new jobs only to ``st.only``, the other engine drains."""
        only = self.st.only
        if only is not None:
            return only if self.st.slots.get(only) is None else None
        free = None
        busy = 0
        for e, job in self.st.slots.items():
            if job is None:
                if free is None:
                    free = e
            else:
                busy += 1
        limit = self.cfg.scheduler.admission.max_inflight_jobs
        if limit is not None and busy >= limit:
            return None
        return free

    def degrade(self, only: JobEngine | None, batch_one: bool, admit_after: float) -> CoreOutput:
        """Degradation (spec §14, the reset budget): new jobs only to ``only`` (None: any engine),
        the smallest decode profile when ``batch_one``, no admission before ``admit_after`` (the
        core's pass). Jobs already on either engine drain. The output asks for a pass (an engine
        may be usable now); none runs inside this call (it may come from an executor between a
        completion and its bookkeeping)."""
        st = self.st
        st.only, st.batch_one, st.admit_after = only, batch_one, admit_after
        return CoreOutput(wake=True)

    def hand_over(self, engine: JobEngine, job: DeviceJob) -> None:
        self.st.slots[engine] = job
        job.epoch = self.st.epoch
        self.st.out.jobs.append((engine, job))

    def dispatch(self, now: float) -> None:
        window_us = self.cfg.scheduler.batch.batching_window_us
        out = self.st.out
        while True:
            engine = self._free_engine()
            if engine is None:
                return
            progressed = False
            gens = [g for g in self.models.generations.values() if serves_jobs(g.state)]
            multi = len(gens) > 1
            if multi:  # several generations: weighted fair order of device time + engine cap
                gens = [g for gid in self.share.order(g.id for g in gens) for g in gens if g.id == gid]
            for gen in gens:
                q = self.requests.queues(gen)
                if multi and not may_take_engine(self._held(gen), len(self.st.slots),
                                                 self._others_have_work(gen, gens)):
                    continue
                available = {c for c in PREFILL_CLASSES if _live_head(q.prefill[c])}
                B = gen.compiled_batch
                earliest = None  # the ready set's earliest deadline (the batch pick's too)
                if q.decode_ready:
                    first = next(iter(q.decode_ready.values()))
                    if self.st.batch_one:  # reset budget spent: the smallest profile
                        B = min(gen.calbins)
                    elif gen.selecting:  # spec §8: the profile of this pass, by ready count
                        B = select_profile(len(q.decode_ready), now - first.ready_since, gen.calbins,
                                           self.cfg.scheduler.batch.selection)
                    earliest = earliest_deadline(q.decode_ready.values())
                    fire, wake_at = batching_window(
                        now, len(q.decode_ready), B, first.ready_since, earliest, window_us,
                    )
                    ready = len(q.decode_ready)
                    if fire and (self._hold_partial_decode(gen, ready, now, earliest)
                                 or self._prefill_first(gen, q, ready, B, available, now, earliest)):
                        fire, wake_at = False, None  # the decode or prefill job's completion wakes us
                    if fire:
                        available.add(QueueClass.DECODE)
                    elif wake_at is not None:
                        out.timer = min(out.timer, wake_at)
                cls = self.rr.next(available)
                if cls is None:
                    continue
                job = (self._decode_job(gen, q, now, B, earliest) if cls is QueueClass.DECODE
                       else self._prefill_job(gen, q, cls, now))
                if job is None:
                    continue
                self.hand_over(engine, job)
                if multi:
                    self.share.charge(gen.id, gen.weight, job_device_s(gen, job))
                progressed = True
                break
            if not progressed:
                return

    def stop_runs(self) -> None:
        """Ask a host-driven multi-step decode in flight to end with its step in flight
        (``CoreOutput.stops``) when a prompt waits for its prefill and no engine is free or being
        freed. A multi-step job keeps its engine for all its steps: without this, a prompt that
        arrives meanwhile waits for them (time to first token: up to N steps more). The device's
        own multi-step jobs cannot be cut short; a run driven by the host can, at a step's end
        (``BackendCalbin.stop_steps``): the same tokens either way (greedy), the run shorter. One
        engine is enough for the prompts: the run that began first (the nearest its end) is
        stopped. Called after each pass's dispatch (an engine that was free took the work
        already). A sequence that became ready meanwhile is not a reason: stopping for those cost
        more than half of what the runs save (bench/README, session 51), and its first token came
        from its prefill already."""
        first: tuple[JobEngine, DeviceJob] | None = None
        for engine, job in self.st.slots.items():
            if job is None:
                continue
            if job.stop_asked:
                return  # an engine is being freed already
            if job.host_driven and (first is None or job.created_at < first[1].created_at):
                first = (engine, job)
        if first is None or self._free_engine() is not None:
            return
        if any(self.requests.queues(g).prefill_waiting() for g in self.models.generations.values()
               if serves_jobs(g.state)):
            self._stop(*first)

    def stop_for(self, seq: Seq) -> None:
        """``seq`` ends early (cancel, stop string, deadline, shutdown) while in ``job``, a run
        the host drives: end the run with its step in flight (its ending, its lane and its
        admission slot come a step later instead of at the run's last)."""
        job = seq.inflight
        if job is None or job.stop_asked or not job.host_driven:
            return
        for engine, j in self.st.slots.items():
            if j is job:
                self._stop(engine, job)

    def _stop(self, engine: JobEngine, job: DeviceJob) -> None:
        job.stop_asked = True
        self.stats.runs_stopped_total += 1
        self.st.out.stops.append((engine, job))

    def _held(self, gen: Generation) -> int:
        return sum(1 for j in self.st.slots.values() if j is not None and j.gen is gen)

    def _others_have_work(self, gen: Generation, gens: list[Generation]) -> bool:
        for g in gens:
            if g is gen:
                continue
            q = self.requests.queues(g)
            if q.decode_ready or q.waiting or q.prefill_waiting():
                return True
        return False

    def _on_device(self, gen: Generation, kind: str) -> int:
        """Sequences of ``gen`` in the ``kind`` jobs the engines hold now (a prefill has one)."""
        n = 0
        for job in self.st.slots.values():
            if job is not None and job.kind == kind and job.gen is gen:
                n += len(job.seqs)
        return n

    def _may_hold(self, now: float, earliest: float | None) -> bool:
        """A decode batch may be held back unless its earliest deadline is within the urgency."""
        urgency = self.cfg.scheduler.fairness.deadline_urgency_ms * 1e-3
        return earliest is None or earliest - now > urgency

    def _hold_partial_decode(self, gen: Generation, ready: int, now: float, earliest: float | None,
                             on_device: int | None = None) -> bool:
        """Whether to keep a partial decode batch back while the other engine runs a decode job of
        the same generation whose sequences would fit in this batch too.

        With PING/PONG, sending ``ready`` < B sequences to the free engine splits the running set in
        two half-full jobs that then alternate for good; on a device that serialises its engines
        every sequence gets a token every two steps (measured: fill 0.5, TPOT 2x the step, bench
        saturation at c=16). Holding for at most one step lets the halves merge. Never held when the
        largest profile could not take both, or when a deadline is at risk."""
        if len(self.st.slots) < 2 or self.st.only is not None:
            return False
        if on_device is None:  # (the rotation passes the count without the job just finished)
            on_device = self._on_device(gen, "decode")
        if not on_device or ready + on_device > max(gen.calbins):
            return False
        return self._may_hold(now, earliest)

    def _prefill_first(self, gen: Generation, q: GenQueues, ready: int, B: int,
                       prefills: set[QueueClass], now: float, earliest: float | None) -> bool:
        """Whether to keep a partial decode batch back for the prefills that will fill it.

        When the device serialises its two engines (:attr:`Generation.engines_serialise`), a decode
        job and a prefill cost the same device time in either order, so running the prefill first
        loses the running sequences nothing and the decode batch that follows carries the new
        sequence too — one lane more per prefill. Only for prefills whose sequences fit in this
        batch, never when a deadline is at risk, never while nothing is prefilling or queued."""
        if ready >= B or not gen.engines_serialise:
            return False
        coming = self._on_device(gen, "prefill") + sum(len(q.prefill[c]) for c in prefills)
        if not coming or ready + coming > B:
            return False
        return self._may_hold(now, earliest)

    def _next_prefill(self, gen: Generation, dq: collections.deque[Seq]) -> Seq:
        """The prompt of a prefill class to run next (its head is live): a re-admitted one keeps
        its place in front; otherwise, under the fair policy, the least-served tenant's first
        (:func:`~calserve.core.prefill.fair_prefill_index`)."""
        if len(dq) == 1 or dq[0].retries or self.cfg.scheduler.fairness.policy == "fcfs":
            return dq.popleft()
        pick = fair_prefill_pick(dq, gen.admission.lane_virtual_time)
        seq = dq[pick]
        del dq[pick]
        return seq

    def _prefill_job(self, gen: Generation, q: GenQueues, cls: QueueClass, now: float) -> DeviceJob:
        seq = self._next_prefill(gen, q.prefill[cls])
        job = self.builder.prefill_job(gen, seq, now)
        self.requests.submitted(seq, job)
        self.requests.trace.append(("prefill", (seq.rid,)))
        return job

    def _decode_job(self, gen: Generation, q: GenQueues, now: float, B: int, earliest: float | None
                    ) -> DeviceJob | None:
        job, skipped = self.builder.decode_batch(gen, q.decode_ready, now, B, earliest)
        if isinstance(skipped, str):  # every sequence left ready was passed over (lanes full)
            self._passed_over(q.decode_ready.values())
            skipped = []
        get = q.decode_ready.get
        for rid, why in skipped:
            seq = get(rid)
            if seq is None:
                continue
            if why == "batch_full" or why == "tenant_share":
                n = seq.passed_over = seq.passed_over + 1
                if n == STARVATION_PASSES:
                    self._starving(rid)
            elif why == "deadline":
                self.requests.stop(seq, FinishReason.DEADLINE, now=now)
            elif why == "length":
                self.requests.stop(seq, FinishReason.LENGTH, now=now)
        if job is None:
            return None
        self.requests.submitted_all(job)
        self.requests.trace.append(("decode", tuple([s.rid for s in job.seqs])))
        return job

    def _passed_over(self, seqs: Iterable[Seq]) -> None:
        """``seqs`` were decode-ready and left out of a batch (lanes full): their starvation count."""
        for passed in seqs:
            n = passed.passed_over = passed.passed_over + 1
            if n == STARVATION_PASSES:
                self._starving(passed.rid)

    # ------------------------------------------------------------------------------ rotation
    def rotation_pick(self, done: DeviceJob, engine: JobEngine, now: float
                      ) -> tuple[int, list[Seq], str, list[QueueClass]] | None:
        """The decode batch a full pass would hand ``engine`` right after ``done``'s completion,
        decided *before* that completion's bookkeeping (``EngineCore.fast_decode``), as ``(B, the
        sequences in lane order, the skip reason of the rest, the classes the round robin weighs:
        none when only decode has work)``; None unless that is certain.
        Changes no state but what the pass would change first at this instant: the prefill
        queues' dead heads are dropped. The caller checked that every sequence of ``done`` continues and that no
        waiting, parked or releasing request, pending park or due deadline needs the pass.

        The rotation of a running set larger than the batch (64 streams over B16 lanes, or the
        default profile's streams over B1): ``done``'s sequences rejoin the ready set as its newest
        (``ready_since`` = ``now``), so when the ready set alone holds a full batch served before
        them, the pass's pick is the batch of that set. What the pass would weigh is weighed with
        them counted as ready and ``done`` off the device: the profile selection, the batching
        window, the PING/PONG partial-batch hold, the service round robin when prefills are queued
        (its turn must be decode's); the one-tenant pick's conditions hold for them too (no ending
        pending, their next position below the profile's length, no deadline inside the urgency
        horizon, the one tenant). (The prefill-first hold never applies: the ready count is at
        least the batch.) Any other case — another engine free (the pass fills it first) or
        running another generation's job, several generations, a degraded state, the FCFS policy
        or the general builder — is left to the pass."""
        st = self.st
        gen = done.gen
        if done.kind != "decode" or st.batch_one or st.only is not None:
            return None
        if not serves_jobs(gen.state) or len(self.models.generations) != 1:
            return None
        on_device = 0  # the other engines' decode sequences (all busy with this generation's jobs)
        for e, job in st.slots.items():
            if e is engine:
                continue
            if job is None or job.gen is not gen:
                return None
            if job.kind == "decode":
                on_device += len(job.seqs)
        limit = self.cfg.scheduler.admission.max_inflight_jobs
        if limit is not None and len(st.slots) - 1 >= limit:
            return None
        q = self.requests.queues(gen)
        # the prefill classes the pass would find work in (dropping dead heads, as it does now)
        classes = [c for c in PREFILL_CLASSES if _live_head(q.prefill[c])]
        ready = q.decode_ready
        if not ready:
            return None
        seqs = done.seqs
        n = len(ready) + len(seqs)  # the ready count the pass would see
        first = next(iter(ready.values()))
        B = gen.compiled_batch
        if gen.selecting:
            B = select_profile(n, now - first.ready_since, gen.calbins, self.cfg.scheduler.batch.selection)
        if len(ready) < B:
            return None
        fcfg = self.cfg.scheduler.fairness
        if not self.builder.fast or fcfg.policy == "fcfs":
            return None
        ready_earliest = earliest = earliest_deadline(ready.values())
        theirs = earliest_deadline(seqs)
        if theirs is not None and (earliest is None or theirs < earliest):
            earliest = theirs
        fire, _ = batching_window(now, n, B, first.ready_since, earliest,
                                  self.cfg.scheduler.batch.batching_window_us)
        if not fire:
            return None
        if self._hold_partial_decode(gen, n, now, earliest, on_device):
            return None  # the pass would hold the batch back
        profile = self.builder.profile(gen, B)
        urgency = fcfg.deadline_urgency_ms * 1e-3
        if theirs is not None and theirs <= now + urgency:
            return None
        tenant = first.req.tenant
        for s in seqs:
            if (s.pending_reason is not None or s.pending_error is not None
                    or s.position + 1 >= profile.max_seq or s.req.tenant != tenant):
                return None
        picked = single_tenant_lanes(ready, now, B, profile.max_seq, urgency,
                                     fcfg.tenant_max_lane_share, ready_earliest)
        if picked is None:
            return None
        chosen, why = picked
        last = chosen[-1]
        # ``done``'s sequences rejoin the ready set at ``now``: the earliest of them in the pass's
        # order is (now, their least request id)
        if len(chosen) < B or (last.ready_since, last.rid) >= (now, min(map(_RID, seqs))):
            return None  # the pass would pick one of ``done``'s sequences too
        if classes:  # the round robin's turn: a prefill's, and the pass runs it
            classes.append(QueueClass.DECODE)
            if self.rr.peek(classes) is not QueueClass.DECODE:
                return None
        return B, chosen, why, classes

    def commit_rotation(self, done: DeviceJob, now: float, B: int, chosen: list[Seq], why: str,
                        classes: list[QueueClass]) -> DeviceJob:
        """What the pass does with :meth:`rotation_pick`'s batch: the round robin's turn among
        ``classes`` (those with work; none: decode alone), the job (the chosen sequences leave the
        ready set, their KV transactions open), the passed-over count of the sequences left ready,
        the submit moves. ``done``'s sequences get theirs in :meth:`after_rotation`, once its
        bookkeeping made them ready."""
        gen = done.gen
        q = self.requests.queues(gen)
        self.rr.next(classes or _DECODE_ONLY)
        job, _ = self.builder.picked_batch(gen, q.decode_ready, now, B, self.builder.profile(gen, B),
                                           chosen, why)
        assert job is not None
        self._passed_over(q.decode_ready.values())
        self.requests.submitted_all(job)
        self.requests.trace.append(("decode", tuple([s.rid for s in job.seqs])))
        return job

    def after_rotation(self, done: DeviceJob) -> None:
        """``done``'s sequences, decode-ready now, were passed over by the rotation's batch."""
        self._passed_over(done.seqs)

    def _starving(self, rid: int) -> None:
        """A starvation event: request ``rid`` was passed over by STARVATION_PASSES batches."""
        self.stats.starvation_events_total += 1
        log.info("request %d passed over by %d decode batches", rid, STARVATION_PASSES,
                 extra={"request_id": rid})

    def can_continue(self, done: DeviceJob, engine: JobEngine | None, ready_now: int, now: float) -> bool:
        """Whether a full pass after ``done`` could only run its sequences next, as one decode batch
        (after a prefill: its one sequence's first decode step), given ``ready_now`` decode-ready
        sequences at this point (all of ``done``'s once its completion was dispatched, none
        before): nothing waits for admission or prefill, no other job is in flight, one generation.
        A full pass could then only pick the same sequences on the same profile (they all fit, so
        fairness has nothing to arbitrate). Same decisions either way (tested)."""
        gen = done.gen
        st = self.st
        if st.paused or not serves_jobs(gen.state) or len(self.models.generations) != 1:
            return False
        if st.batch_one or (st.only is not None and engine is not None and engine is not st.only):
            return False  # degraded: a full pass picks the engine and the profile
        n = len(done.seqs)
        q = self.requests.queues(gen)
        if len(q.decode_ready) != ready_now or len(q.holders) != n:
            return False
        if q.waiting and gen.kv.free_lanes():
            return False  # a waiting request might be admitted (no free lane: the pass admits none)
        B = self.builder.next_profile(done)
        if B is None:
            return False
        if n < B and self.cfg.scheduler.batch.batching_window_us > 0:
            return False  # a partial batch may be held for the window: the full pass decides
        for e, job in self.st.slots.items():
            if job is not None and e is not engine:
                return False
        if q.prefill_waiting():
            return False
        if q.deadlines and q.deadlines[0][0] <= now:
            return False  # let expire() end it
        for s in done.seqs:
            if s.pending_reason is not None or s.pending_error is not None:
                return False
        return True

    def continue_decode(self, done: DeviceJob, now: float) -> DeviceJob | None:
        """After ``done``'s completion: the next decode job for its sequences when they are all the
        work there is (see :meth:`_can_continue`), built from the previous one; else None."""
        if done.kind != "decode" or not self.can_continue(done, None, len(done.seqs), now):
            return None
        ready = self.requests.queues(done.gen).decode_ready
        for s in done.seqs:
            if ready.get(s.rid) is not s:
                return None
        job = self.builder.continuation(done, [s.last_token for s in done.seqs],
                                        [s.position for s in done.seqs], now)
        self.commit_continuation(job)
        return job

    def commit_continuation(self, job: DeviceJob) -> None:
        """What a full pass records when it runs ``job``: its sequences leave the ready set at their
        new positions. Invariant: every sequence is ACTIVE in the KV table at position ==
        committed_len."""
        gen = job.gen
        ready = self.requests.queues(gen).decode_ready
        self.rr.next(_DECODE_ONLY)
        seqs = job.seqs
        for s in seqs:
            del ready[s.rid]
        gen.kv.begin_decode([s.lease.lane for s in seqs], [s.position for s in seqs],
                            job.steps if job.seq_steps is None else job.seq_steps)
        self.requests.submitted_all(job)
        self.builder.continuations_total += 1
        self.builder.record_decode(job)
        self.requests.trace.append(("decode", tuple([s.rid for s in seqs])))

