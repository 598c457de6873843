"""A streamed response's body chunks written straight to hypercorn's HTTP/1.1 connection.

Why: every SSE event of a stream is one ASGI ``http.response.body`` message, and hypercorn takes it
through ``HTTPStream.app_send`` (state checks, a ``Body`` event), ``H11Protocol.stream_send`` (an
``isinstance`` chain, an ``h11.Data`` event) and h11's ``Connection.send`` (its state machine and
chunked writer) before ``TCPServer.protocol_send`` writes the bytes — per event, the same work every
time, on the serving thread that also runs the engine (issue 18: the host work per token). For an
HTTP/1.1 response without a Content-Length, which is what h11 frames as ``Transfer-Encoding:
chunked``, all that machinery produces ``b"%x\\r\\n" % len(body) + body + b"\\r\\n"`` and hands it to
``protocol_send``: :func:`chunked_send` does exactly that itself, through hypercorn's own
``protocol_send`` (its send lock, its shield, its handling of a connection that broke), so nothing
about the connection's lifecycle changes. On a plain TCP socket (not TLS) with no write of
hypercorn's under way, the chunk is first offered to the socket in the same call (``os.write`` on
the non-blocking descriptor): what the kernel takes at once needs no trip through trio's scheduler
(hypercorn's send lock and trio's socket write each yield once per write); whatever it does not take
(a full send buffer, an error) goes on through ``protocol_send``, which waits for room or closes the
connection as before.

What stays hypercorn's: the response head (sent before), the end of the body (a message without
``more_body`` or an empty one: h11 writes the last chunk and hypercorn recycles the connection for
keep-alive), and every write once the stream is closed or h11 left ``SEND_BODY``. h11 keeps no count
of a chunked body's bytes, so its state is the same as if it had framed the chunks itself.

The app's own wrappers of ``send`` that mark themselves with ``__wrapped__`` (the request id on
the head, :func:`~calserve.api.request_ids.echo_request_id`; the shielded final message,
:func:`~calserve.api.hygiene.shield_final_send`) act on the head and the final message only: body
chunks skip them too, those two messages still go through them.

When it applies (checked once, after the head was written): the ASGI ``send`` (under those
wrappers) is hypercorn 0.17 / 0.18's ``HTTPStream.app_send`` bound to an ``H11Protocol`` stream, h11 is in ``SEND_BODY``, the
client speaks HTTP/1.1, the request is not ``HEAD`` and the response declared neither
Content-Length nor Transfer-Encoding (so h11 chose chunked framing). Anything else (HTTP/1.0, HTTP/2,
another server or version, a test double) gets ``send`` itself back.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

__all__ = ["chunked_send"]

Send = Callable[[dict[str, Any]], Awaitable[None]]

_FRAMING: Final = (b"content-length", b"transfer-encoding")


def chunked_send(send: Send) -> Send:
    """``send`` for the rest of a streamed response whose head it wrote (module docstring): body
    chunks go straight to the connection, everything else through ``send``."""
    try:
        import h11
        from hypercorn.events import RawData
        from hypercorn.protocol.h11 import H11Protocol
        from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
    except ImportError:  # pragma: no cover - another server
        return send
    inner: Any = send
    while hasattr(inner, "__wrapped__"):  # the app's own wrappers (head and final message only)
        inner = inner.__wrapped__
    stream: Any = getattr(inner, "__self__", None)
    if type(stream) is not HTTPStream or stream.state is not ASGIHTTPState.RESPONSE:
        return send
    proto: Any = getattr(getattr(stream, "send", None), "__self__", None)
    if type(proto) is not H11Protocol:
        return send
    conn = proto.connection
    response = getattr(stream, "response", None) or {}
    if (conn.our_state is not h11.SEND_BODY or conn.their_http_version != b"1.1"
            or stream.scope.get("method") == "HEAD"
            or any(bytes(name).lower() in _FRAMING for name, _ in response.get("headers", ()))):
        return send
    raw = proto.send  # the connection's TCPServer.protocol_send
    tcp: Any = getattr(raw, "__self__", None)
    lock: Any = getattr(tcp, "send_lock", None)
    sock: Any = getattr(getattr(tcp, "stream", None), "socket", None)
    if (lock is None or isinstance(getattr(tcp, "stream", None), trio.SSLStream)
            or not callable(getattr(sock, "fileno", None))
            or getattr(sock, "type", None) != socket.SOCK_STREAM):
        sock = None  # not a plain socket we may write to: every chunk through protocol_send
    body_state = h11.SEND_BODY

    async def direct(message: dict[str, Any]) -> None:
        body = message.get("body", b"")
        if (body and message.get("more_body", False) and not stream.closed
                and conn.our_state is body_state):
            frame = b"%x\r\n%b\r\n" % (len(body), body)
            if sock is not None and not lock.locked():
                # What the socket takes now, in this call; the rest (a full buffer, an error)
                # through hypercorn's write, which waits for room or handles the broken
                # connection. No other write can come between: hypercorn writes under this lock,
                # and nothing here yields before protocol_send takes it.
                fd = sock.fileno()  # -1 once closed (never a reused descriptor)
                if fd >= 0:
                    try:
                        n = os.write(fd, frame)
                    except OSError:
                        n = 0
                    if n == len(frame):
                        return
                    frame = frame[n:]
            await raw(RawData(data=frame))
        else:
            await send(message)

    return direct
