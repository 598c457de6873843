"""The scheduler task: one tick = expire, release, admit, then hand work to free executors.

Each tick (spec §6-§9, batching note "调度循环"):

1. expire deadlines (waiting requests via admission, admitted ones via a lazy deadline heap);
2. free the runtime sequences of requests that ended (one device round trip per generation), and
   only then return their lanes (spec §9.2: a lane is reused after the runtime confirmed release);
3. admission: ``pop_admissible`` with the free lanes/KV tokens, reserve a lane per admitted request;
4. while an executor is free: the service round robin (decode:short:medium:long) picks a class;
   decode builds a batch for the tick's profile (spec §8: ``select_profile`` over the generation's
   shared-KV group members by ready count, else its one serving profile; fair lane order), prefill
   takes the oldest request of the class (on the group's KV owner).

Continuous batching falls out of this: a sequence that finishes frees its lane in the dispatcher,
the next tick admits a waiting request into it, and the next decode batch includes it.

It never busy-waits: when nothing can move it sleeps on an event (set by submit, cancel, job
completion, recovery) with a timer at the next deadline or batching-window expiry.

Invariant: every method here runs in the engine's one trio thread and mutates state synchronously
(no await between reading and writing a request's scheduling fields), so the scheduler, dispatcher,
recovery and cancel never interleave inside a decision.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from calserve.config import CalserveConfig
from calserve.core.decode import (
    BatchProfile,
    DecodeCandidate,
    LaneOrder,
    batching_window,
    build_decode_batch,
    select_profile,
)
from calserve.core.kv_state import KvSequenceState
from calserve.core.model_state import ModelState
from calserve.core.prefill import QueueClass, ServiceRoundRobin
from calserve.engine.jobs import DeviceJob
from calserve.engine.state import Admitted, End, Seq
from calserve.engine.types import ErrorEvent, FinishReason

if TYPE_CHECKING:
    from calserve.engine.executor import DeviceExecutor
    from calserve.engine.generations import Generation, ModelManager

__all__ = ["Scheduler", "GenQueues", "SchedulerStats", "STARVATION_PASSES"]

# A starvation event: a decode-ready sequence passed over (lanes full or its tenant at the lane cap)
# by this many consecutive decode batches of its generation. Counted once per streak. Fair lanes
# keep every sequence well below it (each tenant is served in proportion, round robin inside);
# FCFS with more sequences than lanes crosses it for every sequence that arrived late.
STARVATION_PASSES = 32

log = logging.getLogger("calserve.engine.scheduler")

_PREFILL_CLASSES = (QueueClass.SHORT, QueueClass.MEDIUM, QueueClass.LONG)
_DECODE_ONLY = frozenset((QueueClass.DECODE,))


@dataclasses.dataclass(eq=False)
class GenQueues:
    """The scheduler's per-generation view."""

    waiting: dict[int, Seq] = dataclasses.field(default_factory=dict)  # in the admission queue
    prefill: dict[QueueClass, collections.deque[Seq]] = dataclasses.field(
        default_factory=lambda: {c: collections.deque() for c in _PREFILL_CLASSES}
    )
    # decode-ready, in the order they became ready (least recently served first)
    decode_ready: dict[int, Seq] = dataclasses.field(default_factory=dict)
    holders: dict[int, Seq] = dataclasses.field(default_factory=dict)  # admitted, not ended
    deadlines: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # lazy heap
    # (lane, seq_id, request id, ended at) waiting for the runtime to free the sequence
    releases: list[tuple[int, int, int, float]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    waiting: int
    prefill_ready: dict[str, int]
    decode_ready: int
    holders: int
    inflight_jobs: int
    batches_total: dict[int, int]
    lanes_active_total: dict[int, int]
    lanes_total: dict[int, int]
    prefill_jobs_total: int
    batch_wait_s_total: float
    ticks: int
    starvation_events_total: int = 0
    continuations_total: int = 0  # decode jobs built by the continuation shortcut (after_completion)


class Scheduler:
    def __init__(self, cfg: CalserveConfig, models: ModelManager) -> None:
        self.cfg = cfg
        self.models = models
        self.executors: list[DeviceExecutor] = []
        self.rr = ServiceRoundRobin.from_config(cfg.scheduler.queues)
        self._wake = trio.Event()
        self._queues: dict[int, GenQueues] = {}
        self.paused = False  # recovery in progress: no new jobs
        self._timer = math.inf
        # The timer the scheduler task sleeps with (-inf while it is ticking itself). An inline
        # tick (executor, after a completion) wakes the task only when it moved the timer earlier.
        self._armed = -math.inf
        self._profiles: dict[tuple[int, int], BatchProfile] = {}  # (generation id, B) -> profile
        # statistics
        self.batches_total: dict[int, int] = collections.Counter()
        self.lanes_active_total: dict[int, int] = collections.Counter()
        self.lanes_total: dict[int, int] = collections.Counter()
        self.prefill_jobs_total = 0
        self.batch_wait_s_total = 0.0
        self.kv_free_seconds_total = 0.0  # sequence end -> runtime confirmed its release
        self.ticks = 0
        self.starvation_events_total = 0
        self.continuations_total = 0
        # ("admit" | "prefill" | "decode" | "released", request ids) of recent admissions and jobs,
        # in order (tests, debugging). Invariant: bounded small — at 20,000 entries it was ~6.6 MiB
        # of tuples in a serving process (bench soak, issue 7) kept for nothing but debugging.
        self.trace: collections.deque[tuple[str, tuple[int, ...]]] = collections.deque(maxlen=4096)

    # ---------------------------------------------------------------------------------------------
    def queues(self, gen: Generation) -> GenQueues:
        q = self._queues.get(gen.id)
        if q is None:
            q = self._queues[gen.id] = GenQueues()
        return q

    def wake(self) -> None:
        self._wake.set()

    def enqueue(self, seq: Seq) -> None:
        """A request the admission controller queued: run the scheduling pass now, in the caller's
        task (spec §19 M1: no scheduler-task hop between a request's arrival and its admission and
        prefill dispatch; the pass is synchronous, so it cannot interleave with another one). The
        task is woken only if the pass moved its timer earlier, like after a completion."""
        seq.queued = True
        self.queues(seq.gen).waiting[seq.rid] = seq
        self.tick_sync()

    def stop(self, seq: Seq, reason: FinishReason | None = None, error: ErrorEvent | None = None) -> None:
        """End a request early (cancel, stop string, deadline, shutdown). Idempotent (spec §4).

        Waiting/ready requests end now; one with a job on the device gets a pending ending applied
        when the job drains (its output is then dropped)."""
        if seq.ended:
            return
        if seq.inflight is not None:
            if seq.pending_reason is None and seq.pending_error is None:
                seq.pending_reason, seq.pending_error = reason, error
            return
        if seq.queued:
            seq.gen.admission.remove(seq.rid)
            seq.queued = False
        self.end(seq, reason, error)

    def end(self, seq: Seq, reason: FinishReason | None = None, error: ErrorEvent | None = None) -> None:
        """Return every resource of a request that has no job in flight, then tell its actor."""
        assert seq.inflight is None, "a request with a job on the device cannot end yet"
        if seq.ended:
            return
        seq.ended = True
        gen = seq.gen
        q = self.queues(gen)
        q.waiting.pop(seq.rid, None)
        q.decode_ready.pop(seq.rid, None)
        q.holders.pop(seq.rid, None)
        if seq.admitted:
            gen.admission.release(seq.rid)
        if seq.lease is not None:
            lane = seq.lease.lane
            info = gen.kv.info(lane)
            # Unknown lanes stay quarantined until recovery clears them after the reset.
            if info.request_id == seq.rid and info.generation == gen.id:
                if info.state in (KvSequenceState.RESERVED, KvSequenceState.ACTIVE):
                    gen.kv.begin_release(lane)
                    if info.seq_id is None:
                        gen.kv.confirm_released(lane)
                    else:
                        q.releases.append((lane, info.seq_id, seq.rid, trio.current_time()))
        if error is None and reason is None:
            reason = FinishReason.STOP
        if seq.deferred is not None:  # its last token message first (dispatcher.flush)
            msg, seq.deferred = seq.deferred, None
            seq.inbox.send_nowait(msg)
        seq.inbox.send_nowait(End(reason, error) if error is None else End(None, error))
        self.wake()

    def set_ready(self, seq: Seq, now: float) -> None:
        seq.ready_since = now
        self.queues(seq.gen).decode_ready[seq.rid] = seq

    def requeue_prefill(self, seq: Seq) -> None:
        self.queues(seq.gen).prefill[seq.qclass].appendleft(seq)

    # ---------------------------------------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._wake = trio.Event()
            self._armed = -math.inf
            await self.tick()
            self._armed = self._timer
            with trio.move_on_at(self._timer):
                await self._wake.wait()

    async def tick(self) -> None:
        self.ticks += 1
        # Decide first, then free the ended requests' runtime sequences: freeing is a device round
        # trip (a thread hop), and admission/dispatch into the lanes already free need not wait for
        # it (closed loop: the next request arrived as the previous one ended). _flush_releases
        # wakes the task again, so lanes it returns are used by the next pass.
        self.tick_sync()
        for gen in list(self.models.generations.values()):
            q = self.queues(gen)
            if q.releases:
                await self._flush_releases(gen, q)

    def tick_sync(self) -> None:
        """The synchronous part of a tick: expire, admit, dispatch. Executors call it right after a
        completion so the next job starts without waiting for the scheduler task (hot path); the
        task is then only woken if this tick needs it earlier than it planned (a nearer deadline
        or batching-window expiry). Ended requests wake it themselves (:meth:`end`) so their
        sequences are freed by the task."""
        now = trio.current_time()
        timer = math.inf
        for gen in list(self.models.generations.values()):
            q = self.queues(gen)
            self._expire(gen, q, now)
            if q.releases and gen.calbin.frees_inline and not self.paused:
                self._release_now(gen, q)
            if gen.state is ModelState.READY and not self.paused:
                self._admit(gen, q, now)
            d = gen.admission.next_deadline()
            if d is not None:
                timer = min(timer, d)
            if q.deadlines:
                timer = min(timer, q.deadlines[0][0])
        self._timer = timer
        if not self.paused:
            self._dispatch(now)
        if self._timer < self._armed:
            self.wake()

    def continue_decode(self, done: DeviceJob) -> DeviceJob | None:
        """The next decode job for the sequences of ``done`` when they are all the work there is.

        Called by an executor right after dispatching ``done``'s completion, before the full
        :meth:`tick_sync` (spec §19 M1: the host time between a completion and the next submit is the
        per-token overhead). When every sequence of the decode job that just came back continues and
        nothing else competes — nothing waits for admission or prefill, no other job is in flight, one
        generation — a full tick could only decide to run the same sequences again on the same
        profile: they all fit, so fairness has nothing to arbitrate, and the profile is chosen by the
        same ready count. The job is then built from the previous one (same lanes, the sampled tokens,
        positions + 1) without the candidate/ordering machinery, for the caller to run. Otherwise
        None, and the caller runs :meth:`tick_sync`. Same decisions either way (tested).
        """
        if done.kind != "decode" or not self.can_continue(done, None, len(done.seqs)):
            return None
        ready = self._queues[done.gen.id].decode_ready
        for s in done.seqs:
            if ready.get(s.rid) is not s:
                return None
        job = self.build_continuation(done, [s.last_token for s in done.seqs],
                                      [s.position for s in done.seqs])
        self.commit_continuation(job)
        return job

    def can_continue(self, done: DeviceJob, caller: DeviceExecutor | None, ready_now: int) -> bool:
        """Whether a full tick after ``done`` could only run its sequences next, as one decode batch
        (see :meth:`continue_decode`; after a prefill: its one sequence's first decode step), given
        ``ready_now`` decode-ready sequences at this point (all of ``done``'s once its completion was
        dispatched, none before). Every sequence of ``done`` must continue (the caller checks that);
        ``caller`` is the executor asking, busy or not."""
        gen = done.gen
        if self.paused or gen.state is not ModelState.READY or len(self.models.generations) != 1:
            return False
        n = len(done.seqs)
        q = self._queues.get(gen.id)
        if q is None or len(q.decode_ready) != ready_now or len(q.holders) != n:
            return False
        if q.waiting and gen.kv.free_lanes():
            return False  # a waiting request might be admitted (no free lane: the tick admits none)
        B = self._next_profile(done)
        if B is None:
            return False
        if n < B and self.cfg.scheduler.batch.batching_window_us > 0:
            return False  # a partial batch may be held for the window: the full tick decides
        for ex in self.executors:
            if ex.busy and ex is not caller:
                return False
        for c in _PREFILL_CLASSES:
            if q.prefill[c]:
                return False
        if q.deadlines and q.deadlines[0][0] <= trio.current_time():
            return False  # let _expire end it
        for s in done.seqs:
            if s.pending_reason is not None or s.pending_error is not None:
                return False
        return True

    def _next_profile(self, done: DeviceJob) -> int | None:
        """The compiled batch a full tick would pick for ``done``'s sequences alone (None: not the
        profile ``done`` runs on, for a decode job)."""
        gen = done.gen
        n = len(done.seqs)
        if gen.selecting:
            B = select_profile(n, 0.0, gen.calbins, self.cfg.scheduler.batch.selection)
        else:
            B = gen.compiled_batch
        if done.kind == "decode" and B != len(done.lanes):
            return None
        return B

    def build_continuation(self, done: DeviceJob, tokens: list[int], positions: list[int]) -> DeviceJob:
        """The job that runs ``done``'s sequences again in the same lanes with ``tokens`` at
        ``positions`` (one per sequence, in lane order); after a prefill, its sequence's first decode
        step in lane 0 of the profile :meth:`_next_profile` picks (what the batch builder lays out
        for one candidate). Changes no state: see :meth:`commit_continuation`."""
        if done.kind == "prefill":
            return self._first_decode_job(done, tokens[0], positions[0])
        toks = done.tokens.tolist()  # inactive lanes keep the declared filler token/position
        pos = done.positions.tolist()
        for i, t, p in zip(done.active, tokens, positions, strict=True):
            toks[i] = t
            pos[i] = p
        job = DeviceJob("decode", done.gen, done.lanes, np.array(toks, np.int32),
                        np.array(pos, np.int32), done.valid, trio.current_time(),
                        seq_ids=done.seq_ids, calbin=done.calbin)  # read-only after construction
        job.expect = [(sid, p) for (sid, _), p in zip(done.expect, positions, strict=True)]
        return job

    def _profile(self, gen: Generation, B: int) -> BatchProfile:
        profile = self._profiles.get((gen.id, B))
        if profile is None:  # a generation is immutable: build each member's profile once
            cb = gen.calbins[B]
            profile = self._profiles[(gen.id, B)] = BatchProfile(
                B, gen.max_seq, valid_mask=cb.spec.valid_mask or B == 1,
                inactive_writes_kv=cb.spec.inactive_writes_kv)
        return profile

    def _first_decode_job(self, done: DeviceJob, token: int, position: int) -> DeviceJob:
        gen = done.gen
        B = self._next_profile(done)
        assert B is not None
        profile = self._profile(gen, B)
        seq = done.seqs[0]
        sid = -1 if seq.seq_id is None else seq.seq_id
        fill = B - 1
        return self._decode_device_job(
            gen, B, [seq, *([None] * fill)], [token] + [profile.inactive_token_id] * fill,
            [position] + [profile.inactive_position] * fill, [1] + [0] * fill, [sid] + [-1] * fill,
            trio.current_time())

    def _decode_device_job(
        self, gen: Generation, B: int, lanes: list[Seq | None], token_ids: Sequence[int],
        positions: Sequence[int], valid: Sequence[int], seq_ids: Sequence[int], created: float,
    ) -> DeviceJob:
        """A decode job over ``B`` lanes (inactive ones: None, with the profile's filler token and
        position) on the generation's member for ``B``; changes no scheduling state."""
        # One int32 [3, B] array, its rows (contiguous views) are the job's tensors.
        host = np.array((token_ids, positions, seq_ids), np.int32)
        job = DeviceJob("decode", gen, lanes, host[0], host[1], np.asarray(valid, np.uint8), created,
                        seq_ids=host[2], calbin=gen.calbins[B])
        job.expect = [(seq_ids[i], positions[i]) for i in job.active]
        return job

    def _record_decode(self, job: DeviceJob) -> None:
        """Statistics and trace of a decode job that was handed to an executor."""
        B = len(job.lanes)
        self.batches_total[B] += 1
        self.lanes_active_total[B] += len(job.seqs)
        self.lanes_total[B] += B
        self.trace.append(("decode", tuple(s.rid for s in job.seqs)))

    def commit_continuation(self, job: DeviceJob) -> None:
        """The scheduling state of running ``job`` (built by :meth:`build_continuation`) once its
        sequences are decode-ready at their new positions: what a full tick's dispatch records.
        Invariant: every sequence is ACTIVE in the KV table at position == committed_len."""
        gen = job.gen
        ready = self._queues[gen.id].decode_ready
        self.rr.next(_DECODE_ONLY)
        for s in job.seqs:
            del ready[s.rid]
            gen.kv.begin_update(s.lease.lane, s.position, 1)
            s.inflight = job
        self.continuations_total += 1
        self._record_decode(job)

    def _expire(self, gen: Generation, q: GenQueues, now: float) -> None:
        for item in gen.admission.expire(now):
            seq = q.waiting.get(item.request_id)
            if seq is not None:
                seq.queued = False
                self.end(seq, FinishReason.DEADLINE)
        while q.deadlines and q.deadlines[0][0] <= now:
            _, rid = heapq.heappop(q.deadlines)
            seq = q.holders.get(rid)
            if seq is not None:
                self.stop(seq, FinishReason.DEADLINE)

    async def _flush_releases(self, gen: Generation, q: GenQueues) -> None:
        batch, q.releases = q.releases, []
        # Shielded: once taken out of q.releases the lanes must reach Free even if the engine is
        # being cancelled (else they would stay Releasing forever).
        with trio.CancelScope(shield=True):
            await gen.calbin.free_sequences([sid for _, sid, _, _ in batch])
        self._confirm_released(gen, batch)
        self.wake()

    def _release_now(self, gen: Generation, q: GenQueues) -> None:
        """The ended requests' sequences freed inside this pass (a runtime whose free is host
        bookkeeping): their lanes are free for this pass's admission. Without it, a full lane table
        (``admission.max_sequences`` = the running set) admitted the next request only after a
        scheduler-task round trip, ~1.6 ms of an idle lane at every turnover (bench batching)."""
        batch, q.releases = q.releases, []
        gen.calbin.free_sequences_now([sid for _, sid, _, _ in batch])
        self._confirm_released(gen, batch)

    def _confirm_released(self, gen: Generation, batch: list[tuple[int, int, int, float]]) -> None:
        now = trio.current_time()
        for lane, sid, rid, ended_at in batch:
            info = gen.kv.info(lane)
            # A reset in between may have cleared the lane already (then nothing is left to do).
            if info.state is KvSequenceState.RELEASING and info.seq_id == sid:
                gen.kv.confirm_released(lane)
                self.kv_free_seconds_total += now - ended_at
                self.trace.append(("released", (rid,)))
            if gen.lane_seq.get(lane) == sid:
                del gen.lane_seq[lane]

    def _admit(self, gen: Generation, q: GenQueues, now: float) -> None:
        gen.admission.observe(now)  # decode speed for the expected-wait estimate (overload)
        if not q.waiting:
            return
        st = gen.kv.statistics()
        if st.free == 0:
            return
        for item in gen.admission.pop_admissible(now, st.free, st.free_tokens):
            seq = q.waiting.pop(item.request_id)
            seq.queued = False
            seq.admitted = True
            lease = gen.kv.reserve(seq.rid, gen.id, min(item.kv_tokens, gen.max_seq))
            if lease is None:  # admission and the lane table disagree: never silently drop
                self.end(seq, error=ErrorEvent("no KV lane available", "internal"))
                continue
            seq.lease = lease
            seq.admitted_at = now
            q.holders[seq.rid] = seq
            q.prefill[seq.qclass].append(seq)
            if seq.deadline is not None:
                heapq.heappush(q.deadlines, (seq.deadline, seq.rid))
            seq.inbox.send_nowait(Admitted(now))
            self.trace.append(("admit", (seq.rid,)))

    # ---------------------------------------------------------------------------------------------
    def _free_executor(self) -> DeviceExecutor | None:
        for ex in self.executors:
            if not ex.busy:
                return ex
        return None

    def _dispatch(self, now: float) -> None:
        window_us = self.cfg.scheduler.batch.batching_window_us
        while True:
            ex = self._free_executor()
            if ex is None:
                return
            progressed = False
            for gen in list(self.models.generations.values()):
                if gen.state is not ModelState.READY:
                    continue
                q = self.queues(gen)
                available: set[QueueClass] = set()
                for c in _PREFILL_CLASSES:
                    dq = q.prefill[c]
                    while dq and (dq[0].ended or dq[0].inflight is not None):
                        dq.popleft()
                    if dq:
                        available.add(c)
                B = gen.compiled_batch
                if q.decode_ready:
                    first = next(iter(q.decode_ready.values()))
                    if gen.selecting:  # spec §8: the profile of this tick, by ready count
                        B = select_profile(len(q.decode_ready), now - first.ready_since, gen.calbins,
                                           self.cfg.scheduler.batch.selection)
                    deadlines = [s.deadline for s in q.decode_ready.values() if s.deadline is not None]
                    earliest = min(deadlines) if deadlines else None
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
                        self._timer = min(self._timer, wake_at)
                cls = self.rr.next(available)
                if cls is None:
                    continue
                job = self._decode_job(gen, q, now, B) if cls is QueueClass.DECODE else self._prefill_job(gen, q, cls, now)
                if job is None:
                    continue
                ex.start(job)
                progressed = True
                break
            if not progressed:
                return

    def _hold_partial_decode(self, gen: Generation, ready: int, now: float, earliest: float | None) -> bool:
        """Whether to keep a partial decode batch back while another executor runs a decode job of
        the same generation whose sequences would fit in this batch too.

        With PING/PONG, sending ``ready`` < B sequences to the free engine splits the running set in
        two half-full jobs; the halves then alternate for good (each comes back while the other is on
        the device), and on a device that serialises its engines every sequence gets a token every
        two steps (measured: fill 0.5, TPOT 2x the step, bench saturation at c=16). Holding for at
        most one step lets the two halves merge into one fuller batch. Never held when the batch is
        already full, when the largest profile could not take both, or when a deadline is at risk.
        """
        if len(self.executors) < 2:
            return False
        on_device = self._on_device(gen, "decode")
        if not on_device or ready + on_device > max(gen.calbins):
            return False
        return self._may_hold(now, earliest)

    def _on_device(self, gen: Generation, kind: str) -> int:
        """Sequences of ``gen`` in the ``kind`` jobs the executors hold now (a prefill has one)."""
        n = 0
        for ex in self.executors:
            job = ex.current
            if job is not None and job.kind == kind and job.gen is gen:
                n += len(job.seqs)
        return n

    def _may_hold(self, now: float, earliest: float | None) -> bool:
        """A decode batch may be held back unless its earliest deadline is within the urgency."""
        urgency = self.cfg.scheduler.fairness.deadline_urgency_ms * 1e-3
        return earliest is None or earliest - now > urgency

    def _prefill_first(self, gen: Generation, q: GenQueues, ready: int, B: int,
                       prefills: set[QueueClass], now: float, earliest: float | None) -> bool:
        """Whether to keep a partial decode batch back for the prefills that will fill it.

        When the device serialises its two engines (:attr:`Generation.engines_serialise`), a decode
        job and a prefill cost the same device time in either order, so running the prefill first
        loses the running sequences nothing, and the decode batch that follows carries the new
        sequence too — one lane more per prefill (measured at B16 with ``max_sequences`` 16: every
        turnover ran a 15-lane step). Only for prefills whose sequences fit in this batch (``ready``
        + those on the device + those queued <= B), never when a deadline is at risk, and never
        while nothing is prefilling or queued to prefill (then the batching window decides)."""
        if ready >= B or not gen.engines_serialise:
            return False
        coming = self._on_device(gen, "prefill") + sum(len(q.prefill[c]) for c in prefills)
        if not coming or ready + coming > B:
            return False
        return self._may_hold(now, earliest)

    def _prefill_job(self, gen: Generation, q: GenQueues, cls: QueueClass, now: float) -> DeviceJob:
        seq = q.prefill[cls].popleft()
        job = DeviceJob(
            "prefill", gen, [seq], seq.prompt, np.zeros(1, np.int32), np.ones(1, np.uint8), now
        )
        seq.inflight = job
        self.prefill_jobs_total += 1
        self.trace.append(("prefill", (seq.rid,)))
        return job

    def _decode_job(self, gen: Generation, q: GenQueues, now: float, B: int) -> DeviceJob | None:
        """A decode batch for compiled batch ``B`` (a member of ``gen.calbins``), run on that member."""
        profile = self._profile(gen, B)
        gid = gen.id
        cands = [  # positional (request_id, seq_id, tenant, generation, last_token, position, deadline,
            # virtual_finish, cancelled, lane, arrival): one per ready sequence per batch
            DecodeCandidate(s.rid, -1 if s.seq_id is None else s.seq_id, s.tenant, gid, s.last_token,
                            s.position, s.deadline, s.ready_since, s.pending_reason is not None,
                            s.lease.lane, s.arrival)
            for s in q.decode_ready.values()
        ]
        fcfg = self.cfg.scheduler.fairness
        if fcfg.policy == "fcfs":
            order = LaneOrder(policy="fcfs")
        else:
            adm = gen.admission
            tenants = {c.tenant for c in cands}
            order = LaneOrder(
                urgency_s=fcfg.deadline_urgency_ms * 1e-3,
                tenant_vt={t: adm.lane_virtual_time(t) for t in tenants},
                tenant_weight={t: adm.weight(t) for t in tenants},
                token_cost=fcfg.output_token_cost,
            )
        batch = build_decode_batch(profile, cands, now, gen.id, fcfg.tenant_max_lane_share, order)
        for rid, why in batch.skipped:
            seq = q.decode_ready.get(rid)
            if seq is None:
                continue
            if why == "batch_full" or why == "tenant_share":
                seq.passed_over += 1
                if seq.passed_over == STARVATION_PASSES:
                    self.starvation_events_total += 1
                    log.info("request %d passed over by %d decode batches", rid, STARVATION_PASSES,
                             extra={"request_id": rid})
            elif why == "deadline":
                self.stop(seq, FinishReason.DEADLINE)
            elif why == "length":
                self.stop(seq, FinishReason.LENGTH)
        if batch.empty:
            return None
        lanes: list[Seq | None] = []
        wait = 0.0
        for c in batch.lanes:
            if c is None:
                lanes.append(None)
                continue
            seq = q.decode_ready.pop(c.request_id)
            seq.passed_over = 0
            gen.kv.begin_update(seq.lease.lane, seq.position, 1)
            wait += now - seq.ready_since
            lanes.append(seq)
        job = self._decode_device_job(gen, B, lanes, batch.token_ids, batch.positions, batch.valid_mask,
                                      batch.seq_ids, now)
        for s in job.seqs:
            s.inflight = job
        self.batch_wait_s_total += wait
        self._record_decode(job)
        return job

    # ---------------------------------------------------------------------------------------------
    def shutdown_requests(self) -> None:
        """Engine shutdown: every request still alive ends with a shutdown error; requests with a
        job on the device end when it drains."""
        err = ErrorEvent("the engine is shutting down", "shutdown")
        for q in self._queues.values():
            for seq in [*q.waiting.values(), *q.holders.values()]:
                self.stop(seq, error=err)

    def fail_generation_waiting(self, gen: Generation, err: ErrorEvent) -> None:
        q = self.queues(gen)
        for seq in list(q.waiting.values()):
            self.stop(seq, error=err)

    def inflight_jobs(self) -> int:
        return sum(1 for ex in self.executors if ex.busy)

    def statistics(self) -> SchedulerStats:
        waiting = sum(len(q.waiting) for q in self._queues.values())
        pre = {c.value: sum(sum(1 for s in q.prefill[c] if not s.ended and s.inflight is None)
                            for q in self._queues.values()) for c in _PREFILL_CLASSES}
        return SchedulerStats(
            waiting=waiting,
            prefill_ready=pre,
            decode_ready=sum(len(q.decode_ready) for q in self._queues.values()),
            holders=sum(len(q.holders) for q in self._queues.values()),
            inflight_jobs=self.inflight_jobs(),
            batches_total=dict(self.batches_total),
            lanes_active_total=dict(self.lanes_active_total),
            lanes_total=dict(self.lanes_total),
            prefill_jobs_total=self.prefill_jobs_total,
            batch_wait_s_total=self.batch_wait_s_total,
            ticks=self.ticks,
            starvation_events_total=self.starvation_events_total,
            continuations_total=self.continuations_total,
        )

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self.statistics())
