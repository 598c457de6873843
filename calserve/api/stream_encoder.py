"""Engine events -> the SSE bytes of one streamed completion (OpenAI chunk shape). Pure: no trio, no
clock, no I/O; :func:`calserve.api.running.pump_stream` reads the events, times, paces and writes.

What a stream looks like (``tests/api/test_stream_encoder.py`` pins each rule):

- first (:meth:`StreamEncoder.opening`): chat's role chunk ``delta: {"role": "assistant",
  "content": ""}``; a completion with ``echo`` sends the prompt text as its first chunk;
- every batch of token events read together becomes ONE chunk (texts and logprobs concatenated); a
  batch adding no text and no logprobs (a partial UTF-8 character, text held back for a stop string)
  sends nothing;
- ``FinishEvent``: the tokens read with it, then the chunk carrying ``finish_reason`` (and the
  finish's own text), then the usage chunk (``stream_options.include_usage``), then ``[DONE]``;
- ``ErrorEvent`` after the stream started: ``data: {"error": ...}`` and no ``[DONE]`` (``[DONE]``
  marks a complete answer only; ``code: "client_too_slow"`` when the engine gave up on a client that
  did not read, ``server.stream_buffer_bytes``); the same for an engine whose events end without a terminal event
  and (:meth:`StreamEncoder.failure`) for one whose event stream raised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol, final

from calserve.api.chunks import ChunkEncoder
from calserve.api.convert import Prepared
from calserve.api.errors import ApiError, error_event_to_api, from_exception
from calserve.api.render import (
    DONE, LogprobFormatter, finish_reason, merge_completion_logprobs, new_id, now_s, sse,
)
from calserve.engine.types import ErrorEvent, Event, FinishEvent, TokenEvent, Usage

__all__ = ["StreamEncoder", "SseEncoder", "stream_error_chunk", "failure_chunk", "NO_TERMINAL"]


class SseEncoder(Protocol):
    """What :func:`~calserve.api.running.pump_stream` drives (:class:`StreamEncoder`, and
    ``api/tool_stream.py``'s for tool calling): see :class:`StreamEncoder`."""

    tokens: int
    terminal: FinishEvent | ErrorEvent | None
    finished: bool

    def opening(self) -> bytes: ...

    def encode(self, batch: Sequence[Event]) -> bytes: ...

    def failure(self, exc: BaseException) -> bytes: ...

    def usage_chunk(self, usage: Usage) -> bytes: ...


def _error_chunk(err: ApiError) -> bytes:
    return sse(err.body())


def stream_error_chunk(ev: ErrorEvent) -> bytes:
    """The last event of a stream that ended with ``ev``."""
    return _error_chunk(_stream_error(ev))


def failure_chunk(exc: BaseException) -> bytes:
    """The last event of a stream whose engine event stream raised ``exc``."""
    return _error_chunk(from_exception(exc))


def _stream_error(ev: ErrorEvent) -> ApiError:
    """A stream's terminal ErrorEvent as the error of its last event. ``slow_consumer``: the engine
    gave up on a client that did not read (``server.stream_buffer_bytes``); only a stream has it."""
    if ev.kind == "slow_consumer":
        return ApiError(408, ev.message, type="timeout_error", code="client_too_slow")
    return error_event_to_api(ev)


# What a client gets when the engine's events end without a terminal event (an engine bug).
NO_TERMINAL: Final = _error_chunk(ApiError(
    500, "the engine ended the request without a terminal event", type="server_error",
    code="internal_error"))


@final
class StreamEncoder:
    """Encodes one streamed completion, batch by batch of engine events.

    After each :meth:`encode`: ``tokens`` is the number of tokens of that batch, ``terminal`` the
    terminal event once one was encoded, and ``finished`` is True once nothing more may be sent
    (a terminal event, or the end of the events). Invariant: nothing is encoded after
    ``finished``; events after a terminal event in the same batch are ignored."""

    __slots__ = ("_chunks", "_text", "_fmt", "_chat", "_usage", "_echo", "_last", "tokens",
                 "terminal", "finished")

    def __init__(self, chunks: ChunkEncoder, *, include_usage: bool = False, echo_text: str = "",
                 logprobs: LogprobFormatter | None = None, last: bool = True) -> None:
        """``chunks`` has the request's constant bytes; ``logprobs`` formats the token events'
        logprobs (None: the request asked for none, they are not sent). ``last`` False: one choice
        of several (``n`` > 1): its finish chunk is followed by neither the usage chunk nor
        ``[DONE]`` (the caller sends them once, after every choice finished)."""
        self._last = last
        self._chunks = chunks
        self._text: Callable[[str], bytes] = chunks.text  # the per-token call, bound once
        self._fmt = logprobs
        self._chat = chunks.chat
        self._usage = include_usage
        self._echo = echo_text
        self.tokens = 0
        self.terminal: FinishEvent | ErrorEvent | None = None
        self.finished = False

    @classmethod
    def for_request(cls, prep: Prepared, fmt: LogprobFormatter,
                    system_fingerprint: str | None = None) -> StreamEncoder:
        """The encoder of an accepted streaming request (a fresh id, ``created`` = now;
        ``system_fingerprint``: the generation the request is pinned to)."""
        chat = prep.kind == "chat"
        chunks = ChunkEncoder(chat=chat, rid=new_id("chatcmpl" if chat else "cmpl"),
                              created=now_s(), model=prep.alias,
                              include_usage=prep.include_usage,
                              system_fingerprint=system_fingerprint)
        return cls(chunks, include_usage=prep.include_usage, echo_text=prep.echo_text,
                   logprobs=fmt if prep.logprobs is not None else None)

    @classmethod
    def for_choice(cls, prep: Prepared, fmt: LogprobFormatter, *, rid: str, created: int,
                   index: int) -> StreamEncoder:
        """The encoder of choice ``index`` of an ``n`` > 1 stream (shared ``rid``/``created``)."""
        chunks = ChunkEncoder(chat=prep.kind == "chat", rid=rid, created=created,
                              model=prep.alias, include_usage=prep.include_usage, index=index)
        return cls(chunks, include_usage=prep.include_usage, echo_text=prep.echo_of(index),
                   logprobs=fmt if prep.logprobs is not None else None, last=False)

    def opening(self) -> bytes:
        """What goes out before any event: chat's role chunk, a completion's echoed prompt."""
        out = self._chunks.chunk("", None, None, role=True) if self._chat else b""
        if self._echo:
            out += self._text(self._echo)
        return out

    def encode(self, batch: Sequence[Event]) -> bytes:
        """The bytes for the events read together (``[]``: the events ended); b"" = send nothing."""
        if len(batch) == 1 and self._fmt is None:
            ev = batch[0]
            if type(ev) is TokenEvent:  # the hot path: one token event, nothing else
                self.tokens = len(ev.token_ids)
                text = ev.text
                return self._text(text) if text else b""
        return self._encode_batch(batch)

    def usage_chunk(self, usage: Usage) -> bytes:
        """The ``choices: []`` chunk carrying ``usage`` (an ``n`` > 1 stream sends it once)."""
        return self._chunks.usage(usage)

    def failure(self, exc: BaseException) -> bytes:
        """The last event of a stream whose engine event stream raised ``exc``."""
        return failure_chunk(exc)

    def _encode_batch(self, batch: Sequence[Event]) -> bytes:
        if not batch:  # the events ended without a terminal event: an engine bug
            self.tokens = 0
            self.finished = True
            return NO_TERMINAL
        chat = self._chat
        fmt = self._fmt
        texts: list[str] = []
        lp_items: list[Any] = []
        n_tokens = 0
        terminal: FinishEvent | ErrorEvent | None = None
        for ev in batch:
            if isinstance(ev, TokenEvent):
                n_tokens += len(ev.token_ids)
                texts.append(ev.text)
                if fmt is not None and ev.logprobs:
                    lp_items.append(fmt.chat(ev.logprobs) if chat else fmt.completion(ev.logprobs))
                continue
            terminal = ev
            break
        self.tokens = n_tokens
        out = self._token_chunk(texts, lp_items) if texts else b""
        if terminal is None:
            return out
        self.terminal = terminal
        self.finished = True
        if isinstance(terminal, FinishEvent):
            chunks = self._chunks
            out += chunks.chunk(terminal.text if (terminal.text or not chat) else None, None,
                                finish_reason(terminal.reason))
            if not self._last:
                return out
            if self._usage:
                out += chunks.usage(terminal.usage)
            return out + DONE
        return out + _error_chunk(_stream_error(terminal))

    def _token_chunk(self, texts: list[str], lp_items: list[Any]) -> bytes:
        """One chunk for several token events, or b"" when they add neither text nor logprobs."""
        text = texts[0] if len(texts) == 1 else "".join(texts)
        if not lp_items:
            return self._text(text) if text else b""
        lps = ([x for part in lp_items for x in part] if self._chat
               else merge_completion_logprobs(lp_items))
        return self._chunks.chunk(text, lps, None)
