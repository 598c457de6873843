"""HealthRecovery (first version): one recovery episode per device fault (spec §12, §14, §16).

On a fault (CCU fault, unknown DMA, crosstalk, INVALID, or a wait past its timeout):

1. every generation goes Recovering: no new admission, no new job;
2. the device is reset (this aborts every in-flight job; each completes ABORTED and its batch
   fails in the dispatcher with an explicit error — results of jobs submitted before the reset carry
   an older ``epoch`` and are not new faults);
3. once every executor drained, every request still holding device KV ends with an explicit
   ``ErrorEvent`` (a reset invalidates every KV sequence; nothing is re-admitted silently); lanes
   that only held a reservation keep their request and get a fresh lane;
4. the runtime sequences are freed and the lane table cleared (``clear_after_reset``);
5. after ``DMA_UNKNOWN`` the calbin is reconfigured when ``recovery.restart_on_unknown_dma``,
   else the generation goes Failed;
6. ``recovery.max_resets_per_10min``: a fault beyond the budget still resets the device (a
   submitted job must drain), but the generation goes Failed, waiting requests end with an
   ``unavailable`` error and new ones get RejectUnavailable; :attr:`failed` is set so the HTTP layer
   drops readiness and ``calserve serve`` exits non-zero.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import trio

from calserve.config import CalserveConfig
from calserve.core.kv_state import KvSequenceState
from calserve.core.model_state import ModelEvent, ModelState
from calserve.engine.backend import DeviceBackend
from calserve.engine.types import ErrorEvent

if TYPE_CHECKING:
    from calserve.engine.executor import DeviceExecutor
    from calserve.engine.jobs import DeviceJob
    from calserve.engine.generations import ModelManager
    from calserve.engine.scheduler import Scheduler

__all__ = ["HealthRecovery", "RecoveryStats"]

log = logging.getLogger("calserve.engine.recovery")

WINDOW_S = 600.0


@dataclasses.dataclass(frozen=True)
class _Fault:
    reason: str
    epoch: int
    job_id: int


@dataclasses.dataclass(frozen=True)
class RecoveryStats:
    faults_total: dict[str, int]
    resets_total: int
    quarantined_jobs_total: int
    quarantined_kv_total: int
    recovery_seconds_total: float
    epoch: int


class HealthRecovery:
    def __init__(
        self, cfg: CalserveConfig, backend: DeviceBackend, models: ModelManager, sched: Scheduler
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.models = models
        self.sched = sched
        self.executors: list[DeviceExecutor] = []
        # Invariant: epoch counts device resets; a job remembers the epoch it was submitted in.
        self.epoch = 0
        self._send, self._recv = trio.open_memory_channel[_Fault](256)
        self._running = False
        self._resets: collections.deque[float] = collections.deque()
        self.failed = trio.Event()
        self.faults_total: collections.Counter[str] = collections.Counter()
        self.resets_total = 0
        self.quarantined_jobs_total = 0
        self.quarantined_kv_total = 0
        self.recovery_seconds_total = 0.0

    def report(self, reason: str, job: DeviceJob) -> None:
        """A job ended in a fault (called synchronously by the dispatcher)."""
        self.faults_total[reason] += 1
        self.quarantined_jobs_total += 1
        if job.epoch < self.epoch:
            return
        try:
            self._send.send_nowait(_Fault(reason, job.epoch, job.job_id))
        except trio.WouldBlock:  # 256 queued faults of the current epoch: one reset covers them
            pass

    async def on_timeout(self, job: DeviceJob) -> None:
        """A job's wait passed its timeout. Normally the recovery task resets the device; when it
        is gone (engine shutting down) the waiting executor resets it itself so the job drains."""
        if job.epoch < self.epoch:
            return
        if self._running:
            self.faults_total["timeout"] += 1
            self._send.send_nowait(_Fault("timeout", job.epoch, job.job_id))
        else:
            self.epoch += 1
            await self.backend.reset()
            self.resets_total += 1

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._running = True
        try:
            task_status.started()
            async for fault in self._recv:
                if fault.epoch < self.epoch:
                    continue  # already covered by a later reset
                with trio.CancelScope(shield=True):
                    await self._recover(fault)
        finally:
            self._running = False

    async def _recover(self, fault: _Fault) -> None:
        t0 = time.monotonic()
        now = trio.current_time()
        log.warning("device fault %s (job %d): resetting", fault.reason, fault.job_id,
                    extra={"job_id": fault.job_id, "reason": fault.reason})
        gens = list(self.models.generations.values())
        for g in gens:
            if g.state is not ModelState.FAILED and ModelEvent.FAULT in _fault_ok(g.state):
                g.fire(ModelEvent.FAULT)
        self.sched.paused = True
        while self._resets and self._resets[0] <= now - WINDOW_S:
            self._resets.popleft()
        over_budget = len(self._resets) >= self.cfg.scheduler.recovery.max_resets_per_10min
        self.epoch += 1
        await self.backend.reset()
        self._resets.append(now)
        self.resets_total += 1
        for ex in self.executors:
            await ex.wait_idle()
        needs_reconfigure = self.backend.needs_reconfigure
        err = ErrorEvent(f"device reset after a {fault.reason} fault; the request's KV was lost",
                         "device_error")
        for g in gens:
            q = self.sched.queues(g)
            reserved_only = []
            for seq in list(q.holders.values()):
                info = g.kv.info(seq.lease.lane)
                if info.state is KvSequenceState.RESERVED and seq.seq_id is None:
                    reserved_only.append(seq)
                    continue
                if info.state is not KvSequenceState.UNKNOWN:
                    g.kv.mark_unknown(seq.lease.lane)
                self.sched.end(seq, error=err)
            sids = sorted(set(g.lane_seq.values()) | {r[1] for r in q.releases})
            q.releases.clear()
            await g.calbin.free_sequences(sids)
            g.lane_seq.clear()
            held = g.kv.clear_after_reset()
            self.quarantined_kv_total += sum(1 for h in held if h.state is KvSequenceState.UNKNOWN)
            for seq in reserved_only:
                seq.lease = g.kv.reserve(seq.rid, g.id, seq.lease.reserved_len)
                assert seq.lease is not None
            failed = over_budget
            if needs_reconfigure and not failed:
                if self.cfg.scheduler.recovery.restart_on_unknown_dma:
                    for cb in g.calbins.values():  # after DMA_UNKNOWN each group member
                        await cb.reconfigure()
                else:
                    failed = True
            if g.state is ModelState.RECOVERING:
                if failed:
                    g.fire(ModelEvent.FAIL)
                    log.error("model %s generation %d failed (reset budget or unknown DMA)",
                              g.alias, g.id, extra={"generation": g.id})
                    self.sched.fail_generation_waiting(
                        g, ErrorEvent("the model failed and is unavailable", "unavailable")
                    )
                    for seq in reserved_only:
                        self.sched.stop(seq, error=ErrorEvent("the model failed", "unavailable"))
                else:
                    g.fire(ModelEvent.RECOVERED)
        if gens and all(g.state is ModelState.FAILED for g in gens):
            self.failed.set()
        self.sched.paused = False
        self.sched.wake()
        self.recovery_seconds_total += time.monotonic() - t0

    def statistics(self) -> RecoveryStats:
        return RecoveryStats(dict(self.faults_total), self.resets_total, self.quarantined_jobs_total,
                             self.quarantined_kv_total, self.recovery_seconds_total, self.epoch)


def _fault_ok(state: ModelState) -> frozenset[ModelEvent]:
    from calserve.core.model_state import TRANSITIONS

    return frozenset(TRANSITIONS[state])
