"""RequestTable: the request lifecycle the engine core decides with (spec §4), and its one writer.

``Seq.state`` is the lifecycle (:mod:`calserve.core.request_state`, one table): WaitingAdmission
(in its generation's admission queue) -> PrefillReady with a KV lane (``lease``, in a prefill
queue) -> PrefillRunning / DecodeReady / DecodeRunning (``inflight`` names the job) -> a terminal
state, exactly once, with one ``End`` message after every other message of the request. An ending
decided while a job of the request is on the device is ``pending_*`` (the table's CANCEL
self-loop) and applied when the job drains (idempotent: the first reason wins). Every move is
made here or by the core's planner and step handler, through :func:`calserve.core.request_state.fire`;
nothing else writes them.

Invariant (spec §9.2): a lane whose runtime sequence exists is reused only after the runtime
confirmed the free (``Release`` -> :meth:`RequestTable.confirm_released`).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from calserve.core.kv_state import KvSequenceState
from calserve.core.prefill import QueueClass
from calserve.core.request_state import RUNNING, TRANSITIONS, RequestEvent, RequestState, fire
from calserve.engine.state import Admitted, End, Release, Seq
from calserve.engine.trace import Timeline
from calserve.engine.types import ErrorEvent, FinishReason

if TYPE_CHECKING:
    from calserve.engine.generations import Generation

__all__ = ["RequestTable", "GenQueues", "PREFILL_CLASSES", "terminal_state", "exhausted"]

PREFILL_CLASSES = (QueueClass.SHORT, QueueClass.MEDIUM, QueueClass.LONG)

_E = RequestEvent


def exhausted(err: ErrorEvent, seq: Seq) -> ErrorEvent:
    """The error of a request that cannot continue after its retries: retryable by the client."""
    return ErrorEvent(f"{err.message}; the request could not continue after {seq.retries}"
                      " re-admissions", "device_unavailable")


def terminal_state(state: RequestState, reason: FinishReason | None, error: ErrorEvent | None
                   ) -> RequestState:
    """The terminal state a request in ``state`` reaches when it ends with ``reason`` / ``error``,
    through the table (an ending the table does not allow raises ``IllegalTransition``): an error
    fails it; a cancel drains a Running request or cancels one that waits; a deadline expires one
    that is not running (Failed before any output, Finishing with partial output); anything else
    finishes it (Finishing, then Completed once its resources are back, right here)."""
    if error is not None:
        return fire(state, _E.FAIL)
    if reason is FinishReason.CANCELLED:
        return fire(state, _E.DRAINED if state in RUNNING else _E.CANCEL)
    if reason is FinishReason.DEADLINE and state not in RUNNING:
        state = fire(state, _E.EXPIRE)
    else:
        state = fire(state, _E.FINISH)
    if state is RequestState.FINISHING:
        state = fire(state, _E.COMPLETE)
    return state


@dataclasses.dataclass(eq=False)
class GenQueues:
    """The core's per-generation view of its requests."""

    waiting: dict[int, Seq] = dataclasses.field(default_factory=dict)  # in the admission queue
    prefill: dict[QueueClass, collections.deque[Seq]] = dataclasses.field(
        default_factory=lambda: {c: collections.deque() for c in PREFILL_CLASSES}
    )
    # decode-ready, in the order they became ready (least recently served first)
    decode_ready: dict[int, Seq] = dataclasses.field(default_factory=dict)
    holders: dict[int, Seq] = dataclasses.field(default_factory=dict)  # admitted, not ended
    deadlines: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # lazy heap
    # ended requests' runtime sequences waiting for the runtime to free them
    releases: list[Release] = dataclasses.field(default_factory=list)
    # requests whose KV a fault lost, waiting for the reset to re-prefill them (in order)
    lost: list[Seq] = dataclasses.field(default_factory=list)
    # decode-ready requests whose client is behind, out of the ready set (engine/parking.py)
    parked: dict[int, Seq] = dataclasses.field(default_factory=dict)

    def prefill_waiting(self) -> bool:
        """Whether an admitted prompt waits for its prefill (in any queue class)."""
        prefill = self.prefill
        for c in PREFILL_CLASSES:
            if prefill[c]:
                return True
        return False


class RequestTable:
    def __init__(self, trace_events: int = 4096) -> None:
        self._queues: dict[int, GenQueues] = {}
        # Set when something ended (or a lane came back): the scheduler task must run a pass (and
        # free runtime sequences). The core moves it into its output.
        self.wake = False
        self.kv_free_seconds_total = 0.0  # sequence end -> runtime confirmed its release
        # ("admit" | "prefill" | "decode" | "released", request ids) of recent admissions and jobs,
        # in order (tests, debugging). Invariant: bounded (``server.trace_events``) — at 20,000
        # entries it was ~6.6 MiB of tuples in a serving process (bench soak, issue 7).
        self.trace: collections.deque[tuple[str, tuple[int, ...]]] = collections.deque(
            maxlen=trace_events)
        # The timed ring (device jobs, request phases) that GET /admin/v1/trace exports.
        self.timeline = Timeline(trace_events)
        # Requests still scoring their prompt (``Seq.score_upto``): their jobs take the general
        # completion path. Invariant: ``rid in scoring`` <=> the request has not ended and its
        # ``score_upto`` is not None.
        self.scoring: set[int] = set()
        # Called with a request whose ending waits for its job on the device to drain (a cancel, a
        # stop string, a deadline, a shutdown): the core's planner ends a run the host drives
        # with its step in flight (Planner.stop_for)
        self.on_pending: Callable[[Seq], None] = lambda seq: None

    def queues(self, gen: Generation) -> GenQueues:
        q = self._queues.get(gen.id)
        if q is None:
            q = self._queues[gen.id] = GenQueues()
        return q

    def prefill_waiting(self, gen: Generation) -> bool:
        """Whether an admitted prompt of ``gen`` waits for its prefill (JobBuilder.step_limit)."""
        return self.queues(gen).prefill_waiting()

    def forget(self, gen: Generation) -> None:
        """The generation was unloaded (nothing of it is left)."""
        self._queues.pop(gen.id, None)

    def load_of(self, gen: Generation) -> int:
        """Requests of ``gen`` not ended (waiting + admitted)."""
        q = self._queues.get(gen.id)
        return 0 if q is None else len(q.waiting) + len(q.holders)

    def all_queues(self) -> list[GenQueues]:
        return list(self._queues.values())

    def enqueue(self, seq: Seq) -> None:
        """A request the admission controller queued (WaitingAdmission)."""
        seq.state = fire(seq.state, _E.ENQUEUE)
        self.queues(seq.gen).waiting[seq.rid] = seq
        self.timeline.request(seq.arrival, "queued", seq.rid)
        if seq.score_upto is not None:
            self.scoring.add(seq.rid)

    def scoring_in(self, seqs: list[Seq]) -> bool:
        """Some of ``seqs`` is still scoring its prompt."""
        sc = self.scoring
        return bool(sc) and any(s.rid in sc for s in seqs)

    def stop(self, seq: Seq, reason: FinishReason | None = None, error: ErrorEvent | None = None,
             *, now: float) -> None:
        """End a request early (cancel, stop string, deadline, shutdown). Idempotent (spec §4).

        Waiting/ready requests end now; one with a job on the device gets a pending ending applied
        when the job drains (its output is then dropped)."""
        if seq.ended:
            return
        if seq.inflight is not None:
            seq.state = fire(seq.state, _E.CANCEL)  # a flag on a Running state: the job drains
            if seq.pending_reason is None and seq.pending_error is None:
                seq.pending_reason, seq.pending_error = reason, error
                self.on_pending(seq)
            return
        if seq.queued:
            seq.gen.admission.remove(seq.rid)
        self.end(seq, reason, error, now=now)

    def end(self, seq: Seq, reason: FinishReason | None = None, error: ErrorEvent | None = None,
            *, now: float) -> None:
        """Return every resource of a request that has no job in flight, then tell its actor."""
        assert seq.inflight is None, "a request with a job on the device cannot end yet"
        if seq.ended:
            return
        if error is None and reason is None:
            reason = FinishReason.STOP
        seq.state = terminal_state(seq.state, reason, error)
        if self.scoring:
            self.scoring.discard(seq.rid)
        gen = seq.gen
        q = self.queues(gen)
        q.waiting.pop(seq.rid, None)
        q.decode_ready.pop(seq.rid, None)
        q.holders.pop(seq.rid, None)
        if q.parked:
            q.parked.pop(seq.rid, None)
        if q.lost and seq in q.lost:  # parked for re-admission after a fault (cancel, deadline)
            q.lost.remove(seq)
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
                        q.releases.append(Release(lane, info.seq_id, seq.rid, now))
        if seq.deferred is not None:  # its last token message first (EngineCore.flush)
            msg, seq.deferred = seq.deferred, None
            seq.inbox.send_nowait(msg)
        seq.inbox.send_nowait(End(reason, error) if error is None else End(None, error))
        self.wake = True
        self.timeline.request(now, "end", seq.rid)

    def set_ready(self, seq: Seq, now: float, event: RequestEvent) -> None:
        """Decode-ready after its job: ``PREFILL_DONE`` / ``DECODE_DONE`` (a token came back) or
        ``REQUEUE`` (the device refused a decode job with DeviceBusy)."""
        nxt = TRANSITIONS[seq.state].get(event)  # fire() inlined: once per token per sequence
        if nxt is None:
            fire(seq.state, event)  # raises IllegalTransition naming the move
        seq.state = nxt  # type: ignore[assignment]
        seq.ready_since = now
        self.queues(seq.gen).decode_ready[seq.rid] = seq

    def requeue_prefill(self, seq: Seq) -> None:
        """The device refused its prefill (DeviceBusy): first in its class again."""
        seq.state = fire(seq.state, _E.REQUEUE)
        self.queues(seq.gen).prefill[seq.qclass].appendleft(seq)

    @staticmethod
    def submitted(seq: Seq, job: Any) -> None:
        """``seq`` is in ``job``, handed to an executor (PrefillRunning / DecodeRunning)."""
        event = _E.PREFILL_SUBMIT if job.kind == "prefill" else _E.DECODE_SUBMIT
        nxt = TRANSITIONS[seq.state].get(event)  # fire() inlined: once per token per sequence
        if nxt is None:
            fire(seq.state, event)  # raises IllegalTransition naming the move
        seq.state = nxt  # type: ignore[assignment]
        seq.inflight = job

    @staticmethod
    def submitted_all(job: Any) -> None:
        """:meth:`submitted` for each of ``job``'s sequences, in lane order (one call per job)."""
        event = _E.PREFILL_SUBMIT if job.kind == "prefill" else _E.DECODE_SUBMIT
        table = TRANSITIONS
        for seq in job.seqs:
            nxt = table[seq.state].get(event)
            if nxt is None:
                fire(seq.state, event)  # raises IllegalTransition naming the move
            seq.state = nxt
            seq.inflight = job

    def expire(self, gen: Generation, now: float) -> None:
        """Deadlines: waiting requests via admission, admitted ones via the lazy deadline heap."""
        q = self.queues(gen)
        for item in gen.admission.expire(now):
            seq = q.waiting.get(item.request_id)
            if seq is not None:
                self.end(seq, FinishReason.DEADLINE, now=now)
        while q.deadlines and q.deadlines[0][0] <= now:
            _, rid = heapq.heappop(q.deadlines)
            seq = q.holders.get(rid)
            if seq is not None:
                self.stop(seq, FinishReason.DEADLINE, now=now)

    def take_releases(self, gen: Generation) -> list[Release]:
        """The ended requests' runtime sequences to free now (the caller frees, then confirms)."""
        q = self._queues.get(gen.id)  # an unloaded generation has none (and gets no queues back)
        if q is None:
            return []
        batch, q.releases = q.releases, []
        return batch

    def confirm_released(self, gen: Generation, batch: list[Release], now: float) -> None:
        for lane, sid, rid, ended_at in batch:
            info = gen.kv.info(lane)
            # A reset in between may have cleared the lane already (then nothing is left to do).
            if info.state is KvSequenceState.RELEASING and info.seq_id == sid:
                gen.kv.confirm_released(lane)
                self.kv_free_seconds_total += now - ended_at
                self.trace.append(("released", (rid,)))
            if gen.lane_seq.get(lane) == sid:
                del gen.lane_seq[lane]

    def admit(self, gen: Generation, now: float) -> None:
        """Admission: ``pop_admissible`` with the free lanes/KV tokens, a lane per admitted request."""
        q = self.queues(gen)
        gen.admission.observe(now)  # decode speed for the expected-wait estimate (overload)
        if not q.waiting:
            return
        kv = gen.kv
        free = kv.free_lanes()  # O(1): statistics() counts every lane's state, once per pass
        if free == 0:
            return
        for item in gen.admission.pop_admissible(now, free, kv.free_tokens(), len(q.parked)):
            seq = q.waiting.pop(item.request_id)
            seq.admitted_at = now  # popped by admission: released at its end
            seq.run_since = now
            lease = gen.kv.reserve(seq.rid, gen.id, min(item.kv_tokens, gen.max_seq))
            if lease is None:  # admission and the lane table disagree: never silently drop
                self.end(seq, error=ErrorEvent("no KV lane available", "internal"), now=now)
                continue
            seq.state = fire(seq.state, _E.ADMIT)
            seq.lease = lease
            q.holders[seq.rid] = seq
            q.prefill[seq.qclass].append(seq)
            if seq.deadline is not None:
                heapq.heappush(q.deadlines, (seq.deadline, seq.rid))
            seq.inbox.send_nowait(Admitted(now))
            self.trace.append(("admit", (seq.rid,)))
            self.timeline.request(now, "admitted", seq.rid)

    def bind_sequence(self, seq: Seq, seq_id: int) -> None:
        """The runtime created the sequence of ``seq``'s prefill (it lives in ``seq``'s lane)."""
        gen = seq.gen
        lane = seq.lease.lane
        seq.seq_id = seq_id
        gen.kv.bind(lane, seq_id)
        gen.lane_seq[lane] = seq_id

    def park_lost(self, seq: Seq, max_retries: int) -> bool:
        """A fault lost ``seq``'s device KV (no job of it in flight): re-admit it (True) unless
        re-admission is off or it already used its ``max_retries`` consecutive retries. A parked
        request keeps its admission (never refused by the waiting budgets) and its deadline, and
        is re-prefilled from prompt + generated tokens once the device was reset."""
        if max_retries <= 0 or seq.retries >= max_retries:
            return False
        seq.retries += 1
        seq.state = fire(seq.state, _E.LOST)
        q = self.queues(seq.gen)
        q.decode_ready.pop(seq.rid, None)
        q.parked.pop(seq.rid, None)
        q.lost.append(seq)
        return True

    def lose_kv_after_reset(self, gen: Generation, err: ErrorEvent, now: float, max_retries: int
                            ) -> tuple[list[Seq], list[int]]:
        """After a device reset: every request of ``gen`` holding device KV is re-admitted
        (:meth:`park_lost`) or, past its retries, ends with ``err``; the ones that only held a
        reservation are returned (they keep their request and get a fresh lane, :meth:`rereserve`),
        with every runtime sequence id the shell must free."""
        q = self.queues(gen)
        reserved_only = []
        parked = {s.rid for s in q.lost}
        for seq in list(q.holders.values()):
            if seq.rid in parked:
                continue
            info = gen.kv.info(seq.lease.lane)
            if info.state is KvSequenceState.RESERVED and seq.seq_id is None:
                reserved_only.append(seq)
                continue
            if info.state is not KvSequenceState.UNKNOWN:
                gen.kv.mark_unknown(seq.lease.lane)
            if self.park_lost(seq, max_retries):
                self.timeline.request(now, "lost", seq.rid)
            else:
                self.end(seq, error=err if max_retries <= 0 else exhausted(err, seq), now=now)
        sids = sorted(set(gen.lane_seq.values()) | {r.seq_id for r in q.releases})
        q.releases.clear()
        return reserved_only, sids

    def rereserve(self, gen: Generation, reserved_only: list[Seq]) -> None:
        """After the lane table was cleared: fresh lanes for the reservation-only requests, then for
        the re-admitted ones, which go first in their prefill class (in their order)."""
        for seq in reserved_only:
            seq.lease = gen.kv.reserve(seq.rid, gen.id, seq.lease.reserved_len)
            assert seq.lease is not None
        q = self.queues(gen)
        lost, q.lost = q.lost, []
        if not lost:
            return
        ids = {s.rid for s in lost}
        for c in PREFILL_CLASSES:  # a re-admitted request is queued once, in front
            q.prefill[c] = collections.deque(s for s in q.prefill[c] if s.rid not in ids)
        for seq in reversed(lost):
            seq.seq_id = None
            seq.position = 0
            seq.lease = gen.kv.reserve(seq.rid, gen.id, seq.lease.reserved_len)
            assert seq.lease is not None
            q.prefill[seq.qclass].appendleft(seq)
            self.trace.append(("readmit", (seq.rid,)))
