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

import collections
import math
from collections.abc import Mapping

__all__ = ["StepTimes", "P99_MIN_SAMPLES", "WINDOW"]

WINDOW = 512  # recent job times kept per key
P99_MIN_SAMPLES = 32  # fewer observed times: no observed P99 yet
_RECOMPUTE = 32  # the P99 is recomputed after this many new samples (sorting is not per step)


class _Window:
    __slots__ = ("times", "p99", "fresh")

    def __init__(self) -> None:
        self.times: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.p99: float | None = None
        self.fresh = 0


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
        w.times.append(seconds)
        w.fresh += 1
        if w.fresh >= _RECOMPUTE and len(w.times) >= P99_MIN_SAMPLES:
            w.fresh = 0
            w.p99 = _p99(w.times)
            return w.p99
        return None

    def p99(self, kind: str, batch: int) -> float | None:
        w = self._w.get((kind, batch))
        return None if w is None else w.p99

    def samples(self, kind: str, batch: int) -> int:
        w = self._w.get((kind, batch))
        return 0 if w is None else len(w.times)

    def timeout(self, kind: str, batch: int, modeled_s: float | None) -> float:
        """How long a job of this key may take before it is a hung job (see the module doc)."""
        base = modeled_s if modeled_s is not None and modeled_s > 0 else self.p99(kind, batch)
        if base is None:
            return self.max_wait_s
        return min(self.max_wait_s, max(self.hang_min_s, self.hang_factor * base))

    def snapshot(self) -> Mapping[str, float]:
        """``kind/B`` -> the last computed P99 (seconds), for statistics."""
        return {f"{k}/{b}": w.p99 for (k, b), w in self._w.items() if w.p99 is not None}


def _p99(times: collections.deque[float]) -> float:
    s = sorted(times)
    return s[min(len(s) - 1, max(0, math.ceil(0.99 * len(s)) - 1))]
