"""Hands a stream's park / resume wishes (:mod:`calserve.engine.parking`) to the engine core
outside whatever called them.

Why deferred: a stream decides to park while its producer writes a token, and that write can run
inline inside an engine-core method (the actor's inbox runs a token step synchronously while the
core delivers it); the core's methods must never interleave. So a wish is recorded here and one
task of the engine's applies every recorded wish, the latest per request, in a later step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import trio

from calserve.engine.state import Seq

__all__ = ["ParkRequests"]


@final
class ParkRequests:
    """``wish(seq)(park)`` records; the task started on the first one applies them all."""

    __slots__ = ("_apply", "_nursery", "_wishes", "_scheduled")

    def __init__(self, apply: Callable[[Seq, bool | None, float], None], nursery: trio.Nursery
                 ) -> None:
        """``apply(seq, park, now)``: the core's park (None: stop the request), through the
        shell."""
        self._apply = apply
        self._nursery = nursery
        self._wishes: dict[int, tuple[Seq, bool | None]] = {}
        self._scheduled = False

    def wish(self, seq: Seq) -> Callable[[bool | None], None]:
        """The stream's ``park`` callback for ``seq``."""

        def park(on: bool | None) -> None:
            self._wishes[seq.rid] = (seq, on)
            if not self._scheduled:
                try:
                    self._nursery.start_soon(self._run, name="park-requests")
                except RuntimeError:  # the engine is closing: its requests end anyway
                    self._wishes.clear()
                    return
                self._scheduled = True

        return park

    async def _run(self) -> None:
        self._scheduled = False
        wishes, self._wishes = self._wishes, {}
        now = trio.current_time()
        for seq, on in wishes.values():
            self._apply(seq, on, now)
