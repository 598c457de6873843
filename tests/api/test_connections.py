"""``calserve serve``'s connection guard (calserve/api/listener.py) and the app's protocol hygiene
(calserve/api/hygiene.py), over real sockets against an in-process server with short timeouts. The
defaults, and the hypercorn CLI, are checked against real processes in tests/e2e/test_connections.py."""

from __future__ import annotations

import pytest
import trio

from .rawconn import COMPLETION, GET_HEALTH, Conn, guarded_server, metrics, post

pytestmark = pytest.mark.timeout(60)

C = "/v1/completions"


async def test_idle_and_silent_connections_are_closed_after_keep_alive() -> None:
    async with guarded_server(keep_alive_timeout_s=0.5) as port:
        used = await Conn.open(port)
        assert (await used.request(GET_HEALTH)).status == 200
        assert (await used.request(post(C, COMPLETION))).status == 200  # keep-alive reuse works
        silent = await Conn.open(port)
        async with trio.open_nursery() as n:
            times: list[float | None] = []

            async def wait(c: Conn) -> None:
                times.append(await c.closed_within(5.0))

            n.start_soon(wait, used)
            n.start_soon(wait, silent)
        assert all(t is not None and 0.3 < t < 2.0 for t in times), times
        assert (await metrics(port)).get("calserve_http_connections") == 1.0  # the scrape itself


async def test_a_slow_header_sender_is_cut_off_with_408() -> None:
    async with guarded_server(header_timeout_s=0.5, keep_alive_timeout_s=30) as port:
        c = await Conn.open(port)
        t0 = trio.current_time()
        with trio.move_on_after(5):
            try:
                await c.send(b"GET /health HTTP/1.1\r\n")
                while True:  # one header line every 100 ms: never a complete head
                    await trio.sleep(0.1)
                    await c.send(b"X-Slow: 1\r\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        r = await c.response()
        assert r.status == 408 and r.error()["code"] == "request_timeout"
        assert r.headers["connection"] == "close"
        assert await c.closed_within(2.0) is not None
        assert 0.4 < trio.current_time() - t0 < 3.0
        m = await metrics(port)
        assert m['calserve_http_connections_closed_total{reason="header_timeout"}'] == 1.0
        ok = await Conn.open(port)  # a fast client is unaffected
        assert (await ok.request(GET_HEALTH)).status == 200


@pytest.mark.parametrize("path", [C, "/tokenize"])
async def test_a_slow_body_is_a_408_and_the_connection_closed(path: str) -> None:
    """The generation routes (raw ASGI) and the quart routes (BODY_TIMEOUT) answer alike."""
    async with guarded_server(body_timeout_s=0.5) as port:
        c = await Conn.open(port)
        await c.send(post(path, COMPLETION[:10], length=len(COMPLETION)))
        with trio.fail_after(5):
            r = await c.response()
        assert r.status == 408, r
        assert r.error()["code"] == "request_timeout"
        assert await c.closed_within(2.0) is not None


async def test_the_connection_cap_refuses_cleanly_and_recovers() -> None:
    async with guarded_server(max_connections=4, body_timeout_s=30) as port:
        busy = []
        for _ in range(4):  # requests in progress (bodies still arriving): not evictable
            c = await Conn.open(port)
            await c.send(post(C, COMPLETION[:10], length=len(COMPLETION)))
            busy.append(c)
        await trio.sleep(0.2)
        for _ in range(3):
            extra = await Conn.open(port)
            r = await extra.request(GET_HEALTH)
            assert r.status == 503 and r.error()["code"] == "too_many_connections"
            assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
            assert await extra.closed_within(3.0) is not None
        for c in busy:
            await c.aclose()
        await trio.sleep(0.2)
        # Idle keep-alive connections do not lock new clients out: the longest-idle one goes.
        idle = []
        for _ in range(4):
            c = await Conn.open(port)
            assert (await c.request(GET_HEALTH)).status == 200
            idle.append(c)
        await trio.sleep(0.1)
        fresh = await Conn.open(port)
        assert (await fresh.request(post(C, COMPLETION))).status == 200
        assert await idle[0].closed_within(2.0) is not None
        assert [await c.closed_within(0.1) for c in idle[1:]] == [None] * 3
        await fresh.aclose()
        for c in idle[1:]:
            await c.aclose()
        await trio.sleep(0.2)
        m = await metrics(port)
        assert m['calserve_http_connections_closed_total{reason="refused"}'] == 3.0
        assert m['calserve_http_connections_closed_total{reason="evicted"}'] >= 1.0
        assert m["calserve_http_connections"] == 1.0


async def test_a_client_eof_frees_its_connection_at_once() -> None:
    async with guarded_server(keep_alive_timeout_s=30) as port:
        for _ in range(5):
            c = await Conn.open(port)
            assert (await c.request(GET_HEALTH)).status == 200
            await c.aclose()
        await trio.sleep(0.2)
        assert (await metrics(port))["calserve_http_connections"] == 1.0


async def _exchange(port: int, data: bytes) -> tuple[int, dict[str, object], bool]:
    c = await Conn.open(port)
    try:
        await c.send(data)
        with trio.fail_after(5):
            r = await c.response()
        return r.status, r.error(), await c.closed_within(2.0) is not None
    finally:
        await c.aclose()


async def test_protocol_errors_are_openai_shaped_and_close() -> None:
    async with guarded_server(max_header_bytes=4096) as port:
        cases: list[tuple[bytes, int, str]] = [
            (b"GARBAGE\r\n\r\n", 400, "invalid_http"),  # h11's own 400, rewritten
            (b"GET /health HTTP/1.1\r\n\r\n", 400, "invalid_http"),  # no Host
            (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n",
             501, "not_implemented"),
            (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
             b"zz\r\n", 400, "invalid_http"),
            (post(C, COMPLETION, b"Transfer-Encoding: chunked\r\n")[:-len(COMPLETION)]
             + b"%x\r\n%s\r\n0\r\n\r\n" % (len(COMPLETION), COMPLETION), 400,
             "invalid_http_framing"),  # CL + TE: the app's refusal
            (b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n", 431,
             "headers_too_large"),  # complete in one read: the app's check
        ]
        for data, status, code in cases:
            got, err, closed = await _exchange(port, data)
            assert (got, err["code"], closed) == (status, code, True), (data[:60], err)
        # A head still growing past the limit: h11's 431, rewritten.
        c = await Conn.open(port)
        await c.send(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        with trio.move_on_after(5):
            try:
                for _ in range(100):
                    await c.send(b"X-Big: " + b"a" * 1000 + b"\r\n")
                    await trio.sleep(0)
            except trio.BrokenResourceError:
                pass
        r = await c.response()
        assert r.status == 431 and r.error()["code"] == "headers_too_large"
        # Deep JSON: 400 invalid_json naming the field; the connection stays usable.
        ok = await Conn.open(port)
        deep = b'{"prompt":"x","tools":' + b"[" * 100 + b"]" * 100 + b"}"
        r = await ok.request(post(C, deep))
        assert r.status == 400 and r.error()["code"] == "invalid_json", r
        assert r.error()["param"] == "tools"
        r = await ok.request(post(C, b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}"))
        assert r.status == 400 and r.error()["code"] == "invalid_json", r
        assert (await ok.request(post(C, COMPLETION))).status == 200
