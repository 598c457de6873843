"""Rotation: the next decode batch of the ready set, decided before a completion's bookkeeping.

When more sequences run than a batch holds (64 streams over B16 lanes; the default profile's
streams over B1), the lanes rotate through the ready set and almost every completion needs a full
scheduling pass to pick the next batch — after the completion's bookkeeping, with the device
waiting for both (~60 µs a job of the pass alone at B16; issue 18). The pass's pick is known
earlier: every sequence of the job that came back continues (``EngineCore.fast_decode`` checked
it), so its sequences rejoin the ready set as the newest, and when the ready set alone holds a full
batch served before them, that batch is the pick. :class:`Rotation` decides it then, as the
continuation shortcut does for a job whose sequences are all the work there is: the executor
submits it first and the bookkeeping follows (``EngineCore.finish_fast``).

Same decisions as the full pass (``tests/engine/test_continuation_fake.py`` compares tokens,
times, every job's sequences, counters, parks and passed-over counts with full passes only):
:meth:`Rotation.may` rules out what the pass would do besides the pick (admit, park, resume,
time-slice, release, expire a deadline, answer a wake-up); :meth:`Planner.rotation_pick
<calserve.engine.planner.Planner.rotation_pick>` weighs the pick with the finished job's sequences
counted as ready and its engine free, and anything it cannot weigh that way goes to the pass. The
rest of the pass then runs as the pass runs it, finding nothing to do but its clocks. Owned by
:class:`~calserve.engine.core.EngineCore`; no trio, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, final

from calserve.core.admission import admission_room
from calserve.engine.core_stats import CoreState
from calserve.engine.parking import Parking
from calserve.engine.planner import Planner
from calserve.engine.requests import RequestTable
from calserve.engine.state import DeviceJob, Seq
from calserve.engine.timeslice import TimeSlice
from calserve.runtime.types import JobEngine

if TYPE_CHECKING:
    from calserve.engine.generations import Generation

__all__ = ["Rotation"]


@final
class Rotation:
    """The rotation shortcut of the engine core (module docstring)."""

    __slots__ = ("_st", "_requests", "_planner", "_parking", "_timeslice", "_housekeeping")

    def __init__(self, st: CoreState, requests: RequestTable, planner: Planner, parking: Parking,
                 timeslice: TimeSlice,
                 housekeeping: Callable[[Generation, float, Sequence[Seq]], float]) -> None:
        """``housekeeping(gen, now, also)``: the pass's steps for one generation before dispatch,
        as ``EngineCore._pass`` runs them, with ``also`` (the finished job's sequences) counted
        as decode-ready where they would be; the next instant one of them is due."""
        self._st = st
        self._requests = requests
        self._planner = planner
        self._parking = parking
        self._timeslice = timeslice
        self._housekeeping = housekeeping

    def may(self, job: DeviceJob, now: float) -> bool:
        """Whether the pass after ``job``'s completion could only dispatch a decode batch (what
        :meth:`next` needs before it looks at the batch; cheap, checked before sampling): nothing
        but running requests, parked ones and queued prompts (whose turn :meth:`Planner.rotation_pick
        <calserve.engine.planner.Planner.rotation_pick>` weighs) in the pass's way — no request
        waiting to be parked, no releasing one, due deadline or pending wake-up; waiting requests
        only when admission has no room for them; and the time-slicer quiet (no resume, no park;
        :meth:`TimeSlice.quiet`, with ``job``'s sequences counted as ready: every one continues,
        so its bookkeeping frees no lane and no running slot) — and the device not paused. A
        request parked for its client is left as the pass leaves it (its stream resumes it, which
        wakes the pass)."""
        if self._st.paused or self._requests.wake or job.kind != "decode" or self._parking.wanting:
            return False
        gen = job.gen
        q = self._requests.queues(gen)
        if q.releases or (q.deadlines and q.deadlines[0][0] <= now):
            return False
        admitting = gen.admitting and now >= self._st.admit_after
        if admitting and q.waiting and admission_room(gen.admission, gen.kv.free_lanes(), len(q.parked)) > 0:
            return False
        return self._timeslice.quiet(gen, now, job.seqs, admitting)

    def next(self, engine: JobEngine, job: DeviceJob, now: float) -> DeviceJob | None:
        """The job the pass after ``job``'s completion would hand ``engine``, committed as the pass
        commits it, or None (then the pass decides, after the bookkeeping). :meth:`may` held and
        every sequence of ``job`` continues. The rest of the pass for the one generation runs as
        ``EngineCore._pass`` runs it — the time-slicer, the deadlines, admission's decode-speed
        sample — and finds nothing to do (:meth:`may` ruled the rest out); its timers go out with
        the output."""
        picked = self._planner.rotation_pick(job, engine, now)
        if picked is None:
            return None
        out = self._st.out
        out.timer = min(out.timer, self._housekeeping(job.gen, now, job.seqs))
        return self._planner.commit_rotation(job, now, *picked)
