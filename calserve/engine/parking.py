"""Parking: a running request whose client is behind gives its running slot up while others wait.

Why (README "Per-request limits and slow readers"): at most ``max_running`` admitted requests run
at once (the TPOT bound: ``scheduler.admission.max_tpot_steps``), and with one tenant the
admission queue is FIFO. A client that does not read its stream is only recognisable after it has
left some data unread for a while, and a client that reads in bursts (every ~100 ms) looks exactly
the same for that long. Cutting a stream that early would cut such readers; cutting it only after
a safe wait kept its slot that long for each of the never-readers queued ahead of a normal
request (60 of them at 3 slots: seconds). Parking separates the two decisions: the slot is given up
as soon as the client is seen behind (``server.stream_contended_stall_ms``), the verdict comes
later and costs no slot: the request is resumed the moment its client caught up, or cancelled
(``client_too_slow``) once it has stayed parked ``server.stream_parked_cut_ms``
(:class:`~calserve.engine.stream.StreamWriter` decides both, from what the HTTP layer reports).

A parked request keeps its KV lane and its state (DecodeReady, so ending it, a fault or a
shutdown treat it like any ready request); it is out of its generation's decode-ready set (never
batched) and does not count against ``max_running`` in admission. A request asked to park while a
job of it is on the device (or before its prefill) is parked by the first pass after it became
decode-ready (:meth:`Parking.apply`). Resumed, it is decode-ready again (least recently served
last) and counts again: the running set may then exceed ``max_running`` until a request ends.

The same parked state serves time-slicing (:mod:`calserve.engine.timeslice`): a request parked
by :meth:`Parking.slice` is recorded with that reason (:meth:`Parking.sliced`), is resumed only by
the time-slicer (:meth:`Parking.unslice`, never by its stream, and never cut for it: the stream's
cut timer runs only while the *stream* asked to park). If its stream asks to park meanwhile, the
reason becomes the client's (the stream's resume then resumes it).
"""

from __future__ import annotations

from typing import final

from calserve.engine.requests import RequestTable
from calserve.engine.state import Seq

__all__ = ["Parking"]


@final
class Parking:
    """The engine core's parking (module docstring): :meth:`set` from the request's stream,
    :meth:`apply` once per scheduling pass, before admission."""

    __slots__ = ("_requests", "_want", "parks_total", "_sliced", "slices_total")

    def __init__(self, requests: RequestTable) -> None:
        self._requests = requests
        # Invariant: asked to park, not parked yet (not decode-ready when asked), not ended.
        self._want: dict[int, Seq] = {}
        self.parks_total = 0
        # Parked by time-slicing (the reason flag), in park order: rid -> (seq, when parked).
        # Invariant: pruned lazily (:meth:`sliced_queue`) once the request ended or left parked.
        self._sliced: dict[int, tuple[Seq, float]] = {}
        self.slices_total = 0

    @property
    def wanting(self) -> bool:
        """Requests asked to park that :meth:`apply` parks once they are decode-ready (the rotation
        shortcut, which skips the pass's :meth:`apply`, then leaves the completion to the pass)."""
        return bool(self._want)

    def set(self, seq: Seq, park: bool, now: float) -> None:
        """Park ``seq`` (``park``) or resume it. Idempotent; an ended request is ignored."""
        if seq.ended:
            self._want.pop(seq.rid, None)
            return
        reqs = self._requests
        q = reqs.queues(seq.gen)
        if park:
            if seq.rid in q.parked:
                self._sliced.pop(seq.rid, None)  # now parked for its client
                return
            if q.decode_ready.pop(seq.rid, None) is seq:
                self._park(q.parked, seq)
            else:
                self._want[seq.rid] = seq
            reqs.wake = True  # its running slot may admit a waiting request now
            return
        self._want.pop(seq.rid, None)
        if seq.rid in self._sliced:
            return  # parked by time-slicing: only the time-slicer resumes it
        if q.parked.pop(seq.rid, None) is seq:
            self._ready(q.decode_ready, seq, now)

    def _ready(self, ready: dict[int, Seq], seq: Seq, now: float) -> None:
        seq.ready_since = now
        seq.run_since = now
        ready[seq.rid] = seq
        self._requests.wake = True

    def slice(self, seq: Seq, now: float) -> bool:
        """Park decode-ready ``seq`` for time-slicing (False: it is not decode-ready)."""
        q = self._requests.queues(seq.gen)
        if seq.ended or q.decode_ready.get(seq.rid) is not seq:
            return False
        del q.decode_ready[seq.rid]
        self._park(q.parked, seq)
        self._sliced[seq.rid] = (seq, now)
        self.slices_total += 1
        self._requests.wake = True
        return True

    def unslice(self, seq: Seq, now: float) -> None:
        """Resume a request parked by :meth:`slice` (decode-ready again)."""
        if self._sliced.pop(seq.rid, None) is None:
            return
        q = self._requests.queues(seq.gen)
        if q.parked.pop(seq.rid, None) is seq:
            self._ready(q.decode_ready, seq, now)

    def sliced(self, rid: int) -> bool:
        """``rid`` is parked by time-slicing (not for its client)."""
        return rid in self._sliced

    def sliced_queue(self, q_parked: dict[int, Seq], gen_id: int) -> list[tuple[Seq, float]]:
        """The time-sliced requests of one generation (its ``parked`` dict), oldest park first;
        drops the entries of requests that ended or left the parked set (fault, cancel)."""
        out: list[tuple[Seq, float]] = []
        if not self._sliced:  # the usual pass: nothing is time-sliced
            return out
        for rid, (seq, t) in list(self._sliced.items()):
            if seq.ended or (seq.gen.id == gen_id and q_parked.get(rid) is not seq):
                del self._sliced[rid]
            elif seq.gen.id == gen_id:
                out.append((seq, t))
        return out

    def _park(self, parked: dict[int, Seq], seq: Seq) -> None:
        parked[seq.rid] = seq
        self.parks_total += 1

    def apply(self) -> None:
        """Park the requests asked to that became decode-ready since (one pass's hook)."""
        want = self._want
        if not want:
            return
        for rid, seq in list(want.items()):
            if seq.ended:
                del want[rid]
                continue
            q = self._requests.queues(seq.gen)
            if q.decode_ready.get(rid) is seq:
                del q.decode_ready[rid]
                del want[rid]
                self._park(q.parked, seq)

    def parked(self) -> int:
        """Requests parked now (all generations)."""
        return sum(len(q.parked) for q in self._requests.all_queues())
