"""The per-request output channel between the request actor and the HTTP handler (issue 5 item 5).

The producer (the request actor, a trio task) must never block on a slow client: a stuck stream
would stall its actor and, through it, the decode batch its lane sits in. It must never drop a token
either. So :meth:`StreamWriter.put` is synchronous and unbounded in tokens but bounded in *events*:
once ``max_events`` token events are buffered, new tokens are coalesced into the last buffered
event (token ids, text and logprobs concatenated). Memory stays O(tokens of the request), which
``max_tokens`` bounds. Coalescing also cuts the per-event serving cost (STACK.md: ~130 µs per SSE
event).

Lifecycle: ``put``* then exactly one ``close(terminal)``; the consumer iterates (``async for``)
until the terminal event, or gives up with ``aclose()`` (client disconnect), which marks the writer
``abandoned`` so the producer can cancel the request. The producer is not told otherwise (STACK.md:
only the handler sees the disconnect).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import final

import trio

from calserve.engine.types import ErrorEvent, Event, FinishEvent, TokenEvent

__all__ = ["StreamWriter", "StreamStatistics"]


@dataclasses.dataclass(frozen=True)
class StreamStatistics:
    buffered: int  # token events waiting for the consumer
    coalesced: int  # token events merged into a buffered one so far
    tokens_put: int  # tokens accepted by put()
    events_delivered: int  # events handed to the consumer (terminal included)
    closed: bool  # close() was called
    abandoned: bool  # the consumer gave up (aclose)


def _merge(a: TokenEvent, b: TokenEvent) -> TokenEvent:
    if a.logprobs is None and b.logprobs is None:
        lp = None
    else:
        lp = (a.logprobs or ()) + (b.logprobs or ())
    return TokenEvent(token_ids=a.token_ids + b.token_ids, text=a.text + b.text, logprobs=lp)


@final
class StreamWriter:
    """Bounded, coalescing, single-producer single-consumer event stream for one request."""

    def __init__(self, max_events: int) -> None:
        if max_events < 1:
            raise ValueError(f"StreamWriter max_events must be >= 1, got {max_events!r}")
        self._max = max_events
        # Invariant: len(_buf) <= _max; _buf holds TokenEvents only; the terminal is kept apart and
        # is delivered after every buffered token event.
        self._buf: collections.deque[TokenEvent] = collections.deque()
        self._terminal: FinishEvent | ErrorEvent | None = None
        self._terminal_delivered = False
        self._abandoned = False
        self._wakeup = trio.Event()
        self._abandoned_event = trio.Event()
        self._coalesced = 0
        self._tokens_put = 0
        self._delivered = 0

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
        await self._abandoned_event.wait()

    def put(self, event: TokenEvent) -> None:
        """Queue a token event. Never blocks, never drops (coalesces when full).

        After ``aclose`` by the consumer the event is discarded (there is no reader). Raises
        RuntimeError after ``close`` (a producer bug: tokens after the terminal event).
        """
        if self._terminal is not None:
            raise RuntimeError("StreamWriter.put after close")
        if not isinstance(event, TokenEvent):
            raise TypeError(f"StreamWriter.put takes a TokenEvent, got {type(event).__name__}")
        self._tokens_put += len(event.token_ids)
        if self._abandoned:
            return
        if len(self._buf) >= self._max:
            self._buf[-1] = _merge(self._buf[-1], event)
            self._coalesced += 1
        else:
            self._buf.append(event)
        self._wakeup.set()

    def close(self, terminal: FinishEvent | ErrorEvent) -> None:
        """Deliver the terminal event after the buffered ones. Exactly once: a second call raises."""
        if self._terminal is not None:
            raise RuntimeError("StreamWriter.close called twice (one terminal event per request)")
        if not isinstance(terminal, (FinishEvent, ErrorEvent)):
            raise TypeError(f"StreamWriter.close takes a FinishEvent or ErrorEvent, got {type(terminal).__name__}")
        self._terminal = terminal
        self._wakeup.set()

    # ---------------------------------------------------------------- consumer side (HTTP)
    def _done(self) -> bool:
        return self._abandoned or self._terminal_delivered

    async def _wait_ready(self) -> bool:
        """Wait until something can be delivered; False when the stream is over for the consumer."""
        while True:
            if self._done():
                return False
            if self._buf or self._terminal is not None:
                return True
            await self._wakeup.wait()
            self._wakeup = trio.Event()

    def _pop(self) -> Event:
        self._delivered += 1
        if self._buf:
            return self._buf.popleft()
        assert self._terminal is not None
        self._terminal_delivered = True
        return self._terminal

    def __aiter__(self) -> StreamWriter:
        return self

    async def __anext__(self) -> Event:
        if not await self._wait_ready():
            raise StopAsyncIteration
        return self._pop()

    async def receive_many(self) -> list[Event]:
        """Everything deliverable now (at least one event), the terminal last; [] when over.

        Lets the HTTP layer write several events in one send."""
        if not await self._wait_ready():
            return []
        out: list[Event] = []
        while self._buf or (self._terminal is not None and not self._terminal_delivered):
            out.append(self._pop())
        return out

    async def aclose(self) -> None:
        """The consumer gives up (client disconnect). Idempotent; after the terminal it is a no-op
        apart from ending iteration."""
        if not self._terminal_delivered and not self._abandoned:
            self._abandoned = True
            self._buf.clear()
            self._abandoned_event.set()
        self._wakeup.set()
        await trio.lowlevel.checkpoint()

    def statistics(self) -> StreamStatistics:
        return StreamStatistics(
            buffered=len(self._buf),
            coalesced=self._coalesced,
            tokens_put=self._tokens_put,
            events_delivered=self._delivered,
            closed=self._terminal is not None,
            abandoned=self._abandoned,
        )
