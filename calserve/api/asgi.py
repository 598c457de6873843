"""The generation routes, ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``POST
/v1/responses`` (the chat path answering in OpenAI's Responses shape: ``api/responses.py``): raw
ASGI, the only implementation of them.

Why raw ASGI: under quart every streamed chunk went through quart's response machinery
(request/response wrappers, per-chunk timeout and context handling) — about half of the server's CPU
per token in ``bench.http_floor``, and ~0.7 ms per request even for a 429. These two routes carry all
the load, so :class:`CalserveApp` hands them to :class:`FastRoutes` straight from its ASGI
``__call__``, also when the app is mounted (a ``root_path``): :func:`fast_route` takes exactly the
requests quart would route to them (:func:`routed_path`). Every other path, method and scope
(lifespan, ``/metrics``, ``/v1/models``, a GET or OPTIONS on these paths) goes to quart, which
knows these two paths only to answer other methods like any route (405 + Allow, OPTIONS:
:mod:`calserve.api.routes`).

Behaviour, shared with the quart routes where both have it:
- request decoding and the body limit (:mod:`calserve.api.bodies`: 413 on Content-Length or on the
  bytes received, whichever shows it first), the body deadline (``server.body_timeout_s`` after the
  head: 408 + close, as quart's ``BODY_TIMEOUT``), tenant auth (``ApiState.tenant_of``: 401 before the
  body is read), error mapping (``errors.to_api_error``: a genuine bug is logged and answered 500
  ``internal_error``), ``calserve_http_responses`` counted once per response;
- OpenAI bodies: ``running.run_json`` (JSON) and ``running.pump_stream`` + ``stream_encoder`` (SSE);
- disconnect: a watcher task reads ASGI ``receive`` after the body; ``http.disconnect`` (or the
  server cancelling the handler) cancels the handler scope and the engine request is cancelled at
  once, shielded (``running.RequestLease``; quart-trio cancels a handler the same way).

Cheap refusals: everything before ``engine.submit`` is what deciding needs (auth, body, decode,
tokenize); logprob formatters, observers and chunk encoders are built only for accepted requests.

Invariant: once ``engine.submit`` returned a handle, its :class:`RequestLease` is released in
:meth:`FastRoutes._generate`'s ``finally``: the request ended (its terminal event was read) or is
cancelled there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final, final
from urllib.parse import urlparse

import trio

from calserve.api.bodies import check_declared, too_large
from calserve.api.chunked_send import chunked_send
from calserve.api.choices import pump_choices, release_all, run_json_choices, submit_choices
from calserve.api.convert import Kind, Prepared, prepare_body
from calserve.api.errors import ApiError, to_api_error
from calserve.api.hygiene import body_timeout, drain
from calserve.api.infill import infill_json
from calserve.api.infill_stream import InfillStreamEncoder
from calserve.api.protocol import EngineLike
from calserve.api.render import LogprobFormatter, encode
from calserve.api.responses import json_response
from calserve.api.responses_stream import ResponsesStreamEncoder
from calserve.api.running import RequestLease, collect_choice, pump_stream, run_json
from calserve.api.socket_probe import SocketProbe, probe_from_send, probe_of
from calserve.api.state import ApiState
from calserve.api.stream_encoder import SseEncoder, StreamEncoder
from calserve.api.tool_stream import ToolStreamEncoder
from calserve.api.write_watch import close_later, watched_send
from calserve.engine.types import ErrorEvent, FinishEvent

__all__ = ["FastRoutes", "fast_route", "routed_path", "FAST_ROUTES"]

# Exact paths served here (POST only; other methods get quart's 405/OPTIONS handling).
FAST_ROUTES: Final[dict[str, Kind]] = {
    "/v1/completions": "completion", "/v1/chat/completions": "chat", "/v1/responses": "responses",
    "/infill": "infill",
}
_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_END_BODY: Final = {"type": "http.response.body", "body": b"", "more_body": False}

Scope = dict[str, Any]
Receive = Any  # ASGI receive callable
Send = Any  # ASGI send callable


def fast_route(scope: Scope) -> Kind | None:
    """The route kind when ``scope`` is one of ours, else None (quart serves it)."""
    if scope.get("method") != "POST":
        return None
    path = scope.get("path", "")
    root = scope.get("root_path")
    if not root:
        kind = FAST_ROUTES.get(path)
        if kind is not None:
            return kind  # the hot case: the exact path, not mounted
    return FAST_ROUTES.get(routed_path(path, root or ""))


def routed_path(path: str, root_path: str) -> str:
    """The path quart's routing matches for an ASGI ``path``/``root_path``: an absolute-form
    target's path, less the ``root_path`` prefix (outside it: " ", no route), leading slashes
    folded into one (werkzeug's ``MapAdapter.match``). Other differences (a doubled slash inside,
    a trailing slash) match no route here, and quart answers them (308, 404)."""
    if path[:1] != "/":
        path = urlparse(path).path
    if root_path:
        if path == root_path or not path.startswith(root_path):
            return " "
        path = path[len(root_path):]
    return "/" + path.lstrip("/")


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """After the body: the next ASGI message is ``http.disconnect`` (client gone or response
    done). Cancels the handler at once, as quart-trio does."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            scope.cancel()
            return


@final
class FastRoutes:
    """The generation routes as one raw ASGI handler bound to the app's :class:`ApiState` (the
    same engine host quart's lifespan starts)."""

    def __init__(self, state: ApiState) -> None:
        self._state = state
        self._responses: dict[int, Any] = {}  # status -> labelled counter child

    def _count(self, status: int) -> None:
        c = self._responses.get(status)
        if c is None:
            c = self._responses[status] = self._state.metrics.responses.labels(str(status))
        c.inc()

    async def __call__(self, kind: Kind, scope: Scope, receive: Receive, send: Send) -> None:
        body_read = [False]
        try:
            got = await self._accept_body(kind, scope, receive, body_read)
            if got is None:
                return  # the client left while sending the body: nothing to answer
            eng, prep = got
        except Exception as exc:
            await self._send_error(send, to_api_error(exc))
            if not body_read[0]:  # after an early refusal (401/408/413/503): the rest, bounded
                await drain(receive, self._state.config.server.body_timeout_s)
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope)
            try:
                await self._generate(eng, prep, send, scope, nursery)
            finally:
                nursery.cancel_scope.cancel()  # done (or failed): stop watching

    async def _accept_body(self, kind: Kind, scope: Scope, receive: Receive, body_read: list[bool]
                           ) -> tuple[EngineLike, Prepared] | None:
        """Auth, body (limit), decode, prepare: everything admission needs, nothing more."""
        auth = clen = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                if auth is None:
                    auth = value
            elif name == b"content-length":
                clen = value
        state = self._state
        tenant = state.tenant_of(auth.decode("latin-1") if auth is not None else "")
        eng = state.engine()
        server = state.config.server
        limit = server.max_body_bytes
        check_declared(clen, limit)
        parts: list[bytes] = []
        size = 0
        with trio.move_on_after(server.body_timeout_s) as slow:
            while True:
                msg = await receive()
                if msg["type"] == "http.request":
                    chunk = msg.get("body", b"")
                    if chunk:
                        size += len(chunk)
                        if size > limit:
                            raise too_large(limit)
                        parts.append(chunk)
                    if not msg.get("more_body", False):
                        break
                elif msg["type"] == "http.disconnect":
                    return None
        if slow.cancelled_caught:  # a slow (or stalled) sender: 408, the connection is closed
            raise body_timeout(server.body_timeout_s)
        body_read[0] = True
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        # Decode + prepare: a big body in the prompt worker thread (convert.prepare_body).
        return eng, await prepare_body(kind, eng, data, tenant, server.max_n, server.max_prompts,
                                       state.responses_store() if kind == "responses" else None)

    async def _generate(self, eng: EngineLike, prep: Prepared, send: Send, scope: Scope,
                        nursery: trio.Nursery) -> None:
        if prep.choices > 1:
            await self._generate_choices(eng, prep, send, scope, nursery)
            return
        try:
            handle = await eng.submit(prep.request)  # admission: 429/503 raise here
        except Exception as exc:
            await self._send_error(send, to_api_error(exc))
            return
        # No checkpoint between submit returning and this try: the lease owns the request from
        # here; the finally releases it (cancels it unless its terminal event was read).
        lease = RequestLease(handle)
        try:
            metrics = self._state.metrics
            metrics.prompt_tokens.labels(prep.alias, prep.request.tenant).inc(
                len(prep.request.prompt_tokens))
            fmt = LogprobFormatter(eng.tokenizer(prep.alias), start_offset=prep.logprob_offset(0))
            # the generation the request is pinned to (engines without one: no such field)
            fingerprint: str | None = getattr(handle, "system_fingerprint", None)
            if prep.stream:
                enc: SseEncoder
                if prep.responses is not None:
                    enc = ResponsesStreamEncoder(prep.alias, prep.answer, prep.responses,
                                                 fmt if prep.logprobs is not None else None)
                elif prep.infill is not None:
                    enc = InfillStreamEncoder(prep.alias, prep.infill)
                elif prep.answer is None:
                    enc = StreamEncoder.for_request(prep, fmt, fingerprint)
                else:
                    enc = ToolStreamEncoder.for_request(prep, prep.answer, fmt, fingerprint)
                self._count(200)
                await send({"type": "http.response.start", "status": 200,
                            "headers": _SSE_HEADERS})
                probe = self._probe(scope, send)
                out = watched_send(probe, chunked_send(send), [handle], nursery,
                                   self._state.config.server.send_timeout_s)
                keep = None
                if isinstance(enc, ResponsesStreamEncoder) and prep.responses is not None:
                    keep = self._keeper(prep, enc)
                await pump_stream(lease, enc, out, metrics, prep, self._state.pacer, probe, keep)
                _close_if_cut(probe, [enc.terminal], nursery)
                await out(_END_BODY)
                return
            try:
                if prep.responses is not None:
                    choice, usage = await collect_choice(lease, metrics, prep, fmt, 0)
                    lps = choice["logprobs"]["content"] if (
                        choice["logprobs"] and prep.answer is None) else None
                    body = json_response(prep.responses, prep.alias, choice["message"],
                                         choice["finish_reason"], usage, lps)
                    await self._state.keep_response(prep.request.tenant, body,
                                                    prep.responses.stored_input)
                elif prep.infill is not None:
                    choice, _ = await collect_choice(lease, metrics, prep, fmt, 0)
                    body = infill_json(prep.alias, prep.infill, choice["text"], choice["terminal"])
                else:
                    body = await run_json(lease, metrics, prep, fmt)
                if fingerprint is not None and prep.responses is None and prep.infill is None:
                    body["system_fingerprint"] = fingerprint
            except Exception as exc:  # an ErrorEvent (500/503) or a bug
                await self._send_error(send, to_api_error(exc))
                return
            await self._send_json(send, 200, encode(body), [])
        finally:
            await lease.release()  # no-op once ended; else cancels, shielded

    def _keeper(self, prep: Prepared, enc: ResponsesStreamEncoder
                ) -> Callable[[], Awaitable[None]]:
        """What stores a streamed response before its terminal event is sent."""
        echo = prep.responses
        assert echo is not None

        async def keep() -> None:
            if enc.response is not None:
                await self._state.keep_response(prep.request.tenant, enc.response,
                                                echo.stored_input)
        return keep

    def _probe(self, scope: Scope, send: Send) -> SocketProbe | None:
        """The connection's socket probe (None: the launcher gives none)."""
        return probe_of(scope) or probe_from_send(
            send, self._state.config.server.stream_contended_stall_ms / 1000.0)

    async def _generate_choices(self, eng: EngineLike, prep: Prepared, send: Send, scope: Scope,
                                nursery: trio.Nursery) -> None:
        """``n`` > 1 or a list of prompts (:mod:`calserve.api.choices`): every choice is its own
        engine request."""
        try:
            leases = await submit_choices(eng, prep)  # admission of every choice: 429/503 here
        except Exception as exc:
            await self._send_error(send, to_api_error(exc))
            return
        try:
            metrics = self._state.metrics
            metrics.prompt_tokens.labels(prep.alias, prep.request.tenant).inc(prep.prompt_tokens())
            tok = eng.tokenizer(prep.alias)
            if prep.stream:
                self._count(200)
                await send({"type": "http.response.start", "status": 200,
                            "headers": _SSE_HEADERS})
                probe = self._probe(scope, send)
                out = watched_send(probe, chunked_send(send), [lease.handle for lease in leases],
                                   nursery, self._state.config.server.send_timeout_s)
                encs = await pump_choices(leases, out, metrics, prep, tok, self._state.pacer,
                                          probe)
                _close_if_cut(probe, [e.terminal for e in encs], nursery)
                await out(_END_BODY)
                return
            try:
                body = await run_json_choices(leases, metrics, prep, tok)
            except Exception as exc:  # an ErrorEvent (500/503) or a bug
                await self._send_error(send, to_api_error(exc))
                return
            await self._send_json(send, 200, encode(body), [])
        finally:
            await release_all(leases)  # no-op for the ended ones; else cancels, shielded

    async def _send_json(self, send: Send, status: int, body: bytes,
                         extra: list[tuple[bytes, bytes]]) -> None:
        self._count(status)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()), *extra]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _send_error(self, send: Send, err: ApiError) -> None:
        extra = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                 for k, v in err.headers().items()]
        await self._send_json(send, err.status, encode(err.response_body()), extra)


def _close_if_cut(probe: SocketProbe | None, ends: list[FinishEvent | ErrorEvent | None],
                  nursery: trio.Nursery) -> None:
    """A stream given up as too slow (``client_too_slow``): its last writes went through (the
    watch may not have seen the cut yet); the handler ends now and cancels the watch, so this
    schedules the close of the connection."""
    if probe is not None and any(isinstance(e, ErrorEvent) and e.kind == "slow_consumer"
                                 for e in ends):
        nursery.start_soon(close_later, probe.close)
