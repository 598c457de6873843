"""EngineCore: the one synchronous, trio-free owner of all scheduling state (vLLM v1's EngineCore).

It owns the requests (:class:`~calserve.engine.requests.RequestTable`: their lifecycle, queues and
lanes), the job engines' slots (which job each PING/PONG engine runs), the service round robin,
the job builder, the recovery epoch and the per-generation bookkeeping (admission, KV lanes). Its
state changes only through the methods below; each takes ``now`` and returns a
:class:`~calserve.engine.state.CoreOutput` (jobs to hand to executors, faults for recovery,
generations whose runtime sequences must be freed, the next instant a pass is due). It never
awaits and reads no clock. The shells around it (:mod:`calserve.engine.driver`): executors submit
and wait, recovery resets the device, the registry and actors turn requests and cancels into
:meth:`add` / :meth:`abort`.

One pass (spec §6-§9, batching note "调度循环"): expire deadlines; free ended sequences when the
runtime's free is host bookkeeping (their lanes serve this pass); admission into free lanes; then,
while a job engine is free, the service round robin (decode:short:medium:long) picks a class —
decode builds a batch for the pass's profile (spec §8), prefill takes the oldest request of the
class.

The fast path (spec §19 M1, issue 7): when a decode job comes back and its sequences are all the
work there is, the next job is decided before the completion's bookkeeping (:meth:`fast_decode`),
the shell submits it, and :meth:`finish_fast` does the bookkeeping while the device computes,
delivering each continuing sequence's token as it goes. On the general path the continuing
sequences' token messages wait for :meth:`flush` after the next submit.

Invariant: every method runs to completion in the engine's one trio thread, so no two decisions
interleave.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from calserve.config import CalserveConfig
from calserve.core.kv_state import KvSequenceState
from calserve.core.model_state import TRANSITIONS, ModelEvent, ModelState, is_loading
from calserve.engine.batches import JobBuilder
from calserve.engine.completion import SAMPLE_FAILED, Sampled, ends, ends_run, expect, sample, step_rows
from calserve.engine.core_stats import CoreState, CoreStatistics, CoreStats, FastStep
from calserve.engine.parking import Parking
from calserve.engine.planner import Planner
from calserve.engine.requests import PREFILL_CLASSES, RequestTable
from calserve.engine.rotation import Rotation
from calserve.engine.state import NO_OUTPUT, CoreOutput, DeviceJob, JobOutcome, Release, Seq
from calserve.engine.steps import StepHandler
from calserve.engine.timeslice import TimeSlice
from calserve.engine.types import ErrorEvent, FinishReason
from calserve.runtime.types import JobEngine, JobStatus

if TYPE_CHECKING:
    from calserve.engine.generations import Generation, ModelManager

__all__ = ["EngineCore", "FastStep", "NOTHING"]

#: The output of a call that asks nothing of the shells (read-only: engine/state.py NO_OUTPUT).
NOTHING: Final[CoreOutput] = NO_OUTPUT

log = logging.getLogger("calserve.engine.core")


def _waking(out: CoreOutput) -> CoreOutput:
    """``out`` asking for a pass in any case (a fresh output for the shared read-only
    ``NOTHING``)."""
    if out is NOTHING:
        out = CoreOutput()
    out.wake = True
    return out


def _housekeeping(st: CoreState, reqs: RequestTable, timeslice: TimeSlice, gen: Generation,
                  now: float, also: Sequence[Seq] = ()) -> float:
    """A scheduling pass's steps for one generation before dispatch (:meth:`EngineCore._pass`,
    and the rotation's replay of them, engine/rotation.py): the time-slicer, expiry, the
    releases, admission, refilling the slots parking left; returns the next instant one of them
    is due (``math.inf``: none). ``also``: the rotation's finished job's sequences, decode-ready
    in the pass it replays (for the time-slicer's next instant)."""
    out = st.out
    paused = st.paused
    timer = math.inf
    q = reqs.queues(gen)
    admitting = not paused and gen.admitting
    if admitting and now >= st.admit_after:  # before its expiry and admission
        timer = timeslice.apply(gen, now, also)
    reqs.expire(gen, now)
    if q.releases:
        if gen.calbin.frees_inline and not paused:
            batch = reqs.take_releases(gen)
            gen.calbin.free_sequences_now([r.seq_id for r in batch])
            reqs.confirm_released(gen, batch, now)
        elif gen not in out.release_gens:
            out.release_gens.append(gen)
    if admitting:
        if now >= st.admit_after:
            reqs.admit(gen, now)
        elif q.waiting:  # degraded: admission cool-down after a reset
            timer = min(timer, st.admit_after)
    if q.parked:
        timeslice.fill(gen, now)  # slots the queue left free (engine/timeslice.py)
    d = gen.admission.next_deadline()
    if d is not None:
        timer = min(timer, d)
    if q.deadlines:
        timer = min(timer, q.deadlines[0][0])
    return timer


class EngineCore:
    def __init__(self, cfg: CalserveConfig, models: ModelManager, engines: Sequence[JobEngine]) -> None:
        self.cfg = cfg
        self.models = models
        self.requests = RequestTable(cfg.server.trace_events)
        self.builder = JobBuilder(cfg)
        self.builder.prefill_waiting = self.requests.prefill_waiting
        self.st = CoreState({e: None for e in engines})
        self.stats = CoreStats()
        self.planner = Planner(cfg, models, self.requests, self.builder, self.st, self.stats)
        self.requests.on_pending = self.planner.stop_for
        self.parking = Parking(self.requests)  # slots of streams whose client is behind
        # long streams take turns with waiting requests (engine/timeslice.py)
        sched = cfg.scheduler
        slo_ms = sched.admission.max_expected_wait_ms or 0  # waits admission promised: not sliced
        self.timeslice = TimeSlice(self.requests, self.parking, sched.timeslice_ms,
                                   max(sched.timeslice_wait_ms, 2 * slo_ms))
        self.rotation = Rotation(
            self.st, self.requests, self.planner, self.parking, self.timeslice,
            lambda gen, now, also: _housekeeping(self.st, self.requests, self.timeslice, gen, now, also))
        self.steps = StepHandler(self.requests, self.st, self.stats,
                                 cfg.scheduler.recovery.max_request_retries)

    @property
    def epoch(self) -> int:
        """The recovery epoch (device resets so far); a job handed over in an older one is stale."""
        return self.st.epoch

    @property
    def slots(self) -> dict[JobEngine, DeviceJob | None]:
        """The job each job engine runs (read-only for the shells)."""
        return self.st.slots

    # ------------------------------------------------------------------------------ requests
    def add(self, seq: Seq, now: float) -> CoreOutput:
        """A request its generation's admission controller queued: the pass runs now, in the
        caller's call (spec §19 M1: no task hop between arrival and admission + prefill)."""
        self.requests.enqueue(seq)
        self._pass(now)
        return self._take()

    def abort(self, seq: Seq, reason: FinishReason | None, now: float,
              error: ErrorEvent | None = None) -> CoreOutput:
        """End ``seq`` early (cancel, stop string, shutdown); idempotent, the first reason wins.
        With a job on the device the ending is applied when it drains."""
        self.requests.stop(seq, reason, error, now=now)
        return self._take()

    def shutdown(self, now: float, message: str | None = None) -> CoreOutput:
        """Every live request ends with a shutdown error (those on the device when it drains)."""
        err = ErrorEvent(message or "the engine is shutting down", "shutdown")
        for q in self.requests.all_queues():
            for seq in [*q.waiting.values(), *q.holders.values()]:
                self.requests.stop(seq, error=err, now=now)
        return self._take()

    # ------------------------------------------------------------------------------ the pass
    def tick(self, now: float) -> CoreOutput:
        """One scheduling pass (the scheduler task's, or after an event)."""
        self.stats.passes += 1
        self._pass(now)
        return self._take()

    def take_releases(self, gen: Generation) -> list[Release]:
        return self.requests.take_releases(gen)

    def confirm_released(self, gen: Generation, batch: list[Release], now: float) -> CoreOutput:
        """The runtime freed ``batch``'s sequences (a device round trip the shell made): their lanes
        are free, and the next pass — which the output asks for — can admit into them. (A pass
        that frees inline uses the lanes in that same pass and asks for nothing.)"""
        self.requests.confirm_released(gen, batch, now)
        return _waking(self._take())

    def _take(self) -> CoreOutput:
        st = self.st
        out = st.out
        if self.requests.wake:
            self.requests.wake = False
            out.wake = True
        elif not (out.jobs or out.faults or out.release_gens or out.stops) and out.timer == math.inf:
            return NOTHING  # the common per-token answer: no new record on the hot path
        st.out = CoreOutput()
        return out

    def _pass(self, now: float) -> None:
        out = self.st.out
        paused = self.st.paused
        timer = math.inf
        reqs = self.requests
        self.parking.apply()
        for gen in list(self.models.generations.values()):
            timer = min(timer, _housekeeping(self.st, reqs, self.timeslice, gen, now))
        out.timer = min(out.timer, timer)
        if not paused:
            self.planner.dispatch(now)
            self.planner.stop_runs()

    # ------------------------------------------------------------------------------ completions
    def begin_prefill(self, job: DeviceJob, seq_id: int | None) -> bool:
        """Right before a prefill's submit: bind the runtime sequence the shell created (``seq_id``;
        None when it exists already) and open the lane's KV transaction. False: the lane was lost
        while the job was queued (a reset in between) — the job is refused."""
        seq = job.seqs[0]
        gen = job.gen
        if seq_id is not None:
            self.requests.bind_sequence(seq, seq_id)
        lane = seq.lease.lane
        if gen.kv.info(lane).state is not KvSequenceState.ACTIVE:
            return False
        gen.kv.begin_update(lane, seq.position, len(job.tokens))
        return True

    def on_completion(self, engine: JobEngine, job: DeviceJob, outcome: JobOutcome, now: float,
                      fast: FastStep | None = None) -> CoreOutput:
        """``engine`` answered ``job`` (general path; ``fast``: :meth:`fast_decode` already
        verified and sampled it and found a sequence that ends). Then the next work: the same
        sequences again when they are all the work there is, else a full pass."""
        if fast is not None:
            self.steps.complete(job, outcome, True, fast.sampled, fast.now, rows=fast.rows)
        else:
            self.steps.complete(job, outcome, False, None, now)
        slots = self.st.slots
        if slots.get(engine) is job:
            slots[engine] = None
        only = self.st.only
        cont = self.planner.continue_decode(job, now) if only is None or only is engine else None
        if cont is not None:
            self.planner.hand_over(engine, cont)
        else:
            # This pass is the one a wake from the completion (a request ended: its lane and its
            # admission slot are free) asks the scheduler task for: no second pass for it (~40-50
            # µs of cold code per request end, before the client may see its last token).
            self.requests.wake = False
            self._pass(now)
        return self._take()

    def fast_decode(self, engine: JobEngine, job: DeviceJob, outcome: JobOutcome, now: float
                    ) -> FastStep | None:
        """The next decode job, decided *before* ``job``'s completion is dispatched, or None.

        When every sequence of the job that just came back continues (no EOS/stop token, length,
        deadline, cancel) and they are all the work there is (:meth:`_can_continue`), the next
        job needs only the sampled tokens: the shell submits ``step.nxt`` first and calls
        :meth:`finish_fast` right after the submit. Nothing can observe the state in between
        (no checkpoint until the submit). The output is verified (echo + checksum) before any token
        is used; anything unusual returns None, or a step without ``nxt`` (a sequence ends: take
        :meth:`on_completion` with it, the tokens are drawn already)."""
        r = outcome.result
        if r is not None and r.lane_steps is not None:
            # a host-driven run with lanes short of their steps (stopped, or ended on their end
            # tokens): the job it ran
            self.stats.steps_cut_total += self.builder.ran_short(job, r)
        if r is None or r.status is not JobStatus.OK or outcome.timed_out:
            return None
        if self.requests.scoring and self.requests.scoring_in(job.seqs):
            return None  # a request scoring its prompt: the general path (StepHandler._scored)
        cont = self.planner.can_continue(job, engine, 0, now)
        if not cont and not self.rotation.may(job, now):
            return None
        if job.calbin.verify_lanes(r, job.job_id, job.active, expect(job)):
            return None  # crosstalk: _complete counts and reports it
        seqs = job.seqs
        eos = job.gen.source.eos_token_ids
        rows: list[list[int]] | None = None
        if job.steps > 1:  # a multi-step decode: every token of every lane against the finish rule
            rows = step_rows(job, r.logits, r.step_tokens)
            if rows is None:
                return None  # not to be trusted: the general path's check reports it
            tokens = [toks[-1] for toks in rows]
            sampled: Sampled = (tokens, [None] * len(seqs))
            for toks, s in zip(rows, seqs, strict=True):
                if ends_run(s, toks, s.generated, s.position, now, eos)[1] is not None:
                    return FastStep(engine, job, outcome, None, sampled, now, rows=rows)
            counts = [len(toks) for toks in rows]
            pending: int | list[int] = counts
            positions = [s.position + n for s, n in zip(seqs, counts, strict=True)]
        else:
            sampled = sample(job, seqs, r.logits)
            tokens = sampled[0]
            n_new = len(job.tokens) if job.kind == "prefill" else 1
            pending = 1
            for tok, s in zip(tokens, seqs, strict=True):
                if tok == SAMPLE_FAILED or ends(s, tok, s.generated + 1, s.position + n_new, now,
                                                eos) is not None:
                    return FastStep(engine, job, outcome, None, sampled, now)
            positions = [s.position + n_new for s in seqs]
        nxt: DeviceJob | None
        if cont:
            nxt = self.builder.continuation(job, tokens, positions, now, pending)
        else:
            nxt = self.rotation.next(engine, job, now)
            if nxt is None:  # the pass decides, with the tokens drawn already
                return FastStep(engine, job, outcome, None, sampled, now)
            self.stats.rotations_total += 1
        self.stats.fast_steps_total += 1
        self.st.slots[engine] = nxt
        nxt.epoch = self.st.epoch
        return FastStep(engine, job, outcome, nxt, sampled, now, rotated=not cont, rows=rows)

    def flush(self) -> None:
        """Deliver the deferred token messages to their actors (the shell calls it after the next
        submit, or when its engine goes idle)."""
        self.steps.flush()

    def finish_fast(self, step: FastStep) -> CoreOutput:
        """The bookkeeping of a fast step whose successor was submitted (or refused). Idempotent."""
        if step.finished:
            return self._take()
        step.finished = True
        assert step.nxt is not None
        # every sequence continues: fast_decode applied the finish rule as of step.now
        self.steps.complete(step.job, step.outcome, True, step.sampled, step.now, continuing=True,
                            rows=step.rows)
        if step.rotated:  # its sequences are decode-ready now: the rotation's batch passed them over
            self.planner.after_rotation(step.job)
        else:
            self.planner.commit_continuation(step.nxt)
        self.flush()
        return self._take()

    # ------------------------------------------------------------------------------ recovery
    def begin_recovery(self) -> None:
        """A fault is being recovered: every generation goes Recovering, no new job, a new epoch
        (results of jobs handed over before it are no new faults)."""
        for g in self.models.generations.values():
            if is_loading(g.state):
                continue  # still being built (its golden job fails on the reset: the load fails)
            if g.state is not ModelState.FAILED and ModelEvent.FAULT in TRANSITIONS[g.state]:
                g.fire(ModelEvent.FAULT)
        self.st.paused = True
        self.st.epoch += 1

    def bump_epoch(self) -> None:
        """A reset outside a recovery episode (the engine is shutting down and a wait timed out)."""
        self.st.epoch += 1

    def lose_kv_after_reset(self, gen: Generation, err: ErrorEvent, now: float) -> tuple[list[Seq], list[int]]:
        """After the reset and once every engine drained: the requests that held device KV are
        re-admitted (``scheduler.recovery.max_request_retries``) or end with ``err``; see
        :meth:`RequestTable.lose_kv_after_reset`."""
        q = self.requests.queues(gen)
        before = len(q.lost)
        out = self.requests.lose_kv_after_reset(gen, err, now, self.steps.max_retries)
        self.stats.readmitted_total += len(q.lost) - before
        return out

    def clear_lanes_after_reset(self, gen: Generation, reserved_only: list[Seq]) -> int:
        """The runtime sequences are freed: clear the lane table (quarantined Unknown lanes become
        Free only now) and give the reservation-only requests fresh lanes. Returns how many Unknown
        lanes were cleared."""
        gen.lane_seq.clear()
        held = gen.kv.clear_after_reset()
        self.requests.rereserve(gen, reserved_only)
        return sum(1 for h in held if h.state is KvSequenceState.UNKNOWN)

    def end_recovery(self, gen: Generation, failed: bool, reserved_only: list[Seq], now: float,
                     why: str = "reset budget or unknown DMA") -> None:
        """``gen`` recovered, or failed (``why``: reset budget, unknown DMA, a reset that failed):
        then its waiting, reservation-only and re-admitted requests end as unavailable."""
        if gen.state is not ModelState.RECOVERING:
            return
        if not failed:
            if not gen.retiring:
                gen.fire(ModelEvent.RECOVERED)
            elif not gen.drain_expired:  # a draining generation goes on draining
                gen.fire(ModelEvent.DRAIN)
            return  # past its drain deadline it stays Recovering until its jobs drained
        gen.fire(ModelEvent.FAIL)
        log.error("model %s generation %d failed (%s)", gen.alias, gen.id, why,
                  extra={"generation": gen.id})
        err = ErrorEvent(f"the model failed and is unavailable: {why}", "unavailable")
        for seq in list(self.requests.queues(gen).waiting.values()):
            self.requests.stop(seq, error=err, now=now)
        for seq in [*reserved_only, *self.requests.queues(gen).holders.values()]:
            self.requests.stop(seq, error=err, now=now)

    def resume(self, now: float) -> CoreOutput:
        """Recovery is over: new jobs again (a pass runs)."""
        self.st.paused = False
        self._pass(now)
        return _waking(self._take())

    def leftover_sequences(self, gen: Generation) -> list[int]:
        """At close, after the drain: the runtime sequences still bound to a lane (0 after a clean
        shutdown), forgotten here for the shell to free."""
        sids = sorted(set(gen.lane_seq.values()))
        gen.lane_seq.clear()
        return sids

    # ------------------------------------------------------------------------------ reading
    def inflight_jobs(self) -> int:
        return sum(1 for j in self.st.slots.values() if j is not None)

    def statistics(self, now: float) -> CoreStatistics:
        qs = self.requests.all_queues()
        oldest = {"decode": 0.0, "short": 0.0, "medium": 0.0, "long": 0.0}
        pre = {c.value: 0 for c in PREFILL_CLASSES}
        for q in qs:
            if q.decode_ready:
                first = min(s.ready_since for s in q.decode_ready.values())
                oldest["decode"] = max(oldest["decode"], now - first)
            for c, dq in q.prefill.items():
                live = [s for s in dq if not s.ended and s.inflight is None]
                pre[c.value] += len(live)
                if live and live[0].admitted_at is not None:
                    oldest[c.value] = max(oldest[c.value], now - live[0].admitted_at)
        b = self.builder.statistics()
        st = self.stats
        return CoreStatistics(
            waiting=sum(len(q.waiting) for q in qs), prefill_ready=pre,
            decode_ready=sum(len(q.decode_ready) for q in qs),
            holders=sum(len(q.holders) for q in qs), inflight_jobs=self.inflight_jobs(),
            queue_oldest_wait_s=oldest, batches_total=b.batches_total,
            lanes_active_total=b.lanes_active_total, lanes_total=b.lanes_total,
            prefill_jobs_total=b.prefill_jobs_total, batch_wait_s_total=b.batch_wait_s_total,
            continuations_total=b.continuations_total, decode_steps_total=b.decode_steps_total,
            kv_free_seconds_total=self.requests.kv_free_seconds_total, passes=st.passes,
            starvation_events_total=st.starvation_events_total, crosstalk_total=st.crosstalk_total,
            stale_total=st.stale_total, requeued_busy=st.requeued_busy,
            fast_steps_total=st.fast_steps_total, quarantined_jobs_total=st.quarantined_jobs_total,
            rotations_total=st.rotations_total,
            readmitted_total=st.readmitted_total,
            epoch=self.st.epoch, job_status_total=dict(st.job_status_total),
            parked=self.parking.parked(), parks_total=self.parking.parks_total,
            timeslices_total=self.parking.slices_total,
            runs_stopped_total=st.runs_stopped_total, steps_cut_total=st.steps_cut_total,
        )
