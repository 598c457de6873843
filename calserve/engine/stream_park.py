"""One stream's side of parking (:mod:`calserve.engine.parking`): whether it is parked, since
when, and whether the consumer watches it (:class:`~calserve.engine.stream.StreamWriter` module
docstring, "Parking")."""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import trio

__all__ = ["StreamPark"]


@final
class StreamPark:
    """``park(True/False)`` asks the engine to park / resume the request, ``park(None)`` to stop
    it (given up while parked: no token will come for its actor to notice); parking is on only
    once the consumer :meth:`watch`\\ es (it reports the socket while parked)."""

    __slots__ = ("_park", "_cut_s", "_watched", "since", "_event")

    def __init__(self, park: Callable[[bool | None], None] | None, cut_s: float) -> None:
        self._park = park
        self._cut_s = cut_s
        self._watched = False
        # Invariant: since is not None <=> park(True) was the last call.
        self.since: float | None = None
        self._event: trio.Event | None = None  # wait_parked's (made on demand)

    def behind(self, now: float) -> bool:
        """The stream is behind while others wait: park it. True: parked (less than the cut
        time so far); False: give it up (no parking here, or parked for the cut time)."""
        park = self._park
        if park is None or not self._watched:
            return False
        since = self.since
        if since is None:
            self.since = now
            park(True)
            ev = self._event
            if ev is not None:
                self._event = None
                ev.set()
            return True
        return now - since < self._cut_s

    def resume(self) -> None:
        """Resume a parked stream (no-op otherwise)."""
        if self.since is not None:
            self.since = None
            assert self._park is not None
            self._park(False)

    def drop(self) -> None:
        """The stream ended: nothing to resume."""
        self.since = None

    def give_up(self) -> None:
        """The stream was given up: a parked request is stopped (cancelled)."""
        if self.since is not None:
            self.since = None
            assert self._park is not None
            self._park(None)

    @property
    def parked(self) -> bool:
        return self.since is not None

    def watch(self) -> None:
        """The consumer reports the socket while parked (:meth:`wait_parked`, then the writer's
        ``report_unread`` every ~50 ms): parking is on from now."""
        self._watched = True

    async def wait_parked(self) -> None:
        """Return once the stream is parked (at once if it is)."""
        if self.since is None:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        else:
            await trio.lowlevel.checkpoint()
