"""DeviceExecutor: one task per job engine (PING, and PONG when enabled), one job at a time.

The executor is a thin shell around :class:`~calserve.engine.core.EngineCore`: submit, wait on the
completion fd, hand the result to the core, submit what it returns (the core's output is applied
by the :class:`~calserve.engine.shell.Shell`).

Spec §12/§14 and STACK.md "Threads and cancellation": the whole submit + wait of a job is shielded,
so a job that reached the device is always waited for, even when the engine is being cancelled; KV
transactions are committed or rolled back only after the device answered (in the core). A wait past
``executor.wait_timeout_ms`` is reported as a device fault; the executor keeps waiting (the job ends
ABORTED once recovery reset the device) — a submitted job is never abandoned, except when recovery
declared the device lost (a reset that raised or left it faulted: the generation is Failed and the
process is about to exit or stays up answering 503).

Hung jobs: the wait's timeout is per job (:meth:`FaultWatch.hang_timeout`: a multiple of the
modeled or observed job time, ``executor.wait_timeout_ms`` at most). Each job is reported to the
:class:`~calserve.engine.fault_watch.FaultWatch` (trace ring, observed times, PING/PONG degradation).

PING/PONG: with ``executor.max_inflight: 2`` and a runtime whose profile has ``pingpong``, two
executors run independent batches with their own buffers; ``fixed_engine: true`` keeps a single
executor pinned to PING.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import trio

from calserve.engine.backend import BackendCalbin, JobTicket
from calserve.engine.completion import run_ends
from calserve.engine.core import EngineCore, FastStep
from calserve.engine.fault_watch import FaultWatch
from calserve.engine.shell import Shell
from calserve.engine.state import DeviceJob, JobOutcome
from calserve.runtime.types import CalrtError, DeviceBusy, DeviceFaulted, JobEngine, JobResult

__all__ = ["DeviceExecutor", "ExecutorStats"]

log = logging.getLogger("calserve.engine.executor")

BUSY_RETRIES = 3
BUSY_BACKOFF_S = 0.0005


@dataclasses.dataclass(frozen=True)
class ExecutorStats:
    engine: str
    busy: bool
    jobs: int
    submit_refused: int
    timeouts: int


class DeviceExecutor:
    def __init__(self, engine: JobEngine, core: EngineCore, shell: Shell, watch: FaultWatch) -> None:
        self.engine = engine
        self.core = core
        self.shell = shell
        self.watch = watch
        self._t_submit = 0.0
        # A fast step's FaultWatch.observe, run after its successor's submit and its own
        # bookkeeping and token delivery (see run() and _finish()).
        self._observe_later: tuple[DeviceJob, JobOutcome, float, float] | None = None
        self._send, self._recv = trio.open_memory_channel[DeviceJob](1)
        self.jobs = 0
        self.submit_refused = 0
        self.timeouts = 0

    def start(self, job: DeviceJob) -> None:
        """Hand a job over (sync, never blocks: the core hands one only to a free engine)."""
        self._send.send_nowait(job)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        core = self.core
        shell = self.shell
        async for first in self._recv:
            job: DeviceJob | None = first
            # One shielded scope per busy period (not per job): the only checkpoints inside are the
            # device waits, which must not be cancelled anyway; idle, the executor is cancellable.
            with trio.CancelScope(shield=True):
                # The previous completion's bookkeeping when its successor was decided first
                # (core.fast_decode): run right after that successor's submit.
                pending: FastStep | None = None
                while job is not None:
                    try:
                        outcome = await self._execute(job, pending)
                    finally:
                        if pending is not None:
                            self._finish(pending)  # idempotent; already done unless the submit failed
                    self.jobs += 1
                    if outcome.submit_error is not None:
                        # refused without reaching the device (no checkpoint so far): let the
                        # other tasks run before anything is retried
                        await trio.lowlevel.checkpoint()
                    now = trio.current_time()
                    fast = core.fast_decode(self.engine, job, outcome, now)
                    if fast is not None and fast.nxt is not None:
                        # Submit the continuation first; this completion is dispatched right after,
                        # and so is the watch's record of it: its statistics (a sort of the step
                        # times every 32 jobs, the counter check every 256) are off the critical
                        # path. Only an OK, verified completion gets here (the watch's fault paths
                        # stay in front), and what the watch may change (a degradation) applies
                        # from the job after the continuation.
                        self._observe_later = (job, outcome, self._t_submit, now)
                        job = fast.nxt
                        pending = fast
                        continue
                    self.watch.observe(self.engine, job, outcome, self._t_submit, now)
                    pending = None
                    try:
                        # The completion, then the next work at once (the same sequences again
                        # when they are all the work there is, else a full pass), without a
                        # scheduler task hop; the deferred token messages go out after the submit.
                        out = core.on_completion(self.engine, job, outcome, now, fast)
                    finally:
                        shell.engine_idle()
                    shell.apply(out)
                    try:
                        job = self._recv.receive_nowait()
                    except trio.WouldBlock:
                        job = None
                        core.flush()

    def _finish(self, step: FastStep) -> None:
        later, self._observe_later = self._observe_later, None
        self.shell.apply(self.core.finish_fast(step))  # its tokens go out first
        if later is not None:
            self.watch.observe(self.engine, *later)

    async def _execute(self, job: DeviceJob, pending: FastStep | None = None) -> JobOutcome:
        """Submit ``job`` and wait for it. ``pending``'s bookkeeping (else the deferred messages)
        runs right after the submit (and before any checkpoint on a way out of it: a refused
        submit, a busy back-off)."""
        after: Callable[[], None] = (self.core.flush if pending is None
                                     else lambda: self._finish(pending))
        cb: BackendCalbin = job.calbin  # the batch's profile member
        if job.host_driven:
            # a run the core asked to stop before it reached the device (Planner.stop_runs):
            # stopped once submitted; later asks reach the calbin through the shell
            first = after

            def after() -> None:
                first()
                if job.stop_asked:
                    cb.stop_steps(self.engine)

        watch = self.watch
        timeout = watch.hang_timeout(job)
        self._t_submit = trio.current_time()
        try:
            if job.epoch != self.core.epoch:
                raise DeviceFaulted("the device was reset after this job was built")
            if job.kind == "prefill":
                sid = await cb.create_sequence() if job.seqs[0].seq_id is None else None
                if not self.core.begin_prefill(job, sid):
                    raise DeviceFaulted("KV lane lost while the job was queued")
            for attempt in range(BUSY_RETRIES + 1):
                try:
                    ticket, r = await self._submit(job, after, timeout)
                    break
                except DeviceBusy:
                    watch.on_busy(self.engine)
                    if attempt == BUSY_RETRIES:
                        raise
                    after()  # nothing may wait behind the back-off
                    await trio.sleep(BUSY_BACKOFF_S * (attempt + 1))
        except CalrtError as e:
            self.submit_refused += 1
            return JobOutcome(submit_error=e)
        job.job_id = ticket.job_id
        if log.isEnabledFor(logging.DEBUG):
            ids = [s.rid for s in job.seqs]
            log.debug("job %d %s on %s: requests %s", job.job_id, job.kind, self.engine.name, ids,
                      extra={"job_id": job.job_id, "request_ids": ids})
        timed_out = False
        while r is None:
            if not timed_out:
                timed_out = True
                self.timeouts += 1
                log.warning("job %d: no completion after %.3fs (hung)", job.job_id, timeout,
                            extra={"job_id": job.job_id})
                await self.shell.on_timeout(job)
            if watch.device_lost:
                # uncertain recovery: the device may never answer; its generation is Failed
                log.error("job %d abandoned on %s: the device is lost", job.job_id, self.engine.name,
                          extra={"job_id": job.job_id})
                return JobOutcome(submit_error=DeviceFaulted("the device is lost"))
            r = await cb.wait(ticket, timeout)
        return JobOutcome(result=r, timed_out=timed_out)

    async def _submit(self, job: DeviceJob, after: Callable[[], None], timeout: float
                      ) -> tuple[JobTicket, JobResult | None]:
        cb: BackendCalbin = job.calbin
        if job.kind == "prefill":
            seq = job.seqs[0]
            assert seq.seq_id is not None
            return await cb.submit_prefill_wait(seq.seq_id, job.tokens, self.engine, timeout,
                                                after_submit=after, all_logits=job.all_logits)
        assert job.seq_ids is not None
        lane_steps = None
        if job.seq_steps is not None:  # each lane its own steps (inactive lanes: ignored)
            lane_steps = np.ones(len(job.lanes), np.int32)
            lane_steps[job.active] = job.seq_steps
        # A run the host drives ends each lane on its EOS or stop token (completion.run_ends)
        ends = run_ends(job) if job.host_driven else None
        # The previous completion's deferred per-token work runs once this job is on its way.
        return await cb.submit_decode_wait(
            job.seq_ids, job.tokens, job.positions, job.valid, self.engine, timeout,
            after_submit=after, steps=job.steps, lane_steps=lane_steps, ends=ends,
        )

    def statistics(self) -> ExecutorStats:
        return ExecutorStats(self.engine.name.lower(), self.core.slots.get(self.engine) is not None,
                             self.jobs, self.submit_refused, self.timeouts)
