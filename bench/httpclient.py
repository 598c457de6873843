"""A deliberately tiny HTTP/1.1 client on trio sockets, with an SSE event splitter.

Why not httpx: on 2 cores the load generator competes with the server for CPU, and every microsecond
the client spends per streamed token is stolen from the measured system. This client does one
``receive_some`` per network read, splits SSE events with ``bytes.find`` and timestamps each event at
the read that completed it, which is exactly what TTFT/ITL need. It speaks only what benchmarks use:
``POST``/``GET`` with a JSON body, ``Content-Length`` or ``chunked`` responses, keep-alive reuse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Final

import trio

__all__ = ["HttpError", "Response", "Connection", "ConnectionPool", "iter_sse"]

_READ: Final = 65536
_MAX_HEADER: Final = 64 * 1024


class HttpError(Exception):
    """The peer broke the HTTP protocol or closed the connection early."""


@dataclasses.dataclass
class Response:
    status: int
    headers: dict[str, str]
    conn: Connection
    # Invariant: exactly one of (chunked, length is not None, until_close) describes the body framing.
    chunked: bool
    length: int | None
    keep_alive: bool

    async def body_parts(self) -> AsyncGenerator[bytes, None]:
        """Yield body bytes as they arrive (de-chunked); marks the connection reusable at the end."""
        c = self.conn
        if self.chunked:
            while True:
                line = await c.read_line()
                size_s = line.split(b";", 1)[0].strip()
                try:
                    size = int(size_s, 16)
                except ValueError:
                    raise HttpError(f"bad chunk size {size_s[:20]!r}") from None
                if size == 0:
                    while (await c.read_line()) != b"":  # trailers
                        pass
                    break
                remaining = size
                while remaining:
                    part = await c.read_some(remaining)
                    remaining -= len(part)
                    yield part
                if (await c.read_line()) != b"":
                    raise HttpError("chunk not followed by CRLF")
        elif self.length is not None:
            remaining = self.length
            while remaining:
                part = await c.read_some(remaining)
                remaining -= len(part)
                yield part
        else:
            self.keep_alive = False
            while True:
                try:
                    part = await c.read_some(_READ)
                except HttpError:
                    break
                yield part
        c.reusable = self.keep_alive

    async def read_all(self) -> bytes:
        parts = [p async for p in self.body_parts()]
        return b"".join(parts)


class Connection:
    """One TCP connection; reads are buffered so header/chunk framing can be parsed incrementally."""

    def __init__(self, stream: trio.SocketStream, host: str, port: int) -> None:
        self.stream = stream
        self.host = host
        self.port = port
        self._buf = bytearray()
        self.reusable = False
        self.used = 0  # requests sent on this connection
        # Monotonic time of the last network read that returned data (for event timestamps).
        self.last_read_at = 0.0

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        stream = await trio.open_tcp_stream(host, port)
        return cls(stream, host, port)

    async def _fill(self) -> None:
        data = await self.stream.receive_some(_READ)
        if not data:
            raise HttpError("connection closed by peer")
        self.last_read_at = trio.current_time()
        self._buf += data

    async def read_line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[: i + 2]
                return line
            if len(self._buf) > _MAX_HEADER:
                raise HttpError("line too long")
            await self._fill()

    async def read_some(self, limit: int) -> bytes:
        if not self._buf:
            await self._fill()
        n = min(limit, len(self._buf))
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> Response:
        self.reusable = False
        self.used += 1
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        await self.stream.send_all(head + (body or b""))
        status_line = await self.read_line()
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HttpError(f"bad status line {status_line[:60]!r}")
        status = int(parts[1])
        hdrs: dict[str, str] = {}
        while True:
            line = await self.read_line()
            if not line:
                break
            k, _, v = line.partition(b":")
            hdrs[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
        chunked = "chunked" in hdrs.get("transfer-encoding", "").lower()
        length = None if chunked or "content-length" not in hdrs else int(hdrs["content-length"])
        keep_alive = hdrs.get("connection", "").lower() != "close" and (chunked or length is not None)
        return Response(status, hdrs, self, chunked, length, keep_alive)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


class ConnectionPool:
    """Keep-alive connections to one host. A reused connection that fails before any response byte is
    retried once on a fresh connection (the server may have closed it while idle)."""

    def __init__(self, host: str, port: int, max_idle: int = 256) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        self._idle: list[Connection] = []
        self.opened = 0

    async def acquire(self) -> tuple[Connection, bool]:
        if self._idle:
            return self._idle.pop(), True
        self.opened += 1
        return await Connection.open(self.host, self.port), False

    async def release(self, conn: Connection) -> None:
        if conn.reusable and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            await conn.aclose()

    async def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> Response:
        """Send a request; the caller must consume the body and then ``release(resp.conn)``."""
        conn, reused = await self.acquire()
        try:
            return await conn.request(method, path, body, headers)
        except (HttpError, trio.BrokenResourceError, OSError):
            await conn.aclose()
            if not reused:
                raise
        conn = await Connection.open(self.host, self.port)
        self.opened += 1
        return await conn.request(method, path, body, headers)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for c in idle:
            await c.aclose()


async def iter_sse(resp: Response) -> AsyncGenerator[tuple[float, bytes], None]:
    """Yield ``(arrival_time, data)`` for each SSE event's ``data:`` payload (multi-line joined).

    The arrival time is the monotonic time of the network read that completed the event."""
    buf = b""
    async with aclosing(resp.body_parts()) as parts:
        async for part in parts:
            buf += part
            t = resp.conn.last_read_at
            while True:
                i = buf.find(b"\n\n")
                j = buf.find(b"\r\n\r\n")
                if i < 0 and j < 0:
                    break
                if j >= 0 and (i < 0 or j < i):
                    block, buf = buf[:j], buf[j + 4 :]
                else:
                    block, buf = buf[:i], buf[i + 2 :]
                data = [ln[5:].lstrip() for ln in block.splitlines() if ln.startswith(b"data:")]
                if data:
                    yield t, b"\n".join(data)
