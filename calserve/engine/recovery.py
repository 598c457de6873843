"""HealthRecovery: one recovery episode per device fault (spec §12, §14, §16), a shell of the core.

On a fault (CCU fault, unknown DMA, crosstalk, INVALID, or a wait past its timeout), reported by
the core's output (:class:`~calserve.engine.state.Fault`) or by an executor's timeout:

1. ``core.begin_recovery``: every generation goes Recovering, no new job, a new epoch;
2. the device is reset (this aborts every in-flight job; each completes ABORTED and its batch
   fails in the core with an explicit error — results of jobs handed over before the reset carry
   an older ``epoch`` and are not new faults);
3. once every engine drained, every request that held device KV (a reset invalidates every KV
   sequence) is re-admitted and re-prefilled from prompt + generated tokens, or — past
   ``recovery.max_request_retries`` consecutive faults, or with re-admission off — ends with an
   explicit ``ErrorEvent``; lanes that only held a reservation keep their request and get a fresh
   lane;
4. the runtime sequences are freed and the lane table cleared;
5. after ``DMA_UNKNOWN`` the calbin is reconfigured when ``recovery.restart_on_unknown_dma``,
   else the generation goes Failed;
6. ``recovery.max_resets_per_10min``: a fault beyond the budget still resets the device (a
   submitted job must drain), but the generation goes Failed, waiting requests end with an
   ``unavailable`` error and new ones get RejectUnavailable; :attr:`failed` is set so the HTTP layer
   drops readiness and ``calserve serve`` exits non-zero.

Recovery changes scheduling state only through the core's methods.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import trio

from calserve.config import CalserveConfig
from calserve.core.model_state import ModelState
from calserve.engine.backend import DeviceBackend
from calserve.engine.core import EngineCore
from calserve.engine.shell import Shell
from calserve.engine.state import DeviceJob, Fault
from calserve.engine.types import ErrorEvent

if TYPE_CHECKING:
    from calserve.engine.generations import ModelManager

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
    quarantined_kv_total: int
    recovery_seconds_total: float
    device_restarts_total: int = 0  # calbins reconfigured after DMA_UNKNOWN (restart_on_unknown_dma)


class HealthRecovery:
    def __init__(self, cfg: CalserveConfig, backend: DeviceBackend, models: ModelManager,
                 core: EngineCore, shell: Shell) -> None:
        self.cfg = cfg
        self.backend = backend
        self.models = models
        self.core = core
        self.shell = shell
        self._send, self._recv = trio.open_memory_channel[_Fault](256)
        self._running = False
        self._resets: collections.deque[float] = collections.deque()
        self.failed = trio.Event()
        self.faults_total: collections.Counter[str] = collections.Counter()
        self.resets_total = 0
        self.device_restarts_total = 0
        self.quarantined_kv_total = 0
        self.recovery_seconds_total = 0.0

    def report(self, fault: Fault) -> None:
        """A job ended in a fault of the current epoch (from a core output)."""
        self.faults_total[fault.reason] += 1
        job = fault.job
        if job.epoch < self.core.epoch:
            return
        try:
            self._send.send_nowait(_Fault(fault.reason, job.epoch, job.job_id))
        except trio.WouldBlock:  # 256 queued faults of the current epoch: one reset covers them
            pass

    async def on_timeout(self, job: DeviceJob) -> None:
        """A job's wait passed its timeout. Normally the recovery task resets the device; when it
        is gone (engine shutting down) the waiting executor resets it itself so the job drains."""
        if job.epoch < self.core.epoch:
            return
        if self._running:
            self.faults_total["timeout"] += 1
            self._send.send_nowait(_Fault("timeout", job.epoch, job.job_id))
        else:
            self.core.bump_epoch()
            await self.backend.reset()
            self.resets_total += 1

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._running = True
        try:
            task_status.started()
            async for fault in self._recv:
                if fault.epoch < self.core.epoch:
                    continue  # already covered by a later reset
                with trio.CancelScope(shield=True):
                    await self._recover(fault)
        finally:
            self._running = False

    async def _recover(self, fault: _Fault) -> None:
        t0 = time.monotonic()
        now = trio.current_time()
        core = self.core
        log.warning("device fault %s (job %d): resetting", fault.reason, fault.job_id,
                    extra={"job_id": fault.job_id, "reason": fault.reason})
        gens = list(self.models.generations.values())
        core.begin_recovery()
        while self._resets and self._resets[0] <= now - WINDOW_S:
            self._resets.popleft()
        over_budget = len(self._resets) >= self.cfg.scheduler.recovery.max_resets_per_10min
        await self.backend.reset()
        self._resets.append(now)
        self.resets_total += 1
        await self.shell.wait_idle()
        needs_reconfigure = self.backend.needs_reconfigure
        err = ErrorEvent(f"device reset after a {fault.reason} fault; the request's KV was lost",
                         "device_error")
        for g in gens:
            reserved_only, sids = core.lose_kv_after_reset(g, err, trio.current_time())
            await g.calbin.free_sequences(sids)
            self.quarantined_kv_total += core.clear_lanes_after_reset(g, reserved_only)
            failed = over_budget
            if needs_reconfigure and not failed:
                if self.cfg.scheduler.recovery.restart_on_unknown_dma:
                    for cb in g.calbins.values():  # after DMA_UNKNOWN each group member
                        await cb.reconfigure()
                    self.device_restarts_total += 1
                else:
                    failed = True
            core.end_recovery(g, failed, reserved_only, trio.current_time())
        if gens and all(g.state is ModelState.FAILED for g in gens):
            self.failed.set()
        self.shell.apply(core.resume(trio.current_time()))
        self.recovery_seconds_total += time.monotonic() - t0

    def statistics(self) -> RecoveryStats:
        return RecoveryStats(dict(self.faults_total), self.resets_total, self.quarantined_kv_total,
                             self.recovery_seconds_total, self.device_restarts_total)
