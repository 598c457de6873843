"""A trio-native fake engine implementing the HTTP layer's engine contract (calserve.api.protocol).

Tokens are bytes (vocab 0..255) plus EOS=256; generation is deterministic in (prompt, seed, position)
so tests can compute the expected text. Token delay uses ``trio.sleep`` so ``autojump_clock`` works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio

from calserve import errors as E
from calserve.config import CalserveConfig, default_alias
from calserve.engine.types import (
    EngineStatistics, ErrorEvent, Event, ExecutorEngineStats, FinishEvent, FinishReason,
    GenerateRequest, ModelInfo, ProfileInfo, RequestTimings, TenantStats, TokenEvent,
    TokenLogprob, Usage,
)

EOS = 256
VOCAB = 257


class FakeTokenizer:
    eos_token_ids = (EOS,)
    vocab_size = VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> str:
        return self.decode([i])

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        s = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")


def expected_token(prompt: Sequence[int], seed: int | None, i: int) -> int:
    """The fake model: a letter a..z determined by the prompt, seed and position."""
    return ord("a") + (sum(prompt) + 7 * i + (seed or 0)) % 26


@dataclasses.dataclass
class _Req:
    rid: str
    req: GenerateRequest
    send: trio.MemorySendChannel[Event]
    recv: trio.MemoryReceiveChannel[Event]
    cancelled: trio.Event = dataclasses.field(default_factory=trio.Event)
    admitted_at: float = 0.0


class FakeHandle:
    """The full handle protocol (``calserve.api.protocol.HandleLike``); ``receive_many`` hands one
    event per read (an engine that never has several queued)."""

    def __init__(self, r: _Req, engine: FakeEngine) -> None:
        self._r = r
        self._engine = engine
        self._done = False  # the terminal event was handed out, or aclose()
        self._cancelled = False

    @property
    def request_id(self) -> str:
        return self._r.rid

    async def events(self) -> AsyncIterator[Event]:
        async for ev in self._r.recv:
            yield ev
            if isinstance(ev, (FinishEvent, ErrorEvent)):
                return

    async def receive_many(self) -> list[Event]:
        if self._done:
            return []
        ev = await self._r.recv.receive()
        self._done = isinstance(ev, (FinishEvent, ErrorEvent))
        return [ev]

    def cancel(self) -> None:
        self._cancelled = True
        self._engine.cancel(self._r.rid)

    async def aclose(self) -> None:
        """Like the real handle: the consumer is gone, cancel (once) and drop the stream."""
        if not self._cancelled:
            self.cancel()
        self._done = True


class FakeCoalescingHandle(FakeHandle):
    """``receive_many`` hands everything queued at once (like the real RequestHandle)."""

    async def receive_many(self) -> list[Event]:
        if self._done:
            return []
        out = [await self._r.recv.receive()]
        while True:
            try:
                out.append(self._r.recv.receive_nowait())
            except trio.WouldBlock:
                break
        self._done = any(isinstance(e, (FinishEvent, ErrorEvent)) for e in out)
        self._engine.batches.append(len(out))
        return out


class FakeEngine:
    def __init__(self, config: CalserveConfig, *, max_running: int = 64, token_delay: float = 0.01,
                 max_seq: int = 512, fail_after_tokens: int | None = None,
                 coalesce: bool = False) -> None:
        self.coalesce = coalesce
        self.batches: list[int] = []  # sizes of receive_many() answers
        self.config = config
        self.default_alias = default_alias(config)
        self.max_running = max_running
        self.token_delay = token_delay
        self.max_seq = max_seq
        self.fail_after_tokens = fail_after_tokens
        self.unavailable = False
        self.not_ready = False
        self.active: dict[str, _Req] = {}
        self.cancelled_ids: list[str] = []
        self.submitted: list[GenerateRequest] = []
        self.finished = 0
        self.rejected: dict[str, int] = {}
        self._n = 0
        self._nursery: trio.Nursery | None = None
        self._tok = FakeTokenizer()
        self._crash = trio.Event()

    # ----- the contract used by the HTTP layer -----
    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, config: CalserveConfig, **kw: Any) -> AsyncIterator[FakeEngine]:
        eng = cls(config, **kw)
        async with trio.open_nursery() as n:
            eng._nursery = n
            n.start_soon(eng._crash_watch)
            yield eng
            n.cancel_scope.cancel()

    async def _crash_watch(self) -> None:
        await self._crash.wait()
        raise RuntimeError("fake engine crashed")

    def crash(self) -> None:
        self._crash.set()

    async def submit(self, req: GenerateRequest) -> FakeHandle:
        await trio.lowlevel.checkpoint()
        alias = req.model or self.default_alias
        if alias not in self.config.models:
            raise E.UnknownModel(f"unknown model {alias!r}", param="model")
        if self.unavailable:
            self.rejected["unavailable"] = self.rejected.get("unavailable", 0) + 1
            raise E.UnavailableError("model is recovering", retry_after=3.0)
        if len(self.active) >= self.max_running:
            self.rejected["capacity"] = self.rejected.get("capacity", 0) + 1
            raise E.CapacityError("token budget full", retry_after=2.0)
        if len(req.prompt_tokens) + req.sampling.max_tokens > self.max_seq:
            raise E.RequestError("prompt beyond the context", param="prompt")
        self._n += 1
        send, recv = trio.open_memory_channel[Event](math.inf)
        r = _Req(f"req-{self._n}", req, send, recv, admitted_at=trio.current_time())
        self.active[r.rid] = r
        self.submitted.append(req)
        assert self._nursery is not None
        self._nursery.start_soon(self._generate, r)
        return FakeCoalescingHandle(r, self) if self.coalesce else FakeHandle(r, self)

    def cancel(self, request_id: str) -> None:
        r = self.active.get(request_id)
        self.cancelled_ids.append(request_id)
        if r is not None:
            r.cancelled.set()

    def models(self) -> list[ModelInfo]:
        return [
            ModelInfo(alias=a, generation=1, state="Loading" if self.not_ready else "Ready",
                      max_seq=self.max_seq,
                      profiles=(ProfileInfo(1, "C0", True), ProfileInfo(8, "C3", False)),
                      package_sha256="0" * 64, created=1700000000,
                      extra={"vocab_size": VOCAB})
            for a in self.config.models
        ]

    def tokenizer(self, alias: str | None = None) -> FakeTokenizer:
        return self._tok

    def ready(self, alias: str | None = None) -> bool:
        return not self.not_ready and not self.unavailable

    def statistics(self) -> EngineStatistics:
        n = len(self.active)
        reserved = sum(len(r.req.prompt_tokens) + r.req.sampling.max_tokens
                       for r in self.active.values())
        return EngineStatistics(
            requests_running=n, requests_waiting=0,
            requests_total={"completed": self.finished, "cancelled": len(set(self.cancelled_ids))},
            admitted_total=self._n, rejected_total=dict(self.rejected), waiting_prompt_tokens=0,
            tenants={"default": TenantStats(0, 0, n, float(self._n), 0.0)},
            starvation_events_total=0, queue_depth={"decode": n, "short": 0},
            queue_oldest_wait_s={"decode": 0.0}, batches_total={1: self._n},
            lanes_active_total={1: self._n}, lanes_total={1: self._n}, decode_steps_total={1: self._n},
            current_compiled_batch=1,
            batch_wait_s_total=0.0, prefill_jobs_total=self._n,
            kv_sequences={"Active": n, "Free": 0}, kv_tokens_reserved=reserved,
            kv_tokens_used=reserved, kv_free_seconds_total=0.0, executor_inflight_jobs=min(n, 1),
            executor={"ping": ExecutorEngineStats(self._n, self._n, 0, 0, 0, min(n, 1))},
            models={a: (1, "Ready") for a in self.config.models}, model_load_seconds={},
            faults_total={}, resets_total=0, quarantined_jobs_total=0, quarantined_kv_total=0,
            recovery_seconds_total=0.0,
        )

    # ----- the fake model -----
    async def _generate(self, r: _Req) -> None:
        sp = r.req.sampling
        t0 = trio.current_time()
        text = ""
        emitted = 0
        n = 0
        ttft: float | None = None
        try:
            for i in range(sp.max_tokens):
                with trio.move_on_after(self.token_delay):
                    await r.cancelled.wait()
                if r.cancelled.is_set():
                    return
                if self.fail_after_tokens is not None and i >= self.fail_after_tokens:
                    r.send.send_nowait(ErrorEvent("device fault (injected)", "device_error",
                                                  Usage(len(r.req.prompt_tokens), n)))
                    return
                tok = expected_token(r.req.prompt_tokens, sp.seed, i)
                n += 1
                ttft = ttft if ttft is not None else trio.current_time() - t0
                text += chr(tok)
                stop_at = min((p for s in sp.stop if (p := text.find(s)) >= 0), default=-1)
                lps = None
                if sp.logprobs is not None:
                    top = tuple((expected_token(r.req.prompt_tokens, sp.seed, i + j), -0.5 - j)
                                for j in range(sp.logprobs))
                    lps = (TokenLogprob(tok, -0.5, top),)
                if stop_at >= 0:
                    tail = text[emitted:stop_at]
                    self._finish(r, FinishReason.STOP, n, tail, t0, ttft)
                    return
                # hold back text that might be the start of a stop string
                hold = max((k for s in sp.stop for k in range(1, len(s))
                            if text.endswith(s[:k])), default=0)
                out = text[emitted:len(text) - hold]
                emitted += len(out)
                r.send.send_nowait(TokenEvent((tok,), out, lps))
            self._finish(r, FinishReason.LENGTH, n, text[emitted:], t0, ttft)
        finally:
            self.active.pop(r.rid, None)

    def _finish(self, r: _Req, reason: FinishReason, n: int, tail: str, t0: float,
                ttft: float | None) -> None:
        self.finished += 1
        now = trio.current_time()
        r.send.send_nowait(FinishEvent(reason, Usage(len(r.req.prompt_tokens), n), tail,
                                       RequestTimings(r.admitted_at - t0, ttft, now - t0)))


def fake_factory(**kw: Any) -> Any:
    return lambda config: FakeEngine.open(config, **kw)
