"""The per-request output channel between the request actor and the HTTP handler (issue 5 item 5).

The producer (the request actor, a trio task) must never block on a slow client: a stuck stream
would stall its actor and, through it, the decode batch its lane sits in. It must never drop a token
either. So :meth:`StreamWriter.put_token` / :meth:`StreamWriter.put_tokens` are synchronous and unbounded
in tokens but bounded in *events*: every token written since the consumer's last read is coalesced
into ONE pending token event (token ids, text pieces and logprobs appended in order), which the
consumer takes whole when it next reads (consumer-side coalescing).

Bounded in bytes (``max_bytes``, config ``server.stream_buffer_bytes``; README "Per-request limits
and slow readers"): the backlog of a stream is what the writer holds for the consumer plus what the
consumer took at its last read and has not finished with (the HTTP pump is still sending it: it reads
again only once that write completed), both as an estimate of their size (text, and ~2 KB per token
with 20 top logprobs), plus what the consumer last reported written and not yet read by its client
(:meth:`StreamWriter.report_unread`: the socket's estimate, where the launcher gives one). When the
backlog has stayed over the bound for ``grace_s``, or at once while ``contended()`` says other
requests wait for a lane (the lane of a client that does not read is then what they wait for), the
writer gives up on its consumer: it logs why (once), drops what it holds, marks itself
``abandoned`` (the request actor then cancels the request, which frees its lane) and hands the
consumer, if it ever reads again, one ErrorEvent (``kind="slow_consumer"``) as the stream's end.
While contended it also gives up on a consumer whose client the socket shows stalled, or whose
write has not completed, for ``stall_s`` (``server.stream_contended_stall_ms``). This is checked as
tokens arrive and as the consumer reports, so only a request that is still producing is cut. A
client that never reads would otherwise pin a lane until ``max_tokens`` and keep every token in
memory until it disconnects. A read by the consumer (the client took the last write) restarts the
grace period, unless the client's unread bytes alone are over the bound.

Parking (:mod:`calserve.engine.parking`; only where the HTTP layer watches the stream while it is
parked, :meth:`~calserve.engine.stream_park.StreamPark.watch`): instead of being given up at
once while others wait, a stream found behind (any of the three signals above) is *parked*:
``park(True)`` gives its running slot to a waiting request, and nothing more is produced for it.
The consumer's watcher keeps reporting the socket (after 10 ms, doubling to every 100 ms:
``calserve.api.write_watch``); as soon as its client caught up (not stalled, nothing
over the bound, no write pending) it is resumed (``park(False)``); still stalled ``park_cut_s``
after it was parked (``server.stream_parked_cut_ms``), it is given up as above (and its request
stopped: ``park(None)``), whether or not others still wait. So a client that
reads in bursts is paused while others wait, never cut; a client that does not read costs its
running slot only until it is first seen behind.

Why coalesce on the consumer's side and build the event lazily: one SSE event costs the server more
than one token (hypercorn's send path alone is ~30 µs per event on this machine, see
``bench/http_floor.py``), so whatever a consumer that fell behind finds buffered goes out as one
event; nothing ever waits on purpose — a consumer that keeps up gets each token as soon as it is
written. Building the :class:`TokenEvent` once per read (not once per token) also takes a frozen
dataclass and a tuple concatenation per token off the actor's hot path.

Lifecycle: ``put_token``/``put_tokens``* then exactly one ``close(terminal)``; the consumer iterates
(``async for``) or calls :meth:`receive_many` until the terminal event, or gives up with
``aclose()`` (client disconnect), which marks the writer ``abandoned`` so the producer can cancel
the request. The producer is not told otherwise (STACK.md: only the handler sees the disconnect).

Single producer, single consumer: one task waits at a time (a second concurrent reader is a bug and
raises). The wake-up parks/reschedules the consumer task directly (no ``trio.Event`` per event).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, final

import trio

from calserve.engine.stream_park import StreamPark
from calserve.engine.types import (
    ErrorEvent, Event, FinishEvent, TokenEvent, TokenLogprob, token_event,
)

__all__ = ["StreamWriter", "StreamStatistics", "token_bytes"]

log = logging.getLogger("calserve.engine.stream")

# The size estimate of a buffered token (what it takes in memory and about what it takes on the
# wire once encoded): its text plus a fixed part, and with logprobs a part per top entry. With 20 top
# logprobs (the most a request may ask): 2,112 bytes plus its text (a chat chunk carries ~1.4 KB of
# JSON for it; the TokenLogprob tuples hold ~2 KB).
TOKEN_BYTES: Final = 64
LOGPROB_BYTES: Final = 128
TOP_LOGPROB_BYTES: Final = 96
_UNBOUNDED: Final = sys.maxsize
# A write that has not completed is a stall only past this much at least, whatever ``stall_s``
# says: the wall time of a write also holds the server's own scheduling delay (tens of ms on a
# saturated event loop), while a client that does not read blocks it for good.
WRITE_STALL_MIN_S: Final = 0.5


def token_bytes(text: str, logprob: TokenLogprob | None) -> int:
    """The backlog estimate of one token (see the module docstring)."""
    n = TOKEN_BYTES + len(text)
    if logprob is not None:
        n += LOGPROB_BYTES + TOP_LOGPROB_BYTES * len(logprob.top)
    return n


@dataclasses.dataclass(frozen=True)
class StreamStatistics:
    buffered: int  # token events waiting for the consumer (0 or 1: they are coalesced)
    coalesced: int  # tokens appended to an already pending token event so far
    tokens_put: int  # tokens accepted by put_token() / put_tokens()
    events_delivered: int  # events handed to the consumer (terminal included)
    closed: bool  # close() was called
    abandoned: bool  # the consumer gave up (aclose), or the writer gave up on it (overflowed)
    backlog_bytes: int = 0  # estimated bytes held for the consumer + taken and not yet done with
    overflowed: bool = False  # the backlog stayed over max_bytes past the grace period


@final
class StreamWriter:
    """Coalescing, never-blocking, single-producer single-consumer event stream for one request."""

    __slots__ = ("_ids", "_texts", "_lps", "_terminal", "_terminal_delivered", "_abandoned",
                 "_waiter", "_abandoned_event", "_coalesced", "_tokens_put", "_delivered",
                 "_bytes", "_room", "_limit", "_grace", "_full_at", "_overflow", "_overflowed",
                 "_name", "_contended", "_below", "_stall", "_sending_since", "_now", "parking")

    def __init__(self, max_events: int = 1, *, max_bytes: int = 0, grace_s: float = 0.0,
                 contended: Callable[[], bool] | None = None, stall_s: float = 0.0,
                 name: object = "?", park: Callable[[bool | None], None] | None = None,
                 park_cut_s: float = 0.0) -> None:
        # ``max_events`` (config ``server.stream_buffer_events``, kept for compatibility) is the
        # bound on buffered token events; the writer needs only 1 since every pending token goes
        # into one event. ``max_bytes`` (0 = unbounded) and ``grace_s`` bound the backlog in bytes
        # (module docstring), ``contended`` (None: never) cuts the grace short; ``stall_s`` (0 =
        # off; ``server.stream_contended_stall_ms``): while contended, a consumer whose write has
        # not completed this long (at least WRITE_STALL_MIN_S) is given up; ``name`` (the
        # request id) is for the log line. ``park`` (None: never) parks / resumes the request once
        # the consumer watches (module docstring); after ``park_cut_s`` parked it is given up.
        if max_events < 1:
            raise ValueError(f"StreamWriter max_events must be >= 1, got {max_events!r}")
        if max_bytes < 0 or grace_s < 0 or stall_s < 0:
            raise ValueError("StreamWriter max_bytes, grace_s and stall_s must be >= 0")
        # The pending token event, in parts. Invariant: something is pending <=> _texts is
        # non-empty (one text piece per put_token / put_tokens, maybe ""); _ids and _lps (None or the
        # pending tokens' logprobs that were not None) in put order; nothing is pending after the
        # consumer's read or after aclose().
        self._ids: list[int] = []
        self._texts: list[str] = []
        self._lps: list[TokenLogprob] | None = None
        # Invariant: the terminal is delivered once, after every token put before close().
        self._terminal: FinishEvent | ErrorEvent | None = None
        self._terminal_delivered = False
        self._abandoned = False
        self._waiter: trio.lowlevel.Task | None = None  # the consumer, parked in _wait_ready
        self._abandoned_event: trio.Event | None = None  # made on demand (wait_abandoned)
        self._coalesced = 0
        self._tokens_put = 0
        self._delivered = 0
        # The byte bound. Invariant: _bytes is the estimate of the pending tokens; _below what the
        # consumer last reported written and not yet read by its client (report_unread: the
        # socket); _room is _limit less _below less the estimate of what the consumer took at its
        # last read (until it reads or parks again); the stream is over its bound while
        # _bytes > _room, since _full_at.
        self._limit = max_bytes if max_bytes else _UNBOUNDED
        self._grace = grace_s
        self._bytes = 0
        self._below = 0
        self._room = self._limit
        self._full_at: float | None = None
        self._overflow: ErrorEvent | None = None  # handed to the consumer once after overflowing
        self._overflowed = False
        self._name = name
        self._contended = contended
        # The write stall. Invariant: _sending_since is when the consumer took its last batch,
        # until it reports that batch written (report_written) or reads again; None otherwise
        # (and always when _stall is 0).
        self._stall = max(stall_s, WRITE_STALL_MIN_S) if stall_s else 0.0
        self._sending_since: float | None = None
        # The run's clock, looked up at the first take that needs it (a writer may be built
        # outside trio): trio.current_time() is three Python calls, this one. Invariant: set
        # whenever _sending_since is (that take sets both), so the stall check reads it too.
        self._now: Callable[[], float] | None = None
        # Parking (module docstring). Invariant: not parked once abandoned or closed.
        self.parking = StreamPark(park, park_cut_s)

    # ---------------------------------------------------------------- producer side (actor)
    @property
    def closed(self) -> bool:
        return self._terminal is not None

    @property
    def abandoned(self) -> bool:
        """The consumer is gone: the producer should cancel the request."""
        return self._abandoned

    async def wait_abandoned(self) -> None:
        """Return once the consumer called ``aclose`` before the terminal event."""
        if self._abandoned:
            await trio.lowlevel.checkpoint()
            return
        if self._abandoned_event is None:
            self._abandoned_event = trio.Event()
        await self._abandoned_event.wait()

    def _wake(self) -> None:
        t = self._waiter
        if t is not None:
            self._waiter = None
            trio.lowlevel.reschedule(t)

    def put_token(self, token_id: int, text: str, logprob: TokenLogprob | None = None) -> bool:
        """Queue one token and the text it adds (may be ""). The actor's hot path: never blocks,
        never drops, allocates no event. After ``aclose`` it is discarded; after ``close`` it
        raises RuntimeError (a producer bug: tokens after the terminal event). Returns
        :attr:`abandoned` (after this token: the producer should cancel the request)."""
        if self._terminal is not None:
            raise RuntimeError("StreamWriter.put after close")
        self._tokens_put += 1
        if self._abandoned:
            return True
        texts = self._texts
        if texts:
            self._coalesced += 1
        texts.append(text)
        self._ids.append(token_id)
        if logprob is None:
            b = self._bytes = self._bytes + TOKEN_BYTES + len(text)  # token_bytes(text, None)
        else:
            if self._lps is None:
                self._lps = [logprob]
            else:
                self._lps.append(logprob)
            b = self._bytes = self._bytes + token_bytes(text, logprob)
        if b > self._room:
            self._over_bound()
        elif self._sending_since is not None:
            self._check_write_stall()
        t = self._waiter
        if t is not None:
            self._waiter = None
            trio.lowlevel.reschedule(t)
        return self._abandoned

    def put_tokens(self, token_ids: Sequence[int], text: str,
                   logprobs: Sequence[TokenLogprob] | None = None) -> bool:
        """Queue several tokens and the text they add together (a multi-step job's run), with
        the logprobs of those that have one; or none with logprobs only (a prompt's scores). For
        tokens the same pending event, byte estimate and counts as :meth:`put_token` of each, the
        first with ``text`` and the others with "". Same rules and return value."""
        if self._terminal is not None:
            raise RuntimeError("StreamWriter.put after close")
        n = len(token_ids)
        self._tokens_put += n
        if self._abandoned or not (n or text or logprobs):
            return self._abandoned
        texts = self._texts
        self._coalesced += n if texts else max(0, n - 1)
        texts.append(text)
        self._ids.extend(token_ids)
        b = self._bytes + TOKEN_BYTES * max(1, n) + len(text)
        if logprobs:
            b += sum(LOGPROB_BYTES + TOP_LOGPROB_BYTES * len(lp.top) for lp in logprobs)
            if self._lps is None:
                self._lps = list(logprobs)
            else:
                self._lps.extend(logprobs)
        self._bytes = b
        if b > self._room:
            self._over_bound()
        elif self._sending_since is not None:
            self._check_write_stall()
        self._wake()
        return self._abandoned

    def _over_bound(self) -> None:
        """The backlog is over the bound (a put just made it so, or kept it so): start the grace
        period, or give up on the consumer once it has passed."""
        now = trio.current_time()
        since = self._full_at
        if since is None:
            since = self._full_at = now
        if now - since < self._grace:
            contended = self._contended
            if contended is None or not contended():
                return
            if self.parking.behind(now):
                return
            why = "other requests wait for its lane"
        else:
            why = "past the grace period (server.stream_stall_grace_ms)"
        self._cut(now - since, why)

    def _check_write_stall(self) -> None:
        """The consumer is writing its last batch: give it up when that write has taken
        ``stall_s`` (at least :data:`WRITE_STALL_MIN_S`) already and other requests wait for its
        lane (a client that does not read blocks the write once the kernel's buffers are full,
        whatever the launcher)."""
        since, clock = self._sending_since, self._now
        assert since is not None and clock is not None  # both set by the take that set since
        now = clock()
        if now - since < self._stall:
            return
        contended = self._contended
        if contended is not None and contended() and not self.parking.behind(now):
            self._cut(now - since, "its last write has not completed while other requests wait"
                      " for its lane (server.stream_contended_stall_ms)")

    def _cut(self, stalled_s: float, why: str) -> None:
        """Give up on the consumer (logged once, with why): its next read is the overflow."""
        since = self.parking.since
        if since is not None:
            why += (f"; parked {trio.current_time() - since:.2f} s without catching up"
                    " (server.stream_parked_cut_ms)")
        backlog = self._bytes + self._limit - self._room
        log.warning(
            "request %s: stream cancelled, its client did not read for %.2f s while %d bytes"
            " were waiting for it (bound %d bytes, server.stream_buffer_bytes): %s",
            self._name, stalled_s, backlog, self._limit, why, extra={"request_id": self._name})
        self._overflow = ErrorEvent(
            f"stream cancelled: the client did not read it for {stalled_s:.2f} s while"
            f" {backlog} bytes were waiting (bound {self._limit} bytes): {why}", "slow_consumer")
        self._overflowed = True
        self._give_up()

    def _give_up(self) -> None:
        """The consumer is gone (or treated as gone): nothing more is kept for it."""
        # a parked request is stopped (no token comes to tell its actor); a cut is told to the
        # consumer's watch (the HTTP side closes the connection of a client it gave up on)
        self.parking.give_up(self._overflowed)
        self._abandoned = True
        self._ids, self._texts, self._lps = [], [], None
        self._bytes = self._below = 0
        self._room = self._limit
        self._full_at = self._sending_since = None
        if self._abandoned_event is not None:
            self._abandoned_event.set()
        self._wake()  # a consumer waiting for tokens gets the end (a cut from a report)

    def close(self, terminal: FinishEvent | ErrorEvent) -> None:
        """Deliver the terminal event after the pending tokens. Exactly once: a second call raises."""
        if self._terminal is not None:
            raise RuntimeError("StreamWriter.close called twice (one terminal event per request)")
        if not isinstance(terminal, (FinishEvent, ErrorEvent)):
            raise TypeError(f"StreamWriter.close takes a FinishEvent or ErrorEvent, got {type(terminal).__name__}")
        self._terminal = terminal
        self.parking.drop()
        self._wake()

    # ---------------------------------------------------------------- consumer side (HTTP)
    def report_unread(self, n: int, stalled_for: float | None = None) -> None:
        """The consumer is about to write more and ``n`` bytes of what it wrote before are still
        not read by its client (the socket's estimate: ``calserve.api.socket_probe``). They count
        in the backlog bound like what the engine holds: a client that leaves the kernel's
        buffers full is as far behind as one whose tokens wait here. ``stalled_for`` (None: not
        stalled): the client has not caught up for that long, past the consumer's stall
        threshold (``server.stream_contended_stall_ms``) — while other requests wait for its
        lane, that alone parks it (where the consumer watches: module docstring) or gives it
        up, however few bytes it left. Checks at once (a stream others wait for is parked or
        given up now, not at its next token); a parked stream is resumed by a report that shows
        its client caught up (whether or not others still wait), and given up by one that shows
        it still stalled ``park_cut_s`` after it was parked."""
        if self._abandoned or self._terminal is not None:
            return
        self._room += self._below - n
        self._below = n
        if stalled_for is not None and n and (
                self.parking.parked or (self._contended is not None and self._contended())):
            if not self.parking.behind(trio.current_time()):
                self._cut(stalled_for, "other requests wait for its lane (server."
                          "stream_contended_stall_ms)")
            return
        if self._bytes > self._room:
            self._over_bound()
        else:
            self._full_at = None
            if self._sending_since is None:
                self.parking.resume()  # it caught up (if parked)

    def report_written(self) -> None:
        """The consumer's write of what it took last has completed (the write stall ends; what
        it took is the socket's now: :meth:`report_unread`)."""
        self._sending_since = None
        self._room = self._limit - self._below

    async def _wait_ready(self) -> bool:
        """Wait until something can be delivered; False when the stream is over for the consumer.

        No checkpoint when something is already there (the hot path: the consumer was woken by
        the producer); parking is a checkpoint (cancellable)."""
        self._sending_since = None  # it is back: done with what it took
        while True:
            if self._abandoned or self._terminal_delivered:
                return False
            if self._texts or self._terminal is not None:
                return True
            if self._waiter is not None:
                raise RuntimeError("StreamWriter has one consumer: two tasks are reading it")
            self._park()
            await trio.lowlevel.wait_task_rescheduled(self._abort_wait)

    def _park(self) -> None:
        """The consumer waits for the producer (nothing to deliver): it is done with what it
        took, and it is the task a put() wakes."""
        self._room = self._limit - self._below
        if self._room >= 0:  # (its client is not known to be over the bound on its own)
            self._full_at = None
        self._waiter = trio.lowlevel.current_task()

    def _abort_wait(self, _: Any) -> trio.lowlevel.Abort:
        # Cancelled while parked: forget the waiter at once, so a later put() does not
        # reschedule a task trio already woke with Cancelled.
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _take_tokens(self) -> TokenEvent:
        ids, texts, lps = self._ids, self._texts, self._lps
        self._ids, self._texts, self._lps = [], [], None
        # The consumer read again (done with the last batch) and now holds this one.
        self._room = self._limit - self._below - self._bytes
        self._bytes = 0
        if self._below <= self._limit:  # the grace restarts unless its client is over on its own
            self._full_at = None
        if self._stall:
            now = self._now
            if now is None:
                now = self._now = trio.lowlevel.current_clock().current_time
            self._sending_since = now()
        self._delivered += 1
        return token_event(tuple(ids), texts[0] if len(texts) == 1 else "".join(texts),
                           None if lps is None else tuple(lps))

    def _take_terminal(self) -> FinishEvent | ErrorEvent:
        assert self._terminal is not None
        self._terminal_delivered = True
        self._delivered += 1
        return self._terminal

    def __aiter__(self) -> StreamWriter:
        return self

    async def __anext__(self) -> Event:
        """The pending tokens as one event, else the terminal; StopAsyncIteration at the end."""
        if not await self._wait_ready():
            ev = self._overflow
            if ev is None:
                raise StopAsyncIteration
            self._overflow = None
            return ev
        if self._texts:
            return self._take_tokens()
        return self._take_terminal()

    async def receive_many(self) -> list[Event]:
        """Everything deliverable now: ``[tokens]``, ``[tokens, terminal]`` or ``[terminal]``
        (the pending tokens as ONE event, the terminal last); ``[]`` when over.

        Lets the HTTP layer write everything in one send. After the writer gave up on a consumer
        that fell too far behind (overflow), that consumer's next read is ``[ErrorEvent]``."""
        if self._terminal is None and not self._abandoned:
            self._sending_since = None  # the hot paths: what _wait_ready would do, without a frame
            if self._texts:
                return [self._take_tokens()]
            if self._waiter is None:
                # nothing yet (a consumer that keeps up): _wait_ready's park, without its frame
                self._park()
                await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
                if self._texts and self._terminal is None and not self._abandoned:
                    return [self._take_tokens()]  # woken by a token (what _wait_ready returns to)
        if not await self._wait_ready():
            end = self._overflow
            if end is None:
                return []
            self._overflow = None
            return [end]
        if self._texts:
            ev = self._take_tokens()
            if self._terminal is None:
                return [ev]
            return [ev, self._take_terminal()]
        return [self._take_terminal()]

    async def aclose(self) -> None:
        """The consumer gives up (client disconnect). Idempotent; after the terminal it is a no-op
        apart from ending iteration."""
        if not self._terminal_delivered and not self._abandoned:
            self._give_up()
        self._overflow = None
        self._wake()
        await trio.lowlevel.checkpoint()

    def statistics(self) -> StreamStatistics:
        return StreamStatistics(
            buffered=1 if self._texts else 0,
            coalesced=self._coalesced,
            tokens_put=self._tokens_put,
            events_delivered=self._delivered,
            closed=self._terminal is not None,
            abandoned=self._abandoned,
            backlog_bytes=self._bytes + self._limit - self._room,
            overflowed=self._overflowed,
        )
