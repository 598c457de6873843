"""StepHandler: what a job's completion does to the requests in it (spec §7.4, §4).

Checks before any output is used: the job id, sequence id and position the device echoed for every
active lane, and the per-lane checksum of the logits row; a mismatch is crosstalk and the whole
batch fails (spec §7.4: no lane-level isolation is promised). Then per request: KV commit, the
tenant's charge, the sampled token, the finish rule, the token message (deferred for a sequence
that continues: it goes out after the next submit), the return to the ready set. A refused submit
rolls the KV transaction back; DeviceBusy requeues. Owned by
:class:`~calserve.engine.core.EngineCore`; no trio, no clock.
"""

from __future__ import annotations

import logging

from calserve.core.kv_state import KvSequenceState
from calserve.core.request_state import TRANSITIONS, RequestEvent, RequestState
from calserve.engine.completion import (SAMPLE_FAILED, Sampled, ends, ends_run, expect, out_lanes, sample,
                                       step_rows)
from calserve.engine.core_stats import CoreState, CoreStats
from calserve.engine.requests import RequestTable, exhausted
from calserve.engine.state import STATUS_NAMES, DeviceJob, Fault, JobOutcome, Scored, Seq, TokenRun, Tokens
from calserve.engine.types import ErrorEvent, FinishReason, TokenLogprob
from calserve.runtime.types import DeviceBusy, DeviceFaulted, JobStatus

__all__ = ["StepHandler"]

_RUNNING = RequestState.DECODE_RUNNING
_DONE_TO = TRANSITIONS[_RUNNING][RequestEvent.DECODE_DONE]  # DecodeReady

log = logging.getLogger("calserve.engine.steps")


class StepHandler:
    def __init__(self, requests: RequestTable, st: CoreState, stats: CoreStats,
                 max_retries: int = 0) -> None:
        self.requests = requests
        self.st = st
        self.stats = stats
        # scheduler.recovery.max_request_retries: re-admit a request whose KV a fault lost
        self.max_retries = max_retries
        # decode completions through _ok_decode (False: the general per-lane path; tests compare)
        self.fast = True

    def flush(self) -> None:
        """Deliver the deferred token messages to their actors (after the next submit)."""
        d = self.st.deferred
        if not d:
            return
        self.st.deferred = []
        for s in d:
            msg = s.deferred
            if msg is not None:  # else end() delivered it already
                s.deferred = None
                s.inbox.send_nowait(msg)

    def complete(self, job: DeviceJob, outcome: JobOutcome, verified: bool,
                  sampled: Sampled | None, now: float, continuing: bool = False,
                  rows: list[list[int]] | None = None) -> None:
        """``job``'s completion as of ``now``. ``verified``: its echo and checksums were checked
        already; ``sampled``: its tokens were drawn already (``rows``: a multi-step decode's, by
        :func:`step_rows`); ``continuing``: the finish rule was applied already, as of ``now``, and
        no sequence ends (``EngineCore.fast_decode`` decided the next job on it: it is not
        evaluated twice)."""
        self.flush()
        seqs = job.seqs
        for s in seqs:
            s.inflight = None
        counts = self.stats.job_status_total
        if outcome.submit_error is not None:
            counts["refused"] = counts.get("refused", 0) + 1
            self._refused(job, seqs, outcome.submit_error, now)
            return
        r = outcome.result
        assert r is not None
        key = "timeout" if outcome.timed_out else STATUS_NAMES[r.status]
        counts[key] = counts.get(key, 0) + 1
        if r.status is not JobStatus.OK:
            reason: str | None = STATUS_NAMES[r.status]
        else:
            reason = None if verified else self._check(job, r)
        if reason is None and job.steps > 1:
            if rows is None:
                rows = step_rows(job, r.logits, r.step_tokens)
            if rows is None:
                reason = self._crosstalk(job, list(range(len(job.seqs))))
            else:
                self._ok_steps(job, seqs, rows, now, continuing)
                return
        if reason is None:
            self._ok(job, seqs, sampled if sampled is not None else sample(job, seqs, r.logits), now,
                     continuing)
        else:
            self._failed(job, seqs, reason, outcome.timed_out, now)

    def _check(self, job: DeviceJob, r: object) -> str | None:
        """None when every active lane's echo and checksum match; else "crosstalk" (spec §7.4: no
        lane-level isolation is promised, the whole batch fails)."""
        bad = job.calbin.verify_lanes(r, job.job_id, out_lanes(job), expect(job))
        if not bad:
            return None
        return self._crosstalk(job, bad)

    def _crosstalk(self, job: DeviceJob, bad: list[int]) -> str:
        self.stats.crosstalk_total += 1
        rids = [job.seqs[0 if job.all_logits else k].rid for k in bad]
        log.warning("crosstalk in job %d: lanes of requests %s", job.job_id, rids,
                    extra={"job_id": job.job_id, "request_ids": rids})
        return "crosstalk"

    def _refused(self, job: DeviceJob, seqs: list[Seq], err: BaseException, now: float) -> None:
        gen = job.gen
        reqs = self.requests
        for s in seqs:
            lane = s.lease.lane
            if gen.kv.info(lane).state is KvSequenceState.UPDATING:
                gen.kv.rollback(lane)
        if isinstance(err, DeviceBusy):
            self.stats.requeued_busy += 1
            self._requeue(job, seqs, now)
            return
        if self.max_retries > 0 and isinstance(err, DeviceFaulted):
            # refused because the device needs (or had) a reset: nothing ran; the request waits
            # where it was and the reset's bookkeeping re-admits it. A job of the current epoch
            # means a reset is due: no new job until it happened (else the refusals would loop).
            if job.epoch == self.st.epoch:
                self.st.paused = True
                self.st.out.faults.append(Fault("device_refused", job))
            self._requeue(job, seqs, now)
            return
        err_ev = ErrorEvent(f"the device refused the job: {err}", "device_error")
        for s in seqs:
            reqs.end(s, error=err_ev, now=now)

    def _requeue(self, job: DeviceJob, seqs: list[Seq], now: float) -> None:
        """A refused job ran nothing: its requests wait where they were (a pending ending applies)."""
        reqs = self.requests
        for s in seqs:
            if s.pending_reason is not None or s.pending_error is not None:
                reqs.end(s, s.pending_reason, s.pending_error, now=now)
            elif job.kind == "prefill":
                reqs.requeue_prefill(s)
            else:
                reqs.set_ready(s, now, RequestEvent.REQUEUE)

    def _failed(self, job: DeviceJob, seqs: list[Seq], reason: str, timed_out: bool, now: float) -> None:
        gen = job.gen
        for s in seqs:
            gen.kv.mark_unknown(s.lease.lane)
        if job.epoch < self.st.epoch:  # aborted by a reset already under way: no new fault
            self.stats.stale_total += 1
            if timed_out:  # aborted by the reset its own timeout asked for: still quarantined
                self.stats.quarantined_jobs_total += 1
        else:
            self.stats.quarantined_jobs_total += 1
            self.st.out.faults.append(Fault("timeout" if timed_out else reason, job))
            # the device faulted in this epoch: nothing new is dispatched until recovery reset it
            # (jobs submitted meanwhile would be refused or run on a faulted chip)
            self.st.paused = True
        ids = [s.rid for s in seqs]
        log.warning("job %d failed (%s) for requests %s", job.job_id, reason, ids,
                    extra={"job_id": job.job_id, "request_ids": ids})
        ev = ErrorEvent(f"device fault ({'timeout' if timed_out else reason}) in job {job.job_id}",
                        "device_error")
        reqs = self.requests
        if self.max_retries <= 0:
            for s in seqs:
                reqs.end(s, error=ev, now=now)
            return
        for s in seqs:  # transparent recovery: re-prefilled after the reset, from where it stopped
            if s.pending_reason is not None or s.pending_error is not None:
                reqs.end(s, s.pending_reason, s.pending_error, now=now)  # drained: its ending stands
            elif reqs.park_lost(s, self.max_retries):
                self.stats.readmitted_total += 1
                reqs.timeline.request(now, "lost", s.rid)
            else:
                reqs.end(s, error=exhausted(ev, s), now=now)

    def _scored(self, s: Seq, tok: int, logprob: TokenLogprob | None, prefill: bool,
                now: float) -> bool:
        """A step of a request scoring its prompt (``Seq.score_upto``), after its KV commit and
        charge: the step's logits scored the next prompt token ``tok``, which is the next decode
        input. Once every prompt token is scored, the scores go to the actor (before any token);
        with ``max_tokens`` 0 the request ends there. False: these logits are the first
        completion token's (a one-token prompt), to be sampled as usual."""
        reqs = self.requests
        k = s.score_upto
        assert k is not None and s.prompt_scores is not None
        done = RequestEvent.PREFILL_DONE if prefill else RequestEvent.DECODE_DONE
        scored_now = k < len(s.prompt)
        if scored_now:
            assert logprob is not None and tok == int(s.prompt[k])
            s.prompt_scores.append(logprob)
            s.last_token = tok
            k = s.score_upto = k + 1
            s.retries = 0
            if s.deadline is not None and s.deadline <= now:
                reqs.end(s, FinishReason.DEADLINE, now=now)
                return True
            if k < len(s.prompt):
                reqs.set_ready(s, now, done)
                return True
        s.score_upto = None  # every prompt token is scored
        reqs.scoring.discard(s.rid)
        s.inbox.send_nowait(Scored(tuple(s.prompt_scores)))
        s.prompt_scores = None
        if s.req.sampling.max_tokens == 0:
            reqs.end(s, FinishReason.LENGTH, now=now)
            return True
        if scored_now:  # the last prompt token is the next input: its logits draw the first token
            reqs.set_ready(s, now, done)
            return True
        return False

    def _ok_decode(self, job: DeviceJob, seqs: list[Seq], sampled: Sampled, now: float,
                   continuing: bool = False) -> None:
        """:meth:`_ok` for a decode job, the per-token path: the same steps in the same order per
        lane, with what is the same for every lane looked up once per batch (the KV table's and
        the admission controller's methods, the ready set, the deferred list, the EOS set) and
        the continuing lane's ready move inlined (DecodeRunning -> DecodeReady, the one move the
        table has for DECODE_DONE there; any other state takes the table's checked path).
        ``continuing`` (``EngineCore.finish_fast``: the next job is submitted already): each
        lane's token goes to its actor right after the lane's bookkeeping instead of waiting for
        :meth:`flush` (an inline token step never calls back into the core: a stream's park wish
        is applied by a task of its own, engine/park_requests.py)."""
        gen = job.gen
        reqs = self.requests
        tokens, logprobs = sampled
        eos = gen.source.eos_token_ids
        charge = gen.admission.charge_decoded
        ready = reqs.queues(gen).decode_ready
        deferred = self.st.deferred
        timeline = reqs.timeline
        stop = FinishReason.STOP
        new = tuple.__new__  # Tokens(...) without the NamedTuple's Python-level __new__
        # Every lane's KV commit first, in lane order, in one call (a commit touches only its own
        # lane's record, which nothing below reads before the commit would have happened).
        gen.kv.commit_decode([s.lease.lane for s in seqs])
        for s, tok, logprob in zip(seqs, tokens, logprobs, strict=True):
            position = s.position = s.position + 1
            rid = s.rid
            charge(s.req.tenant, rid)
            if s.pending_reason is not None or s.pending_error is not None:
                reqs.end(s, s.pending_reason, s.pending_error, now=now)  # output dropped (drained)
                continue
            if tok == SAMPLE_FAILED:
                reqs.end(s, error=ErrorEvent("sampling failed for this request", "internal"), now=now)
                continue
            generated = s.generated
            first = generated == 0
            generated = s.generated = generated + 1
            s.last_token = tok
            s.tokens.append(tok)
            s.retries = 0
            if first:
                s.first_token_at = now
                timeline.request(now, "first_token", rid)
            # (``continuing``: the fast step found that no sequence ends, with these values)
            reason = None if continuing else ends(s, tok, generated, position, now, eos)
            # the EOS / stop token itself is not shown to the client
            msg = new(Tokens, (tok, logprob, first, reason is stop))
            if reason is None:
                if s.state is _RUNNING:
                    s.state = _DONE_TO
                    s.ready_since = now
                    ready[rid] = s
                else:
                    reqs.set_ready(s, now, RequestEvent.DECODE_DONE)
                if continuing:  # the next job is submitted already: delivered now
                    s.inbox.send_nowait(msg)
                else:
                    s.deferred = msg  # continues: delivered after the next submit (see flush)
                    deferred.append(s)
                continue
            s.inbox.send_nowait(msg)
            reqs.end(s, reason, now=now)

    def _ok_steps(self, job: DeviceJob, seqs: list[Seq], rows: list[list[int]], now: float,
                  continuing: bool = False) -> None:
        """:meth:`_ok_decode` for a multi-step decode (each lane's steps' tokens: ``rows``):
        every lane's KV commit of all its steps (the device wrote and committed them); per lane,
        the steps charged, then its tokens through the finish rule as if each had been a step of
        its own (:func:`ends_run`), and those it keeps to its actor as one :class:`TokenRun`. A
        lane that ends on a token drops the ones after it (never shown: they follow its EOS /
        stop token, or an ending asked for while the job ran); a lane that continues gets every
        token, deferred on the general path as there."""
        gen = job.gen
        reqs = self.requests
        eos = gen.source.eos_token_ids
        charge = gen.admission.charge
        timeline = reqs.timeline
        stop = FinishReason.STOP
        new = tuple.__new__
        gen.kv.commit_decode([s.lease.lane for s in seqs], job.steps if job.seq_steps is None else job.seq_steps)
        for s, toks in zip(seqs, rows, strict=True):
            n = len(toks)  # its steps
            position = s.position
            s.position = position + n
            charge(s.req.tenant, decode_tokens=n, request_id=s.rid)
            if s.pending_reason is not None or s.pending_error is not None:
                reqs.end(s, s.pending_reason, s.pending_error, now=now)  # output dropped (drained)
                continue
            s.retries = 0
            generated = s.generated
            # (``continuing``: the fast step found that no sequence ends, with these values)
            k, reason = (n, None) if continuing else ends_run(s, toks, generated, position, now, eos)
            if k < n:
                toks = toks[:k]
            s.generated = generated + k
            s.last_token = toks[-1]
            s.tokens.extend(toks)
            first = generated == 0
            if first:
                s.first_token_at = now
                timeline.request(now, "first_token", s.rid)
            msg = new(TokenRun, (toks, first, reason is stop))
            if reason is not None:
                s.inbox.send_nowait(msg)
                reqs.end(s, reason, now=now)
                continue
            reqs.set_ready(s, now, RequestEvent.DECODE_DONE)
            if continuing:
                s.inbox.send_nowait(msg)
            else:
                s.deferred = msg  # continues: delivered after the next submit (see flush)
                self.st.deferred.append(s)

    def _ok(self, job: DeviceJob, seqs: list[Seq], sampled: Sampled, now: float,
            continuing: bool = False) -> None:
        if self.fast and job.kind == "decode" and not (
                self.requests.scoring and self.requests.scoring_in(seqs)):
            self._ok_decode(job, seqs, sampled, now, continuing)
            return
        gen = job.gen
        reqs = self.requests
        n_new = len(job.tokens) if job.kind == "prefill" else 1
        tokens, logprobs = sampled
        eos = gen.source.eos_token_ids
        prefill = job.kind == "prefill"
        adm = gen.admission
        for i, s in enumerate(seqs):
            gen.kv.commit(s.lease.lane, n_new)
            s.position += n_new
            if prefill and not s.generated:
                adm.charge(s.tenant, prefill_tokens=n_new, request_id=s.rid)
            else:  # a re-prefill after a fault is charged as the one token it yields: once
                adm.charge(s.tenant, decode_tokens=1, request_id=s.rid)
            if s.pending_reason is not None or s.pending_error is not None:
                reqs.end(s, s.pending_reason, s.pending_error, now=now)  # output dropped (drained)
                continue
            tok = tokens[i]
            if tok == SAMPLE_FAILED:
                reqs.end(s, error=ErrorEvent("sampling failed for this request", "internal"), now=now)
                continue
            if s.score_upto is not None and self._scored(s, tok, logprobs[i], prefill, now):
                continue
            first = s.generated == 0
            s.generated += 1
            s.last_token = tok
            s.tokens.append(tok)
            s.retries = 0
            if first:
                s.first_token_at = now
                reqs.timeline.request(now, "first_token", s.rid)
            reason = ends(s, tok, s.generated, s.position, now, eos)
            # the EOS / stop token itself is not shown to the client
            msg = Tokens(tok, logprobs[i], first, reason is FinishReason.STOP)
            if reason is None and not prefill:
                s.deferred = msg  # continues: delivered after the next submit (see flush)
                self.st.deferred.append(s)
                reqs.set_ready(s, now, RequestEvent.DECODE_DONE)
                continue
            s.inbox.send_nowait(msg)
            if reason is not None:
                reqs.end(s, reason, now=now)
            else:
                reqs.set_ready(s, now, RequestEvent.PREFILL_DONE if prefill else RequestEvent.DECODE_DONE)

