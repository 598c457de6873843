"""Raw HTTP/1.1 over plain sockets, for tests of what the server does at the connection level (idle
and slow clients, framing errors): no client library that would fix up or hide the bytes."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Sequence
from typing import Any

import msgspec

COMPLETION = b'{"model":"qwen3","prompt":"hi","max_tokens":1}'


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s\r\n" % (path.encode(), len(body), extra)) + body


GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.settimeout(timeout)
    return s


class Response(msgspec.Struct):
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return msgspec.json.decode(self.body)


def _head(buf: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, rest


def parse_response(data: bytes) -> Response:
    """A whole response already received (``data``)."""
    status, headers, rest = _head(data)
    n = int(headers.get("content-length", len(rest)))
    return Response(status, headers, rest[:n])


def read_response(s: socket.socket) -> Response:
    """One response with a Content-Length body (or up to EOF without one)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = s.recv(65536)
        if not d:
            raise ConnectionError(f"EOF before a response head: {buf!r}")
        buf += d
    status, headers, rest = _head(buf)
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            d = s.recv(65536)
            if not d:
                break
            rest += d
        return Response(status, headers, rest[:n])
    while True:  # no length: the body ends at EOF
        d = s.recv(65536)
        if not d:
            return Response(status, headers, rest)
        rest += d


def exchange(port: int, data: bytes) -> tuple[Response, bool]:
    """Send ``data`` on a new connection, read one response; (response, closed after it?)."""
    s = connect(port)
    try:
        s.sendall(data)
        r = read_response(s)
        return r, is_closed(s, 2.0)
    finally:
        s.close()


def is_closed(s: socket.socket, wait: float) -> bool:
    """True when the peer closes ``s`` (EOF or reset) within ``wait`` seconds."""
    s.settimeout(wait)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def close_times(socks: Sequence[socket.socket], timeout: float,
                received: list[bytes] | None = None) -> list[float | None]:
    """For each socket, the seconds until the server closed it (None: still open at ``timeout``);
    ``received`` gets what each one received meanwhile."""
    t0 = time.monotonic()
    out: list[float | None] = [None] * len(socks)
    got = [b""] * len(socks)
    pending = {s.fileno(): i for i, s in enumerate(socks)}
    by_fd = {s.fileno(): s for s in socks}
    while pending and time.monotonic() - t0 < timeout:
        ready, _, _ = select.select(list(pending), [], [], 0.05)
        for fd in ready:
            try:
                d = by_fd[fd].recv(65536)
            except OSError:
                d = b""
            got[pending[fd]] += d
            if not d:
                out[pending.pop(fd)] = time.monotonic() - t0
    if received is not None:
        received[:] = got
    return out


def assert_openai_error(r: Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status == status, (r.status, r.body)
    assert r.headers.get("content-type") == "application/json", r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


def read_until(s: socket.socket, marker: bytes) -> bytes:
    """Bytes up to and including ``marker`` (a streamed response's last chunk: ``0\\r\\n\\r\\n``)."""
    buf = b""
    while marker not in buf:
        d = s.recv(65536)
        if not d:
            raise ConnectionError(f"EOF before {marker!r}: {buf[-200:]!r}")
        buf += d
    return buf
