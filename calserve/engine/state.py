"""Plain records shared by the engine's tasks: one :class:`Seq` per accepted request, actor messages.

Ownership (who may write what) is the point of this module:

- :class:`Seq` scheduling fields (lease, seq_id, position, inflight, ...) are written only from the
  scheduler side (scheduler tick, dispatcher, recovery), all of which run in the one trio thread
  and mutate synchronously between checkpoints.
- The request lifecycle (:class:`calserve.core.request_state.RequestState`) is written only by the
  request's actor (:mod:`calserve.engine.actor`), which replays the lifecycle from the messages
  below; per-token Ready/Running toggles stay in ``Seq.inflight`` so the hot path never waits for a
  task hop (spec §4 actor rule, issue 5 item 4).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from calserve.engine.types import ErrorEvent, FinishReason, GenerateRequest, TokenLogprob

if TYPE_CHECKING:
    from calserve.engine.jobs import DeviceJob
    from calserve.engine.generations import Generation

__all__ = ["Seq", "Admitted", "Tokens", "End", "ActorMsg"]


@dataclasses.dataclass(frozen=True)
class Admitted:
    at: float


class Tokens(NamedTuple):
    """One sampled token. ``hidden``: EOS / stop token id, counted in usage but never shown.

    A NamedTuple (immutable like the other messages) because one is built per token on the
    dispatcher's hot path, where a frozen dataclass's ``__init__`` costs several times more."""

    token_id: int
    logprob: TokenLogprob | None
    first: bool
    hidden: bool = False


@dataclasses.dataclass(frozen=True)
class End:
    """The request's resources are back; the actor must emit the terminal event and stop.

    Exactly one of ``reason`` / ``error`` is set."""

    reason: FinishReason | None = None
    error: ErrorEvent | None = None


ActorMsg = Admitted | Tokens | End


class Inbox(Protocol):
    """The engine's side of a request actor's inbox (``actor.ActorInbox``, or a trio memory send
    channel): never blocks, unbounded."""

    def send_nowait(self, msg: ActorMsg) -> None: ...


@dataclasses.dataclass(eq=False)
class Seq:
    rid: int
    req: GenerateRequest
    gen: Generation
    arrival: float
    deadline: float | None
    seed: int
    prompt: np.ndarray  # int32 prompt tokens
    qclass: Any  # core QueueClass
    inbox: Inbox
    # --- scheduler side -------------------------------------------------------------------------
    queued: bool = False  # in the admission controller's queue
    admitted: bool = False  # popped by admission: counts as active for its tenant until released
    lease: Any = None  # KvLease while a lane is held
    seq_id: int | None = None  # runtime KV sequence (created by the prefill job)
    position: int = 0  # committed KV length (== position of the next decode input token)
    last_token: int = -1
    generated: int = 0  # tokens sampled so far
    # Invariant: inflight is not None <=> exactly one job containing this request is on the device;
    # while set, the lane is Updating and nothing of the request is released.
    inflight: DeviceJob | None = None
    prefilled: bool = False
    # Pending ending decided while a job was in flight (cancel / stop string / shutdown): applied
    # when the job drains. Cancel is idempotent: setting it twice changes nothing.
    pending_reason: FinishReason | None = None
    pending_error: ErrorEvent | None = None
    ended: bool = False
    admitted_at: float | None = None
    first_token_at: float | None = None
    ready_since: float = 0.0  # when it last became decode-ready (batching window)
    # Consecutive decode batches that passed this ready sequence over (starvation accounting).
    passed_over: int = 0
    # A token message held back until the next job was submitted (dispatcher._deferred); whoever
    # sends this request anything else first delivers it (Scheduler.end), so messages keep order.
    deferred: Any = None
    job_ids: list[int] = dataclasses.field(default_factory=list)  # recent job ids, for logs

    @property
    def tenant(self) -> str:
        return self.req.tenant

    @property
    def max_new(self) -> int:
        return self.req.sampling.max_tokens
