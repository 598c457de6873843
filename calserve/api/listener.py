"""The HTTP listener's connection guard, under both launchers.

:func:`serve_guarded` (``calserve serve``) is ``hypercorn.trio.serve`` (``worker_serve`` of
hypercorn 0.18: lifespan, sockets, listeners, graceful shutdown) with our own per-connection
handler in front of hypercorn's ``TCPServer``. Under the hypercorn CLI (``hypercorn -k trio
calserve:app``) hypercorn's own ``worker_serve`` builds the listener; it looks up the name
``TCPServer`` in ``hypercorn.trio.run`` only after the app's lifespan start-up, so
:func:`install_cli_guard` (called from that start-up) puts the same handler there. What is here
(the app-level defences of :mod:`calserve.api.hygiene` come on top, under both):

- keep-alive: ``server.keep_alive_timeout_s`` is hypercorn's ``keep_alive_timeout`` (the time a
  connection may sit with no request, fresh or between requests; under the CLI its own
  ``--keep-alive``, 5 s by default);
- header timeout: a request head must be complete ``server.header_timeout_s`` after its first byte,
  else 408 (OpenAI shape) and the connection is closed; hypercorn's own timer would allow a head
  to trickle in for the whole keep-alive time;
- connection cap: ``server.max_connections`` (clamped to the open-file limit less a reserve) open
  connections at most. At the cap the longest-idle keep-alive connection is closed for the new one
  (closing an idle connection is ordinary HTTP); when none is idle the new one gets 503
  ``too_many_connections`` + Retry-After and is closed — at most ``_REFUSING`` such answers at
  once, beyond that a plain close, so a flood never takes fds past the cap + ``_REFUSING``;
- a client's EOF on a connection with no request in progress frees its fd at once (hypercorn
  keeps it in CLOSE_WAIT until its keep-alive timer fires);
- each connection's socket goes to the app as a :class:`~calserve.api.socket_probe.SocketProbe`
  in the request scope's ``state`` (how far behind its client is, and closing it: slow readers,
  README "Per-request limits and slow readers");
- hypercorn's own error answers (h11 framing errors: bad request line, bad chunk, head over
  ``server.max_header_bytes`` before it is complete, unsupported Transfer-Encoding; a 500 when the
  app sent nothing) are written by h11 as empty bodies: they are rewritten to the OpenAI error
  shape (the head keeps its status, date and server lines).

Refusals are logged through :class:`~calserve.api.hygiene.RateLimitedLog` (one line per kind per
10 s), and counted in ``calserve_http_connections_closed_total{reason}``.
"""

from __future__ import annotations

import logging
import resource
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from enum import Enum
from functools import partial
from math import inf
from typing import Any, Final, cast, final

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.events import Event, Updated
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app
from prometheus_client import CollectorRegistry, Counter, Gauge

from calserve.api.errors import ApiError
from calserve.api.hygiene import RateLimitedLog, error_response_bytes
from calserve.api.socket_probe import PROBE_KEY, SocketProbe
from calserve.config import ServerConfig

__all__ = ["serve_guarded", "install_cli_guard", "connection_cap", "rewrite_error_response",
           "FD_RESERVE"]

log = logging.getLogger("calserve.serve")

FD_RESERVE: Final = 64  # fds kept for the process itself (~20 at rest) and refusals in flight
_REFUSING: Final = 16  # 503 answers in flight at most; beyond, a refused connection is just closed
_REFUSAL_LINGER_S: Final = 1.0  # read the refused client's request (no RST before it reads the 503)
_CUT_WRITE_S: Final = 1.0  # a 408 to a slow client is best effort
# h11's error answer as hypercorn writes it: "HTTP/1.1 <status> " + these two headers first.
_HC_ERROR: Final = b" \r\ncontent-length: 0\r\nconnection: close\r\n"


def connection_cap(configured: int) -> int:
    """``server.max_connections`` clamped to what the open-file limit allows; raises the soft limit
    towards the hard one first when the configured cap needs it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = configured + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if new > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
    if soft == resource.RLIM_INFINITY:
        return configured
    room = soft - FD_RESERVE
    cap = min(configured, room if room >= 16 else max(1, soft // 2))
    if cap < configured:
        log.warning("server.max_connections %d is more than the open-file limit (%d) allows: "
                    "serving at most %d connections", configured, soft, cap)
    return cap


_ERRORS: Final[dict[int, tuple[str, str, str]]] = {
    400: ("malformed HTTP request (request line, headers or body framing)",
          "invalid_request_error", "invalid_http"),
    404: ("not found", "invalid_request_error", "not_found"),
    408: ("request timed out", "invalid_request_error", "request_timeout"),
    413: ("request too large", "invalid_request_error", "request_too_large"),
    431: ("request header fields too large", "invalid_request_error", "headers_too_large"),
    501: ("unsupported Transfer-Encoding (only chunked is implemented)", "invalid_request_error",
          "not_implemented"),
}


def rewrite_error_response(data: bytes, max_header_bytes: int) -> bytes | None:
    """The OpenAI-shaped version of a response head hypercorn wrote for its own error (an empty
    body, ``Connection: close``), or None when ``data`` is not one."""
    if not (data.startswith(b"HTTP/1.1 ") and data[12:12 + len(_HC_ERROR)] == _HC_ERROR):
        return None
    try:
        status = int(data[9:12])
    except ValueError:
        return None
    message, typ, code = _ERRORS.get(status, ("internal server error", "server_error",
                                               "internal_error"))
    if status == 431:
        message += f" (server.max_header_bytes {max_header_bytes})"
    body = error_response_bytes(ApiError(status, message, type=typ, code=code, close=True))
    _, _, ours = body.partition(b"\r\n")  # our headers and body, after our status line
    rest = data[12 + len(_HC_ERROR):]  # hypercorn's date/server headers and the blank line
    head_end = ours.index(b"\r\n\r\n")
    return data[:12] + b" \r\n" + ours[:head_end] + b"\r\n" + rest + ours[head_end + 4:]


class _Phase(Enum):
    IDLE = 0  # no request in progress, no byte of the next one: hypercorn's keep-alive timer
    HEAD = 1  # bytes of a request head arrived: the header timeout runs
    BUSY = 2  # a request is in progress: the app's own limits (body timeout, ...)
    CLOSED = 3  # the socket is closed (hypercorn's tasks may still wind down)


@final
class _Guard:
    """The connections of one listener: the cap, the idle order, the refusals."""

    def __init__(self, limits: ServerConfig, cap: int, registry: CollectorRegistry | None) -> None:
        self.limits = limits
        self.cap = cap
        self.active = 0
        self.refusing = 0
        self.idle: OrderedDict[_Conn, None] = OrderedDict()  # oldest idle first
        self.log = RateLimitedLog(log)
        self._open = Gauge("calserve_http_connections", "open client connections",
                           registry=registry)
        self._closed = Counter(
            "calserve_http_connections_closed", "client connections the server closed or refused "
            "to protect itself: refused (cap), evicted (idle, at the cap), "
            "header_timeout", ["reason"], registry=registry)

    def count(self, reason: str) -> None:
        self._closed.labels(reason).inc()

    def opened(self) -> None:
        self.active += 1
        self._open.set(self.active)

    def released(self) -> None:
        self.active -= 1
        self._open.set(self.active)

    async def handle(self, app: AppWrapper, hc: HyperConfig, context: WorkerContext,
                     state: ConnectionState, stream: trio.SocketStream) -> None:
        if self.active >= self.cap and not self._evict_idle():
            await self._refuse(stream)
            return
        conn = _Conn(self, stream)
        # The connection's own state dict (hypercorn copies it into every request's scope):
        # the socket probe the streaming pump reports slow readers with.
        own = ConnectionState({**state, PROBE_KEY: SocketProbe(
            stream.socket, self.limits.stream_contended_stall_ms / 1000.0, conn.close_now)})
        server = _GuardedTCPServer(app, hc, context, own, conn)
        async with trio.open_nursery() as nursery:
            conn.scope = nursery.cancel_scope
            nursery.start_soon(conn.watch)
            try:
                await server.run()
            finally:
                nursery.cancel_scope.cancel()
                conn.release()

    def _evict_idle(self) -> bool:
        if not self.idle:
            return False
        conn, _ = self.idle.popitem(last=False)
        self.count("evicted")
        self.log.warning("evicted", "%d connections open (server.max_connections): closed the "
                         "longest-idle keep-alive connection for a new one", self.active)
        conn.close_now()
        return True

    async def _refuse(self, stream: trio.SocketStream) -> None:
        self.count("refused")
        self.log.warning("refused", "%d connections open (server.max_connections), none idle: "
                         "refusing new connections (503)", self.active)
        if self.refusing >= _REFUSING:
            await stream.aclose()
            return
        self.refusing += 1
        try:
            with trio.move_on_after(_REFUSAL_LINGER_S):
                await stream.send_all(error_response_bytes(ApiError(
                    503, f"too many open connections (server.max_connections {self.cap}); "
                    "retry later", type="service_unavailable", code="too_many_connections",
                    retry_after=1.0, close=True)))
                await stream.send_eof()
                while await stream.receive_some(65536):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.refusing -= 1
            await stream.aclose()


@final
class _Conn:
    """One admitted connection: its phase (from what hypercorn reads and tells), the header
    watchdog, and the wrapped stream hypercorn reads and writes (:class:`_GuardedStream`)."""

    def __init__(self, guard: _Guard, inner: trio.SocketStream) -> None:
        self.guard = guard
        self.inner = inner
        self.stream = _GuardedStream(self)
        self.phase = _Phase.IDLE
        self.deadline = inf
        self.raw_protocol = False  # HTTP/2 or an upgrade: no HTTP/1.1 answers of ours
        self.scope: trio.CancelScope | None = None  # the connection's nursery (set by handle)
        self.send_lock: trio.Lock | None = None  # hypercorn's, set by _GuardedTCPServer
        self._watch_scope: trio.CancelScope | None = None
        guard.opened()
        guard.idle[self] = None

    def release(self) -> None:
        if self.phase is not _Phase.CLOSED:
            self.phase = _Phase.CLOSED
            self._set_deadline(inf)  # the watchdog has nothing left to cut
            self.guard.idle.pop(self, None)
            self.guard.released()

    def close_now(self) -> None:
        """Close the socket and end the connection's tasks (idle or cut connections only)."""
        self.release()
        self.inner.socket.close()
        if self.scope is not None:
            self.scope.cancel()

    def _set_deadline(self, deadline: float) -> None:
        self.deadline = deadline
        if self._watch_scope is not None:
            self._watch_scope.deadline = deadline

    def on_data(self, data: bytes) -> None:
        if not data:  # the client's EOF: with no request in progress, free the fd now
            if self.phase in (_Phase.IDLE, _Phase.HEAD):
                self.close_now()
            return
        if self.phase is _Phase.IDLE:
            self.phase = _Phase.HEAD
            self.guard.idle.pop(self, None)
            if data.startswith(b"PRI * HTTP/2"):
                self.raw_protocol = True
            self._set_deadline(trio.current_time() + self.guard.limits.header_timeout_s)

    def on_updated(self, idle: bool) -> None:
        if self.phase is _Phase.CLOSED:
            return
        self._set_deadline(inf)
        if idle:
            self.phase = _Phase.IDLE
            self.guard.idle[self] = None
            self.guard.idle.move_to_end(self)
        else:
            self.phase = _Phase.BUSY
            self.guard.idle.pop(self, None)

    def on_send(self, data: bytes) -> bytes:
        if self.raw_protocol:
            return data
        if data.startswith(b"HTTP/1.1 101 "):
            self.raw_protocol = True  # h2c upgrade: HTTP/2 frames from here on
            return data
        new = rewrite_error_response(data, self.guard.limits.max_header_bytes)
        if new is None:
            return data
        self.guard.log.warning("http_error", "answered a malformed request: %s",
                               data[9:12].decode("latin-1"))
        return new

    async def watch(self) -> None:
        """Cut a request head still incomplete ``header_timeout_s`` after its first byte."""
        while True:
            with trio.CancelScope(deadline=self.deadline) as s:
                self._watch_scope = s
                await trio.sleep_forever()
            self._watch_scope = None
            if self.phase is _Phase.HEAD and trio.current_time() >= self.deadline:
                break
        g = self.guard
        g.count("header_timeout")
        g.log.warning("header_timeout", "closed a connection whose request head was incomplete "
                      "after server.header_timeout_s (%g s)", g.limits.header_timeout_s)
        if not self.raw_protocol and self.send_lock is not None:
            answer = error_response_bytes(ApiError(
                408, f"the request head did not arrive within server.header_timeout_s "
                f"({g.limits.header_timeout_s:g} s)", code="request_timeout", close=True))
            with trio.move_on_after(_CUT_WRITE_S):
                async with self.send_lock:
                    try:
                        await self.inner.send_all(answer)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
        self.close_now()


@final
class _GuardedStream(trio.abc.HalfCloseableStream):
    """The socket stream as hypercorn's ``TCPServer`` sees it: reads and writes tell the
    connection's :class:`_Conn`. Not an SSL stream (``TCPServer`` then takes ``.socket``)."""

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.socket = conn.inner.socket

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self._conn.inner.receive_some(max_bytes)
        self._conn.on_data(bytes(data))
        return bytes(data)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._conn.inner.send_all(self._conn.on_send(bytes(data)))

    async def wait_send_all_might_not_block(self) -> None:
        await self._conn.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._conn.inner.send_eof()

    async def aclose(self) -> None:
        self._conn.release()  # the fd is what the cap counts (hypercorn's tasks may linger)
        await self._conn.inner.aclose()


@final
class _GuardedTCPServer(TCPServer):
    """hypercorn's connection handler, telling the connection when a request starts (the head is
    complete: ``Updated(idle=False)``) and when it is idle again."""

    def __init__(self, app: AppWrapper, config: HyperConfig, context: WorkerContext,
                 state: ConnectionState, conn: _Conn) -> None:
        super().__init__(app, config, context, state, cast(Any, conn.stream))
        self._conn = conn
        conn.send_lock = self.send_lock

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated):
            self._conn.on_updated(event.idle)
        await super().protocol_send(event)


async def serve_guarded(
    app: Any, hc: HyperConfig, limits: ServerConfig, *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    registry: CollectorRegistry | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``hypercorn.trio.serve(app, hc, ...)`` for plain-HTTP binds, each connection through the
    guard. Sets hc's ``keep_alive_timeout`` and ``h11_max_incomplete_size`` from ``limits``."""
    hc.keep_alive_timeout = limits.keep_alive_timeout_s
    hc.h11_max_incomplete_size = limits.max_header_bytes
    wrapped = wrap_app(app, hc.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, hc, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        guard = _Guard(limits, connection_cap(limits.max_connections), registry)
        async with trio.open_nursery() as server_nursery:
            sockets = hc.create_sockets()
            listeners = []
            binds = []
            for sock in sockets.insecure_sockets:
                sock.listen(hc.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                bind = repr_socket_addr(sock.family, sock.getsockname())
                binds.append(f"http://{bind}")
                await hc.log.info(f"Running on http://{bind} (CTRL + C to quit)")
            task_status.started(binds)
            handler = partial(guard.handle, wrapped, hc, context,
                              ConnectionState(lifespan_state.copy()))
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(partial(trio.serve_listeners, handler, listeners,
                                               handler_nursery=server_nursery))
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, other = error.split((ShutdownError, KeyboardInterrupt))
                if other is not None:
                    raise other
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + hc.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


def install_cli_guard(limits: ServerConfig, registry: CollectorRegistry | None) -> bool:
    """Under the hypercorn CLI's trio worker: every connection accepted from now on goes through
    the guard (module docstring), as under ``calserve serve``. Call it during the app's lifespan
    start-up: ``hypercorn.trio.run.worker_serve`` binds its handler, ``partial(TCPServer, ...)``,
    right after the start-up completes. False (nothing done) when that worker is not loaded (the
    app served otherwise, in-process tests) or its ``TCPServer`` is not hypercorn's any more
    (installed already)."""
    import sys

    run = sys.modules.get("hypercorn.trio.run")
    if run is None or getattr(run, "TCPServer", None) is not TCPServer:
        return False
    guard = _Guard(limits, connection_cap(limits.max_connections), registry)

    def guarded(app: AppWrapper, hc: HyperConfig, context: WorkerContext,
                state: ConnectionState, stream: trio.SocketStream) -> Awaitable[None]:
        # worker_serve awaits what ``partial(TCPServer, app, config, context, state)(stream)``
        # returns (a TCPServer is awaitable): here the guard's handler coroutine.
        hc.h11_max_incomplete_size = min(hc.h11_max_incomplete_size, limits.max_header_bytes)
        return guard.handle(app, hc, context, state, stream)

    run.TCPServer = guarded  # type: ignore[attr-defined]
    log.info("hypercorn CLI: connections guarded (server.max_connections %d, header_timeout_s %g)",
             guard.cap, limits.header_timeout_s)
    return True
