"""Closing the connection of a streamed response whose client does not read (README "Per-request
limits and slow readers"): hypercorn's write to such a client never completes and cannot be
cancelled (it is shielded), so the only way to end it, and to free the connection, is to close the
socket under it (:attr:`~calserve.api.socket_probe.SocketProbe.close`).

:class:`WriteWatch`, one per streamed response that has a socket probe:

- a write of the stream that has not completed ``server.send_timeout_s`` after it started closes
  the connection (its client has read nothing for that long: the kernels' buffers are full) —
  whether or not the engine is still producing: a stream that ran to its end while its client
  never read would otherwise hold its connection and its last bytes until the client leaves;
- once the engine gave up on the client as too slow (``client_too_slow``), the connection is
  closed :data:`CUT_CLOSE_S` later (time to write that last event to a client that reads again).

And it watches the stream while the engine parked it (its client is behind while others wait:
:mod:`calserve.engine.parking`), :meth:`WriteWatch.follow`: every poll (:data:`POLL_S`
doubling up to :data:`POLL_MAX_S`) it reports
the socket's figure to the stream (which resumes it once the client caught up, or cuts it), and
writes an SSE comment (``:`` and 4 KB of padding, ignored by SSE clients) when no write is under
way: a client that read meanwhile then acknowledges it with its receive window open again (Linux
announces a reopened window on a read only when it had fallen below half), so its catching up is
seen within ~one poll. The comment and the stream's writes never overlap (one write at a time).

Cost per write: one clock read, two attribute stores and two flag tests — no cancel-scope deadline
update (each re-files a deadline in trio's heap): :meth:`WriteWatch.run` wakes at the pending
write's start + ``timeout_s`` and checks whether that write is still the one under way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from math import inf
from typing import Any, Final, final

import trio

from calserve.api.socket_probe import SocketProbe

__all__ = ["CUT_CLOSE_S", "NUDGE_BODY", "POLL_S", "POLL_MAX_S", "WriteWatch", "close_later",
           "watched_send"]

#: A stream given up as too slow has this long to write its last event, then its connection is
#: closed.
CUT_CLOSE_S: Final = 1.0
#: How often a parked stream's socket is looked at: first after POLL_S, then twice as long each
#: time up to POLL_MAX_S (a client that reads in bursts is seen caught up within ~one burst; one
#: that never reads costs ~13 looks before server.stream_parked_cut_ms, 1 s, gives it up).
POLL_S: Final = 0.01
POLL_MAX_S: Final = 0.1
#: The comment a parked stream gets after each look: 4 KB (a reader's kernel then shows it kept
#: room for all of it, past its window's rounding, where a never-reader's window shrinks).
NUDGE_BODY: Final = b":" + b" " * 4093 + b"\n\n"
_NUDGE: Final = {"type": "http.response.body", "body": NUDGE_BODY, "more_body": True}

Send = Callable[[dict[str, Any]], Awaitable[None]]


async def close_later(close: Callable[[], None]) -> None:
    """``close()`` :data:`CUT_CLOSE_S` from now. Shielded from its first step (no checkpoint
    before the shield): the handler's scope is cancelled when its response ends, and a write
    blocked on a client that does not read only ends with the socket."""
    with trio.CancelScope(shield=True):
        await trio.sleep(CUT_CLOSE_S)
        _close(close)


def _close(close: Callable[[], None]) -> None:
    try:
        close()
    except OSError:
        pass


@final
class WriteWatch:
    """See the module docstring. :meth:`wrap` times the stream's writes, :meth:`run` (a task of
    the handler's, cancelled with it) closes the connection when a deadline passes."""

    __slots__ = ("_scope", "_timeout", "_close", "_cut", "_send", "_writing", "_since", "_nudging")

    def __init__(self, close: Callable[[], None], timeout_s: float) -> None:
        self._scope = trio.CancelScope()  # its deadline: the cut's close (inf: not cut)
        self._timeout = timeout_s
        self._since = 0.0  # when the stream's pending write (if _writing) started
        self._close = close
        self._cut = False
        self._send: Send | None = None  # the wrapped send (for the parked stream's comments)
        # Invariant: at most one write at a time: _writing (the stream's) or _nudging (a comment,
        # set while it is written; the stream's next write waits for it).
        self._writing = False
        self._nudging: trio.Event | None = None

    def wrap(self, send: Send) -> Send:
        """``send`` whose every write must complete within ``timeout_s``."""
        clock = trio.current_time
        self._send = send

        async def timed(message: dict[str, Any]) -> None:
            while self._nudging is not None:
                await self._nudging.wait()
            self._since = clock()
            self._writing = True
            try:
                await send(message)
            finally:
                self._writing = False

        return timed

    async def _nudge(self) -> None:
        """One SSE comment, unless a write is under way (a client that reads acknowledges it)."""
        send = self._send
        if send is None or self._writing or self._nudging is not None:
            return
        ev = self._nudging = trio.Event()
        try:
            await send(_NUDGE)
        finally:
            self._nudging = None
            ev.set()

    def follow(self, handle: Any, sample: Callable[[], tuple[int, float | None]],
               nursery: trio.Nursery) -> None:
        """Watch ``handle``'s stream, with no task until something happens: once the engine
        gives up on its client, :meth:`cut`; each time it is parked, a task in ``nursery`` (the
        handler's) that, while it stays parked, reports ``sample()`` (the socket probe's figure)
        to its ``report_unread`` at every poll and writes a comment to the client (module
        docstring). ``handle`` needs ``watch(on_parked, on_given_up)``, ``parked`` and
        ``report_unread`` (else nothing is watched: no parking)."""
        watch = getattr(handle, "watch", None)
        if watch is None or not hasattr(handle, "parked"):
            return
        polling = [False]  # a poll task of this stream's is running

        def on_parked() -> None:
            if polling[0]:
                return
            polling[0] = True
            try:
                nursery.start_soon(self._poll_parked, handle, sample, nursery, polling)
            except RuntimeError:  # the handler is over: nothing left to watch
                polling[0] = False

        watch(on_parked=on_parked, on_given_up=self.cut)

    async def _poll_parked(self, handle: Any, sample: Callable[[], tuple[int, float | None]],
                           nursery: trio.Nursery, polling: list[bool]) -> None:
        report: Callable[[int, float | None], None] = handle.report_unread
        poll = POLL_S
        try:
            while handle.parked:
                await trio.sleep(poll)
                poll = min(2 * poll, POLL_MAX_S)
                report(*sample())
                if handle.parked:
                    nursery.start_soon(self._nudge)
        finally:
            polling[0] = False

    def cut(self) -> None:
        """The engine gave up on the client: close :data:`CUT_CLOSE_S` from now at the latest."""
        self._cut = True
        self._scope.deadline = min(self._scope.deadline, trio.current_time() + CUT_CLOSE_S)

    async def run(self) -> None:
        """Until a deadline passes (a write stuck ``timeout_s``, or :data:`CUT_CLOSE_S` after
        :meth:`cut`), then close; or until the handler cancels it."""
        with self._scope:
            await self._until_stuck()
        _close(self._close)

    async def _until_stuck(self) -> None:
        """Return once one write of the stream has been under way ``timeout_s``: sleeps until the
        pending write's deadline (or ``timeout_s`` when none is pending: a write that starts
        meanwhile is due later than the wake-up) and looks again."""
        timeout = self._timeout
        while True:
            if self._writing:
                due = self._since + timeout
                if trio.current_time() >= due:
                    return
                await trio.sleep_until(due)
            else:
                await trio.sleep(timeout)


def watched_send(probe: SocketProbe | None, send: Send, handles: Sequence[Any],
                 nursery: trio.Nursery, timeout_s: float) -> Send:
    """The send of a streamed response on one connection carrying ``handles``' streams (n
    choices share it): with a socket probe, a :class:`WriteWatch` closes the connection when a
    write is stuck ``timeout_s`` (``server.send_timeout_s``) or a stream was given up, and
    watches each stream while it is parked; without one, ``send`` itself. The watch runs one
    task in ``nursery`` (the handler's: cancelled with it), and one more only while a stream is
    parked (a streamed request's tasks and nurseries cost CPU at its start and end)."""
    if probe is None:
        return send
    watch = WriteWatch(probe.close, timeout_s)
    nursery.start_soon(watch.run)
    out = watch.wrap(send)
    clock = trio.current_time
    sample = probe.sample
    for h in handles:
        watch.follow(h, lambda: sample(clock()), nursery)
    return out
