"""Connection-level defences against real servers on 127.0.0.1, with raw sockets: idle keep-alive
connections are closed, under both launchers with their default settings."""

from __future__ import annotations

import socket

import pytest

from .rawhttp import COMPLETION, GET_HEALTH, close_times, connect, post, read_response, read_until
from .server import ServerProcess

STREAM = b'{"model":"qwen3","prompt":"hi","max_tokens":3,"stream":true}'


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


@pytest.mark.timeout(60)
def test_idle_keep_alive_connections_are_closed_hypercorn_cli(server: ServerProcess) -> None:
    """`hypercorn -k trio calserve:app`: hypercorn's own --keep-alive default (5 s) applies once
    the app no longer kills the timer (calserve.api.hygiene.shield_final_send)."""
    assert server.port is not None
    socks = _used_connections(server.port)
    silent = connect(server.port)  # never sends a byte: the same timer
    times = close_times([*socks, silent], 15.0)
    for s in [*socks, silent]:
        s.close()
    assert all(t is not None and 3.5 < t < 8.0 for t in times), times
