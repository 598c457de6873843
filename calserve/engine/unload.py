"""Unloader: drain a generation and free everything it holds on the device (spec §12).

Ready -> Draining: new requests are refused by admission (503 + Retry-After); with
``admit_waiting`` (a replacement) the requests already queued for it are still admitted and finish
on it, else (an unload) they end at once with an error; admitted ones finish, or are cancelled at
the drain deadline; submitted jobs always drain. A job still on the device at the deadline sends
the generation to Recovering, and nothing of it is freed until that job came back (the executor's
wait timeout resets the device if it never does). Then: the ended requests' sequences are freed,
the calbins released (pools, KvManager, weights), and the device DRAM it was charged is checked to
be back -> Unloaded. Waiting is on the driver's progress event (every applied core output, every
job that came back): no polling.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import trio

from calserve.core.model_state import TRANSITIONS, ModelEvent, ModelState
from calserve.engine.backend import DeviceBackend
from calserve.engine.generations import Generation, ModelManager, release_members
from calserve.engine.types import ErrorEvent

if TYPE_CHECKING:
    from calserve.engine.driver import CoreDriver

__all__ = ["Unloader", "PhaseHistogram", "PHASES", "PHASE_BUCKETS"]

log = logging.getLogger("calserve.engine.unload")

#: The phases whose durations are recorded (``calserve_model_phase_seconds``).
PHASES = ("load", "configure", "warmup", "drain", "unload")
#: Histogram buckets of the phase durations (seconds).
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

@dataclasses.dataclass
class PhaseHistogram:
    """Cumulative bucket counts (the metrics layer exposes them; no prometheus in the engine)."""

    buckets: list[int] = dataclasses.field(default_factory=lambda: [0] * len(PHASE_BUCKETS))
    count: int = 0
    total: float = 0.0

    def observe(self, s: float) -> None:
        self.count += 1
        self.total += s
        for i, b in enumerate(PHASE_BUCKETS):
            if s <= b:
                self.buckets[i] += 1



class Unloader:
    def __init__(self, backend: DeviceBackend, models: ModelManager, driver: CoreDriver,
                 nursery: trio.Nursery) -> None:
        self.backend = backend
        self.models = models
        self.driver = driver
        self.core = driver.core
        self.nursery = nursery
        self.phases = {p: PhaseHistogram() for p in PHASES}
        self.dram_mismatch_total = 0
        self.retiring: set[int] = set()  # generations draining in the background

    def in_background(self, gen: Generation, drain_timeout_s: float) -> None:
        self.retiring.add(gen.id)

        async def run() -> None:
            try:
                await self.retire(gen, drain_timeout_s, admit_waiting=True)
            except Exception:
                log.exception("model %s generation %d: background unload failed", gen.alias,
                              gen.id, extra={"model": gen.alias, "generation": gen.id})
            finally:
                self.retiring.discard(gen.id)

        self.nursery.start_soon(run, name=f"retire-g{gen.id}")

    async def retire(self, gen: Generation, timeout_s: float, *, admit_waiting: bool,
                      keep_listed: bool = False) -> int:
        """Drain then unload ``gen`` (spec §12); returns the device DRAM freed."""
        core, driver = self.core, self.driver
        t0 = time.monotonic()
        gen.retiring = True
        gen.admit_waiting = admit_waiting
        if ModelEvent.DRAIN in TRANSITIONS[gen.state] and gen.state is not ModelState.RECOVERING:
            gen.fire(ModelEvent.DRAIN)  # Ready -> Draining (Recovering: recovery moves it on)
        if not admit_waiting:
            self._end_requests(gen, ErrorEvent(f"model {gen.alias!r} is being unloaded",
                                               "unavailable"), waiting_only=True)
        with trio.move_on_after(timeout_s):
            while self.load_of(gen) != (0, 0):
                await driver.wait_progress()
        if self.load_of(gen) != (0, 0):
            gen.drain_expired = True
            active, jobs = self.load_of(gen)
            log.warning("model %s generation %d: drain deadline passed with %d requests, %d jobs "
                        "on the device: cancelling", gen.alias, gen.id, active, jobs,
                        extra={"model": gen.alias, "generation": gen.id})
            self._end_requests(gen, ErrorEvent(
                f"model {gen.alias!r} generation {gen.id} was unloaded: its drain deadline "
                "passed", "unavailable"), waiting_only=False)
            if jobs and gen.state is ModelState.DRAINING:
                gen.fire(ModelEvent.FAULT)  # spec §12: never free a buffer under a running job
            with trio.CancelScope(shield=True):  # submitted jobs always drain
                while self.load_of(gen) != (0, 0):
                    await driver.wait_progress()
        self.phases["drain"].observe(time.monotonic() - t0)
        freed = 0
        with trio.CancelScope(shield=True):
            freed = await self._free(gen, keep_listed)
        return freed

    def load_of(self, gen: Generation) -> tuple[int, int]:
        """(requests of ``gen`` not ended, jobs of ``gen`` on the device)."""
        jobs = sum(1 for j in self.core.slots.values() if j is not None and j.gen is gen)
        return self.core.requests.load_of(gen), jobs

    def _end_requests(self, gen: Generation, err: ErrorEvent, *, waiting_only: bool) -> None:
        """End ``gen``'s waiting (and, unless ``waiting_only``, admitted) requests with ``err``;
        one with a job on the device ends when it drains. Then a pass (its output applied)."""
        now = trio.current_time()
        table = self.core.requests
        q = table.queues(gen)
        for seq in [*q.waiting.values(), *([] if waiting_only else q.holders.values())]:
            table.stop(seq, error=err, now=now)
        self.driver.apply(self.core.tick(now))

    async def _free(self, gen: Generation, keep_listed: bool) -> int:
        t0 = time.monotonic()
        core, driver = self.core, self.driver
        async with self.models.device_lock:
            while core.requests.queues(gen).releases or driver.freeing(gen):
                if core.requests.queues(gen).releases:
                    await driver.free_released(gen)
                else:
                    await driver.wait_progress()
            if gen.state in (ModelState.DRAINING, ModelState.RECOVERING):
                gen.fire(ModelEvent.DRAINED)  # -> Unloading
            leftover = core.leftover_sequences(gen)
            if leftover:
                await gen.calbin.free_sequences(leftover)
            if not keep_listed:  # no pass sees it any more (it would re-create its queues)
                self.models.generations.pop(gen.id, None)
                # ... and no request resolves to it: an alias still naming it goes in the same
                # step (an explicit unload used to drop it only after the frees below, and a
                # request arriving during them failed inside the engine: KeyError, not a 404)
                if self.models.aliases.get(gen.alias) == gen.id:
                    del self.models.aliases[gen.alias]
            core.requests.forget(gen)
            core.builder.forget(gen)
            core.planner.share.forget(gen.id)
            before = self.backend.dram()[1]
            await release_members(gen)
            after = self.backend.dram()[1]
            freed = before - after
            if gen.state is ModelState.UNLOADING:
                gen.fire(ModelEvent.UNLOADED)
        if freed != gen.dram_bytes:
            self.dram_mismatch_total += 1
            log.error("model %s generation %d: unload freed %d bytes of device DRAM, %d were "
                      "charged", gen.alias, gen.id, freed, gen.dram_bytes,
                      extra={"model": gen.alias, "generation": gen.id})
        self.phases["unload"].observe(time.monotonic() - t0)
        log.info("model %s generation %d unloaded (%d bytes of device DRAM freed)", gen.alias,
                 gen.id, freed, extra={"model": gen.alias, "generation": gen.id})
        return freed

