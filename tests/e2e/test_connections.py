"""Connection-level defences against real servers on 127.0.0.1 with their DEFAULT settings, over raw
sockets: `hypercorn -k trio calserve:app` (the session ``server``) and `calserve serve`. Short
configured timeouts, the cap's details and every error case are in tests/api/test_connections.py
(in-process `calserve serve`)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from calserve.config import ServerConfig

from .rawhttp import (COMPLETION, GET_HEALTH, assert_openai_error, close_times, connect,
                      exchange, is_closed, parse_response, post, read_response, read_until)
from .server import (ServerProcess, open_fds, serving_calserve, serving_pid, start_calserve_serve,
                     start_hypercorn)

STREAM = b'{"model":"qwen3","prompt":"hi","max_tokens":3,"stream":true}'
DEFAULTS = ServerConfig()


@pytest.fixture(scope="module")
def serve_default(calserve_home: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerProcess]:
    """`calserve serve` with the embedded default config."""
    with serving_calserve(calserve_home, tmp_path_factory.mktemp("serve-default")) as proc:
        yield proc


def _used_connections(port: int) -> list[socket.socket]:
    """Three connections, each after one complete response: a quart route, a JSON generation and
    a streamed one (the three ways a response ends)."""
    socks = [connect(port) for _ in range(3)]
    socks[0].sendall(GET_HEALTH)
    assert read_response(socks[0]).status == 200
    socks[1].sendall(post("/v1/completions", COMPLETION))
    assert read_response(socks[1]).status == 200
    socks[2].sendall(post("/v1/completions", STREAM))
    assert b"data: [DONE]" in read_until(socks[2], b"\r\n0\r\n\r\n")
    return socks


def _slow_header_sender(port: int) -> socket.socket:
    """A connection that has sent part of a request head, and sends nothing more."""
    s = connect(port)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: 1\r\n")
    return s


def _timed_closes(port: int, timeout: float) -> tuple[list[float | None], bytes]:
    """Close times of used, silent and slow-head connections; what the slow one received."""
    socks = [*_used_connections(port), connect(port), _slow_header_sender(port)]
    received: list[bytes] = []
    times = close_times(socks, timeout, received)
    for s in socks:
        s.close()
    return times, received[-1]


@pytest.mark.timeout(60)
def test_idle_and_slow_header_connections_are_closed_hypercorn_cli(server: ServerProcess) -> None:
    """`hypercorn -k trio calserve:app`: hypercorn's own --keep-alive (default 5 s) closes idle
    connections once the app no longer kills its timer (calserve.api.hygiene.shield_final_send);
    an incomplete head is cut by whichever comes first, that timer (it runs until a head is
    complete) or the guard's server.header_timeout_s (5 s, a 408)."""
    assert server.port is not None
    times, slow = _timed_closes(server.port, 15.0)
    assert all(t is not None and 3.5 < t < 8.0 for t in times), times
    if slow:
        assert_openai_error(parse_response(slow), 408, "request_timeout")


@pytest.mark.timeout(90)
def test_idle_and_slow_header_connections_are_closed_calserve_serve(
        serve_default: ServerProcess) -> None:
    """`calserve serve`: the default keep-alive (<= 30 s) and header timeouts, applied."""
    assert DEFAULTS.keep_alive_timeout_s <= 30 and DEFAULTS.header_timeout_s < 30
    assert serve_default.port is not None
    times, slow = _timed_closes(serve_default.port, DEFAULTS.keep_alive_timeout_s + 10)
    *idle, cut = times
    ka, ht = DEFAULTS.keep_alive_timeout_s, DEFAULTS.header_timeout_s
    assert all(t is not None and ka - 1.5 < t < ka + 3.0 for t in idle), times
    assert cut is not None and ht - 1.0 < cut < ht + 3.0, times
    assert_openai_error(parse_response(slow), 408, "request_timeout")


@pytest.mark.timeout(60)
def test_protocol_errors_hypercorn_cli(server: ServerProcess) -> None:
    """What the app itself refuses: CL + TE (400, closed), a head over server.max_header_bytes
    (431), deep JSON (400 invalid_json); the server keeps serving. And hypercorn's own framing
    errors in the OpenAI shape: under the CLI too since the guard is installed in front of its
    connections (api/listener.py install_cli_guard)."""
    assert server.port is not None
    _check_app_level_errors(server.port)
    _check_framing_errors(server.port)


@pytest.mark.timeout(60)
def test_protocol_errors_calserve_serve(serve_default: ServerProcess) -> None:
    """The same under `calserve serve`."""
    port = serve_default.port
    assert port is not None
    _check_app_level_errors(port)
    _check_framing_errors(port)


def _check_framing_errors(port: int) -> None:
    r, closed = exchange(port, b"NOT HTTP\r\n\r\n")
    assert_openai_error(r, 400, "invalid_http")
    assert closed
    s = connect(port)  # a head that keeps growing: h11's limit, answered 431 in the OpenAI shape
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        try:
            for _ in range(64):
                s.sendall(b"X-Big: " + b"a" * 1000 + b"\r\n")
                time.sleep(0.002)
        except OSError:
            pass
        assert_openai_error(read_response(s), 431, "headers_too_large")
    finally:
        s.close()


def _check_app_level_errors(port: int) -> None:
    clte = (post("/v1/completions", b"", b"Transfer-Encoding: chunked\r\n")
            .replace(b"Content-Length: 0", b"Content-Length: %d" % len(COMPLETION))
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(COMPLETION), COMPLETION))
    r, closed = exchange(port, clte)
    assert_openai_error(r, 400, "invalid_http_framing")
    assert closed and r.headers["connection"] == "close"
    big = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n"
    r, closed = exchange(port, big)
    assert_openai_error(r, 431, "headers_too_large")
    assert closed
    deep = b'{"model":"qwen3","prompt":"x","tools":' + b"[" * 2000 + b"]" * 2000 + b"}"
    s = connect(port)
    try:
        s.sendall(post("/v1/completions", deep))
        assert assert_openai_error(read_response(s), 400, "invalid_json")["param"] is None
        s.sendall(post("/v1/completions", deep.replace(b"[" * 2000, b"[" * 80)
                       .replace(b"]" * 2000, b"]" * 80)))
        assert assert_openai_error(read_response(s), 400, "invalid_json")["param"] == "tools"
        s.sendall(post("/v1/completions", COMPLETION))  # the same connection, still usable
        assert read_response(s).status == 200
    finally:
        s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["serve", "cli"])
def test_connection_flood_under_a_256_fd_limit(
        launcher: str, calserve_home: Path, tmp_path: Path) -> None:
    """The probe that locked every new client out (241 idle clients, 256 fds), against
    `calserve serve` and `hypercorn -k trio calserve:app` with default settings: the cap
    (clamped to the fd limit) keeps fds below it; idle connections make room for new ones; busy
    ones get a clean 503; afterwards the server serves as before. (Under the CLI the guard is
    put in front of hypercorn's own connections at start-up: api/listener.py install_cli_guard.)"""
    proc = (start_calserve_serve(calserve_home, cwd=tmp_path, nofile=256) if launcher == "serve"
            else start_hypercorn(calserve_home, cwd=tmp_path, nofile=256))
    socks: list[socket.socket] = []
    try:
        proc.wait_ready()
        port = proc.port
        assert port is not None
        assert "serving at most 192 connections" in proc.stderr, proc.stderr
        pid = serving_pid(proc)
        for _ in range(300):  # idle keep-alive clients, more than the fds allow
            s = connect(port)
            s.sendall(GET_HEALTH)
            assert read_response(s).status == 200
            socks.append(s)
        assert open_fds(pid) < 256
        alive = sum(not is_closed(s, 0.001) for s in socks)
        assert 150 < alive <= 192, alive
        r, _ = exchange(port, GET_HEALTH)
        assert r.status == 200
        for s in socks:
            s.close()
        socks.clear()
        time.sleep(0.3)
        body = post("/v1/completions", COMPLETION)
        for _ in range(192):  # requests in progress (bodies still arriving): not evictable
            s = connect(port)
            s.sendall(body[:-5])
            socks.append(s)
        time.sleep(0.3)
        for _ in range(20):
            r, closed = exchange(port, GET_HEALTH)
            assert_openai_error(r, 503, "too_many_connections")
            assert r.headers["retry-after"] == "1" and closed
        assert open_fds(pid) < 256
        for s in socks:
            s.close()
        socks.clear()
        time.sleep(0.5)
        r, _ = exchange(port, post("/v1/completions", COMPLETION))
        assert r.status == 200
        assert "Too many open files" not in proc.stderr and "Traceback" not in proc.stderr
    finally:
        for s in socks:
            s.close()
        proc.stop()


def _check_close_honoured(port: int) -> None:
    """A request with ``Connection: close`` gets its answer and then the close, whichever route
    answers and however: quart routes (/tokenize, /detokenize: 400 from the schema, a text longer
    than any prompt, invalid JSON; 200; 404) and the generation routes (400, 413)."""
    close = b"Connection: close\r\n"
    cases = [
        (post("/tokenize", b'{"model":"qwen3"}', close), 400, "invalid_value"),
        (post("/tokenize", b'{"model":"qwen3","prompt":"' + b"x" * 500000 + b'"}', close), 400,
         None),
        (post("/tokenize", b'{"model":', close), 400, "invalid_json"),
        (post("/detokenize", b'{"model":"qwen3","tokens":[-1]}', close), 400, None),
        (post("/tokenize", b'{"model":"qwen3","prompt":"hi"}', close), 200, None),
        (b"GET /nope HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 404, "not_found"),
        (post("/v1/completions", b'{"model":"qwen3"}', close), 400, None),
        (post("/v1/completions", b'{"model":"qwen3","prompt":"' + b"x" * 1100000 + b'"}', close),
         413, "request_too_large"),
    ]
    for req, status, code in cases:
        r, closed = exchange(port, req)
        if status == 200:
            assert r.status == 200, r
        else:
            assert_openai_error(r, status, code)
        assert closed and r.headers.get("connection") == "close", (req[:40], r.status)
    s = connect(port)  # the same after a kept-alive request on the connection
    try:
        s.sendall(post("/tokenize", b'{"model":"qwen3","prompt":"hi"}'))
        assert read_response(s).status == 200
        s.sendall(post("/tokenize", b'{"model":"qwen3"}', close))
        assert_openai_error(read_response(s), 400)
        assert is_closed(s, 2.0)
    finally:
        s.close()


@pytest.mark.timeout(60)
def test_connection_close_is_honoured_by_every_route_hypercorn_cli(server: ServerProcess) -> None:
    assert server.port is not None
    _check_close_honoured(server.port)


@pytest.mark.timeout(60)
def test_connection_close_is_honoured_by_every_route_calserve_serve(
        serve_default: ServerProcess) -> None:
    assert serve_default.port is not None
    _check_close_honoured(serve_default.port)
