"""FaultWatch: the shell that watches the device's health between faults and applies degradation.

It owns the :class:`~calserve.engine.degrade.PingPongGuard` (spec §14), the observed job times
(:class:`~calserve.engine.step_times.StepTimes`, for the P99 condition and the hung-job timeout) and
the timed trace ring's device-job records. The executors report each job (:meth:`observe`) and each
DeviceBusy (:meth:`on_busy`); recovery reports faults, uncertain resets and the reset budget's level.
The verdict reaches the scheduling state only through the core's planner (:meth:`Planner.degrade`): new jobs on one
engine (PING), the smallest profile and an admission cool-down while the reset budget is spent.
Every change is logged once with its reason and counted (``calserve_pingpong_degradations_total``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from calserve.config import CalserveConfig
from calserve.engine.degrade import DegradeReason, GuardSettings, PingPongGuard
from calserve.engine.reset_budget import BudgetLevel
from calserve.engine.state import STATUS_NAMES, CoreOutput, DeviceJob, JobOutcome
from calserve.engine.step_times import StepTimes
from calserve.engine.trace import Timeline
from calserve.runtime.types import JobEngine, JobStatus

if TYPE_CHECKING:
    from calserve.engine.backend import DeviceBackend
    from calserve.engine.core import EngineCore

__all__ = ["FaultWatch", "COUNTER_CHECK_JOBS"]

log = logging.getLogger("calserve.engine.degrade")

#: the runtime's engine counters are checked for consistency once per this many jobs
COUNTER_CHECK_JOBS = 256
QUEUE_DEPTH = 2


def modeled_s(job: DeviceJob) -> float | None:
    """The job's modeled device time from its package's timing figures (None: no timing); a
    multi-step decode's per step."""
    batch = job.calbin.spec.compiled_batch
    t = job.gen.source.timing.get(batch)
    if t is None:
        return None
    if job.kind == "prefill":
        us = t.prefill_base_us + t.prefill_us_per_token * len(job.tokens)
    else:
        us = t.decode_step_us.get(batch, 0.0) or (max(t.decode_step_us.values())
                                                  if t.decode_step_us else 0.0)
    return us / 1e6 if us > 0 else None


class FaultWatch:
    def __init__(self, cfg: CalserveConfig, core: EngineCore, backend: DeviceBackend,
                 apply: Callable[[CoreOutput], None], engines: list[JobEngine],
                 clock: Callable[[], float]) -> None:
        ex = cfg.scheduler.executor
        d = ex.degrade
        self.guard = PingPongGuard(
            GuardSettings(d.enabled, d.busy_streak, d.fault_streak, d.p99_factor,
                          d.p99_min_samples, d.probation_s),
            pingpong=len(engines) >= 2)
        self.times = StepTimes(ex.hang_factor, ex.hang_min_ms / 1000, ex.wait_timeout_ms / 1000)
        self.timeline: Timeline = core.requests.timeline
        self.core = core
        self.backend = backend
        self._apply = apply
        self._clock = clock
        self._cooldown_s = cfg.scheduler.recovery.degraded_admit_cooldown_ms / 1000
        self.budget = BudgetLevel.OK
        self._admit_after = -math.inf
        self._jobs = 0
        # set by recovery when the device is lost (uncertain recovery): waits stop, jobs are abandoned
        self.device_lost = False

    # ------------------------------------------------------------------------------ executors
    def hang_timeout(self, job: DeviceJob) -> float:
        """How long ``job`` may take before it is hung (:meth:`StepTimes.timeout`). A decode job
        with a modeled step keeps the figure: it depends only on its profile's timing and the
        executor's settings, and every continuation (a copy of its predecessor) reuses it instead of
        looking the timing up again on the critical path to its submit. Without a modeled time it
        follows the observed P99 and is computed per job; so is a multi-step decode's (its steps
        vary from job to job)."""
        if job.steps > 1:
            return self.times.timeout("decode", job.calbin.spec.compiled_batch, modeled_s(job), job.steps)
        t = job.hang_timeout_s
        if t is not None:
            return t
        modeled = modeled_s(job)
        t = self.times.timeout(job.kind, job.calbin.spec.compiled_batch, modeled)
        if modeled is not None and job.kind == "decode":
            job.hang_timeout_s = t
        return t

    def observe(self, engine: JobEngine, job: DeviceJob, outcome: JobOutcome, t_submit: float,
                now: float) -> None:
        """A job came back (or was refused at submit)."""
        r = outcome.result
        batch = job.calbin.spec.compiled_batch
        if r is None:
            self.timeline.job(engine.name, job.kind, batch, len(job.seqs), job.job_id, t_submit, now,
                              0.0, "refused")
            return
        status = "timeout" if outcome.timed_out else STATUS_NAMES[r.status]
        name = engine.name
        self.guard.submitted(name)
        self.timeline.job(name, job.kind, batch, len(job.seqs), job.job_id, t_submit, now,
                          r.device_us / 1e6, status)
        if r.status is not JobStatus.OK or outcome.timed_out:
            return
        self.guard.job_ok()
        # hung-job timeouts: the host-observed time (what a wait must allow), per step of a
        # multi-step decode
        steps = job.steps
        self.times.add(job.kind, batch, (now - t_submit) / steps)
        if job.kind == "decode":
            # §14 P99 condition: the step on the device (the runtime's measured run time when it
            # reports one, not the host's round trip: a busy host is no device degradation)
            dev = (r.device_us / 1e6 if r.device_us > 0 else now - t_submit) / steps
            p99 = self.times.add("device", batch, dev)
            if p99 is not None and self.guard.step_p99(
                    p99, self.times.samples("device", batch), self._expected_step(job), now):
                self._changed(DegradeReason.P99, now,
                              f"P99 decode step {p99 * 1e3:.2f} ms at B{batch}")
        self._jobs += 1
        if self._jobs % COUNTER_CHECK_JOBS == 0:
            self._check_counters(now)

    def _expected_step(self, job: DeviceJob) -> float | None:
        """The modeled step of ``job``: what its ``device_us`` should be (the runtime counts it from
        the job's start on its engine, after any wait for the other engine's serialised share)."""
        return modeled_s(job)

    def on_busy(self, engine: JobEngine) -> None:
        now = self._clock()
        if self.guard.busy(now, engine.name):
            self._changed(DegradeReason.BUSY, now, f"{self.guard.s.busy_streak} DeviceBusy in a row")

    def _check_counters(self, now: float) -> None:
        for e in self.core.slots:
            try:
                c = self.backend.counters(e)
            except Exception:  # a statistics read must not break serving
                continue
            if self.guard.counters(c.submitted, c.completed, c.failed, c.inflight, QUEUE_DEPTH, now):
                self._changed(DegradeReason.ANOMALY, now, f"{e.name} counters {c}")
                return

    # ------------------------------------------------------------------------------ recovery
    def on_fault(self, reason: str) -> None:
        now = self._clock()
        r = self.guard.fault(reason, now)
        if r is not None:
            self._changed(r, now, f"job fault {reason}")

    def on_uncertain(self, why: str) -> None:
        now = self._clock()
        if self.guard.trigger(DegradeReason.UNCERTAIN, now):
            self._changed(DegradeReason.UNCERTAIN, now, why)

    def set_budget(self, level: BudgetLevel, now: float) -> None:
        """The reset budget's level after a reset (or after resets aged out of the window)."""
        was = self.budget
        self.budget = level
        degraded = level is BudgetLevel.DEGRADED
        if degraded:
            self._admit_after = now + self._cooldown_s
        turned = self.guard.hold(degraded, now)
        if degraded and was is not BudgetLevel.DEGRADED:
            log.warning("reset budget spent: degraded (one engine, smallest profile, admission "
                        "paused %.1fs after each reset)", self._cooldown_s,
                        extra={"reason": DegradeReason.RESET_BUDGET.value})
        elif was is BudgetLevel.DEGRADED and level is BudgetLevel.OK:
            log.warning("reset budget: resets aged out of the window, no longer degraded")
        if turned:
            self._log_single(DegradeReason.RESET_BUDGET, "reset budget spent")
        self._push(now)

    # ------------------------------------------------------------------------------ probation
    def next_check(self) -> float:
        return self.guard.reenable_at()

    def poll(self, now: float) -> None:
        if self.guard.poll(now):
            log.warning("PING/PONG re-enabled after its probation (%.0fs without a trigger)",
                        self.guard.s.probation_s or 0.0)
            self._push(now)

    # ------------------------------------------------------------------------------ applying
    def _log_single(self, reason: DegradeReason, detail: str) -> None:
        keep = self.guard.s.probation_s
        log.warning("PING/PONG degraded to one engine: reason=%s (%s); new jobs on PING, submitted "
                    "jobs drain; %s", reason.value, detail,
                    "re-enabled after a probation of %.0fs without a trigger" % keep
                    if keep is not None else "off until restart",
                    extra={"reason": reason.value})

    def _changed(self, reason: DegradeReason, now: float, detail: str) -> None:
        self._log_single(reason, detail)
        self._push(now)

    def _push(self, now: float) -> None:
        g = self.guard
        only = None if g.dual or not g.pingpong else JobEngine.PING
        batch_one = self.budget is BudgetLevel.DEGRADED
        self._apply(self.core.planner.degrade(only, batch_one, self._admit_after))
