"""The cross-model share of the device (issue 14, spec §13 on co-resident runtimes): pure decisions.

Several generations (aliases, or an old and a new generation during a replacement) may have work at
once on a runtime whose calbins co-reside. Each has its own KV lanes, so what they compete for is
the device's job engines and their time. Two rules, separate from the per-tenant fairness inside a
generation:

1. **Weighted fair order by device time** (start-time fair queueing): every job handed to an
   engine is charged its modelled device time divided by the generation's weight
   (``models.<alias>.weight``, default 1) as that generation's virtual time; among the generations
   with work, the one with the smallest virtual time is served first. A generation that was idle
   starts at the virtual time of the job last served (it gets no credit for having been idle, and
   is never starved by one that was busy meanwhile).
2. **Engine cap**: while another generation has work, one generation may hold at most
   ``engines - 1`` of the job engines (with PING/PONG: one), so the next job of the other
   generation never waits for two of the first one's jobs. With one engine the cap is off (it is
   the order alone).

No trio, no clock: the engine's planner asks and charges.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ModelShare", "may_take_engine"]


def may_take_engine(held: int, engines: int, others_have_work: bool) -> bool:
    """Whether a generation holding ``held`` of ``engines`` job engines may take one more."""
    if not others_have_work or engines <= 1:
        return True
    return held < engines - 1


class ModelShare:
    """Virtual device time per generation id (seconds / weight)."""

    def __init__(self) -> None:
        self._v: dict[int, float] = {}
        self._floor = 0.0  # start tag of the job served last (the system virtual time)
        self.charged_s: dict[int, float] = {}  # real modelled device seconds charged, per id

    def key(self, gid: int) -> float:
        """Where ``gid`` stands: its virtual time, never below the system virtual time."""
        return max(self._v.get(gid, 0.0), self._floor)

    def order(self, gids: Iterable[int]) -> list[int]:
        """``gids`` in service order (smallest virtual time first; ties keep the given order)."""
        return sorted(gids, key=self.key)

    def charge(self, gid: int, weight: float, device_s: float) -> None:
        """A job of ``gid`` modelled to take ``device_s`` of device time was handed to an engine."""
        start = self.key(gid)
        self._v[gid] = start + max(device_s, 0.0) / weight
        self._floor = start
        self.charged_s[gid] = self.charged_s.get(gid, 0.0) + device_s

    def forget(self, gid: int) -> None:
        """The generation was unloaded."""
        self._v.pop(gid, None)
        self.charged_s.pop(gid, None)
