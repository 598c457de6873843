"""calserve.api.socket_probe over real loopback TCP sockets (Linux): a peer that never reads shows
up as unread bytes once its receive window stops reopening, one that reads does not; and the probe
is found behind hypercorn's ASGI ``send`` shape."""

from __future__ import annotations

import socket
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from calserve.api.socket_probe import SocketProbe, probe_from_send

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO is Linux's")
CHUNK = b"x" * 1400  # about one 20-logprob token on the wire


def _pair() -> tuple[socket.socket, socket.socket]:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()
    client = socket.create_connection(ls.getsockname())
    server, _ = ls.accept()
    ls.close()
    server.setblocking(False)
    return server, client


def _push(server: socket.socket, probe: SocketProbe, n: int, t0: float
          ) -> list[tuple[int, float | None]]:
    """Write ``n`` chunks a millisecond apart (what the kernel takes), sampling before each."""
    out = []
    for i in range(n):
        out.append(probe.sample(t0 + i * 0.001))
        try:
            server.send(CHUNK)
        except BlockingIOError:
            pass
        time.sleep(0.001)
    return out


def test_a_never_reader_shows_unread_bytes_and_a_stall() -> None:
    server, client = _pair()
    try:
        probe = SocketProbe(server, stall_s=0.05)
        samples = _push(server, probe, 250, 0.0)  # 350 KB offered, 0.25 s of fake time
        unread, stalled = samples[-1]
        assert unread >= 64 * 1024, samples[::25]
        assert stalled is not None and stalled >= 0.05, samples[::25]
        # Once stalled, it stays stalled (nothing is ever read).
        first = next(i for i, (_, s) in enumerate(samples) if s is not None)
        assert all(s is not None for _, s in samples[first:]), samples[first:]
    finally:
        server.close()
        client.close()


def test_a_reader_shows_nothing_unread() -> None:
    """A client that has read what it got: nothing unread, never stalled (sampled once each
    write has been read, as the pump samples before its next write)."""
    server, client = _pair()
    got = [0]
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                d = client.recv(1 << 20)
            except OSError:
                return
            if not d:
                return
            got[0] += len(d)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        probe = SocketProbe(server, stall_s=0.05)
        sent = 0
        samples = []
        for i in range(200):
            server.setblocking(True)
            server.sendall(CHUNK)
            sent += len(CHUNK)
            deadline = time.monotonic() + 5
            while got[0] < sent and time.monotonic() < deadline:
                time.sleep(0.0005)
            assert got[0] == sent
            samples.append(probe.sample(i * 0.01))  # 10 ms of fake time per write
        assert max(u for u, _ in samples) < 4096, samples[::20]
        assert all(s is None for _, s in samples), samples
    finally:
        stop.set()
        server.close()
        client.close()
        t.join(2)


def test_coalesced_writes_show_a_never_reader_within_a_few_writes() -> None:
    """Writes of ~20 KB (14 coalesced logprob tokens, as a busy server sends them, TCP_NODELAY
    as hypercorn's): the receiver's window first grows (65 -> 106 KB here), then its right edge
    stops moving; the probe sees the client behind at the first write its window did not make
    room for, long before the kernel's buffers are full (~200 KB)."""
    server, client = _pair()
    server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        probe = SocketProbe(server, stall_s=0.005)
        big = b"x" * 20000
        sent, first = 0, None
        for i in range(12):
            _, stalled = probe.sample(i * 0.02)
            if stalled is not None and first is None:
                first = sent
            try:
                sent += server.send(big)
            except BlockingIOError:
                pass
            time.sleep(0.02)  # a write per 20 ms (the receiver's delayed ACKs come meanwhile)
        assert first is not None and first <= 100000, first
    finally:
        server.close()
        client.close()


def test_a_reader_in_bursts_is_seen_caught_up_after_each_burst() -> None:
    """A client that reads everything every 100 ms: behind in between (a never-reader looks the
    same for that long), caught up at the first sample after each read: what resumes a parked
    stream (the watcher's comment makes the client acknowledge with its window open again)."""
    server, client = _pair()
    server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client.setblocking(False)
    try:
        probe = SocketProbe(server, stall_s=0.005)
        t = 0.0
        for burst in range(8):
            for _ in range(15):  # 15 writes of 1.4 KB before the client reads
                probe.sample(t)
                server.send(CHUNK)
                t += 0.005
                time.sleep(0.001)
            while True:  # the client reads it all
                try:
                    if not client.recv(1 << 20):
                        break
                except BlockingIOError:
                    break
            server.send(b":")  # the watcher's comment
            time.sleep(0.005)
            assert probe.sample(t)[1] is None, burst
    finally:
        server.close()
        client.close()


def test_no_estimate_without_tcp() -> None:
    a, b = socket.socketpair()
    try:
        assert SocketProbe(a, 0.05).sample(1.0) == (0, None)
    finally:
        a.close()
        b.close()
    server, client = _pair()
    server.close()  # closed: never raises, knows nothing
    client.close()
    assert SocketProbe(server, 0.05).sample(1.0) == (0, None)


def test_found_behind_hypercorns_send() -> None:
    """HTTPStream.app_send -> .send (H11Protocol.stream_send) -> .send (TCPServer.protocol_send)
    -> .stream.socket; through a functools.wraps-style wrapper; anything else: None."""
    server, client = _pair()
    try:
        tcp = SimpleNamespace(stream=SimpleNamespace(socket=server))
        h11 = SimpleNamespace(send=SimpleNamespace(__self__=tcp))
        stream = SimpleNamespace(send=SimpleNamespace(__self__=h11))
        app_send = SimpleNamespace(__self__=stream)
        wrapper = SimpleNamespace(__wrapped__=app_send)
        probe = probe_from_send(wrapper, 0.05)
        assert probe is not None and probe.stall_s == 0.05
        assert probe.sample(0.0) == (0, None)
        assert probe_from_send(SimpleNamespace(__self__=SimpleNamespace()), 0.05) is None
        assert probe_from_send(print, 0.05) is None
    finally:
        server.close()
        client.close()
