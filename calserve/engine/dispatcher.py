"""CompletionDispatcher: turn one finished job into per-request progress (spec §7.4, §4).

Runs synchronously in the executor task right after the device answered, so the next decode batch
never waits for a per-request task hop: KV commit, sampling (one vectorised call for all lanes),
length/EOS finish decisions and the lane's return to the ready set all happen here. The request's
actor only sees a message per token (detokenising, stop strings, streaming).

Checks before any output is used: the job id, sequence id and position the device echoed for every
active lane, and the per-lane checksum of the logits row. A mismatch is crosstalk: the whole batch
fails (spec §7.4: no lane-level isolation is promised) and recovery is told.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np
import trio

from calserve.core.kv_state import KvSequenceState
from calserve.engine.jobs import DeviceJob, JobOutcome
from calserve.engine.sampler import LaneSampling, greedy_argmax, sample_batch
from calserve.engine.state import Seq, Tokens
from calserve.engine.types import ErrorEvent, FinishReason, TokenLogprob
from calserve.runtime.types import DeviceBusy, JobResult, JobStatus

if TYPE_CHECKING:
    from calserve.engine.executor import DeviceExecutor
    from calserve.engine.recovery import HealthRecovery
    from calserve.engine.scheduler import Scheduler

__all__ = ["CompletionDispatcher", "FastStep"]

log = logging.getLogger("calserve.engine.dispatcher")

def _lane_sampling(s: Seq) -> LaneSampling:
    sp = s.req.sampling
    return LaneSampling(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=s.seed,
                        step=s.generated, logprobs=sp.logprobs)


def _ends(s: Seq, tok: int, generated: int, position: int, now: float,
          eos: Collection[int]) -> FinishReason | None:
    """Why ``s`` ends with ``tok`` as its ``generated``-th token and ``position`` committed, or None.

    The one finish rule of a completed step: the general path (after the bookkeeping) and the fast
    path (before it, with the values the bookkeeping will set) must agree, or a continuation would
    be built for a sequence the bookkeeping ends."""
    sp = s.req.sampling
    if generated > sp.min_tokens and ((tok in eos and not sp.ignore_eos) or tok in sp.stop_token_ids):
        return FinishReason.STOP
    if generated >= sp.max_tokens or position >= s.lease.reserved_len:
        return FinishReason.LENGTH
    if s.deadline is not None and s.deadline <= now:
        return FinishReason.DEADLINE
    return None


#: The token of a lane whose sampling raised (:func:`_sample_each`): the request fails alone.
SAMPLE_FAILED = -1


def _sample_each(rows: np.ndarray, lanes: list[LaneSampling], rids: list[int]
                 ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Sample lane by lane after a batch raised: lanes that raise again get
    :data:`SAMPLE_FAILED` (their requests end with an error), the others their token."""
    tokens: list[int] = []
    lps: list[TokenLogprob | None] = []
    for i, ln in enumerate(lanes):
        try:
            r = sample_batch(rows[i:i + 1], [ln])
        except Exception:
            log.exception("sampling failed for request %d", rids[i], extra={"request_id": rids[i]})
            tokens.append(SAMPLE_FAILED)
            lps.append(None)
            continue
        tokens.append(int(r.tokens[0]))
        lps.append(r.logprobs[0])
    return tokens, lps


class FastStep:
    """A completion whose next job was decided before its bookkeeping (:meth:`fast_decode`).

    ``nxt`` is the continuation to submit now (None: some sequence ends, take the general path with
    the tokens already sampled). :meth:`finish` dispatches the completion and records the
    continuation; idempotent, so the executor can call it both right after the submit and on
    every way out of it."""

    __slots__ = ("disp", "job", "outcome", "nxt", "sampled", "now", "finished")

    def __init__(self, disp: CompletionDispatcher, job: DeviceJob, outcome: JobOutcome,
                 nxt: DeviceJob | None, sampled: tuple[list[int], list[TokenLogprob | None]],
                 now: float) -> None:
        self.disp = disp
        self.job = job
        self.outcome = outcome
        self.nxt = nxt
        self.sampled = sampled
        self.now = now  # the instant the decision was taken: the bookkeeping decides as of it too
        self.finished = False

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.disp.complete(self.job, self.outcome, verified=True, sampled=self.sampled, now=self.now)
        if self.nxt is not None:
            self.disp.sched.commit_continuation(self.nxt)
        self.disp.flush()


class CompletionDispatcher:
    def __init__(self, sched: Scheduler, recovery: HealthRecovery) -> None:
        self.sched = sched
        self.recovery = recovery
        self.crosstalk_total = 0
        self.stale_total = 0  # results of jobs aborted by our own reset
        self.requeued_busy = 0
        self.fast_steps_total = 0  # decode jobs submitted before their predecessor's bookkeeping
        # Sequences that continue decoding whose token message (``Seq.deferred``) is delivered after
        # the next job was submitted: the actor's per-token step (detokeniser, stream) is not needed
        # to decide or build the next job (spec §19 M1), and on a turnover step (a sequence ended,
        # the full scheduling pass runs) it would otherwise delay the submit by ~25 µs per lane.
        # Tenant charges are not deferred with it: the pass's fair order depends on them.
        # Invariant: a deferred message reaches its actor before any other message to it
        # (complete() of the next job flushes first; Scheduler.end delivers it before End), and no
        # later than the executor yielding without a job.
        self._deferred: list[Seq] = []

    def flush(self) -> None:
        """Deliver the deferred token messages to their actors."""
        d = self._deferred
        if not d:
            return
        self._deferred = []
        for s in d:
            msg = s.deferred
            if msg is not None:  # else Scheduler.end delivered it already
                s.deferred = None
                s.inbox.send_nowait(msg)

    def fast_decode(self, job: DeviceJob, outcome: JobOutcome, caller: DeviceExecutor) -> FastStep | None:
        """The next decode job, decided *before* ``job``'s completion is dispatched, or None.

        Spec §19 M1 / issue 7 host-device overlap: when every sequence of the decode job that just
        came back continues (no EOS/stop token, length, deadline, cancel) and they are all the work
        there is (:meth:`Scheduler.can_continue`), the next job only needs the sampled tokens: it is
        built and submitted first, and this completion's bookkeeping (KV commit, positions, messages
        to the actors, tenant charges, the continuation's scheduling state) runs right after the
        submit, while the device computes (:meth:`FastStep.finish`, passed as ``after_submit``).
        Nothing can observe the state in between: there is no checkpoint from here to the submit.
        The output is verified (echo + checksum) before any token is used; anything unusual returns
        None and takes the general path (:meth:`complete`), with the tokens already sampled."""
        r = outcome.result
        if (r is None or r.status is not JobStatus.OK or outcome.timed_out
                or not self.sched.can_continue(job, caller, 0)):
            return None
        if job.calbin.verify_lanes(r, job.job_id, job.active, self._expect(job)):
            return None  # crosstalk: complete() counts and reports it
        seqs = job.seqs
        sampled = self._sample(job, seqs, r.logits)
        tokens = sampled[0]
        now = trio.current_time()
        eos = job.gen.source.eos_token_ids
        n_new = len(job.tokens) if job.kind == "prefill" else 1
        for tok, s in zip(tokens, seqs, strict=True):
            if tok == SAMPLE_FAILED or _ends(s, tok, s.generated + 1, s.position + n_new, now,
                                             eos) is not None:
                return FastStep(self, job, outcome, None, sampled, now)
        nxt = self.sched.build_continuation(job, tokens, [s.position + n_new for s in seqs])
        self.fast_steps_total += 1
        return FastStep(self, job, outcome, nxt, sampled, now)

    def complete(
        self, job: DeviceJob, outcome: JobOutcome, verified: bool = False,
        sampled: tuple[list[int], list[TokenLogprob | None]] | None = None, now: float | None = None,
    ) -> None:
        """Dispatch ``job``'s completion. ``verified``/``sampled``/``now``: :meth:`fast_decode`
        already checked the output / drew the tokens (sampling is deterministic per request and
        step) / decided as of that instant (deadlines are judged at the same time both ways)."""
        self.flush()
        seqs = job.seqs
        for s in seqs:
            s.inflight = None
        if outcome.submit_error is not None:
            self._refused(job, seqs, outcome.submit_error)
        else:
            assert outcome.result is not None
            r = outcome.result
            if r.status is not JobStatus.OK:
                reason: str | None = r.status.name.lower()
            else:
                reason = None if verified else self._check(job, r)
            if reason is None:
                self._ok(job, seqs, r.logits, sampled, now)
            else:
                self._failed(job, seqs, reason, outcome.timed_out)
        # No scheduler wake here: the executor runs the scheduling pass inline right after this.

    # ---------------------------------------------------------------------------------------------
    @staticmethod
    def _expect(job: DeviceJob) -> list[tuple[int, int]]:
        """(seq_id, position) each active lane must echo: for a prefill, its last prompt position."""
        if job.kind == "decode":
            return job.expect
        s = job.lanes[0]
        assert s is not None and s.seq_id is not None
        return [(s.seq_id, s.position + len(job.tokens) - 1)]

    def _check(self, job: DeviceJob, r: JobResult) -> str | None:
        """None when every active lane's echo and checksum match; else "crosstalk"."""
        bad = job.calbin.verify_lanes(r, job.job_id, job.active, self._expect(job))
        if not bad:
            return None
        self.crosstalk_total += 1
        rids = [job.seqs[k].rid for k in bad]
        log.warning("crosstalk in job %d: lanes of requests %s", job.job_id, rids,
                    extra={"job_id": job.job_id, "request_ids": rids})
        return "crosstalk"

    def _refused(self, job: DeviceJob, seqs: list[Seq], err: BaseException) -> None:
        gen = job.gen
        for s in seqs:
            lane = s.lease.lane
            if gen.kv.info(lane).state is KvSequenceState.UPDATING:
                gen.kv.rollback(lane)
        if isinstance(err, DeviceBusy):
            self.requeued_busy += 1
            now = trio.current_time()
            for s in seqs:
                if s.pending_reason is not None or s.pending_error is not None:
                    self.sched.end(s, s.pending_reason, s.pending_error)
                elif job.kind == "prefill":
                    self.sched.requeue_prefill(s)
                else:
                    self.sched.set_ready(s, now)
            return
        err_ev = ErrorEvent(f"the device refused the job: {err}", "device_error")
        for s in seqs:
            self.sched.end(s, error=err_ev)

    def _failed(self, job: DeviceJob, seqs: list[Seq], reason: str, timed_out: bool) -> None:
        gen = job.gen
        stale = job.epoch < self.recovery.epoch
        for s in seqs:
            gen.kv.mark_unknown(s.lease.lane)
        if stale:
            self.stale_total += 1
            if timed_out:  # aborted by the reset its own timeout asked for: still quarantined
                self.recovery.quarantined_jobs_total += 1
        else:
            self.recovery.report(reason if not timed_out else "timeout", job)
        ids = [s.rid for s in seqs]
        log.warning("job %d failed (%s) for requests %s", job.job_id, reason, ids,
                    extra={"job_id": job.job_id, "request_ids": ids})
        ev = ErrorEvent(f"device fault ({'timeout' if timed_out else reason}) in job {job.job_id}",
                        "device_error")
        for s in seqs:
            self.sched.end(s, error=ev)

    @staticmethod
    def _sample(job: DeviceJob, seqs: list[Seq], logits: np.ndarray) -> tuple[list[int], list[TokenLogprob | None]]:
        if job.kind == "prefill":
            rows = logits[:1]
        else:
            # Active lanes are ascending: a contiguous prefix is a view, not a fancy-index copy.
            active = job.active
            n = len(active)
            rows = logits[:n] if active[-1] == n - 1 else logits[active]
        if all(s.req.sampling.temperature == 0.0 and s.req.sampling.logprobs is None for s in seqs):
            # what sample_batch returns for such lanes, minus its setup
            return greedy_argmax(rows), [None] * len(seqs)
        lanes = [_lane_sampling(s) for s in seqs]
        try:
            res = sample_batch(rows, lanes)
        except Exception:  # defence in depth: one lane's failure must not stop the engine
            return _sample_each(rows, lanes, [s.rid for s in seqs])
        return res.tokens.tolist(), res.logprobs

    def _ok(
        self, job: DeviceJob, seqs: list[Seq], logits: np.ndarray,
        sampled: tuple[list[int], list[TokenLogprob | None]] | None = None, now: float | None = None,
    ) -> None:
        gen = job.gen
        if now is None:
            now = trio.current_time()
        n_new = len(job.tokens) if job.kind == "prefill" else 1
        tokens, logprobs = sampled if sampled is not None else self._sample(job, seqs, logits)
        eos = gen.source.eos_token_ids
        prefill = job.kind == "prefill"
        for i, s in enumerate(seqs):
            gen.kv.commit(s.lease.lane, n_new)
            s.position += n_new
            if s.pending_reason is not None or s.pending_error is not None:
                self._charge(s, prefill, n_new)
                self.sched.end(s, s.pending_reason, s.pending_error)  # output dropped (drained)
                continue
            tok = tokens[i]
            if tok == SAMPLE_FAILED:
                self._charge(s, prefill, n_new)
                self.sched.end(s, error=ErrorEvent("sampling failed for this request", "internal"))
                continue
            first = s.generated == 0
            s.generated += 1
            s.last_token = tok
            if first:
                s.first_token_at = now
            reason = _ends(s, tok, s.generated, s.position, now, eos)
            # the EOS / stop token itself is not shown to the client
            msg = Tokens(tok, logprobs[i], first, reason is FinishReason.STOP)
            self._charge(s, prefill, n_new)
            if reason is None and not prefill:
                s.deferred = msg  # continues: delivered after the next submit (see flush)
                self._deferred.append(s)
                self.sched.set_ready(s, now)
                continue
            s.inbox.send_nowait(msg)
            if reason is not None:
                self.sched.end(s, reason)
            else:
                self.sched.set_ready(s, now)

    @staticmethod
    def _charge(s: Seq, prefill: bool, n_new: int) -> None:
        if prefill:
            s.prefilled = True
            s.gen.admission.charge(s.tenant, prefill_tokens=n_new, request_id=s.rid)
        else:
            s.gen.admission.charge(s.tenant, decode_tokens=1, request_id=s.rid)
