"""RequestActor: one trio task per request; it renders the engine core's messages as its stream.

It consumes its inbox (messages from the engine core, :mod:`calserve.engine.state`), detokenises
incrementally, applies stop strings (the stop text is never emitted; the engine is told to end the
sequence) and writes events to the request's :class:`StreamWriter`. The request's lifecycle is the
core's (``Seq.state``, moved by :mod:`calserve.engine.requests` through the one table of
:mod:`calserve.core.request_state`); the actor only renders it, so a message out of order is an
engine bug the core's table catches where it happens. It is the one place that turns a client's cancel (an abandoned stream) into
``EngineCore.abort`` (through :class:`ActorSink`).

The per-token work lives in :class:`_TokenStep`, the actor's own state object (its step bound
once per request: the plain one without stop strings). With a plain trio
memory channel as inbox the actor task runs it for every ``Tokens`` message (one task hop per
token). With an :class:`ActorInbox` (``open_actor_inbox``) the sender runs the very same step
synchronously when the actor is idle — parked with nothing queued — which saves that hop (~45k
instructions per token measured in ``bench``'s micro-benchmark, about a third of the actor +
stream + render path). Everything that touches another component (telling the engine to stop)
is still done by the actor task, which the inline step wakes; order is kept because a message is
only run inline when nothing is queued before it.

Invariant: the terminal event is written exactly once — by the ``End`` message, or, if the actor is
cancelled first (engine torn down from outside), by the ``finally`` clause with a shutdown error.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any, Final, Protocol, final

import trio

from calserve.engine.detok import IncrementalDetokenizer, StopMatcher
from calserve.engine.state import ActorMsg, Admitted, End, Scored, Seq, TokenRun, Tokens
from calserve.engine.stream import StreamWriter
from calserve.engine.types import ErrorEvent, FinishEvent, FinishReason, RequestTimings, Usage

__all__ = ["run_actor", "ActorInbox", "open_actor_inbox", "ActorSink"]


class ActorSink(Protocol):
    """What an actor tells the engine (the registry): the only way a client's cancel, a stop string
    or an abandoned stream reaches the engine core."""

    def stop(self, seq: Seq, reason: FinishReason) -> None: ...

    def done(self, seq: Seq, outcome: str) -> None: ...

log = logging.getLogger("calserve.engine.actor")

_OUTCOME = {FinishReason.CANCELLED: "cancelled", FinishReason.DEADLINE: "deadline"}

@final
class _TokenStep:
    """The actor's per-request state and its per-token step. Only the actor's code mutates it: the
    actor task, or (with an :class:`ActorInbox`) the inbox on the actor's behalf while the task is
    parked. ``stop_wanted`` is for the task: a reason the engine must be told (``sink.stop``)."""

    __slots__ = ("completion", "stopped", "stop_wanted", "on_tokens", "on_run", "_detok", "_stops",
                 "_min_tokens", "_writer", "_push", "_put", "_include_stop")

    def __init__(self, seq: Seq, writer: StreamWriter, tokenizer: Any) -> None:
        self.completion = 0
        self.stopped = False  # a stop string matched: later tokens are dropped
        self.stop_wanted: FinishReason | None = None
        self._detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=seq.req.sampling.skip_special_tokens)
        self._stops = StopMatcher(seq.req.sampling.stop) if seq.req.sampling.stop else None
        self._min_tokens = seq.req.sampling.min_tokens
        self._include_stop = seq.req.sampling.include_stop_str
        self._writer = writer
        self._push = self._detok.push_one  # the per-token calls, bound once per request
        self._put = writer.put_token
        #: The step for one ``Tokens`` message: True when the actor task must run
        #: (``stop_wanted`` set). Without stop strings, the plain step (the same effects without
        #: the matcher's branch; ``tests/engine_parts/test_parts_actor.py`` runs both).
        self.on_tokens: Callable[[Tokens], bool] = (
            self._step_plain if self._stops is None else self._step)
        #: The step for one ``TokenRun`` message (a multi-step job's tokens): the run at once
        #: without stop strings, else each token through :meth:`_step`.
        self.on_run: Callable[[TokenRun], bool] = (
            self._run_plain if self._stops is None else self._run)

    def _run_plain(self, msg: TokenRun) -> bool:
        """:meth:`_step_plain` of each token of a run, the text of all of them in one write."""
        ids, _, hidden = msg
        self.completion += len(ids)
        if hidden:
            ids = ids[:-1]
            if not ids:
                return False
        if (self._writer.put_tokens(ids, self._detok.push_many(ids))
                and self.stop_wanted is None):
            self.stop_wanted = FinishReason.CANCELLED  # the consumer is gone
            return True
        return False

    def _run(self, msg: TokenRun) -> bool:
        """:meth:`_step` of each token of a run, in order (stop strings are matched token by
        token: ``min_tokens`` counts tokens, and a match drops the tokens after it)."""
        ids, first, hidden = msg
        last = len(ids) - 1
        wanted = False
        step = self._step
        for i, tok in enumerate(ids):
            wanted = step(Tokens(tok, None, first and i == 0, hidden and i == last)) or wanted
        return wanted

    def _step_plain(self, msg: Tokens) -> bool:
        """:meth:`_step` of a request without stop strings."""
        token_id, logprob, _, hidden = msg
        self.completion += 1
        if hidden:
            return False
        if self._put(token_id, self._push(token_id), logprob) and self.stop_wanted is None:
            self.stop_wanted = FinishReason.CANCELLED  # the consumer is gone
            return True
        return False

    def _step(self, msg: Tokens) -> bool:
        """One token: detokenise, stop strings, write. True when the actor task must run
        (``stop_wanted`` set)."""
        if self.stopped:
            return False
        self.completion += 1
        token_id, logprob, _, hidden = msg
        if hidden:
            return False
        text = self._push(token_id)
        stops = self._stops
        wanted = False
        if stops is not None:
            text, hit = stops.feed(text, check=self.completion > self._min_tokens)
            if hit:
                self.stopped = True
                self.stop_wanted = FinishReason.STOP
                wanted = True
                if self._include_stop:  # vLLM's include_stop_str_in_output
                    text += stops.matched or ""
        if self._put(token_id, text, logprob) and self.stop_wanted is None:
            self.stop_wanted = FinishReason.CANCELLED
            wanted = True
        return wanted

    def tail(self) -> str:
        """The held-back text at the end (nothing after a stop string matched)."""
        if self.stopped:
            return ""
        tail = self._detok.flush()
        stops = self._stops
        if stops is not None:
            tail, hit = stops.feed(tail)
            if not hit:
                tail += stops.flush()
        return tail


class _Poke:
    """Queued by the inline step to have the actor task act (tell the engine, or re-raise)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error


_POKE: Final = _Poke()


@final
class ActorInbox:
    """A request actor's inbox: ``send_nowait`` is the engine's side (the subset of
    ``trio.MemorySendChannel`` it uses: never blocks, unbounded), ``receive`` the actor task's.

    A ``Tokens`` message sent while the actor is parked with nothing queued runs the actor's
    attached step right here (see the module docstring); anything else is queued and wakes the task.
    Invariant: messages take effect in send order; the step never runs concurrently with the task
    (single trio thread; the task is parked whenever the step runs inline).
    """

    __slots__ = ("_q", "_waiter", "_step", "_run")

    def __init__(self) -> None:
        self._q: collections.deque[ActorMsg | _Poke] = collections.deque()
        self._waiter: trio.lowlevel.Task | None = None  # the actor task, parked in receive()
        self._step: Callable[[Tokens], bool] | None = None
        self._run: Callable[[Any], bool] | None = None  # of a TokenRun (send_nowait's dispatch)

    def attach(self, step: Callable[[Tokens], bool] | None,
               run: Callable[[TokenRun], bool] | None = None) -> None:
        """The actor's token step and run step (None: detached — the actor is gone, messages
        just queue; a ``TokenRun`` without a run step is queued for the task)."""
        self._step = step
        self._run = run if step is not None else None

    def send_nowait(self, msg: ActorMsg) -> None:
        inline: Callable[[Any], bool] | None = self._step
        if inline is not None and self._waiter is not None and not self._q:
            kind = type(msg)
            if kind is not Tokens:
                inline = self._run if kind is TokenRun else None
        else:
            inline = None
        if inline is not None:
            try:
                if not inline(msg):
                    return
                self._q.append(_POKE)
            except Exception as exc:  # an actor bug: raised in the actor task, as without inlining
                self._step = self._run = None
                self._q.append(_Poke(exc))
        else:
            self._q.append(msg)
        t = self._waiter
        if t is not None:
            self._waiter = None
            trio.lowlevel.reschedule(t)

    async def receive(self) -> ActorMsg | _Poke:
        """The next queued message (cancellable while waiting)."""
        q = self._q
        while not q:
            self._waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort)
        return q.popleft()

    def _abort(self, _: Any) -> trio.lowlevel.Abort:
        self._waiter = None  # no inline step and no reschedule once trio woke the task
        return trio.lowlevel.Abort.SUCCEEDED

    def statistics(self) -> int:
        """Messages queued for the actor task."""
        return len(self._q)


def open_actor_inbox() -> tuple[ActorInbox, ActorInbox]:
    """``(send side, receive side)`` like ``trio.open_memory_channel(math.inf)``: one object."""
    box = ActorInbox()
    return box, box


async def run_actor(
    seq: Seq,
    recv: trio.MemoryReceiveChannel[ActorMsg] | ActorInbox,
    writer: StreamWriter,
    tokenizer: Any,
    registry: ActorSink,
) -> None:
    step = _TokenStep(seq, writer, tokenizer)
    outcome = "shutdown"

    def timings() -> RequestTimings:
        now = trio.current_time()
        return RequestTimings(
            queue_s=(seq.admitted_at if seq.admitted_at is not None else now) - seq.arrival,
            ttft_s=None if seq.first_token_at is None else seq.first_token_at - seq.arrival,
            e2e_s=now - seq.arrival,
        )

    receive = recv.receive
    on_tokens = step.on_tokens
    on_run = step.on_run
    inbox = recv if isinstance(recv, ActorInbox) else None
    try:
        if inbox is not None:
            inbox.attach(on_tokens, on_run)
        while True:
            try:
                msg = await receive()
            except trio.EndOfChannel:
                return
            if type(msg) is Tokens:
                if not on_tokens(msg):
                    continue
            elif type(msg) is TokenRun:
                if not on_run(msg):
                    continue
            elif type(msg) is _Poke:
                if msg.error is not None:
                    raise msg.error
            elif isinstance(msg, Admitted):
                pass  # admission time is read from the request (timings)
            elif isinstance(msg, Scored):  # the prompt's scores: before any token, no text
                writer.put_tokens((), "", msg.logprobs)
            elif isinstance(msg, End):
                usage = Usage(len(seq.prompt), step.completion)
                if msg.error is not None:
                    outcome = "failed" if msg.error.kind != "shutdown" else "shutdown"
                    writer.close(ErrorEvent(msg.error.message, msg.error.kind, usage, timings()))
                    return
                reason = FinishReason.STOP if step.stopped else msg.reason
                assert reason is not None
                outcome = _OUTCOME.get(reason, "completed")
                writer.close(FinishEvent(reason, usage, step.tail(), timings()))
                return
            # Invariant: the engine hears of a stop from the actor task only, never from inside
            # the sender's call (the core may be in the middle of that sequence's bookkeeping);
            # stop is idempotent, the first reason wins.
            wanted = step.stop_wanted
            if wanted is not None:
                step.stop_wanted = None
                registry.stop(seq, wanted)
    finally:
        if inbox is not None:
            inbox.attach(None)
        if not writer.closed:
            writer.close(ErrorEvent("the engine stopped", "shutdown", Usage(len(seq.prompt), step.completion)))
            outcome = "shutdown"
        registry.done(seq, outcome)
