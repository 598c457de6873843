"""``n`` > 1 (n independent sequences of one prompt) and a list of prompts (``/v1/completions``:
n sequences of each), served as one OpenAI response.

There is no KV fork on this runtime (spec §9.3), so each choice is its own engine request
(:meth:`~calserve.api.convert.Prepared.choice_requests`): its own prefill, admitted and charged to
the tenant like any request (a 429 for any of them refuses the whole request, and the choices
already admitted are cancelled at once). Choice i > 0 uses a seed derived from ``seed``.

- Order: choice ``k * n + j`` is choice j of prompt k; each prompt of a list answers as it would
  alone (the same seeds).
- JSON: the choices are collected concurrently; ``usage`` is each prompt once (as OpenAI and vLLM
  report it) and the completion tokens of all choices summed. An error in any choice is the
  response's error (the others are cancelled).
- SSE: every choice streams its chunks (each carrying its ``index``; chat: a role chunk per
  choice) as its tokens come, through one serialised writer; after the last choice finished: the
  usage chunk (``include_usage``) and exactly one ``[DONE]``. A choice that ends with an error
  sends the error event and the stream ends there, without ``[DONE]``; the other choices are
  cancelled.

Metrics count choices: each one is a stream in ``calserve_streams_active`` and has its own TTFT
and inter-token observations (each is a sequence the engine serves).

Slow readers: the choices share one connection, so each choice's pump reports the connection's
socket probe to its own stream (README "Per-request limits and slow readers"): a client that does
not read is behind on every choice at once; each is parked, and given up (``client_too_slow``)
like a single stream; the first choice given up ends the response with that error.

Cancellation: a client that goes away cancels the handler, and every choice's
:class:`~calserve.api.running.RequestLease` is released (cancelled, shielded) in its ``finally``.
"""

from __future__ import annotations

from typing import Any

import trio

from calserve.api.convert import Prepared
from calserve.api.metrics import ApiMetrics
from calserve.api.pacing import StreamPacer
from calserve.api.protocol import EngineLike, TokenizerLike
from calserve.api.render import DONE, LogprobFormatter, new_id, now_s
from calserve.api.running import RequestLease, Send, collect_choice, pump_stream, response_body
from calserve.api.socket_probe import SocketProbe
from calserve.api.stream_encoder import SseEncoder, StreamEncoder
from calserve.api.tool_stream import ToolStreamEncoder
from calserve.engine.types import FinishEvent, Usage

__all__ = ["submit_choices", "run_json_choices", "pump_choices", "release_all"]


async def submit_choices(eng: EngineLike, prep: Prepared) -> list[RequestLease]:
    """Submit every choice's request (admission raises here: the ones admitted before are
    cancelled, then the error propagates)."""
    leases: list[RequestLease] = []
    try:
        for req in prep.choice_requests():
            leases.append(RequestLease(await eng.submit(req)))
    except BaseException:
        await release_all(leases)
        raise
    return leases


async def release_all(leases: list[RequestLease]) -> None:
    """Cancel every choice that did not end (shielded, idempotent)."""
    for lease in leases:
        await lease.release()


def _usage(prep: Prepared, usages: list[Usage]) -> Usage:
    """Each prompt once (as OpenAI and vLLM report it), the completion tokens of every choice."""
    prompt = (sum(usages[k].prompt_tokens for k in range(0, len(usages), prep.n))
              if len(usages) == prep.choices else prep.prompt_tokens())
    return Usage(prompt, sum(u.completion_tokens for u in usages))


async def run_json_choices(leases: list[RequestLease], metrics: ApiMetrics, prep: Prepared,
                           tok: TokenizerLike) -> dict[str, Any]:
    """The whole answer of every choice, as one response body (or raises the first ApiError)."""
    got: list[tuple[dict[str, Any], Usage] | None] = [None] * len(leases)

    async def one(i: int) -> None:
        fmt = LogprobFormatter(tok, start_offset=prep.logprob_offset(i))
        got[i] = await collect_choice(leases[i], metrics, prep, fmt, i)

    try:
        async with trio.open_nursery() as nursery:
            for i in range(len(leases)):
                nursery.start_soon(one, i)
    except BaseExceptionGroup as eg:  # the first choice's error is the response's (an ApiError)
        raise _first(eg) from None
    done = [g for g in got if g is not None]
    assert len(done) == len(leases)
    return response_body(prep, [c for c, _ in done], _usage(prep, [u for _, u in done]))


def _first(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception of a choice that is not the cancellation it caused the others."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            leaves.append(e)

    walk(eg)
    return next((e for e in leaves if not isinstance(e, trio.Cancelled)), leaves[0])


async def pump_choices(leases: list[RequestLease], send: Send, metrics: ApiMetrics,
                       prep: Prepared, tok: TokenizerLike, pacer: StreamPacer | None,
                       probe: SocketProbe | None = None) -> list[SseEncoder]:
    """The SSE body of an ``n`` > 1 stream, after the response head (see the module docstring);
    returns each choice's encoder (its ``terminal``). ``probe``: the connection's socket probe."""
    rid, created = new_id("chatcmpl" if prep.kind == "chat" else "cmpl"), now_s()
    answer = prep.answer
    encs: list[SseEncoder] = [
        StreamEncoder.for_choice(prep, LogprobFormatter(tok, start_offset=prep.logprob_offset(i)),
                                 rid=rid, created=created, index=i) if answer is None
        else ToolStreamEncoder.for_choice(prep, answer, LogprobFormatter(tok), rid=rid,
                                          created=created, index=i, last=False)
        for i in range(len(leases))]
    lock = trio.Lock()

    async def locked_send(msg: dict[str, Any]) -> None:
        async with lock:
            await send(msg)

    failed = False

    async def one(i: int, cancel: trio.CancelScope) -> None:
        nonlocal failed
        await pump_stream(leases[i], encs[i], locked_send, metrics, prep, pacer, probe)
        if not isinstance(encs[i].terminal, FinishEvent):  # an error event (or a broken stream)
            failed = True
            cancel.cancel()  # the stream ends with that error: no more chunks of the others

    async with trio.open_nursery() as nursery:
        for i in range(len(leases)):
            nursery.start_soon(one, i, nursery.cancel_scope)
    if failed:
        return encs
    usages = [e.terminal.usage for e in encs if isinstance(e.terminal, FinishEvent)]
    tail = encs[0].usage_chunk(_usage(prep, usages)) if prep.include_usage else b""
    await send({"type": "http.response.body", "body": tail + DONE, "more_body": True})
    return encs
