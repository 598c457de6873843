"""FaultPlan: faults from the configuration (``runtime.faults``), for drills, chaos tests and benchmarks.

Software runtime only (a vendor runtime has no fault injection: the binding refuses it). Before each
job is submitted, a seeded draw decides with probability ``rate`` whether that job faults and with
which kind of ``kinds``; the fault is armed on the runtime for exactly that submit (the runtime's
deterministic per-job injection, ``inject_fault(kind, engine, nth=1, lane)``). The same seed and the
same order of submits give the same faults.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Sequence

import numpy as np

from calserve.runtime.types import CalrtError, FaultKind, JobEngine

__all__ = ["FaultPlan", "FAULT_KINDS"]

#: config name -> the runtime's fault kind
FAULT_KINDS: dict[str, FaultKind] = {
    "timeout": FaultKind.TIMEOUT,
    "ccu": FaultKind.CCU_FAULT,
    "unknown_dma": FaultKind.DMA_UNKNOWN,
    "busy": FaultKind.DEVICE_BUSY,
    "crosstalk": FaultKind.CROSSTALK,
}


class FaultPlan:
    def __init__(self, rate: float, kinds: Sequence[str], seed: int,
                 inject: Callable[[FaultKind, JobEngine, int, int], None]) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {rate!r}")
        self.rate = rate
        self.kinds = [FAULT_KINDS[k] for k in kinds]
        self._rng = random.Random(seed)
        self._inject = inject
        self.armed: collections.Counter[str] = collections.Counter()  # by kind name

    def before_submit(self, engine: JobEngine, valid: np.ndarray | None = None) -> None:
        """A job is about to be submitted on ``engine`` (``valid``: its lane mask, for crosstalk)."""
        rng = self._rng
        if not self.kinds or rng.random() >= self.rate:
            return
        kind = rng.choice(self.kinds)
        lane = 0
        if valid is not None:
            active = np.flatnonzero(valid)
            if active.size:
                lane = int(active[rng.randrange(active.size)])
        try:
            self._inject(kind, engine, 1, lane)
        except CalrtError:  # e.g. every fault slot armed while the device refuses submits
            return
        self.armed[kind.name.lower()] += 1
