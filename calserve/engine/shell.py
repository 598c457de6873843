"""What the engine's Trio parts need of each other, as Protocols (no import circles between them).

The :class:`~calserve.engine.driver.CoreDriver` implements :class:`Shell`; executors and recovery
are handed it at construction and talk to the core's other shells only through it.
"""

from __future__ import annotations

from typing import Protocol

from calserve.engine.state import CoreOutput, DeviceJob

__all__ = ["Shell"]


class Shell(Protocol):
    def apply(self, out: CoreOutput) -> None:
        """Act on a core output: hand jobs to executors, faults to recovery, wake the scheduler."""

    def engine_idle(self) -> None:
        """An executor handed a completion back (wakes :meth:`wait_idle`)."""

    async def wait_idle(self) -> None:
        """Return once no job is on any engine."""

    async def on_timeout(self, job: DeviceJob) -> None:
        """A job's wait passed its timeout (recovery resets the device)."""
