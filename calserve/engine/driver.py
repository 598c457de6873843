"""CoreDriver: the Trio shell that owns the engine core and applies what it returns.

It builds the parts at construction (no wiring afterwards): the :class:`EngineCore`, the
:class:`~calserve.engine.fault_watch.FaultWatch` (degradation, hung-job timeouts, the trace ring's
jobs), one :class:`DeviceExecutor` per enabled job engine and the :class:`HealthRecovery`, handing
each the core and itself (:class:`~calserve.engine.shell.Shell`). It also runs the scheduler task: a pass
when something changed or a timer (deadline, batching window) is due, and the device round trip
that frees ended requests' runtime sequences on runtimes whose free is not host bookkeeping.

It never busy-waits: with nothing to do the task sleeps on an event (set by an output that asks
for a pass) with a timer at the next deadline or batching-window expiry. An inline pass (after a
completion or a submit) wakes the task only when it moved the timer earlier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from calserve.config import CalserveConfig
from calserve.engine.backend import DeviceBackend
from calserve.engine.core import EngineCore
from calserve.engine.executor import DeviceExecutor
from calserve.engine.fault_watch import FaultWatch
from calserve.engine.recovery import HealthRecovery
from calserve.engine.reset_budget import ResetBudget
from calserve.engine.state import CoreOutput, DeviceJob
from calserve.runtime.types import JobEngine

if TYPE_CHECKING:
    from calserve.engine.generations import Generation, ModelManager

__all__ = ["CoreDriver"]


class CoreDriver:
    def __init__(self, cfg: CalserveConfig, backend: DeviceBackend, models: ModelManager,
                 engines: Sequence[JobEngine], budget: ResetBudget | None = None) -> None:
        self.core = EngineCore(cfg, models, engines)
        self.models = models
        self.watch = FaultWatch(cfg, self.core, backend, self.apply, list(engines), trio.current_time)
        self.recovery = HealthRecovery(cfg, backend, models, self.core, self, self.watch, budget)
        self.executors = {e: DeviceExecutor(e, self.core, self, self.watch) for e in engines}
        self._wake = trio.Event()
        # The timer the scheduler task sleeps with (-inf while it runs a pass itself).
        self._armed = -math.inf
        self._idle: trio.Event | None = None  # created only when someone waits
        self._progress: trio.Event | None = None  # set by the next output (the control plane waits)
        self._freeing: set[int] = set()  # generations whose sequences are being freed right now

    # ------------------------------------------------------------------------------ Shell
    def apply(self, out: CoreOutput) -> None:
        if self._progress is not None:
            self._progress.set()
            self._progress = None
        executors = self.executors
        for engine, job in out.jobs:
            executors[engine].start(job)
        for engine, job in out.stops:
            job.calbin.stop_steps(engine)
        if out.faults:
            for f in out.faults:
                self.recovery.report(f)
        if out.wake or out.release_gens or out.timer < self._armed:
            self._wake.set()

    def engine_idle(self) -> None:
        if self._progress is not None:
            self._progress.set()
            self._progress = None
        if self._idle is not None and not self.core.inflight_jobs():
            self._idle.set()
            self._idle = None

    async def wait_idle(self) -> None:
        while self.core.inflight_jobs():
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    async def wait_progress(self) -> None:
        """Return after the next core output was applied or a job came back (the control plane
        re-checks a draining generation then: no polling)."""
        if self._progress is None:
            self._progress = trio.Event()
        await self._progress.wait()

    async def on_timeout(self, job: DeviceJob) -> None:
        await self.recovery.on_timeout(job)

    # ------------------------------------------------------------------------------ tasks
    def wake(self) -> None:
        self._wake.set()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The scheduler task."""
        task_status.started()
        core = self.core
        while True:
            self._wake = trio.Event()
            self._armed = -math.inf
            out = core.tick(trio.current_time())
            self.apply(out)
            # Decide first, then free the ended requests' runtime sequences: freeing is a device
            # round trip (a thread hop), and admission/dispatch into the lanes already free need
            # not wait for it. The lanes it returns serve the next pass.
            for gen in out.release_gens:
                await self.free_released(gen)
            self._armed = out.timer
            with trio.move_on_at(out.timer):
                await self._wake.wait()

    async def free_released(self, gen: Generation) -> None:
        batch = self.core.take_releases(gen)
        if not batch:
            return
        # Shielded: once taken from the core the lanes must reach Free even if the engine is being
        # cancelled (else they would stay Releasing forever).
        self._freeing.add(gen.id)
        try:
            with trio.CancelScope(shield=True):
                await gen.calbin.free_sequences([r.seq_id for r in batch])
        finally:
            self._freeing.discard(gen.id)
        self.apply(self.core.confirm_released(gen, batch, trio.current_time()))

    def freeing(self, gen: Generation) -> bool:
        """A device round trip freeing ``gen``'s sequences is under way."""
        return gen.id in self._freeing
