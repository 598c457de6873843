"""A bare ASGI app that speaks just enough OpenAI streaming: the HTTP-stack floor, and a fake server.

Two uses:
- ``bench/http_floor.py`` runs it with no delay under the same hypercorn trio worker as calserve: the
  server CPU per streamed event here is the floor any serving layer on this stack pays (one ``send`` per
  event, a pre-encoded chunk of the same size as calserve's; ``--tokens-per-event`` groups tokens into
  events as calserve's streams did, so the floor per token is read at the same grouping).
  With ``--events-per-s R`` the streams' events are handed out at R per second in all, first come
  first served (:class:`EventPace`: one producer task wakes the waiting streams, as calserve's engine
  wakes a stream when its tokens are ready): the floor at calserve's own event rate, where each
  event finds its stream and its client waiting, as calserve's do, instead of a stack run flat out.
- ``tests/bench`` runs it in-process as a fake OpenAI-compatible server with a per-token delay, a
  concurrency cap (429 + Retry-After above it), injected mid-stream errors and fake ``calserve_*``
  metrics, to check the load generator's accounting without the real server.

Run: ``python -m bench.floor_app --port 8100 [--token-delay-ms 2] [--max-inflight 64]``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

__all__ = ["FloorOptions", "FloorApp", "EventPace", "serve_floor", "main"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclasses.dataclass(frozen=True)
class FloorOptions:
    token_delay_s: float = 0.0  # sleep between events (0 = as fast as the stack goes)
    ttft_delay_s: float = 0.0  # extra delay before the first event
    max_inflight: int | None = None  # above it: 429 with Retry-After
    error_every: int = 0  # every Nth request sends an error event mid-stream (0 = never)
    chunk_bytes: int = 0  # pad each event's JSON to about this size (0 = natural size)
    tokens_per_event: float = 1.0  # tokens grouped into one event (as calserve's streams group them)
    events_per_s: float = 0.0  # all streams' events together at this rate (0 = unpaced): EventPace
    model: str = "floor"


class EventPace:
    """Hands out turns to send an event at ``rate`` per second across all streams, in the order
    they asked (:meth:`turn`). A producer task (started on the first turn) wakes every ``tick_s``
    and releases the turns due since; a waiting stream is parked without a timer of its own, the
    way calserve's streams wait for their engine. No turns are banked while nobody waits."""

    def __init__(self, rate: float, tick_s: float = 0.001) -> None:
        if rate <= 0:
            raise ValueError("rate must be > 0")
        self.rate = rate
        self.tick_s = tick_s
        self._waiting: collections.deque[list[Any]] = collections.deque()  # [task or None]
        self._credit = 0.0
        self._started = False
        self.turns = 0

    async def turn(self) -> None:
        if not self._started:
            self._started = True
            trio.lowlevel.spawn_system_task(self._produce)
        entry: list[Any] = [trio.lowlevel.current_task()]
        self._waiting.append(entry)

        def abort(_: Any) -> trio.lowlevel.Abort:
            entry[0] = None  # cancelled: the producer skips it
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def _produce(self) -> None:
        last = trio.current_time()
        waiting = self._waiting
        while True:
            await trio.sleep(self.tick_s)
            now = trio.current_time()
            self._credit += (now - last) * self.rate
            last = now
            while self._credit >= 1.0 and waiting:
                task = waiting.popleft()[0]
                if task is not None:
                    trio.lowlevel.reschedule(task)
                    self._credit -= 1.0
                    self.turns += 1
            if not waiting:
                self._credit = min(self._credit, 1.0)


class _Chunk(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, int] | None = None


class FloorApp:
    """The ASGI callable. ``statistics`` counts requests and events (read by tests)."""

    def __init__(self, opts: FloorOptions = FloorOptions()) -> None:
        self.opts = opts
        self.inflight = 0
        self.requests = 0
        self.events_sent = 0
        self.rejected = 0
        self.completed = 0
        self._enc = msgspec.json.Encoder()
        # Ticks of 4 ms: at calserve's ~2.7k events/s in all the floor cost 130-134 us per event
        # with them, 137-164 with 1 ms ticks (the producer's own wake-ups): the lower floor.
        self._pace = (EventPace(opts.events_per_s, tick_s=0.004) if opts.events_per_s > 0
                      else None)

    def _event(self, rid: str, chat: bool, text: str, finish: str | None) -> bytes:
        choice: dict[str, Any] = ({"index": 0, "delta": {"content": text}, "finish_reason": finish}
                                  if chat else
                                  {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        body = self._enc.encode(_Chunk(rid, "chat.completion.chunk" if chat else "text_completion",
                                       int(time.time()), self.opts.model, [choice]))
        pad = self.opts.chunk_bytes - len(body) - 8
        if pad > 0:  # pad inside the id so the JSON stays valid
            body = self._enc.encode(_Chunk(rid + "x" * pad, "chat.completion.chunk" if chat
                                           else "text_completion", int(time.time()),
                                           self.opts.model, [choice]))
        return b"data: " + body + b"\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path in ("/health", "/ready"):
            await _respond(send, 200, b"{}")
        elif path == "/metrics":
            await _respond(send, 200, self._metrics(), b"text/plain; version=0.0.4")
        elif path in ("/v1/completions", "/v1/chat/completions") and scope["method"] == "POST":
            await self._generate(scope, receive, send, chat=path.endswith("chat/completions"))
        else:
            await _respond(send, 404, b'{"error": {"message": "not found"}}')

    def _metrics(self) -> bytes:
        running = self.inflight
        fill = min(1.0, running / 16)
        return (f"# TYPE calserve_requests_running gauge\ncalserve_requests_running {running}\n"
                f"# TYPE calserve_requests_waiting gauge\ncalserve_requests_waiting 0\n"
                f"# TYPE calserve_batch_fill_ratio gauge\ncalserve_batch_fill_ratio {fill}\n"
                ).encode()

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        try:
            req = msgspec.json.decode(body)
            n = int(req.get("max_tokens") or 16)
            stream = bool(req.get("stream"))
            usage_wanted = bool((req.get("stream_options") or {}).get("include_usage"))
            prompt = req.get("prompt") if not chat else req.get("messages")
            plen = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
            await _respond(send, 400, b'{"error": {"message": "bad request", "param": null}}')
            return
        self.requests += 1
        seq = self.requests
        if self.opts.max_inflight is not None and self.inflight >= self.opts.max_inflight:
            self.rejected += 1
            await _respond(send, 429, b'{"error": {"message": "over capacity", "type": '
                           b'"rate_limit_error"}}', extra=[(b"retry-after", b"1")])
            return
        self.inflight += 1
        try:
            rid = f"cmpl-{seq:08d}"
            if not stream:
                if self.opts.token_delay_s or self.opts.ttft_delay_s:
                    await trio.sleep(self.opts.ttft_delay_s + self.opts.token_delay_s * n)
                doc = {"id": rid, "object": "text_completion", "model": self.opts.model,
                       "choices": [{"index": 0, "text": "a" * n, "finish_reason": "length"}],
                       "usage": {"prompt_tokens": plen, "completion_tokens": n,
                                 "total_tokens": plen + n}}
                await _respond(send, 200, msgspec.json.encode(doc))
                self.completed += 1
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"),
                                    (b"cache-control", b"no-cache")]})
            tpe = max(1.0, self.opts.tokens_per_event)
            evs: dict[int, bytes] = {}  # one pre-encoded event per group size (k tokens: "a" * k)
            if self.opts.ttft_delay_s:
                await trio.sleep(self.opts.ttft_delay_s)
            fail_at = n // 2 if self.opts.error_every and seq % self.opts.error_every == 0 else -1
            sent = i = 0
            while sent < n:
                # Event i carries the tokens up to round((i + 1) * tpe): groups of the mean size.
                k = min(n - sent, max(1, round((i + 1) * tpe) - sent))
                ev = evs.get(k)
                if ev is None:
                    ev = evs[k] = self._event(rid, chat, "a" * k, None)
                if i == fail_at:
                    await send({"type": "http.response.body", "more_body": True,
                                "body": b'data: {"error": {"message": "injected fault", '
                                        b'"type": "server_error"}}\n\n'})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if self.opts.token_delay_s:
                    await trio.sleep(self.opts.token_delay_s)
                if self._pace is not None:
                    await self._pace.turn()
                await send({"type": "http.response.body", "body": ev, "more_body": True})
                self.events_sent += 1
                sent += k
                i += 1
            tail = self._event(rid, chat, "", "length")
            if usage_wanted:
                tail += b"data: " + msgspec.json.encode(
                    _Chunk(rid, "text_completion", int(time.time()), self.opts.model, [],
                           {"prompt_tokens": plen, "completion_tokens": n,
                            "total_tokens": plen + n})) + b"\n\n"
            await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n",
                        "more_body": False})
            self.completed += 1
        finally:
            self.inflight -= 1


async def _respond(send: Send, status: int, body: bytes, ctype: bytes = b"application/json",
                   extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype),
                            (b"content-length", str(len(body)).encode())] + (extra or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def hypercorn_config(host: str, port: int) -> Any:
    from hypercorn.config import Config

    cfg = Config()
    cfg.bind = [f"{host}:{port}"]
    cfg.accesslog = None
    cfg.errorlog = None
    cfg.keep_alive_timeout = 30
    return cfg


async def serve_floor(app: FloorApp, *, task_status: Any = trio.TASK_STATUS_IGNORED,
                      host: str = "127.0.0.1", port: int = 0) -> None:
    """Serve ``app`` with hypercorn's trio worker until cancelled; ``task_status`` gets the port."""
    from hypercorn.trio import serve

    async with trio.open_nursery() as n:
        binds = await n.start(serve, app, hypercorn_config(host, port))
        task_status.started(int(binds[0].rsplit(":", 1)[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.floor_app", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token-delay-ms", type=float, default=0.0)
    ap.add_argument("--max-inflight", type=int)
    ap.add_argument("--chunk-bytes", type=int, default=0)
    ap.add_argument("--tokens-per-event", type=float, default=1.0,
                    help="group this many tokens (mean) into one event, as calserve's streams do")
    ap.add_argument("--events-per-s", type=float, default=0.0,
                    help="hand out all streams' events at this rate (calserve's, to compare at its pace)")
    a = ap.parse_args(argv)
    app = FloorApp(FloorOptions(token_delay_s=a.token_delay_ms / 1000, max_inflight=a.max_inflight,
                                chunk_bytes=a.chunk_bytes, tokens_per_event=a.tokens_per_event,
                                events_per_s=a.events_per_s))
    try:
        trio.run(lambda: serve_floor(app, host=a.host, port=a.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
