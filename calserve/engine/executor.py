"""DeviceExecutor: one task per job engine (PING, and PONG when enabled), one job at a time.

Spec §12/§14 and STACK.md "Threads and cancellation": the whole submit + wait of a job is shielded,
so a job that reached the device is always waited for, even when the engine is being cancelled; KV
transactions are committed or rolled back only after the device answered (in the dispatcher). A
wait past ``executor.wait_timeout_ms`` is reported as a device fault; the executor keeps waiting
(the job ends ABORTED once recovery reset the device) — a submitted job is never abandoned.

PING/PONG: with ``executor.max_inflight: 2`` and a runtime whose profile has ``pingpong``, two
executors run independent batches with their own buffers (each job has its own input/output
buffers in the runtime); ``fixed_engine: true`` keeps a single executor pinned to PING.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from calserve.core.kv_state import KvSequenceState
from calserve.engine.backend import BackendCalbin, JobTicket
from calserve.engine.jobs import DeviceJob, JobOutcome
from calserve.runtime.types import CalrtError, DeviceBusy, DeviceFaulted, JobEngine, JobResult

if TYPE_CHECKING:
    from calserve.engine.dispatcher import CompletionDispatcher
    from calserve.engine.recovery import HealthRecovery
    from calserve.engine.scheduler import Scheduler

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
    def __init__(
        self,
        engine: JobEngine,
        sched: Scheduler,
        dispatcher: CompletionDispatcher,
        recovery: HealthRecovery,
        wait_timeout_s: float,
    ) -> None:
        self.engine = engine
        self.sched = sched
        self.dispatcher = dispatcher
        self.recovery = recovery
        self.wait_timeout_s = wait_timeout_s
        self._send, self._recv = trio.open_memory_channel[DeviceJob](1)
        # Invariant: busy <=> a job was handed over and its completion was not dispatched yet.
        self.busy = False
        # Invariant: current is the job handed over by start() until its completion was dispatched.
        self.current: DeviceJob | None = None
        # Set (and dropped) when the executor becomes idle; created only when someone waits, so
        # the per-job path allocates nothing for it.
        self._idle: trio.Event | None = None
        self.jobs = 0
        self.submit_refused = 0
        self.timeouts = 0

    def start(self, job: DeviceJob) -> None:
        """Hand a job over (sync, never blocks: the scheduler only calls it when not busy)."""
        assert not self.busy
        self.busy = True
        self.current = job
        job.epoch = self.recovery.epoch
        self._send.send_nowait(job)

    async def wait_idle(self) -> None:
        while self.busy:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    def _set_idle(self) -> None:
        self.busy = False
        self.current = None
        if self._idle is not None:
            self._idle.set()
            self._idle = None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for first in self._recv:
            job: DeviceJob | None = first
            # One shielded scope per busy period (not per job): the only checkpoints inside are the
            # device waits, which must not be cancelled anyway; idle, the executor is cancellable.
            with trio.CancelScope(shield=True):
                # The previous completion's bookkeeping when its successor was decided first
                # (dispatcher.fast_decode): run right after that successor's submit.
                pending: Callable[[], None] | None = None
                while job is not None:
                    try:
                        outcome = await self._execute(job, pending)
                    finally:
                        if pending is not None:
                            pending()  # idempotent; already done unless the submit failed
                    self.jobs += 1
                    fast = self.dispatcher.fast_decode(job, outcome, self)
                    if fast is not None and fast.nxt is not None:
                        # Submit the continuation first; this completion is dispatched right after.
                        self.current = job = fast.nxt
                        job.epoch = self.recovery.epoch
                        pending = fast.finish
                        continue
                    pending = None
                    try:
                        if fast is not None:
                            fast.finish()  # a sequence ends: dispatch with the tokens already drawn
                        else:
                            self.dispatcher.complete(job, outcome)
                    except BaseException:
                        self.sched.wake()
                        raise
                    finally:
                        self._set_idle()
                    # Start the next job now, without a scheduler task hop and without yielding to
                    # the request actors first (they run while the device computes): the same
                    # sequences again when they are all the work there is (on this executor), else
                    # the completion's full scheduling pass (it wakes the scheduler task only if
                    # needed). The deferred token messages go out after the next submit.
                    cont = self.sched.continue_decode(job)
                    if cont is not None:
                        self.start(cont)
                    else:
                        self.sched.tick_sync()
                    try:
                        job = self._recv.receive_nowait()
                    except trio.WouldBlock:
                        job = None
                        self.dispatcher.flush()

    async def _execute(self, job: DeviceJob, pending: Callable[[], None] | None = None) -> JobOutcome:
        """Submit ``job`` and wait for it. ``pending`` runs right after the submit (and before any
        checkpoint on a way out of it: a refused submit, a busy back-off)."""
        after = self.dispatcher.flush if pending is None else pending
        gen = job.gen
        cb: BackendCalbin = job.calbin  # the batch's profile member
        try:
            if job.epoch != self.recovery.epoch:
                raise DeviceFaulted("the device was reset after this job was built")
            if job.kind == "prefill":
                seq = job.lanes[0]
                assert seq is not None
                lane = seq.lease.lane
                if seq.seq_id is None:
                    sid = await cb.create_sequence()
                    seq.seq_id = sid
                    gen.kv.bind(lane, sid)
                    gen.lane_seq[lane] = sid
                if gen.kv.info(lane).state is not KvSequenceState.ACTIVE:
                    raise DeviceFaulted("KV lane lost while the job was queued")
                gen.kv.begin_update(lane, seq.position, len(job.tokens))
            for attempt in range(BUSY_RETRIES + 1):
                try:
                    ticket, r = await self._submit(job, after)
                    break
                except DeviceBusy:
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
                log.warning("job %d: no completion after %.3fs", job.job_id, self.wait_timeout_s,
                            extra={"job_id": job.job_id})
                await self.recovery.on_timeout(job)
            r = await cb.wait(ticket, self.wait_timeout_s)
        return JobOutcome(result=r, timed_out=timed_out)

    async def _submit(self, job: DeviceJob, after: Callable[[], None]) -> tuple[JobTicket, JobResult | None]:
        cb: BackendCalbin = job.calbin
        if job.kind == "prefill":
            seq = job.lanes[0]
            assert seq is not None and seq.seq_id is not None
            return await cb.submit_prefill_wait(seq.seq_id, job.tokens, self.engine, self.wait_timeout_s,
                                                after_submit=after)
        assert job.seq_ids is not None
        # The previous completion's deferred per-token work runs once this job is on its way.
        return await cb.submit_decode_wait(
            job.seq_ids, job.tokens, job.positions, job.valid, self.engine, self.wait_timeout_s,
            after_submit=after,
        )

    def statistics(self) -> ExecutorStats:
        return ExecutorStats(self.engine.name.lower(), self.busy, self.jobs, self.submit_refused,
                             self.timeouts)
