"""RequestActor: one trio task per request, the only writer of the request's lifecycle state.

It consumes its inbox (messages from the scheduler/dispatcher, :mod:`calserve.engine.state`),
replays the request lifecycle through :func:`calserve.core.request_state.fire` (an illegal sequence
of messages raises instead of corrupting state), detokenises incrementally, applies stop strings
(the stop text is never emitted; the scheduler is told to end the sequence) and writes events to
the request's :class:`StreamWriter`.

Invariant: the terminal event is written exactly once — by the ``End`` message, or, if the actor is
cancelled first (engine torn down from outside), by the ``finally`` clause with a shutdown error.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from calserve.core.request_state import RequestEvent as E
from calserve.core.request_state import RequestState, fire
from calserve.engine.detok import IncrementalDetokenizer, StopMatcher
from calserve.engine.state import ActorMsg, Admitted, End, Seq, Tokens
from calserve.engine.stream import StreamWriter
from calserve.engine.types import ErrorEvent, FinishEvent, FinishReason, RequestTimings, Usage

if TYPE_CHECKING:
    from calserve.engine.registry import RequestRegistry

__all__ = ["run_actor"]

log = logging.getLogger("calserve.engine.actor")

# The lifecycle moves of one token, memoised: ``fire`` is a pure function of (state, event), so a
# cached legal move is exactly what replaying it gives; an illegal one is never cached (fire raises).
_AFTER_PREFILL: dict[RequestState, RequestState] = {}
_AFTER_DECODE: dict[RequestState, RequestState] = {}


def _advance(state: RequestState, first: bool) -> RequestState:
    """Replay one token's submit+done through the state table and remember the move."""
    if first:
        nxt = _AFTER_PREFILL[state] = fire(fire(state, E.PREFILL_SUBMIT), E.PREFILL_DONE)
    else:
        nxt = _AFTER_DECODE[state] = fire(fire(state, E.DECODE_SUBMIT), E.DECODE_DONE)
    return nxt


async def run_actor(
    seq: Seq,
    recv: trio.MemoryReceiveChannel[ActorMsg],
    writer: StreamWriter,
    tokenizer: Any,
    registry: RequestRegistry,
) -> None:
    state = fire(RequestState.NEW, E.ENQUEUE)
    detok = IncrementalDetokenizer(tokenizer)
    stops = StopMatcher(seq.req.sampling.stop) if seq.req.sampling.stop else None
    completion = 0
    stopped = False  # a stop string matched: later tokens are dropped
    outcome = "shutdown"
    sched = registry.sched

    def timings() -> RequestTimings:
        now = trio.current_time()
        return RequestTimings(
            queue_s=(seq.admitted_at if seq.admitted_at is not None else now) - seq.arrival,
            ttft_s=None if seq.first_token_at is None else seq.first_token_at - seq.arrival,
            e2e_s=now - seq.arrival,
        )

    # Hot path (one Tokens message per token): locals instead of attribute lookups, the
    # lifecycle replay from a transition cache, one detokenizer step, no event object.
    receive = recv.receive
    push_one = detok.push_one
    put_token = writer.put_token
    min_tokens = seq.req.sampling.min_tokens
    try:
        while True:
            try:
                msg = await receive()
            except trio.EndOfChannel:
                return
            if type(msg) is Tokens:
                if stopped:
                    continue
                completion += 1
                cache = _AFTER_PREFILL if msg.first else _AFTER_DECODE
                nxt = cache.get(state)
                state = nxt if nxt is not None else _advance(state, msg.first)
                if msg.hidden:
                    continue
                token_id = msg.token_id
                text = push_one(token_id)
                if stops is not None:
                    text, hit = stops.feed(text, check=completion > min_tokens)
                    if hit:
                        stopped = True
                        sched.stop(seq, FinishReason.STOP)
                put_token(token_id, text, msg.logprob)
                if writer.abandoned:
                    sched.stop(seq, FinishReason.CANCELLED)
            elif isinstance(msg, Admitted):
                state = fire(state, E.ADMIT)
            elif isinstance(msg, End):
                usage = Usage(len(seq.prompt), completion)
                if msg.error is not None:
                    state = fire(state, E.FAIL)
                    outcome = "failed" if msg.error.kind != "shutdown" else "shutdown"
                    writer.close(ErrorEvent(msg.error.message, msg.error.kind, usage, timings()))
                    return
                reason = FinishReason.STOP if stopped else msg.reason
                assert reason is not None
                if reason is FinishReason.CANCELLED:
                    state = fire(state, E.CANCEL)
                    outcome = "cancelled"
                elif reason is FinishReason.DEADLINE:
                    state = fire(state, E.EXPIRE)
                    outcome = "deadline"
                else:
                    state = fire(state, E.FINISH)
                    outcome = "completed"
                if state is RequestState.FINISHING:
                    state = fire(state, E.COMPLETE)
                tail = ""
                if not stopped:
                    tail = detok.flush()
                    if stops is not None:
                        tail, hit = stops.feed(tail)
                        if not hit:
                            tail += stops.flush()
                writer.close(FinishEvent(reason, usage, tail, timings()))
                return
    finally:
        if not writer.closed:
            writer.close(ErrorEvent("the engine stopped", "shutdown", Usage(len(seq.prompt), completion)))
            outcome = "shutdown"
        registry.done(seq, outcome)
