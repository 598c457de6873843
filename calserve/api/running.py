"""Runs one accepted request for the HTTP layer: to completion (JSON) or as an SSE stream.

Invariant: every request submitted here ends in exactly one of (a) its terminal event was read, or
(b) ``handle.aclose()`` (cancel, drop what is queued) was called from a ``finally`` inside a shielded
scope (client went away, handler cancelled, error while writing). So the engine always gets its
lane back.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any, Final

import trio

from calserve.api.chunks import ChunkEncoder
from calserve.api.convert import Prepared
from calserve.api.errors import ApiError, error_body, from_exception
from calserve.api.metrics import ApiMetrics
from calserve.api.pacing import StreamPacer
from calserve.api.protocol import HandleLike
from calserve.api.render import (
    DONE, LogprobFormatter, finish_reason, merge_completion_logprobs, new_id, now_s, sse,
    usage_dict,
)
from calserve.engine.types import ErrorEvent, FinishEvent, TokenEvent

__all__ = ["cancel_request", "run_json", "run_stream", "error_event_to_api", "StreamGuard"]

log = logging.getLogger("calserve.api")
_CANCEL_TIMEOUT_S: Final = 5.0


async def cancel_request(handle: HandleLike) -> None:
    """Cancel at once and drop what is queued (``handle.aclose``), shielded: we may be running
    inside a cancelled scope or handling GeneratorExit after the client went away."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(_CANCEL_TIMEOUT_S):
            try:
                await handle.aclose()
            except Exception:
                log.exception("cancelling %s failed", handle.request_id)


class StreamGuard:
    """Owns an accepted streaming request until its SSE body generator starts.

    Why: the body generator's ``finally`` cancels the request, but it only runs once the server
    started iterating the body. A client that goes away between "the handler returned the
    Response" and "the body started" (e.g. while the headers are sent) cancels the connection
    before that, so without this guard the request would run on to ``max_tokens`` holding its
    lane. The app runs :meth:`release` (shielded) when the connection ends.

    Invariant: exactly one of the generator (``owned``) or :meth:`release` ends the request."""

    def __init__(self, handle: HandleLike) -> None:
        self._handle = handle
        self.owned = False

    async def release(self) -> None:
        if self.owned:
            return
        self.owned = True
        await cancel_request(self._handle)


def error_event_to_api(ev: ErrorEvent) -> ApiError:
    if ev.kind in ("unavailable", "shutdown"):
        return ApiError(503, ev.message, type="service_unavailable", code="model_unavailable",
                        retry_after=1.0)
    if ev.kind == "device_error":
        return ApiError(500, ev.message, type="server_error", code="device_error")
    return ApiError(500, ev.message, type="server_error", code="internal_error")


class _Observer:
    """Latency histograms as the HTTP layer sees them (spec §16 + issue 6). The labelled children
    are looked up once per request: ``labels()`` is a locked dict lookup, too dear per token."""

    __slots__ = ("_ttft", "_itl", "_tokens", "_e2e", "_queue", "t0", "last")

    def __init__(self, metrics: ApiMetrics, alias: str, tenant: str) -> None:
        self._ttft = metrics.ttft.labels(alias)
        self._itl = metrics.itl.labels(alias)
        self._tokens = metrics.completion_tokens.labels(alias, tenant)
        self._e2e = metrics.e2e.labels(alias)
        self._queue = metrics.queue.labels(alias)
        self.t0 = trio.current_time()
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        """``n`` tokens arrived together. Invariant: one TTFT and ``tokens - 1`` inter-token
        observations per request (tokens arriving with the first one have a gap of 0)."""
        if n <= 0:
            return
        now = trio.current_time()
        h = self._itl
        if self.last is None:
            self._ttft.observe(now - self.t0)
            for _ in range(n - 1):
                h.observe(0.0)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                h.observe(gap)
        self.last = now
        self._tokens.inc(n)

    def end(self, ev: FinishEvent | ErrorEvent) -> None:
        self._e2e.observe(trio.current_time() - self.t0)
        if ev.timings is not None:
            self._queue.observe(ev.timings.queue_s)


async def run_json(
    metrics: ApiMetrics, prep: Prepared, handle: HandleLike, fmt: LogprobFormatter,
) -> dict[str, Any]:
    """Collect the whole answer; returns the OpenAI response body (or raises ApiError)."""
    obs = _Observer(metrics, prep.alias, prep.request.tenant)
    completion = prep.kind == "completion"
    want_lps = prep.logprobs is not None
    texts: list[str] = [prep.echo_text]
    lp_parts: list[Any] = []
    terminal: FinishEvent | None = None
    finished = False
    try:
        while terminal is None:
            batch = await handle.receive_many()
            if not batch:  # the events ended without a terminal event (an engine bug)
                raise ApiError(500, "the engine ended the request without a terminal event",
                               type="server_error", code="internal_error")
            n_tokens = 0
            for ev in batch:
                if isinstance(ev, TokenEvent):
                    n_tokens += len(ev.token_ids)
                    texts.append(ev.text)
                    if ev.logprobs is not None and want_lps:
                        lp_parts.append(fmt.completion(ev.logprobs) if completion
                                        else fmt.chat(ev.logprobs))
                    continue
                finished = True
                obs.tokens(n_tokens)
                obs.end(ev)
                if isinstance(ev, ErrorEvent):
                    raise error_event_to_api(ev)
                texts.append(ev.text)
                terminal = ev
                break
            else:
                obs.tokens(n_tokens)  # one clock read and metric update per batch, not per event
    finally:
        if not finished:
            await cancel_request(handle)
    text = "".join(texts)
    fr = finish_reason(terminal.reason)
    if completion:
        logprobs = merge_completion_logprobs(lp_parts) if want_lps else None
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs,
                                  "finish_reason": fr}
        return {"id": new_id("cmpl"), "object": "text_completion", "created": now_s(),
                "model": prep.alias, "choices": [choice], "usage": usage_dict(terminal.usage)}
    chat_lp = {"content": [x for part in lp_parts for x in part]} if want_lps else None
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now_s(),
            "model": prep.alias,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": chat_lp, "finish_reason": fr}],
            "usage": usage_dict(terminal.usage)}


async def run_stream(
    metrics: ApiMetrics, prep: Prepared, handle: HandleLike, fmt: LogprobFormatter,
    guard: StreamGuard | None = None, *, pacer: StreamPacer | None = None,
) -> AsyncGenerator[bytes, None]:
    """The SSE body. No nursery around a yield (STACK.md); cancellation on disconnect arrives at a
    yield as Cancelled/GeneratorExit and the ``finally`` cancels the request at once. From its
    first step (no checkpoint before the ``try``) this generator owns the request, not ``guard``.

    After a token chunk is written, the next read waits until the hold interval has passed, so the
    tokens produced meanwhile go out as one chunk: ``pacer.interval()`` (the server's
    :class:`~calserve.api.pacing.StreamPacer`: fixed ``server.stream_interval_ms``, or adaptive to
    the server's CPU load; no pacer: 0). At 0 nothing ever waits on purpose: every read takes
    whatever is queued. The first token is never held."""

    def held_until() -> float:
        """When the read after the chunk just written may happen (0: at once)."""
        hold = pacer.interval() if pacer is not None else 0.0
        return trio.current_time() + hold if hold else 0.0
    if guard is not None:
        if guard.owned:  # released already: the connection ended before the body started
            return
        guard.owned = True
    obs = _Observer(metrics, prep.alias, prep.request.tenant)
    chat = prep.kind == "chat"
    enc = ChunkEncoder(chat=chat, rid=new_id("chatcmpl" if chat else "cmpl"), created=now_s(),
                       model=prep.alias, include_usage=prep.include_usage)
    want_lps = prep.logprobs is not None

    def token_chunk(texts: list[str], lp_items: list[Any]) -> bytes:
        """One chunk for several token events, or b"" when they add neither text nor logprobs."""
        text = texts[0] if len(texts) == 1 else "".join(texts)
        if not lp_items:
            return enc.text(text) if text else b""
        lps = ([x for part in lp_items for x in part] if chat
               else merge_completion_logprobs(lp_items))
        return enc.chunk(text, lps, None)

    # Every event already queued (one write for all of them), or [] at the end.
    next_batch = handle.receive_many

    finished = False
    broken = False  # the engine's stream raised (not a client disconnect)
    metrics.streams_active.inc()
    try:
        if chat:
            yield enc.chunk("", None, None, role=True)
        if prep.echo_text:
            yield enc.text(prep.echo_text)
        hold_until = 0.0  # no read before this (0: the first token is never held)
        while not finished:
            if hold_until:
                await trio.sleep_until(hold_until)
                hold_until = 0.0
            try:
                batch = await next_batch()
            except Exception as exc:  # an engine bug: still one terminal event for the client
                log.exception("the event stream of %s failed", handle.request_id)
                err = from_exception(exc)
                broken = True  # not ``finished``: the finally cancels the request
                yield sse(error_body(err.message, err.type, err.param, err.code))
                break
            if len(batch) == 1 and not want_lps:
                ev = batch[0]
                if type(ev) is TokenEvent:  # the hot path: tokens, nothing else
                    obs.tokens(len(ev.token_ids))
                    if ev.text:
                        yield enc.text(ev.text)
                        hold_until = held_until()
                    continue
            if not batch:
                finished = True  # stream ended without a terminal event: an engine bug
                yield sse(error_body("the engine ended the request without a terminal event",
                                     "server_error", None, "internal_error"))
                break
            # Invariant: the token events of one batch become ONE chunk (their texts and logprobs
            # concatenated), written before the terminal's chunk; a batch adding no text and no
            # logprobs (a partial UTF-8 character, text held back for a stop string) sends nothing.
            texts: list[str] = []
            lp_items: list[Any] = []
            n_tokens = 0
            terminal: FinishEvent | ErrorEvent | None = None
            for ev in batch:
                if isinstance(ev, TokenEvent):
                    n_tokens += len(ev.token_ids)
                    texts.append(ev.text)
                    if want_lps and ev.logprobs:
                        lp_items.append(fmt.chat(ev.logprobs) if chat
                                        else fmt.completion(ev.logprobs))
                    continue
                terminal = ev
                break
            obs.tokens(n_tokens)  # one clock read and metric update per batch, not per event
            out = token_chunk(texts, lp_items) if texts else b""
            if terminal is not None:
                finished = True
                obs.end(terminal)
                if isinstance(terminal, FinishEvent):
                    out += enc.chunk(terminal.text if (terminal.text or not chat) else None, None,
                                     finish_reason(terminal.reason))
                    if prep.include_usage:
                        out += enc.usage(terminal.usage)
                    out += DONE
                else:
                    err = error_event_to_api(terminal)
                    out += sse(error_body(err.message, err.type, err.param, err.code))
            if out:
                yield out  # coalesced: one write per batch of queued events
                if not finished:
                    hold_until = held_until()
    finally:
        metrics.streams_active.dec()
        if not finished and not broken:
            metrics.streams_disconnected.labels(prep.alias).inc()
        if not finished:
            await cancel_request(handle)
