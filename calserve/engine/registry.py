"""RequestRegistry (spec §4): create / cancel / finish, request ids, one actor task per request.

``create`` validates and offers the request to its generation's admission controller synchronously,
so the HTTP layer gets its 400/404/429/503 at once (as an exception from ``calserve.errors``); an
accepted request gets an id, a :class:`StreamWriter`, an inbox and an actor task, and is added to
the engine core (``EngineCore.add``: admission and the prefill dispatch run in that call).
``cancel``/``stop`` are idempotent and call ``EngineCore.abort``, which ends the request now or
when its in-flight job drains. Completions are handled by the core (the spec's
``on_prefill_complete`` / ``on_decode_complete``, done per batch).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from calserve.config import CalserveConfig
from calserve.core.admission import Outcome, WorkItem
from calserve.core.model_state import ModelState, accepts_requests
from calserve.core.prefill import classify
from calserve.engine.actor import open_actor_inbox, run_actor
from calserve.engine.park_requests import ParkRequests
from calserve.engine.sampler import resolve_seed
from calserve.engine.state import Seq
from calserve.engine.stream import StreamWriter
from calserve.engine.types import Event, FinishReason, GenerateRequest
from calserve.errors import CapacityError, EngineError, RequestError, UnavailableError

if TYPE_CHECKING:
    from calserve.engine.core import EngineCore
    from calserve.engine.generations import ModelManager
    from calserve.engine.shell import Shell

__all__ = ["RequestRegistry", "RequestHandle"]


#: Opens a request actor's inbox, ``(send side, receive side)``: an :class:`ActorInbox` (tests swap
#: in a plain trio memory channel to run the actor task for every message).
open_inbox: Callable[[], tuple[Any, Any]] = open_actor_inbox

log = logging.getLogger("calserve.engine.registry")


class RequestHandle:
    """What ``Engine.submit`` returns: the request id and its event stream."""

    def __init__(self, request_id: int, writer: StreamWriter, registry: RequestRegistry,
                 system_fingerprint: str | None = None) -> None:
        self.request_id = request_id
        #: names the generation the request is pinned to (``calserve-g<id>-<sha256[:8]>``)
        self.system_fingerprint = system_fingerprint
        self._writer = writer
        self._registry = registry
        #: ``await receive_many()``: everything buffered (at least one event); ``[]`` after the
        #: terminal event. The writer's own method (one coroutine layer less per streamed event).
        self.receive_many: Callable[[], Awaitable[list[Event]]] = writer.receive_many
        #: ``report_unread(n, stalled_for)``: what the client has not read yet (slow readers).
        self.report_unread: Callable[[int, float | None], None] = writer.report_unread
        self.report_written: Callable[[], None] = writer.report_written
        #: parking while the client is behind (engine/parking.py): ``watch(on_parked,
        #: on_given_up)`` turns it on (the consumer reports the socket while parked) and tells the
        #: consumer when it parks or gives up the stream; ``parked``.
        self.watch = writer.parking.watch

    @property
    def parked(self) -> bool:
        return self._writer.parking.parked

    async def events(self) -> AsyncIterator[Event]:
        """TokenEvent* then exactly one FinishEvent or ErrorEvent."""
        async for ev in self._writer:
            yield ev

    def cancel(self) -> None:
        self._registry.cancel(self.request_id)

    async def aclose(self) -> None:
        """The consumer is gone (client disconnect): cancel and drop the stream."""
        self._registry.cancel(self.request_id)
        await self._writer.aclose()


_INT32_MAX = 2**31 - 1


def work_item(rid: int, req: GenerateRequest, now: float, deadline: float | None,
              gen_id: int, scores_in_prefill: bool = False) -> WorkItem:
    """What admission weighs of ``req``: its prefill's tokens and its decode steps (a scored
    prompt, ``prompt_logprobs``: a one-token prefill, then a step per further prompt token,
    unless ``scores_in_prefill``: the prefill returns every position's logits)."""
    n, mt = len(req.prompt_tokens), req.sampling.max_tokens
    if req.sampling.prompt_logprobs is None or scores_in_prefill:
        return WorkItem(rid, req.tenant, n, max(1, mt), now, deadline, gen_id)
    return WorkItem(rid, req.tenant, 1, max(1, n - 1 + mt), now, deadline, gen_id)


def _validate(req: GenerateRequest, vocab: int) -> None:
    """The engine's own bounds (defence in depth behind the HTTP schema: in-process callers reach
    the sampler and the runtime through here too, and no value may overflow numpy or C)."""
    sp = req.sampling
    if not req.prompt_tokens:
        raise RequestError("the prompt is empty", param="prompt")
    try:
        toks = np.asarray(req.prompt_tokens)
    except (OverflowError, ValueError, TypeError):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab})",
                           param="prompt") from None
    if toks.dtype.kind not in "iu" or int(toks.min()) < 0 or int(toks.max()) >= vocab:
        raise RequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
    if not (math.isfinite(sp.temperature) and sp.temperature >= 0):
        raise RequestError("temperature must be >= 0", param="temperature")
    if not 0 < sp.top_p <= 1:
        raise RequestError("top_p must be in (0, 1]", param="top_p")
    if not 0 <= sp.top_k <= _INT32_MAX:
        raise RequestError(f"top_k must be in [0, {_INT32_MAX}]", param="top_k")
    if sp.seed is not None and not -(2**63) <= sp.seed < 2**63:
        raise RequestError("seed must be a signed 64-bit integer", param="seed")
    if sp.prompt_logprobs is not None and not 0 <= sp.prompt_logprobs <= 20:
        raise RequestError("prompt_logprobs must be in [0, 20]", param="prompt_logprobs")
    if not (0 if sp.prompt_logprobs is not None else 1) <= sp.max_tokens <= _INT32_MAX:
        raise RequestError("max_tokens must be >= 1 (0 only when the prompt is scored: `echo`"
                           " with `logprobs`)", param="max_tokens")
    for t in sp.stop_token_ids:
        if not (isinstance(t, int) and 0 <= t < vocab):
            raise RequestError(f"stop_token_ids must be token ids in [0, {vocab})",
                               param="stop_token_ids")
    if sp.min_tokens < 0 or sp.min_tokens > sp.max_tokens:
        raise RequestError("min_tokens must be in [0, max_tokens]", param="min_tokens")
    if sp.logprobs is not None and not 0 <= sp.logprobs <= 20:
        raise RequestError("logprobs must be in [0, 20]", param="logprobs")
    if any(not s for s in sp.stop):
        raise RequestError("stop strings must be non-empty", param="stop")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        if not (math.isfinite(v) and -2.0 <= v <= 2.0):
            raise RequestError(f"{name} must be in [-2, 2]", param=name)
    if not (math.isfinite(sp.repetition_penalty) and 0.01 <= sp.repetition_penalty <= 10):
        raise RequestError("repetition_penalty must be in [0.01, 10]", param="repetition_penalty")
    if not (math.isfinite(sp.min_p) and 0 <= sp.min_p <= 1):
        raise RequestError("min_p must be in [0, 1]", param="min_p")
    if len({t for t, _ in sp.logit_bias}) != len(sp.logit_bias) or any(
            not (isinstance(t, int) and 0 <= t < vocab and math.isfinite(b) and -100 <= b <= 100)
            for t, b in sp.logit_bias):
        raise RequestError(f"logit_bias must map distinct token ids in [0, {vocab}) to biases in"
                           " [-100, 100]", param="logit_bias")
    if any(not (isinstance(t, int) and 0 <= t < vocab) for t in sp.allowed_token_ids):
        raise RequestError(f"allowed_token_ids must be token ids in [0, {vocab})",
                           param="allowed_token_ids")
    if sp.grammar is not None and (sp.min_tokens or sp.ignore_eos):
        raise RequestError("a grammar (response_format) ends where it may: no min_tokens or"
                           " ignore_eos with it", param="response_format")
    if req.deadline_s is not None and not req.deadline_s > 0:
        raise RequestError("deadline must be > 0 seconds", param="deadline")


class RequestRegistry:
    def __init__(self, cfg: CalserveConfig, models: ModelManager, core: EngineCore, shell: Shell,
                 nursery: trio.Nursery) -> None:
        self.cfg = cfg
        self.models = models
        self.core = core
        self.shell = shell
        self.nursery = nursery  # the engine's: request actors are its children
        self.running = False  # the engine's tasks are up (set by the engine once started)
        self.closing = False
        self.draining: str | None = None  # set by engine.drain: why new requests are refused (503)
        self._ids = itertools.count(1)
        self.live: dict[int, Seq] = {}
        self._parks = ParkRequests(  # streams whose client is behind (engine/parking.py)
            self._park, nursery)
        self._empty = trio.Event()
        self._empty.set()
        self.requests_total: collections.Counter[str] = collections.Counter()
        self.rejected_total: collections.Counter[str] = collections.Counter()

    def create(self, req: GenerateRequest) -> RequestHandle:
        if not self.running or self.closing:
            raise EngineError("the engine is not running")
        if self.draining is not None:
            self.rejected_total["unavailable"] += 1
            raise UnavailableError(self.draining, retry_after=1.0)
        gen = self.models.resolve(req.model)
        try:
            _validate(req, gen.source.model_config.vocab_size)
        except RequestError:
            self.rejected_total["invalid"] += 1
            raise
        now = trio.current_time()
        rid = next(self._ids)
        rel = req.deadline_s if req.deadline_s is not None else (
            self.cfg.scheduler.admission.deadline_default_ms / 1000.0)
        deadline = now + rel
        prompt = np.asarray(req.prompt_tokens, np.int32)
        item = work_item(rid, req, now, deadline, gen.id, req.sampling.prompt_logprobs is not None
                         and gen.scores_in_prefill(len(req.prompt_tokens)))
        # Recovering with re-admission on (issue 15): a new request waits for the reset like the
        # re-admitted ones instead of a 503 (its waiting budget and deadline still hold).
        accepting = accepts_requests(gen.state) or (
            gen.state is ModelState.RECOVERING and self.cfg.scheduler.recovery.max_request_retries > 0)
        d = gen.admission.offer(item, now, accepting)
        if d.outcome is not Outcome.QUEUE:
            if d.outcome is Outcome.REJECT_INVALID:
                self.rejected_total["invalid"] += 1
                raise RequestError(d.reason, param=d.param)
            if d.outcome is Outcome.REJECT_CAPACITY:
                self.rejected_total["quota" if d.quota else "capacity"] += 1
                raise CapacityError(d.reason, retry_after=d.retry_after_s)
            if d.outcome is Outcome.REJECT_UNAVAILABLE:
                self.rejected_total["unavailable"] += 1
                raise UnavailableError(d.reason, retry_after=d.retry_after_s)
            self.rejected_total["deadline"] += 1
            raise RequestError(d.reason, param="deadline")
        # The actor's inbox runs a Tokens message's step inline when the actor is idle (one task hop
        # less per token, on the per-token latency path: spec §19 M1), else queues it.
        send, recv = open_inbox()
        seq = Seq(
            rid=rid, req=req, gen=gen, arrival=now, deadline=deadline,
            seed=resolve_seed(req.sampling.seed), prompt=prompt,
            qclass=classify(len(prompt), self.cfg.scheduler.queues), inbox=send,
        )
        srv = self.cfg.server  # the backlog bound of the stream (README "slow readers")
        waiting = self.core.requests.queues(gen).waiting  # its generation's admission queue
        writer = StreamWriter(srv.stream_buffer_events, max_bytes=srv.stream_buffer_bytes,
                              grace_s=srv.stream_stall_grace_ms / 1000.0,
                              contended=lambda: bool(waiting),
                              stall_s=srv.stream_contended_stall_ms / 1000.0, name=rid,
                              park=self._parks.wish(seq),
                              park_cut_s=srv.stream_parked_cut_ms / 1000.0)
        self.live[rid] = seq
        self._empty = trio.Event()
        self.nursery.start_soon(run_actor, seq, recv, writer, gen.source.tokenizer, self, name=f"request-{rid}")
        self.shell.apply(self.core.add(seq, now))
        log.debug("request %d accepted (tenant %s, gen %d)", rid, req.tenant, gen.id,
                  extra={"request_id": rid, "generation": gen.id})
        return RequestHandle(rid, writer, self, gen.fingerprint)

    def _park(self, seq: Seq, park: bool | None, now: float) -> None:
        """Park / resume ``seq`` (engine/parking.py), then a pass (a freed slot admits); None:
        its stream was given up while parked, cancel it."""
        if park is None:
            self.stop(seq, FinishReason.CANCELLED)
            return
        self.core.parking.set(seq, park, now)
        self.shell.apply(self.core.tick(now))

    def cancel(self, request_id: int) -> None:
        """Idempotent; unknown or finished ids are ignored."""
        seq = self.live.get(request_id)
        if seq is not None:
            self.stop(seq, FinishReason.CANCELLED)

    def stop(self, seq: Seq, reason: FinishReason) -> None:
        """End ``seq`` early (the actor's stop string or abandoned stream, a cancel); idempotent."""
        self.shell.apply(self.core.abort(seq, reason, trio.current_time()))

    def shutdown(self, message: str | None = None) -> None:
        """No new requests; every live one ends with a shutdown error (on the device: when it drains)."""
        self.closing = True
        self.shell.apply(self.core.shutdown(trio.current_time(), message))

    def done(self, seq: Seq, outcome: str) -> None:
        """Called once by the actor after it wrote the terminal event."""
        if self.live.pop(seq.rid, None) is not None:
            self.requests_total[outcome] += 1
            log.debug("request %d ended: %s", seq.rid, outcome, extra={"request_id": seq.rid})
        if not self.live:
            self._empty.set()

    async def wait_empty(self) -> None:
        while self.live:
            await self._empty.wait()
