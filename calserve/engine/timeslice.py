"""Time-slicing: long streams of one tenant take turns with its waiting requests (processor sharing
over the ``max_running`` slots, README "Per-request limits and slow readers").

Why: with one tenant admission is FIFO and at most ``max_running`` requests run. A client that
never reads but whose whole stream fits in its kernel's receive window looks like a reader (the
socket probe and :mod:`calserve.engine.parking` never see it behind), so 60 such streams of ~1000
tokens made a normal request queued behind them wait ~38 s. Here, once per scheduling pass and
before admission (:meth:`TimeSlice.apply`):

- **park**: when the oldest waiting request has waited ``scheduler.timeslice_wait_ms`` (at least
  twice ``admission.max_expected_wait_ms`` when that is set: under overload admission already
  keeps waits near that SLO, and slicing requests that will finish soon anyway would turn its
  FIFO into processor sharing, longer for everyone — measured: the overload test's short-request
  TTFT p99 0.19 s -> 0.67 s with a 100 ms wait) and
  admission is blocked only by the ``max_running`` cap (a KV lane is free and the waiter's tenant
  is below its cap: parking frees neither), the decode-ready request that has run longest since
  its admission / resume is parked (:meth:`Parking.slice`, the time-slicing reason) if that run is
  at least ``scheduler.timeslice_ms`` — one of the waiter's tenant if any (cross-tenant order is
  the fair queue's). At most one per generation per pass.
- **resume** (FIFO by park time, the back of the line): into a free running slot, before admission
  when the queue is empty or its oldest request arrived after that park; after admission
  (:meth:`TimeSlice.fill`) whenever a slot is still free — the queue could not use it (no KV lane
  or tokens, tenant cap, admission paused): parked requests hold KV, so they must progress.

A time-sliced request is an ordinary parked one for everything else (deadlines, cancels, faults,
shutdown, drains: :class:`~calserve.engine.requests.RequestTable` ends or re-admits it like any
decode-ready request) and is never cut for it (``server.stream_parked_cut_ms`` is its stream's,
for its client). With no more requests than slots nothing is ever parked. ``timeslice_ms`` 0:
off.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, final

from calserve.core.admission import tenant_capped
from calserve.engine.parking import Parking
from calserve.engine.requests import GenQueues, RequestTable
from calserve.engine.state import Seq

if TYPE_CHECKING:
    from calserve.engine.generations import Generation

__all__ = ["TimeSlice"]


@final
class TimeSlice:
    """:meth:`apply` before admission, :meth:`fill` after it (module docstring)."""

    __slots__ = ("_requests", "_parking", "_slice_s", "_wait_s")

    def __init__(self, requests: RequestTable, parking: Parking, slice_ms: int, wait_ms: int
                 ) -> None:
        self._requests = requests
        self._parking = parking
        self._slice_s = slice_ms / 1000.0
        self._wait_s = wait_ms / 1000.0

    @staticmethod
    def _running(q: GenQueues) -> int:
        """Admitted, not ended, not parked (what ``pop_admissible`` counts against the cap)."""
        return len(q.holders) - len(q.parked)

    def apply(self, gen: Generation, now: float, also: Sequence[Seq] = ()) -> float:
        """For one admitting generation, before its admission: resume the time-sliced requests
        the queue's head arrived after, then park one if the head waited long enough; the
        instant a park may next be due (``math.inf``: none). ``also``: sequences that will be
        decode-ready when this pass would run (the rotation replays it before its finished
        job's bookkeeping, having checked :meth:`quiet` with them): counted for that instant."""
        parking = self._parking
        cap = gen.admission.max_running
        q = self._requests.queues(gen)
        sliced = parking.sliced_queue(q.parked, gen.id)
        if cap is None:
            for seq, _ in sliced:  # the cap was lifted (never with a constant config)
                parking.unslice(seq, now)
            return math.inf
        head = next(iter(q.waiting.values()), None)
        running = self._running(q)
        for seq, t in sliced:
            if running >= cap or (head is not None and head.arrival <= t):
                break
            parking.unslice(seq, now)
            running += 1
        due = self._park_due(gen, head, running, cap)
        if due is None:
            return math.inf
        if now < due:
            return due
        assert head is not None  # a park is due only for a waiting head
        victim = self._longest(q.decode_ready.values(), head.tenant, now)
        if victim is not None:
            parking.slice(victim, now)
            return math.inf
        return self._first_slice_end(q, also)  # none has run a whole slice yet: the first that will

    def _park_due(self, gen: Generation, head: Seq | None, running: int, cap: int) -> float | None:
        """When a park for the waiting ``head`` is due (its arrival + the wait), or None when
        none may be: slicing off, nobody waiting, a free running slot, or nothing a park could
        give the head (no free lane, or its tenant at its cap)."""
        if self._slice_s <= 0 or head is None or running < cap:
            return None
        if gen.kv.free_lanes() == 0 or tenant_capped(gen.admission, head.tenant):
            return None
        return head.arrival + self._wait_s

    def quiet(self, gen: Generation, now: float, also: Sequence[Seq] = (), admitting: bool = True
              ) -> bool:
        """Whether this pass's time-slicer steps for ``gen`` would change nothing now — :meth:`apply`
        (run when the pass is ``admitting``) and :meth:`fill` — with ``also`` decode-ready besides
        the ready set (the rotation's finished job, ready once its bookkeeping ran) and no running
        slot freed before them (every sequence of that job continues). No time-sliced request is
        resumed: there is none, or every running slot is taken (with a free slot, apply or fill
        resumes one, or admission takes it). No park: no cap, no park due yet (:meth:`_park_due`),
        or a park due but no decode-ready sequence has run a whole slice (apply then only reports
        when the first will have) — the common case under a long queue of short requests."""
        cap = gen.admission.max_running
        q = self._requests.queues(gen)
        sliced = self._parking.sliced_queue(q.parked, gen.id) if q.parked else ()
        if cap is None:
            return not (sliced and admitting)  # apply resumes them all (fill never does)
        running = self._running(q)
        if sliced and running < cap:
            return False
        if not admitting:
            return True
        due = self._park_due(gen, next(iter(q.waiting.values()), None), running, cap)
        if due is None or now < due:
            return True
        return self._first_slice_end(q, also) > now

    def _first_slice_end(self, q: GenQueues, also: Sequence[Seq]) -> float:
        """When the first decode-ready sequence (or of ``also``) will have run a whole slice:
        ``min(run_since) + slice`` is the minimum of the per-sequence sums (float addition is
        monotone), so the same instants as :meth:`_longest`'s test."""
        started = [s.run_since for s in q.decode_ready.values()]
        started.extend([s.run_since for s in also])
        return min(started) + self._slice_s if started else math.inf

    def _longest(self, ready: Iterable[Seq], tenant: str, now: float) -> Seq | None:
        """The decode-ready request that has run longest (at least a slice), the tenant's first."""
        best: Seq | None = None
        best_key: tuple[bool, float] | None = None
        for s in ready:
            if s.run_since + self._slice_s > now:  # the same sum as apply's timer (rounding)
                continue
            key = (s.tenant != tenant, s.run_since)
            if best_key is None or key < best_key:
                best, best_key = s, key
        return best

    def fill(self, gen: Generation, now: float) -> None:
        """After admission: running slots the queue left free go to time-sliced requests."""
        q = self._requests.queues(gen)
        if not q.parked:
            return
        cap = gen.admission.max_running
        sliced = self._parking.sliced_queue(q.parked, gen.id)
        if not sliced or cap is None:
            return
        running = self._running(q)
        for seq, _ in sliced:
            if running >= cap:
                break
            self._parking.unslice(seq, now)
            running += 1
