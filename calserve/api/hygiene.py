"""Protocol hygiene that ``calserve:app`` enforces itself, at the ASGI level: the same under both
launchers (``hypercorn -k trio calserve:app`` and ``calserve serve``). The connection side (idle and
header timeouts, the connection cap, hypercorn's own error responses) is :mod:`calserve.api.listener`,
``calserve serve`` only.

Keep-alive (:func:`shield_final_send`). Hypercorn 0.18 restarts a connection's keep-alive timer from
inside the app's last ``send`` of a response (h11 ``_maybe_recycle`` -> ``Updated(idle=True)`` ->
``TrioSingleTask.restart`` -> ``nursery.start``), and it queues ``http.disconnect`` to the app just
before. quart-trio's message task, and the generation routes' disconnect watcher, cancel the handler
on that message while the handler is still inside this ``send``. ``nursery.start`` from a cancelled
context never hands the new task over (trio's ``TaskStatus.started`` "quietly quits"): the timer task
dies at once, and the connection is never closed for idleness — a probe found 0 of 100 idle
connections closed after 70 s. Sending the response's last message in a shielded scope lets the
timer start; the cancel lands right after.

Request heads (:func:`head_error`): both Content-Length and Transfer-Encoding (h11 lets chunked win,
RFC 9112 §6.3 allows refusing; a proxy in front may have used the other) -> 400
``invalid_http_framing``; a head over ``server.max_header_bytes`` -> 431 ``headers_too_large``. Both
answer in the OpenAI error shape with ``Connection: close``.

:class:`RateLimitedLog`: a hostile client must not turn each refusal into a log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, final

import msgspec
import trio

from calserve.api.errors import ApiError

__all__ = ["shield_final_send", "head_error", "send_error", "refuse", "drain", "RateLimitedLog",
           "error_response_bytes", "body_timeout"]

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

# The shielded last send is bounded: it only has to outlive a cancel that is already pending (its
# socket write is shielded by hypercorn itself), not to wait for a stuck queue forever.
_FINAL_SEND_GRACE_S: Final = 2.0


def shield_final_send(send: Send) -> Send:
    """``send`` whose last message of a response runs shielded (see the module docstring)."""

    async def guarded(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(shield=True, deadline=trio.current_time() + _FINAL_SEND_GRACE_S):
                await send(message)
        else:
            await send(message)

    guarded.__wrapped__ = send  # type: ignore[attr-defined]  # the server's own (socket_probe,
    # chunked_send: a body chunk with more_body skips this wrapper, so it must act on nothing else)
    return guarded


def head_error(scope: dict[str, Any], max_header_bytes: int) -> ApiError | None:
    """The refusal of a request head that calserve does not serve, or None (one pass over the
    headers; hypercorn/h11 lower-case their names)."""
    size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
    clen = te = False
    for name, value in scope["headers"]:
        size += len(name) + len(value) + 4
        if name == b"content-length":
            clen = True
        elif name == b"transfer-encoding":
            te = True
    if clen and te:
        return ApiError(400, "the request has both Content-Length and Transfer-Encoding: its "
                        "framing is ambiguous", code="invalid_http_framing", close=True)
    if size > max_header_bytes:
        return ApiError(431, f"request header fields too large: {size} bytes > "
                        f"server.max_header_bytes ({max_header_bytes})", code="headers_too_large",
                        close=True)
    return None


def body_timeout(timeout_s: float) -> ApiError:
    """The 408 of a request body not complete ``timeout_s`` after its head."""
    return ApiError(408, f"the request body did not arrive within server.body_timeout_s "
                    f"({timeout_s:g} s)", code="request_timeout", close=True)


def _encode(err: ApiError) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    body = msgspec.json.encode(err.response_body())
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers().items()]
    return body, headers


async def send_error(send: Send, err: ApiError) -> None:
    """``err`` as a complete ASGI response."""
    body, headers = _encode(err)
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def drain(receive: Receive, timeout_s: float) -> None:
    """Consume what is left of a refused request (so hypercorn's reader is never stuck on a full
    app queue), at most ``timeout_s``: after a ``Connection: close`` answer hypercorn closes the
    connection and the next message is ``http.disconnect``."""
    with trio.move_on_after(timeout_s):
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
                return


async def refuse(send: Send, receive: Receive, err: ApiError, drain_s: float) -> None:
    """Answer ``err`` (``Connection: close``) before reading the body, then drain (bounded)."""
    await send_error(send, err)
    await drain(receive, drain_s)


_REASONS: Final = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields "
                   b"Too Large", 500: b"Internal Server Error", 501: b"Not Implemented",
                   503: b"Service Unavailable"}


def error_response_bytes(err: ApiError) -> bytes:
    """``err`` as a whole HTTP/1.1 response (``Connection: close``), for answers written below
    the ASGI layer (:mod:`calserve.api.listener`)."""
    body, headers = _encode(err)
    if not err.close:
        headers.append((b"connection", b"close"))
    head = [b"HTTP/1.1 %d %s" % (err.status, _REASONS.get(err.status, b""))]
    head += [k + b": " + v for k, v in headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


@final
class RateLimitedLog:
    """One log line per ``key`` per ``window_s``; the lines suppressed meanwhile are counted in the
    next one ("... (+N more since)")."""

    def __init__(self, logger: logging.Logger, window_s: float = 10.0) -> None:
        self._log = logger
        self._window = window_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._window:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        if n:
            self._log.warning(msg + " (+%d more in the last %.0f s)", *args, n, now - (last or now))
        else:
            self._log.warning(msg, *args)

    def suppressed(self, key: str) -> int:
        return self._suppressed.get(key, 0)
