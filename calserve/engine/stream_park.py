"""One stream's side of parking (:mod:`calserve.engine.parking`): whether it is parked, since
when, and whether the consumer watches it (:class:`~calserve.engine.stream.StreamWriter` module
docstring, "Parking")."""

from __future__ import annotations

from collections.abc import Callable
from typing import final

__all__ = ["StreamPark"]


@final
class StreamPark:
    """``park(True/False)`` asks the engine to park / resume the request, ``park(None)`` to stop
    it (given up while parked: no token will come for its actor to notice); parking is on only
    once the consumer :meth:`watch`\\ es (it reports the socket while parked)."""

    __slots__ = ("_park", "_cut_s", "_watched", "since", "_on_parked", "_on_given_up",
                 "_given_up")

    def __init__(self, park: Callable[[bool | None], None] | None, cut_s: float) -> None:
        self._park = park
        self._cut_s = cut_s
        self._watched = False
        # Invariant: since is not None <=> park(True) was the last call.
        self.since: float | None = None
        # the watching consumer's callbacks (watch()), and whether the stream was given up
        self._on_parked: Callable[[], None] | None = None
        self._on_given_up: Callable[[], None] | None = None
        self._given_up = False

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
            if self._on_parked is not None:
                self._on_parked()
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

    def give_up(self, cut: bool = False) -> None:
        """The stream ended for its consumer: a parked request is stopped (cancelled). ``cut``:
        the writer gave up on the consumer (too slow), which the watching consumer is told
        (:meth:`watch`); not when the consumer left by itself."""
        if self.since is not None:
            self.since = None
            assert self._park is not None
            self._park(None)
        if cut:
            self._given_up = True
            if self._on_given_up is not None:
                self._on_given_up()

    @property
    def parked(self) -> bool:
        return self.since is not None

    def watch(self, on_parked: Callable[[], None] | None = None,
              on_given_up: Callable[[], None] | None = None) -> None:
        """The consumer reports the socket while parked (told by ``on_parked``, then the
        writer's ``report_unread`` every ~50 ms): parking is on from now.
        ``on_parked()`` is called each time the stream is parked, ``on_given_up()`` once the
        writer gave up on the consumer (at once if it already had), both synchronously from
        the engine's code (they must not block or raise): the consumer's watch needs no task
        waiting for either (``calserve.api.write_watch``)."""
        self._watched = True
        self._on_parked = on_parked
        self._on_given_up = on_given_up
        if self._given_up and on_given_up is not None:
            on_given_up()
