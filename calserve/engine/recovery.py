"""HealthRecovery: one recovery episode per device fault (spec §12, §14, §16), a shell of the core.

On a fault (CCU fault, unknown DMA, crosstalk, INVALID, or a job hung past its timeout), reported by
the core's output (:class:`~calserve.engine.state.Fault`) or by an executor's timeout:

1. the fault goes to the :class:`~calserve.engine.fault_watch.FaultWatch` (spec §14 degradation:
   crosstalk, anomaly, fault streaks move new jobs to one engine);
2. ``core.begin_recovery``: every generation goes Recovering, no new job, a new epoch;
3. the reset is counted in the reset budget (:mod:`calserve.engine.reset_budget`: ok / degraded /
   failed, persisted per board) and the device is reset (this aborts every in-flight job; each
   completes ABORTED and its batch fails in the core — results of jobs handed over before the
   reset carry an older ``epoch`` and are not new faults). A reset that raises or leaves the
   device faulted is retried (``recovery.reset_attempts`` in all); one that needed a retry is an
   uncertain recovery (degrades PING/PONG), one that never succeeds loses the device: waits stop,
   the generation goes Failed;
4. once every engine drained, every request that held device KV (a reset invalidates every KV
   sequence) is re-admitted and re-prefilled from prompt + generated tokens, or — past
   ``recovery.max_request_retries`` consecutive faults, or with re-admission off — ends with an
   explicit ``ErrorEvent``; lanes that only held a reservation keep their request and get a fresh
   lane;
5. the runtime sequences are freed and the lane table cleared;
6. after ``DMA_UNKNOWN`` the calbin is reconfigured when ``recovery.restart_on_unknown_dma``,
   else the generation goes Failed;
7. the budget's level applies: degraded (one engine, smallest profile, admission cool-down) or
   Failed: waiting requests end with an ``unavailable`` error (503 + Retry-After), new ones get
   RejectUnavailable, ``/ready`` answers 503, and with ``recovery.exit_on_failed`` :attr:`failed`
   is set so ``calserve serve`` exits 1 once the HTTP side answered.

Never a traceback crash: a reset, free or reconfigure that raises is logged and decides the
outcome (Failed), it does not escape the recovery task.

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
from calserve.engine.fault_watch import FaultWatch
from calserve.engine.reset_budget import BudgetLevel, ResetBudget
from calserve.engine.shell import Shell
from calserve.engine.state import DeviceJob, Fault
from calserve.engine.types import ErrorEvent

if TYPE_CHECKING:
    from calserve.engine.generations import ModelManager

__all__ = ["HealthRecovery", "RecoveryStats"]

log = logging.getLogger("calserve.engine.recovery")


@dataclasses.dataclass(frozen=True)
class _Fault:
    reason: str
    epoch: int
    job_id: int
    at: float  # when it was reported (trio clock)


@dataclasses.dataclass(frozen=True)
class RecoveryStats:
    faults_total: dict[str, int]
    resets_total: int
    quarantined_kv_total: int
    recovery_seconds_total: float
    # by fault reason: (episodes, seconds summed, worst) from the fault's report to the end of its
    # recovery
    recovery_seconds_by_reason: dict[str, tuple[int, float, float]] = dataclasses.field(
        default_factory=dict)
    uncertain_total: int = 0
    budget_level: str = "ok"
    resets_in_window: int = 0
    device_restarts_total: int = 0  # calbins reconfigured after DMA_UNKNOWN (restart_on_unknown_dma)


class HealthRecovery:
    def __init__(self, cfg: CalserveConfig, backend: DeviceBackend, models: ModelManager,
                 core: EngineCore, shell: Shell, watch: FaultWatch,
                 budget: ResetBudget | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        self.models = models
        self.core = core
        self.shell = shell
        self.watch = watch
        rc = cfg.scheduler.recovery
        self.budget = budget if budget is not None else ResetBudget(
            rc.max_resets_per_10min, rc.degraded_resets_per_10min)
        self._send, self._recv = trio.open_memory_channel[_Fault](256)
        self._running = False
        # Set when every generation is Failed and recovery.exit_on_failed: the host stops serving
        # and `calserve serve` exits 1. ``gave_up`` is set whenever every generation is Failed.
        self.failed = trio.Event()
        self.gave_up = False
        self.uncertain_total = 0
        # fault reason -> (episodes, seconds summed, worst): fault report to the end of its recovery
        self.recovery_seconds_by_reason: dict[str, tuple[int, float, float]] = {}
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
        self.watch.on_fault(fault.reason)
        try:
            self._send.send_nowait(_Fault(fault.reason, job.epoch, job.job_id, trio.current_time()))
        except trio.WouldBlock:  # 256 queued faults of the current epoch: one reset covers them
            pass

    async def on_timeout(self, job: DeviceJob) -> None:
        """A job's wait passed its timeout. Normally the recovery task resets the device; when it
        is gone (engine shutting down) the waiting executor resets it itself so the job drains."""
        if job.epoch < self.core.epoch:
            return
        if self._running:
            self.faults_total["timeout"] += 1
            self.watch.on_fault("timeout")
            try:
                self._send.send_nowait(_Fault("timeout", job.epoch, job.job_id, trio.current_time()))
            except trio.WouldBlock:
                pass
        else:
            self.core.bump_epoch()
            if not await self._reset_device():
                self.watch.device_lost = True

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._running = True
        try:
            # resets of the window persisted by an earlier process on this board
            level = self.budget.level(self.budget.clock())
            if level is not BudgetLevel.OK:  # a restart after Failed starts degraded
                self.watch.set_budget(BudgetLevel.DEGRADED, trio.current_time())
            task_status.started()
            while True:
                with trio.move_on_at(self._next_check()):
                    fault = await self._recv.receive()
                    if fault.epoch < self.core.epoch or self.watch.device_lost:
                        continue  # already covered by a later reset / nothing left to recover
                    with trio.CancelScope(shield=True):
                        # not while the control plane frees a generation's calbins
                        # (engine/control.py)
                        async with self.models.device_lock:
                            await self._recover(fault)
                    continue
                now = trio.current_time()
                self.watch.poll(now)  # PING/PONG probation
                if (self.watch.budget is BudgetLevel.DEGRADED
                        and self.budget.level(self.budget.clock()) is BudgetLevel.OK):
                    self.watch.set_budget(BudgetLevel.OK, now)
        finally:
            self._running = False

    def _next_check(self) -> float:
        """When the loop must look again without a fault: the probation's end, the oldest
        reset of the window ageing out while degraded."""
        at = self.watch.next_check()
        if self.watch.budget is BudgetLevel.DEGRADED:
            wall = self.budget.clock()
            at = min(at, trio.current_time() + max(0.0, self.budget.next_change(wall) - wall) + 0.001)
        return at

    async def _reset_device(self) -> bool:
        """Reset, retried up to ``recovery.reset_attempts`` times while it raises or leaves the
        device faulted. False: the device is lost (uncertain recovery). A retry that succeeded is
        uncertain too (reported to the watch)."""
        attempts = self.cfg.scheduler.recovery.reset_attempts
        for attempt in range(1, attempts + 1):
            try:
                await self.backend.reset()
            except Exception as e:  # a failing reset is an outcome, never a crash
                log.error("device reset failed (attempt %d of %d): %s", attempt, attempts, e)
                continue
            self.resets_total += 1
            if self.backend.healthy():
                if attempt > 1:
                    self.watch.on_uncertain(f"the reset succeeded only at attempt {attempt}")
                return True
            log.error("device still faulted after reset (attempt %d of %d)", attempt, attempts)
        self.uncertain_total += 1
        self.watch.on_uncertain(f"no healthy device after {attempts} reset attempts")
        return False

    async def _recover(self, fault: _Fault) -> None:
        t0 = time.monotonic()
        core = self.core
        log.warning("device fault %s (job %d): resetting", fault.reason, fault.job_id,
                    extra={"job_id": fault.job_id, "reason": fault.reason})
        # (an Unloaded generation still listed during a single-resident switch has no calbin)
        gens = [g for g in self.models.generations.values() if g.state is not ModelState.UNLOADED]
        core.begin_recovery()
        level = self.budget.record(self.budget.clock())
        ok = await self._reset_device()
        if not ok:
            self.watch.device_lost = True  # executors stop waiting: their jobs may never end
        await self.shell.wait_idle()
        needs_reconfigure = ok and self.backend.needs_reconfigure
        err = ErrorEvent(f"device reset after a {fault.reason} fault; the request's KV was lost",
                         "device_error")
        why = ("the device could not be recovered (reset failed)" if not ok else
               "the reset budget is spent" if level is BudgetLevel.FAILED else "")
        for g in gens:
            reserved_only, sids = core.lose_kv_after_reset(g, err, trio.current_time())
            try:
                await g.calbin.free_sequences(sids)
            except Exception as e:
                log.error("freeing sequences after the reset failed: %s", e)
                why = why or f"freeing sequences after the reset failed: {e}"
            self.quarantined_kv_total += core.clear_lanes_after_reset(g, reserved_only)
            failed = bool(why)
            if needs_reconfigure and not failed:
                if self.cfg.scheduler.recovery.restart_on_unknown_dma:
                    try:
                        for cb in g.calbins.values():  # after DMA_UNKNOWN each group member
                            await cb.reconfigure()
                        self.device_restarts_total += 1
                    except Exception as e:
                        log.error("reconfigure after DMA_UNKNOWN failed: %s", e)
                        failed = True
                else:
                    failed = True
            core.end_recovery(g, failed, reserved_only, trio.current_time(),
                              why or "unknown DMA without restart_on_unknown_dma")
        now = trio.current_time()
        if gens and all(g.state is ModelState.FAILED for g in gens):
            self._give_up(why or "unknown DMA")
        elif level is not BudgetLevel.FAILED:
            self.watch.set_budget(level, now)
        self.shell.apply(core.resume(now))
        self.recovery_seconds_total += time.monotonic() - t0
        took = now - fault.at
        n, total, worst = self.recovery_seconds_by_reason.get(fault.reason, (0, 0.0, 0.0))
        self.recovery_seconds_by_reason[fault.reason] = (n + 1, total + took, max(worst, took))

    def _give_up(self, why: str) -> None:
        self.gave_up = True
        exit_ = self.cfg.scheduler.recovery.exit_on_failed
        log.critical("every model generation failed (%s): %s", why,
                     "the process exits 1 once the HTTP side answered (recovery.exit_on_failed)"
                     if exit_ else "serving 503 until restarted (recovery.exit_on_failed: false)")
        if exit_:
            self.failed.set()

    def statistics(self) -> RecoveryStats:
        wall = self.budget.clock()
        return RecoveryStats(dict(self.faults_total), self.resets_total, self.quarantined_kv_total,
                             self.recovery_seconds_total, dict(self.recovery_seconds_by_reason),
                             self.uncertain_total,
                             "failed" if self.gave_up else self.watch.budget.value,
                             self.budget.count(wall), self.device_restarts_total)
