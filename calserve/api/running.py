"""Runs one accepted request for the HTTP layer: to completion (JSON) or as an SSE stream.

Invariant: every request the HTTP layer submitted ends in exactly one of (a) its terminal event was
read (:attr:`RequestLease.ended`, set by :func:`run_json` / :func:`pump_stream` as they read it), or
(b) :meth:`RequestLease.release`, run by the handler that submitted it in its ``finally``, cancelled
it at once inside a shielded scope (client went away, handler cancelled, error while writing, the
engine's event stream failed). So the engine always gets its lane back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, final

import trio

from calserve.api.convert import Prepared
from calserve.api.errors import ApiError, error_event_to_api
from calserve.api.histograms import ManyObserver, counter_inc
from calserve.api.metrics import ApiMetrics
from calserve.api.pacing import StreamPacer
from calserve.api.protocol import HandleLike
from calserve.api.render import (
    LogprobFormatter, finish_reason, merge_completion_logprobs, new_id, now_s, usage_dict,
)
from calserve.api.socket_probe import SocketProbe
from calserve.api.stream_encoder import SseEncoder
from calserve.engine.types import ErrorEvent, FinishEvent, TokenEvent, TokenLogprob, Usage

__all__ = ["RequestLease", "cancel_request", "run_json", "collect_choice", "response_body",
           "pump_stream", "Send"]

log = logging.getLogger("calserve.api")
_CANCEL_TIMEOUT_S: Final = 5.0

Send = Callable[[dict[str, Any]], Awaitable[None]]  # ASGI send


async def cancel_request(handle: HandleLike) -> None:
    """Cancel at once and drop what is queued (``handle.aclose``), shielded: we may be running
    inside a cancelled scope after the client went away."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(_CANCEL_TIMEOUT_S):
            try:
                await handle.aclose()
            except Exception:
                log.exception("cancelling %s failed", handle.request_id)


@final
class RequestLease:
    """An accepted request, owned by the handler that submitted it until it ended.

    Why one owner: a client can go away in any window: while the response head is written (before
    any event was read), while the pump waits for or writes an event, or while a JSON answer is
    collected. The handler's ``finally`` covers all of them (``tests/api/test_disconnect_window.py``,
    ``test_fast_path.test_disconnect_cancels_json_and_stream_at_once``)."""

    __slots__ = ("handle", "ended")

    def __init__(self, handle: HandleLike) -> None:
        self.handle = handle
        self.ended = False  # its terminal event was read (or the events ended): nothing to cancel

    async def release(self) -> None:
        """Cancel the request unless it ended (idempotent; shielded)."""
        if self.ended:
            return
        self.ended = True
        await cancel_request(self.handle)


class _Observer:
    """Latency histograms as the HTTP layer sees them (spec §16 + issue 6). The labelled children
    are looked up once per request: ``labels()`` is a locked dict lookup, too dear per token."""

    __slots__ = ("_ttft", "_itl", "_tokens", "_e2e", "_queue", "t0", "last")

    def __init__(self, metrics: ApiMetrics, alias: str, tenant: str) -> None:
        self._ttft = metrics.ttft.labels(alias)
        self._itl = ManyObserver(metrics.itl.labels(alias))  # internals looked up once
        self._tokens = counter_inc(metrics.completion_tokens.labels(alias, tenant))
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
            h.observe(0.0, n - 1)
        else:
            h.observe((now - self.last) / n, n)
        self.last = now
        self._tokens(n)

    def end(self, ev: FinishEvent | ErrorEvent) -> None:
        self._e2e.observe(trio.current_time() - self.t0)
        if ev.timings is not None:
            self._queue.observe(ev.timings.queue_s)


async def run_json(lease: RequestLease, metrics: ApiMetrics, prep: Prepared,
                   fmt: LogprobFormatter) -> dict[str, Any]:
    """Collect the whole answer; returns the OpenAI response body (or raises ApiError)."""
    choice, usage = await collect_choice(lease, metrics, prep, fmt, 0)
    return response_body(prep, [choice], usage)


def response_body(prep: Prepared, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    """The OpenAI response body of the collected ``choices``."""
    if prep.kind == "completion":
        return {"id": new_id("cmpl"), "object": "text_completion", "created": now_s(),
                "model": prep.alias, "choices": choices, "usage": usage_dict(usage)}
    body = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now_s(),
            "model": prep.alias, "choices": choices, "usage": usage_dict(usage)}
    if prep.prompt_logprobs is not None:  # vLLM: one list for the response (its one prompt)
        body["prompt_logprobs"] = next(
            (c["prompt_logprobs"] for c in choices if c["prompt_logprobs"] is not None), None)
        for c in choices:
            del c["prompt_logprobs"]
    return body


async def collect_choice(lease: RequestLease, metrics: ApiMetrics, prep: Prepared,
                         fmt: LogprobFormatter, index: int) -> tuple[dict[str, Any], Usage]:
    """Collect one choice's whole answer: (its OpenAI choice object, its usage); raises ApiError."""
    obs = _Observer(metrics, prep.alias, prep.request.tenant)
    receive_many = lease.handle.receive_many
    completion = prep.kind == "completion"
    want_lps = prep.logprobs is not None
    texts: list[str] = [prep.echo_of(index)]
    lp_parts: list[Any] = []
    # A scored prompt: its entries come first (one per prompt token), before any token's
    prompt_left = prep.scored_prompt_len(index)
    scored: list[TokenLogprob] = []
    prompt_lps: list[dict[str, Any] | None] | None = None
    terminal: FinishEvent | None = None
    while terminal is None:
        batch = await receive_many()
        if not batch:  # the events ended without a terminal event (an engine bug)
            raise ApiError(500, "the engine ended the request without a terminal event",
                           type="server_error", code="internal_error")
        n_tokens = 0
        for ev in batch:
            if isinstance(ev, TokenEvent):
                n_tokens += len(ev.token_ids)
                texts.append(ev.text)
                lps = ev.logprobs
                if lps is not None and prompt_left:
                    scored.extend(lps[:prompt_left])
                    lps, prompt_left = lps[prompt_left:], max(0, prompt_left - len(lps))
                    if not prompt_left:  # the prompt's entries are complete
                        if prep.prompt_logprobs is not None:
                            prompt_lps = fmt.prompt(scored, prep.prompt_logprobs)
                        if prep.echo_scored and prep.logprobs is not None:
                            lp_parts.append(fmt.completion(_top(scored, prep.logprobs)))
                if lps and want_lps:
                    lp_parts.append(fmt.completion(lps) if completion else fmt.chat(lps))
                continue
            lease.ended = True
            obs.tokens(n_tokens)
            obs.end(ev)
            if isinstance(ev, ErrorEvent):
                raise error_event_to_api(ev)
            texts.append(ev.text)
            terminal = ev
            break
        else:
            obs.tokens(n_tokens)  # one clock read and metric update per batch, not per event
    text = "".join(texts)
    fr = finish_reason(terminal.reason)
    if completion:
        logprobs = merge_completion_logprobs(lp_parts) if want_lps else None
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": fr}
    else:
        chat_lp = {"content": [x for part in lp_parts for x in part]} if want_lps else None
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if prep.answer is not None:  # tool calls, reasoning (api/tools.py, api/reasoning.py)
            message, fr = prep.answer.message(text, fr)
        choice = {"index": index, "message": message, "logprobs": chat_lp, "finish_reason": fr}
    if prep.prompt_logprobs is not None:  # null: the request ended before its prompt was scored
        choice["prompt_logprobs"] = prompt_lps
    if prep.infill is not None:  # llama-server's answer reports more of the end (api/infill.py)
        choice["terminal"] = terminal
    return choice, terminal.usage


def _top(lps: list[TokenLogprob], k: int) -> list[TokenLogprob]:
    """``lps`` with at most ``k`` top tokens each (the prompt was scored for a larger k)."""
    if all(len(lp.top) <= k for lp in lps):
        return lps
    return [dataclasses.replace(lp, top=lp.top[:k]) for lp in lps]


def _unread_reporter(handle: HandleLike, probe: SocketProbe | None) -> Callable[[], None] | None:
    """``tell()``: report the socket's unread bytes to the request's stream (None: no probe, or
    a handle without ``report_unread``, e.g. a test double)."""
    report: Callable[[int, float | None], None] | None = getattr(handle, "report_unread", None)
    if probe is None or report is None:
        return None
    sample = probe.sample
    clock = trio.current_time

    def tell() -> None:
        report(*sample(clock()))

    return tell


async def pump_stream(lease: RequestLease, enc: SseEncoder, send: Send, metrics: ApiMetrics,
                      prep: Prepared, pacer: StreamPacer | None = None,
                      probe: SocketProbe | None = None,
                      before_end: Callable[[], Awaitable[None]] | None = None) -> None:
    """The SSE body, after the response head: read the handle's events, encode (``enc``), write one
    ASGI body message per batch. Returns when the stream ended (terminal event, end of the events,
    or the engine's event stream failed); a disconnect arrives as ``trio.Cancelled`` from a read, a
    hold or a write (the handler cancels the request: :meth:`RequestLease.release`).

    After a token chunk is written, the next read waits until the hold interval has passed, so the
    tokens produced meanwhile go out as one chunk: ``pacer.interval()`` (the server's
    :class:`~calserve.api.pacing.StreamPacer`: fixed ``server.stream_interval_ms``, or adaptive to
    the server's CPU load; no pacer: 0). At 0 nothing ever waits on purpose: every read takes
    whatever is queued. The first token is never held.

    ``probe`` (the connection's :class:`~calserve.api.socket_probe.SocketProbe`, ``calserve
    serve``): after each write, what the client has not read of it is reported to the request's
    stream (``report_unread``), where it counts in the backlog bound: a client that never reads
    is found out once ~``server.stream_buffer_bytes`` of it sit unread in the kernels' buffers,
    not only once they are full.

    ``before_end``: awaited once the terminal event is encoded, before it is sent (a Responses
    answer is stored then: a client that read the end may name it at once)."""

    def held_until() -> float:
        """When the read after the chunk just written may happen (0: at once)."""
        hold = pacer.interval() if pacer is not None else 0.0
        return trio.current_time() + hold if hold else 0.0

    obs = _Observer(metrics, prep.alias, prep.request.tenant)
    receive_many = lease.handle.receive_many
    # the pacer's shared timer (trio.sleep_until until its task runs; pacing.HoldTimer)
    hold = pacer.timer.hold_until if pacer is not None else trio.sleep_until
    tell_unread = _unread_reporter(lease.handle, probe)
    written: Callable[[], None] | None = getattr(lease.handle, "report_written", None)
    encode = enc.encode
    broken = False  # the engine's stream raised (not a client disconnect)
    metrics.streams_active.inc()
    try:
        out = enc.opening()
        if out:
            await send({"type": "http.response.body", "body": out, "more_body": True})
        hold_until = 0.0  # no read before this (0: the first token is never held)
        while True:
            if hold_until:
                await hold(hold_until)
                hold_until = 0.0
            try:
                batch = await receive_many()
            except Exception as exc:  # an engine bug: still one terminal event for the client
                log.exception("the event stream of %s failed", lease.handle.request_id)
                broken = True  # not ``ended``: the handler cancels the request
                await send({"type": "http.response.body", "body": enc.failure(exc),
                            "more_body": True})
                return
            out = encode(batch)
            obs.tokens(enc.tokens)  # one clock read and metric update per batch, not per event
            if enc.finished:
                lease.ended = True
                if enc.terminal is not None:
                    obs.end(enc.terminal)
                if before_end is not None:
                    await before_end()
                await send({"type": "http.response.body", "body": out, "more_body": True})
                return
            if out:
                if tell_unread is not None:
                    tell_unread()
                await send({"type": "http.response.body", "body": out, "more_body": True})
                if written is not None:
                    written()
                hold_until = held_until()
    finally:
        metrics.streams_active.dec()
        if not enc.finished and not broken:
            metrics.streams_disconnected.labels(prep.alias).inc()
