"""PingPongGuard: when to stop giving new jobs to the second job engine (spec §14), as pure logic.

Spec §14: PING/PONG in flight is an experiment until a trace proves overlap, and it degrades
automatically on any of: output crosstalk, a status/counter anomaly, P99 step time beyond a
threshold, consecutive DeviceBusy/timeouts, an uncertain recovery. Degrading affects only new
jobs: jobs already submitted on either engine drain.

This module decides; it owns no engine and reads no clock (every method takes ``now``). The
recovery shell feeds it the fault reports and the executors feed it their submits and steps; the
core applies the verdict (:meth:`Planner.degrade`, through the fault watch). Conditions
(``scheduler.executor.degrade``):

- ``crosstalk``: a job's echo/checksum showed another lane's data;
- ``anomaly``: a job ended ``INVALID`` or ``ABORTED`` without our reset, or the runtime's engine
  counters are inconsistent (completed + failed > submitted, in flight beyond the queue depth);
- ``p99``: the P99 of the last observed steps of a profile is above ``p99_factor`` x its modeled
  step (only where the timing model gives one; at least ``p99_min_samples`` steps);
- ``busy``: ``busy_streak`` consecutive submits refused with DeviceBusy;
- ``faults``: ``fault_streak`` consecutive jobs ending in a timeout or CCU fault with no good job
  in between;
- ``uncertain``: a reset raised or left the device faulted (retried, then possibly Failed);
- ``reset_budget``: the reset budget is spent (:mod:`calserve.engine.reset_budget`).

Re-enable: ``probation_s`` after the last trigger (every trigger restarts it) PING/PONG is on
again; ``probation_s: null`` keeps it off until restart. ``reset_budget`` holds it off by itself
while the budget stays spent, whatever the probation.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math

__all__ = ["DegradeReason", "PingPongGuard", "GuardSettings"]


class DegradeReason(enum.Enum):
    CROSSTALK = "crosstalk"
    ANOMALY = "anomaly"
    P99 = "p99"
    BUSY = "busy"
    FAULTS = "faults"
    UNCERTAIN = "uncertain"
    RESET_BUDGET = "reset_budget"


@dataclasses.dataclass(frozen=True)
class GuardSettings:
    enabled: bool = True
    busy_streak: int = 4
    fault_streak: int = 2
    p99_factor: float | None = 3.0
    p99_min_samples: int = 64
    probation_s: float | None = 60.0


#: "faults" streak: the fault reasons that count (a timeout or a compute fault in a row)
STREAK_FAULTS = frozenset(("timeout", "ccu_fault"))
#: job statuses that are a status anomaly when they end a job of the current epoch
ANOMALY_FAULTS = frozenset(("invalid", "aborted"))


class PingPongGuard:
    """``dual``: whether new jobs may go to both engines. Available only when ``pingpong`` (two
    engines configured); a single-engine configuration never degrades (nothing to move)."""

    def __init__(self, settings: GuardSettings, pingpong: bool) -> None:
        self.s = settings
        self.pingpong = pingpong
        self.dual = pingpong
        self.reason: DegradeReason | None = None  # why it is single now (the last trigger)
        self.since = 0.0  # when it went single
        self.last_trigger = -math.inf
        self.held = False  # reset_budget: single whatever the probation
        self.degradations_total: collections.Counter[str] = collections.Counter()
        self._busy: dict[str, int] = {}
        self._faults = 0

    # ------------------------------------------------------------------------------ inputs
    def trigger(self, reason: DegradeReason, now: float) -> bool:
        """A condition fired: single engine from now on. True when this turned PING/PONG off (the
        caller logs it and tells the core); a trigger while single only restarts the probation."""
        if not (self.pingpong and self.s.enabled):
            return False
        self.last_trigger = now
        if not self.dual:
            return False
        self.dual = False
        self.reason = reason
        self.since = now
        self.degradations_total[reason.value] += 1
        return True

    def fault(self, reason: str, now: float) -> DegradeReason | None:
        """A job of the current epoch ended in fault ``reason`` (lower-case status, "crosstalk",
        "timeout", "device_refused"). Returns the condition it turned on, else None."""
        r: DegradeReason | None = None
        if reason == "crosstalk":
            r = DegradeReason.CROSSTALK
        elif reason in ANOMALY_FAULTS:
            r = DegradeReason.ANOMALY
        elif reason in STREAK_FAULTS:
            self._faults += 1
            if self._faults >= self.s.fault_streak:
                r = DegradeReason.FAULTS
        return r if r is not None and self.trigger(r, now) else None

    def job_ok(self) -> None:
        """A job completed OK: the fault streak restarts."""
        self._faults = 0

    def busy(self, now: float, engine: str = "") -> bool:
        """A submit on ``engine`` was refused with DeviceBusy. True when this turned PING/PONG off."""
        n = self._busy[engine] = self._busy.get(engine, 0) + 1
        return n >= self.s.busy_streak and self.trigger(DegradeReason.BUSY, now)

    def submitted(self, engine: str = "") -> None:
        """A submit on ``engine`` was accepted: its busy streak restarts."""
        self._busy[engine] = 0

    def step_p99(self, p99_s: float, samples: int, modeled_s: float | None, now: float) -> bool:
        """The recent P99 step time of a profile against its modeled step. True when this turned
        PING/PONG off."""
        f = self.s.p99_factor
        if (f is None or modeled_s is None or modeled_s <= 0 or samples < self.s.p99_min_samples
                or p99_s <= f * modeled_s):
            return False
        return self.trigger(DegradeReason.P99, now)

    def counters(self, submitted: int, completed: int, failed: int, inflight: int, depth: int,
                 now: float) -> bool:
        """One engine's runtime counters. Inconsistent ones are an anomaly (True: turned off)."""
        bad = completed + failed > submitted or inflight > depth or inflight < 0
        return bad and self.trigger(DegradeReason.ANOMALY, now)

    def hold(self, on: bool, now: float) -> bool:
        """The reset budget is spent (``on``) or no longer: single engine while held. True when
        this turned PING/PONG off."""
        self.held = on
        return on and self.trigger(DegradeReason.RESET_BUDGET, now)

    # ------------------------------------------------------------------------------ re-enable
    def reenable_at(self) -> float:
        """When PING/PONG may come back (inf: not while held, never by config, or dual now)."""
        if self.dual or not self.pingpong or self.held or self.s.probation_s is None:
            return math.inf
        return self.last_trigger + self.s.probation_s

    def poll(self, now: float) -> bool:
        """True when the probation passed and PING/PONG is on again (the caller tells the core)."""
        if self.dual or now < self.reenable_at():
            return False
        self.dual = True
        self.reason = None
        self._busy.clear()
        self._faults = 0
        return True

    @property
    def state(self) -> str:
        """``dual`` | ``single`` (degraded) | ``off`` (one engine configured)."""
        if not self.pingpong:
            return "off"
        return "dual" if self.dual else "single"
