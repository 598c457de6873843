"""Streamed bodies written as HTTP/1.1 chunks straight to hypercorn's connection
(:mod:`calserve.api.chunked_send`): the bytes on the wire, byte for byte, under ``calserve serve``
(a real hypercorn listener on 127.0.0.1), that the direct path is the one taken, keep-alive after
it, and the fallback to hypercorn's own framing for HTTP/1.0."""

from __future__ import annotations

from typing import Any

import h11
import msgspec
import pytest
import trio

from calserve.api.chunked_send import chunked_send

from .rawconn import Conn, guarded_server, post

STREAM = b'{"model":"qwen3","prompt":"hi","max_tokens":6,"stream":true}'


async def _chunks(c: Conn) -> list[bytes]:
    """A chunked body, strictly parsed (hex size line, exactly that many bytes, CRLF), up to and
    including the last (empty) chunk and its empty trailer."""
    out: list[bytes] = []
    while True:
        while b"\r\n" not in c.buf:
            assert await c._more(), (out, c.buf)
        line, _, c.buf = c.buf.partition(b"\r\n")
        size = int(line, 16)
        while len(c.buf) < size + 2:
            assert await c._more(), (out, c.buf)
        data, tail, c.buf = c.buf[:size], c.buf[size:size + 2], c.buf[size + 2:]
        assert tail == b"\r\n", (line, data, tail)
        if size == 0:
            return out
        out.append(data)


def _events(body: bytes) -> list[Any]:
    assert body.endswith(b"data: [DONE]\n\n"), body[-80:]
    evs = [e for e in body.split(b"\n\n") if e]
    assert evs[-1] == b"data: [DONE]"
    return [msgspec.json.decode(e[len(b"data: "):]) for e in evs[:-1]]


@pytest.fixture
def h11_data(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the non-empty ``h11.Data`` events h11 framed (the path not taken)."""
    sizes: list[int] = []
    orig = h11.Connection.send

    def send(self: h11.Connection, event: Any) -> bytes | None:
        if isinstance(event, h11.Data) and event.data:
            sizes.append(len(event.data))
        return orig(self, event)

    monkeypatch.setattr(h11.Connection, "send", send)
    return sizes


async def test_stream_chunks_go_to_the_connection_directly_and_keep_alive_holds(
        h11_data: list[int]) -> None:
    async with guarded_server() as port:
        h11_data.clear()  # the readiness probe's JSON answer
        c = await Conn.open(port)
        for _ in range(2):  # the second request on the same connection: keep-alive intact
            await c.send(post("/v1/completions", STREAM))
            status, headers = await c.head()
            assert status == 200 and headers["transfer-encoding"] == "chunked", headers
            assert headers["content-type"] == "text/event-stream"
            chunks = await _chunks(c)
            evs = _events(b"".join(chunks))
            assert len(chunks) >= 2  # several events, each its own chunk
            text = "".join(ch["text"] for e in evs for ch in e["choices"])
            assert sum(1 for e in evs for ch in e["choices"] if ch["finish_reason"]) == 1
            assert text  # the fake engine's tokens
            assert c.buf == b""  # nothing past the last chunk
        assert h11_data == []  # every body chunk went the direct way
        r = await c.request(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert r.status == 200


async def test_http10_client_gets_hypercorns_own_framing(h11_data: list[int]) -> None:
    async with guarded_server() as port:
        h11_data.clear()
        c = await Conn.open(port)
        req = post("/v1/completions", STREAM).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        await c.send(req)
        status, headers = await c.head()
        assert status == 200 and "transfer-encoding" not in headers, headers
        with trio.fail_after(10):
            while await c._more():  # HTTP/1.0 without a length: the body ends with the connection
                pass
        evs = _events(c.buf)
        assert sum(1 for e in evs for ch in e["choices"] if ch["finish_reason"]) == 1
        assert h11_data  # h11 framed them (no chunking in HTTP/1.0)


async def test_anything_but_hypercorns_h11_stream_keeps_its_send() -> None:
    async def send(message: dict[str, Any]) -> None:
        pass

    class Other:
        async def app_send(self, message: dict[str, Any]) -> None:
            pass

    assert chunked_send(send) is send
    bound = Other().app_send
    assert chunked_send(bound) is bound


async def test_what_the_socket_does_not_take_goes_through_hypercorn_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket takes part of a chunk or none of it (as with a full send buffer: here every third
    write takes half, every seventh none, and the client's receive buffer is tiny and unread for a
    while): hypercorn's write sends the rest; the body read at the end is every chunk, whole and
    in order."""
    import os
    import socket as stdsocket

    writes: list[tuple[int, int]] = []  # (chunk frame bytes, bytes the socket took at once)
    real_write = os.write

    def partial_write(fd: int, data: bytes) -> int:
        k = len(writes)
        if k % 7 == 6:
            writes.append((len(data), 0))
            raise BlockingIOError
        n = real_write(fd, data[:len(data) // 2] if k % 3 == 2 else data)
        writes.append((len(data), n))
        return n

    monkeypatch.setattr("calserve.api.chunked_send.os.write", partial_write)
    body = b'{"model":"qwen3","prompt":"hi","max_tokens":300,"stream":true,"logprobs":5}'
    async with guarded_server() as port:
        sock = trio.socket.socket(stdsocket.AF_INET, stdsocket.SOCK_STREAM)
        sock.setsockopt(stdsocket.SOL_SOCKET, stdsocket.SO_RCVBUF, 2048)
        await sock.connect(("127.0.0.1", port))
        c = Conn(trio.SocketStream(sock))
        await c.send(post("/v1/completions", body))
        await trio.sleep(0.3)  # not reading: the server's writes fill the kernels' buffers
        status, headers = await c.head()
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        with trio.fail_after(30):
            chunks = await _chunks(c)
        evs = _events(b"".join(chunks))
        finals = [ch for e in evs for ch in e["choices"] if ch["finish_reason"]]
        assert len(finals) == 1 and finals[0]["finish_reason"] == "length", finals  # nothing cut
        assert sum(len(ch["logprobs"]["tokens"]) for e in evs for ch in e["choices"]
                   if ch.get("logprobs")) == 300  # every token's chunk arrived
        await c.aclose()
    assert any(n == size for size, n in writes)  # whole chunks straight to the socket
    assert any(0 < n < size for size, n in writes) and any(n == 0 for _, n in writes)
