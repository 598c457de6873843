"""The per-request output channel between the request actor and the HTTP handler (issue 5 item 5).

The producer (the request actor, a trio task) must never block on a slow client: a stuck stream
would stall its actor and, through it, the decode batch its lane sits in. It must never drop a token
either. So :meth:`StreamWriter.put_token` / :meth:`StreamWriter.put` are synchronous and unbounded
in tokens but bounded in *events*: every token written since the consumer's last read is coalesced
into ONE pending token event (token ids, text pieces and logprobs appended in order), which the
consumer takes whole when it next reads (consumer-side coalescing). Memory stays O(tokens of the
request), which ``max_tokens`` bounds.

Why coalesce on the consumer's side and build the event lazily: one SSE event costs the server more
than one token (hypercorn's send path alone is ~30 µs per event on this machine, see
``bench/http_floor.py``), so whatever a consumer that fell behind finds buffered goes out as one
event; nothing ever waits on purpose — a consumer that keeps up gets each token as soon as it is
written. Building the :class:`TokenEvent` once per read (not once per token) also takes a frozen
dataclass and a tuple concatenation per token off the actor's hot path.

Lifecycle: ``put_token``/``put``* then exactly one ``close(terminal)``; the consumer iterates
(``async for``) or calls :meth:`receive_many` until the terminal event, or gives up with
``aclose()`` (client disconnect), which marks the writer ``abandoned`` so the producer can cancel
the request. The producer is not told otherwise (STACK.md: only the handler sees the disconnect).

Single producer, single consumer: one task waits at a time (a second concurrent reader is a bug and
raises). The wake-up parks/reschedules the consumer task directly (no ``trio.Event`` per event).
"""

from __future__ import annotations

import dataclasses
from typing import Any, final

import trio

from calserve.engine.types import ErrorEvent, Event, FinishEvent, TokenEvent, TokenLogprob

__all__ = ["StreamWriter", "StreamStatistics"]


@dataclasses.dataclass(frozen=True)
class StreamStatistics:
    buffered: int  # token events waiting for the consumer (0 or 1: they are coalesced)
    coalesced: int  # tokens appended to an already pending token event so far
    tokens_put: int  # tokens accepted by put()/put_token()
    events_delivered: int  # events handed to the consumer (terminal included)
    closed: bool  # close() was called
    abandoned: bool  # the consumer gave up (aclose)


@final
class StreamWriter:
    """Coalescing, never-blocking, single-producer single-consumer event stream for one request."""

    __slots__ = ("_ids", "_texts", "_lps", "_terminal", "_terminal_delivered", "_abandoned",
                 "_waiter", "_abandoned_event", "_coalesced", "_tokens_put", "_delivered")

    def __init__(self, max_events: int = 1) -> None:
        # ``max_events`` (config ``server.stream_buffer_events``) is the bound on buffered token
        # events; the writer needs only 1 since every pending token goes into one event.
        if max_events < 1:
            raise ValueError(f"StreamWriter max_events must be >= 1, got {max_events!r}")
        # The pending token event, in parts. Invariant: something is pending <=> _texts is
        # non-empty (one text piece per put/put_token, maybe ""); _ids and _lps (None or the
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

    def put_token(self, token_id: int, text: str, logprob: TokenLogprob | None = None) -> None:
        """Queue one token and the text it adds (may be ""). The actor's hot path: never blocks,
        never drops, allocates no event. After ``aclose`` it is discarded; after ``close`` it
        raises RuntimeError (a producer bug: tokens after the terminal event)."""
        if self._terminal is not None:
            raise RuntimeError("StreamWriter.put after close")
        self._tokens_put += 1
        if self._abandoned:
            return
        texts = self._texts
        if texts:
            self._coalesced += 1
        texts.append(text)
        self._ids.append(token_id)
        if logprob is not None:
            if self._lps is None:
                self._lps = [logprob]
            else:
                self._lps.append(logprob)
        if self._waiter is not None:
            self._wake()

    def put(self, event: TokenEvent) -> None:
        """Queue a token event (several tokens possible). Same rules as :meth:`put_token`."""
        if self._terminal is not None:
            raise RuntimeError("StreamWriter.put after close")
        if not isinstance(event, TokenEvent):
            raise TypeError(f"StreamWriter.put takes a TokenEvent, got {type(event).__name__}")
        n = len(event.token_ids)
        self._tokens_put += n
        if self._abandoned or (n == 0 and not event.text and not event.logprobs):
            return
        self._coalesced += n if self._texts else max(0, n - 1)
        self._ids.extend(event.token_ids)
        self._texts.append(event.text)
        if event.logprobs:
            if self._lps is None:
                self._lps = list(event.logprobs)
            else:
                self._lps.extend(event.logprobs)
        self._wake()

    def close(self, terminal: FinishEvent | ErrorEvent) -> None:
        """Deliver the terminal event after the pending tokens. Exactly once: a second call raises."""
        if self._terminal is not None:
            raise RuntimeError("StreamWriter.close called twice (one terminal event per request)")
        if not isinstance(terminal, (FinishEvent, ErrorEvent)):
            raise TypeError(f"StreamWriter.close takes a FinishEvent or ErrorEvent, got {type(terminal).__name__}")
        self._terminal = terminal
        self._wake()

    # ---------------------------------------------------------------- consumer side (HTTP)
    async def _wait_ready(self) -> bool:
        """Wait until something can be delivered; False when the stream is over for the consumer.

        No checkpoint when something is already there (the hot path: the consumer was woken by
        the producer); parking is a checkpoint (cancellable)."""
        while True:
            if self._abandoned or self._terminal_delivered:
                return False
            if self._texts or self._terminal is not None:
                return True
            if self._waiter is not None:
                raise RuntimeError("StreamWriter has one consumer: two tasks are reading it")
            self._waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort_wait)

    def _abort_wait(self, _: Any) -> trio.lowlevel.Abort:
        # Cancelled while parked: forget the waiter at once, so a later put() does not
        # reschedule a task trio already woke with Cancelled.
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _take_tokens(self) -> TokenEvent:
        ids, texts, lps = self._ids, self._texts, self._lps
        self._ids, self._texts, self._lps = [], [], None
        self._delivered += 1
        return TokenEvent(tuple(ids), texts[0] if len(texts) == 1 else "".join(texts),
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
            raise StopAsyncIteration
        if self._texts:
            return self._take_tokens()
        return self._take_terminal()

    async def receive_many(self) -> list[Event]:
        """Everything deliverable now: ``[tokens]``, ``[tokens, terminal]`` or ``[terminal]``
        (the pending tokens as ONE event, the terminal last); ``[]`` when over.

        Lets the HTTP layer write everything in one send."""
        if not await self._wait_ready():
            return []
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
            self._abandoned = True
            self._ids, self._texts, self._lps = [], [], None
            if self._abandoned_event is not None:
                self._abandoned_event.set()
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
        )
