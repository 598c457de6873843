"""StepTimes: observed job times per profile, and the hung-job timeout derived from them.

A job is hung (a device fault: recovery resets) when it has not completed after

- ``hang_factor`` x its modeled time, where the package's timing model gives one (decode: the
  profile's step; prefill: base + per-token x tokens), else
- ``hang_factor`` x the recent P99 of its profile's observed times (at least ``P99_MIN_SAMPLES``),
  else (nothing known yet) ``executor.wait_timeout_ms``;

never below ``executor.hang_min_ms`` (at least 1 s: host stalls, GC, a loaded machine) and never above
``executor.wait_timeout_ms`` (the fixed bound it replaces stays the upper bound).

Pure: no clock, no trio. Keys are ``(kind, compiled batch)``; a prefill's observed time is
normalised per prompt token bucket only by its profile (prefills vary, the P99 covers them).
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Mapping

__all__ = ["StepTimes", "P99_MIN_SAMPLES", "WINDOW"]

WINDOW = 512  # recent job times kept per key
P99_MIN_SAMPLES = 32  # fewer observed times: no observed P99 yet
_RECOMPUTE = 32  # the P99 is republished after this many new samples


class _Window:
    """The last ``WINDOW`` times in arrival order and the same times sorted. Why both: the P99 is
    then an index into ``ordered``, where sorting the window every ``_RECOMPUTE`` jobs cost ~60 µs
    on every 16th decode step (two keys a step), on the executor's thread of control before it
    waits again; keeping ``ordered`` costs two bisections and a short memmove per job.
    Invariant: ``sorted(times) == ordered``."""

    __slots__ = ("times", "ordered", "p99", "fresh")

    def __init__(self) -> None:
        self.times: collections.deque[float] = collections.deque()
        self.ordered: list[float] = []
        self.p99: float | None = None
        self.fresh = 0

    def append(self, seconds: float) -> None:
        if len(self.times) == WINDOW:
            old = self.times.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, old)]
        self.times.append(seconds)
        bisect.insort(self.ordered, seconds)


class StepTimes:
    def __init__(self, hang_factor: float, hang_min_s: float, max_wait_s: float) -> None:
        self.hang_factor = hang_factor
        self.hang_min_s = min(hang_min_s, max_wait_s)
        self.max_wait_s = max_wait_s
        self._w: dict[tuple[str, int], _Window] = {}

    def add(self, kind: str, batch: int, seconds: float) -> float | None:
        """Record one completed job's time; returns the key's P99 when it was just recomputed."""
        key = (kind, batch)
        w = self._w.get(key)
        if w is None:
            w = self._w[key] = _Window()
        w.append(seconds)
        w.fresh += 1
        if w.fresh >= _RECOMPUTE and len(w.times) >= P99_MIN_SAMPLES:
            w.fresh = 0
            w.p99 = _p99_sorted(w.ordered)
            return w.p99
        return None

    def p99(self, kind: str, batch: int) -> float | None:
        w = self._w.get((kind, batch))
        return None if w is None else w.p99

    def samples(self, kind: str, batch: int) -> int:
        w = self._w.get((kind, batch))
        return 0 if w is None else len(w.times)

    def timeout(self, kind: str, batch: int, modeled_s: float | None, steps: int = 1) -> float:
        """How long a job of this key may take before it is a hung job (see the module doc); a
        multi-step decode of ``steps`` steps (its times are recorded per step) ``steps`` times a
        step's base."""
        base = modeled_s if modeled_s is not None and modeled_s > 0 else self.p99(kind, batch)
        if base is None:
            return self.max_wait_s
        return min(self.max_wait_s, max(self.hang_min_s, self.hang_factor * base * steps))

    def snapshot(self) -> Mapping[str, float]:
        """``kind/B`` -> the last computed P99 (seconds), for statistics."""
        return {f"{k}/{b}": w.p99 for (k, b), w in self._w.items() if w.p99 is not None}


def _p99_sorted(s: list[float]) -> float:
    """The P99 of ascending ``s`` (non-empty): the smallest value at or above 99 % of them."""
    return s[min(len(s) - 1, max(0, math.ceil(0.99 * len(s)) - 1))]
