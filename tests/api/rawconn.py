"""In-process ``calserve serve`` (``serve_app`` on the fake engine, port 0) and a raw HTTP/1.1 client
on trio sockets: what the connection guard does is only visible byte for byte."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import msgspec
import trio

from calserve.api.serve import build_parser, serve_app

from .conftest import make_config
from .fake_engine import fake_factory

COMPLETION = b'{"model":"qwen3","prompt":"hi","max_tokens":1}'
GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


def post(path: str, body: bytes, extra: bytes = b"", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s\r\n" % (path.encode(), n, extra)) + body


async def wait_ready(url: str, timeout: float = 30.0) -> None:
    """Poll ``GET /ready`` until 200, as a supervisor does."""
    import httpx

    with trio.fail_after(timeout):
        async with httpx.AsyncClient(base_url=url) as client:
            while (await client.get("/ready")).status_code != 200:
                await trio.sleep(0.01)


@contextlib.asynccontextmanager
async def guarded_server(**server: Any) -> AsyncIterator[int]:
    """``calserve serve`` in this trio run with ``server.`` overrides; yields its port."""
    cfg = make_config(server={"port": 0, "host": "127.0.0.1", **server})
    args = build_parser().parse_args(["--log-level", "warning"])
    opened = len(_OPEN)
    async with trio.open_nursery() as n:
        binds = await n.start(partial(serve_app, args, cfg,
                                      engine_factory=fake_factory(token_delay=0.001)))
        try:
            await wait_ready(binds[0])  # listen first: the engine opens after the port
            yield int(binds[0].rsplit(":", 1)[1])
        finally:
            while len(_OPEN) > opened:  # the test's client sockets
                await _OPEN.pop().aclose()
            n.cancel_scope.cancel()


_OPEN: list[Conn] = []


class Response(msgspec.Struct):
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        """The OpenAI error object (asserting the shape)."""
        assert self.headers.get("content-type") == "application/json", self.headers
        err = msgspec.json.decode(self.body)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert "Traceback" not in err["message"]
        return dict(err)


class Conn:
    """One client connection; ``buf`` keeps bytes read past a response."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    @classmethod
    async def open(cls, port: int) -> Conn:
        c = cls(await trio.open_tcp_stream("127.0.0.1", port))
        _OPEN.append(c)
        return c

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _more(self) -> bool:
        try:
            d = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            d = b""
        self.buf += d
        return bool(d)

    async def head(self) -> tuple[int, dict[str, str]]:
        """The next response head: its status and headers (names lower-cased); the body, if any,
        stays in ``buf``."""
        while b"\r\n\r\n" not in self.buf:
            if not await self._more():
                raise ConnectionError(f"EOF before a response head: {self.buf!r}")
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (ln.partition(":") for ln in lines[1:])}
        return int(lines[0].split(" ")[1]), headers

    async def response(self) -> Response:
        status, headers = await self.head()
        n = int(headers.get("content-length", "0"))
        while len(self.buf) < n and await self._more():
            pass
        body, self.buf = self.buf[:n], self.buf[n:]
        return Response(status, headers, body)

    async def request(self, data: bytes) -> Response:
        await self.send(data)
        return await self.response()

    async def closed_within(self, seconds: float) -> float | None:
        """Seconds until the server closes (EOF/reset), None if still open after ``seconds``."""
        t0 = trio.current_time()
        with trio.move_on_after(seconds):
            while await self._more():
                pass
            return trio.current_time() - t0
        return None

    async def aclose(self) -> None:
        await self.stream.aclose()


async def metrics(port: int) -> dict[str, float]:
    """The connection guard's samples from ``/metrics`` (``name{labels}`` -> value)."""
    c = await Conn.open(port)
    try:
        r = await c.request(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    finally:
        await c.aclose()
    out: dict[str, float] = {}
    for line in r.body.decode().splitlines():
        if line.startswith("calserve_http_connections"):
            name, _, v = line.rpartition(" ")
            out[name] = float(v)
    return out
