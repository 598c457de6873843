"""Hostile clients against real servers with the default settings, over real sockets (issue
"Hostile input and hostile clients", classes 2 and 3; README "Per-request limits and slow readers").

- 60 clients that never read a logprob-heavy stream (chat, 20 top logprobs, ~1.4 KB per token on
  the wire) cost bounded memory. Each is found out on its socket once its TCP receive window stops
  reopening and, while others wait for admission, parked server.stream_contended_stall_ms after
  (its running slot goes to the next request; before: only once the kernels' socket buffers,
  ~140 KB, and server.stream_buffer_bytes were full), then cancelled after
  server.stream_parked_cut_ms parked, which frees its lane; its connection is closed 1 s later.
  With one tenant a normal request queues behind them in FIFO order and is still answered
  within 3 s, on later waves too (both launchers); as another tenant (the only config: API
  keys) it gets the next lane. Clients reading a logprob stream beside them, as it comes or in
  bursts every 100 ms, are never cut. A never-reading n = 4 stream is cut like a single one.
- 60 never-read plain-text streams (the socket probe cannot see them behind) take turns with a
  normal request of the same tenant (time-slicing): it is answered within 3 s.
- ~1 MiB prompts (and a 500k-character /tokenize) arriving while a stream runs are refused before
  tokenizing: the stream's largest inter-token gap stays small.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from calserve.api.write_watch import CUT_CLOSE_S

from .server import ServerProcess, scrape, serving, serving_calserve, value

pytestmark = pytest.mark.slow

NEVER_READERS = 60
RSS_GROWTH_LIMIT_MIB = 150
_NEVER_BODY = {"model": "qwen3", "messages": [{"role": "user", "content": "Write forever"}],
               "max_tokens": 2000, "stream": True, "ignore_eos": True, "logprobs": True,
               "top_logprobs": 20}


def _worker_pids(server: ServerProcess) -> list[int]:
    """hypercorn forks its worker: the parent and its children."""
    pid = server.proc.pid
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    return [pid, *map(int, kids)]


def rss_mib(server: ServerProcess) -> float:
    total = 0
    for pid in _worker_pids(server):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _raw_request(path: str, body: dict[str, object], key: str | None, close: bool = False
                 ) -> bytes:
    data = json.dumps(body).encode()
    extra = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    if close:
        extra += b"Connection: close\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + extra + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)


def _busy(m: dict) -> float:
    return (value(m, "calserve_requests_running") + value(m, "calserve_requests_waiting")
            + value(m, "calserve_kv_sequences", state="Active")
            + value(m, "calserve_kv_sequences", state="Reserved"))


def _reading_stream(url: str, headers: dict[str, str]) -> tuple[int, bool, bool]:
    """A client that reads a 20-logprob stream as it comes: (status, ended with [DONE], cut as
    too slow)."""
    tail = b""
    with httpx.stream("POST", url + "/v1/chat/completions", headers=headers, timeout=120,
                      json={**_NEVER_BODY, "max_tokens": 200}) as r:
        for chunk in r.iter_bytes():
            tail = (tail + chunk)[-400:]
    return r.status_code, b"data: [DONE]" in tail, b"client_too_slow" in tail


def _bursty_stream(port: int, period: float = 0.1) -> tuple[int, bool, bool]:
    """A client that reads a 20-logprob stream in bursts: every ``period`` s whatever arrived
    (it is behind for up to that long each time): (status, ended with [DONE], cut as too slow)."""
    body = json.dumps({**_NEVER_BODY, "max_tokens": 200}).encode()
    buf = b""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(_raw_request("/v1/chat/completions", json.loads(body), None))
        s.setblocking(False)
        deadline = time.monotonic() + 120
        eof = False
        while not eof and time.monotonic() < deadline:
            time.sleep(period)
            try:
                while data := s.recv(1 << 20):
                    buf += data
                else:
                    eof = True
            except BlockingIOError:
                pass
            if buf.startswith(b"HTTP/1.1 429") or buf.endswith(b"\r\n0\r\n\r\n"):
                break
    status = int(buf.split(b" ", 2)[1]) if buf else 0
    return status, b"data: [DONE]" in buf[-400:], b"client_too_slow" in buf


async def _open_never_readers(server: ServerProcess, req: bytes,
                              socks: list[trio.SocketStream]) -> None:
    """NEVER_READERS connections that each send ``req`` and never read (into ``socks``, which the
    caller closes), then time for all of them to be submitted and queued."""
    assert server.port is not None
    for _ in range(NEVER_READERS):
        s = await trio.open_tcp_stream("127.0.0.1", server.port)
        socks.append(s)
        await s.send_all(req)
    await trio.sleep(0.3)


async def _never_readers(server: ServerProcess, key: str | None, report: dict[str, float],
                         normal_key: str | None, reader: bool = False,
                         body: dict[str, object] = _NEVER_BODY) -> None:
    """Open NEVER_READERS streams that are never read, then a normal request beside them (and,
    with ``reader``, a client reading a logprob stream as it comes and one reading it in bursts
    every 100 ms); keep the sockets open (unread) until the server is idle again: every one of
    them was answered (429) or cancelled, its lane freed. Fills ``report``."""
    assert server.port is not None
    base = rss_mib(server)
    peak = base
    req = _raw_request("/v1/chat/completions", body, key)
    socks: list[trio.SocketStream] = []
    t0 = time.monotonic()
    try:
        await _open_never_readers(server, req, socks)

        headers = {"Authorization": f"Bearer {normal_key}"} if normal_key else {}

        def normal() -> tuple[int, float]:
            t = time.monotonic()
            r = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=120,
                           json={"model": "qwen3", "max_tokens": 16, "ignore_eos": True,
                                 "messages": [{"role": "user", "content": "Hello"}]})
            if r.status_code == 200:
                assert r.json()["choices"][0]["finish_reason"] == "length", r.text
            return r.status_code, time.monotonic() - t

        async with trio.open_nursery() as n:
            got: list[tuple[int, float]] = []
            read: list[tuple[int, bool, bool]] = []
            bursty: list[tuple[int, bool, bool]] = []

            async def run_normal() -> None:
                got.append(await trio.to_thread.run_sync(normal))

            async def run_reader() -> None:
                read.append(await trio.to_thread.run_sync(_reading_stream, server.url, headers))

            async def run_bursty() -> None:
                port = server.port
                assert port is not None
                bursty.append(await trio.to_thread.run_sync(_bursty_stream, port))

            if reader:
                n.start_soon(run_reader)
                n.start_soon(run_bursty)
            n.start_soon(run_normal)
            # Meanwhile and after: RSS, until every never-reader's request is over.
            with trio.fail_after(90):
                while True:
                    peak = max(peak, rss_mib(server))
                    if (got and len(read) == len(bursty) == int(reader)
                            and not _busy(await trio.to_thread.run_sync(scrape, server.url))):
                        break
                    await trio.sleep(0.1)
        report["normal_status"], report["normal_s"] = got[0]
        if read:
            report["reader_status"], report["reader_done"], report["reader_cut"] = read[0]
            report["bursty_status"], report["bursty_done"], report["bursty_cut"] = bursty[0]
        m = await trio.to_thread.run_sync(scrape, server.url)
        report["cancelled_total"] = value(m, "calserve_requests_finished_total",
                                          outcome="cancelled")
        report["drained_s"] = time.monotonic() - t0
        peak = max(peak, rss_mib(server))
        report["rss_growth_mib"] = peak - base
        report["streams"], report["streams_closed"] = await _closed_by_server(socks)
    finally:
        for s in socks:
            await s.aclose()


async def _closed_by_server(socks: list[trio.SocketStream]) -> tuple[int, int]:
    """(never-readers whose stream was cancelled, how many of those connections the server has
    closed within CUT_CLOSE_S + 15 s of the end of the wave: the slack is for this process reading
    every backlog in turn on a loaded 2-core box), reading what each was sent. The
    429'd ones got a whole response and stay open as keep-alive connections; so does a stream
    that ran to its end (``[DONE]``) before the engine gave up on its client (nobody waiting: the
    backlog bound and its grace)."""
    deadline = trio.current_time() + CUT_CLOSE_S + 15.0
    cut = closed = 0
    for s in socks:
        head = b""
        with trio.move_on_at(deadline):
            while len(head) < 12:
                got = await s.receive_some(65536)
                if not got:
                    break
                head += got
        if not head.startswith(b"HTTP/1.1 200"):
            continue
        tail, eof = head[-64:], False
        with trio.move_on_at(deadline):
            try:
                while got := await s.receive_some(1 << 20):
                    tail = (tail + got)[-64:]
                    if tail.endswith(b"\r\n0\r\n\r\n") and b"data: [DONE]" in tail:
                        break  # it ran to its end: not cut
                else:
                    eof = True
            except trio.BrokenResourceError:  # a reset is a close too
                eof = True
        if not eof and b"data: [DONE]" in tail:
            continue
        cut += 1
        closed += eof
    return cut, closed


@pytest.fixture(scope="module")
def default_server(calserve_home: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerProcess]:
    """The embedded default, in a process of its own (a clean RSS baseline)."""
    with serving(calserve_home, tmp_path_factory.mktemp("hostile")) as proc:
        yield proc


@pytest.fixture(scope="module")
def serve_server(calserve_home: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[ServerProcess]:
    """`calserve serve` with the embedded default (its listener probes each client's socket)."""
    with serving_calserve(calserve_home, tmp_path_factory.mktemp("hostile-serve")) as proc:
        yield proc


@pytest.fixture(scope="module")
def tenant_server(calserve_home: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerProcess]:
    """The defaults plus two tenants' API keys and a 600 s default deadline. Why the deadline:
    48 lane slots held by 2,000-token streams make admission's expected wait (module
    calserve.core.wait_estimate: a slot frees when a stream ends) ~2,000 x 48 x the observed
    lane-step, 47 s at 0.5 ms here but past the 120 s default once CI's load makes it 1.3 ms, and
    then it refuses (429) the normal request and most never-readers (spec 5.2, CI: 7 of 60
    admitted). This test is about the lane a parked never-reader gives back, not that estimate."""
    yaml = ("tenants:\n  crowd:\n    api_keys: [crowd-key]\n"
            "  normal:\n    api_keys: [normal-key]\n"
            "scheduler:\n  admission:\n    deadline_default_ms: 600000\n")
    with serving(calserve_home, tmp_path_factory.mktemp("hostile-tenants"), yaml) as proc:
        yield proc


async def test_never_readers_cost_bounded_memory_and_give_their_lanes_back(
        default_server: ServerProcess) -> None:
    """One tenant (pure defaults): bounded RSS; every never-reader's request ends while its socket
    stays open and unread; the normal request is answered (it queues behind them in FIFO order:
    admission refuses, 429, what it expects cannot start before its deadline; each admitted
    never-reader is cut once ~200 KB are unread, the kernel's socket buffers plus the bound,
    ~0.4 s of generation on its lane: README "Per-request limits and slow readers")."""
    report: dict[str, float] = {}
    await _never_readers(default_server, None, report, None)
    print("never-readers, one tenant:", report)
    assert report["rss_growth_mib"] < RSS_GROWTH_LIMIT_MIB, report
    assert report["normal_status"] in (200, 429), report
    assert report["drained_s"] < 60, report  # 60 x 2,000 tokens unbounded: ~120 s of lanes
    m = scrape(default_server.url)
    assert value(m, "calserve_requests_finished_total", outcome="cancelled") >= 1
    assert "stream cancelled" in default_server.stderr


async def test_a_normal_client_beside_60_never_readers_is_answered_within_3s(
        tenant_server: ServerProcess) -> None:
    """The never-readers as one tenant, the normal client as another: its request takes the next
    lane a never-reader gives back (backlog over the bound while it waits: no grace)."""
    report: dict[str, float] = {}
    await _never_readers(tenant_server, "crowd-key", report, "normal-key")
    print("never-readers, two tenants:", report)
    assert report["normal_status"] == 200, report
    assert report["normal_s"] < 3.0, report
    assert report["rss_growth_mib"] < RSS_GROWTH_LIMIT_MIB, report


WAVES = 3
MAX_WAVES = 6
# The target. Measured 1.0-2.3 s on later waves here (2 cores, load 5-8); each never-reader
# costs its running slot only until it is first seen behind (parked: engine/parking.py), ~27
# logprob tokens the kernel hides, computed on the same CPUs (the software runtime).
NORMAL_LIMIT_S = 3.0


def normal_limit_s() -> float:
    """NORMAL_LIMIT_S, scaled up only on an oversubscribed host (1-minute load average above twice
    the CPUs: the full suite beside other builds measured 3.6 s at load ~8 on 2 cores)."""
    return NORMAL_LIMIT_S * max(1.0, os.getloadavg()[0] / (2 * (os.cpu_count() or 1)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["serve", "cli"])
async def test_one_tenant_a_normal_request_beside_60_never_readers_on_later_waves(
        launcher: str, request: pytest.FixtureRequest) -> None:
    """Pure single-tenant defaults, both launchers, wave after wave of 60 never-reading
    20-logprob streams (1,000 max tokens: admission lets all of them queue once it has seen how
    early such streams end) with a normal request, a client reading a logprob stream and one
    reading it in bursts every 100 ms beside each wave. Every never-reader is found out on its
    socket (its TCP receive window stops reopening) and parked 25 ms after while others wait
    (server.stream_contended_stall_ms): its running slot goes to the next request at once, and
    it is cancelled once parked server.stream_parked_cut_ms (1 s) without catching up. So the
    FIFO queue ahead of the normal request drains within 3 s; before parking, the bursty reader
    was cut (it is behind for up to 100 ms each time) and before the socket probe each
    never-reader held its lane until ~200 KB had filled the kernels' buffers (12.3 s on a second
    wave). Neither reader is ever cut (the bursty one is paused while parked). Each cancelled
    never-reader's connection is closed CUT_CLOSE_S after (it stayed open until the client
    left)."""
    server: ServerProcess = request.getfixturevalue(
        "serve_server" if launcher == "serve" else "default_server")
    body = {**_NEVER_BODY, "max_tokens": 1000}
    reports: list[dict[str, float]] = []
    for wave in range(MAX_WAVES):
        report: dict[str, float] = {}
        await _never_readers(server, None, report, None, reader=True, body=body)
        report["limit_s"] = normal_limit_s()
        print(f"{launcher} wave {wave + 1}:", report)
        reports.append(report)
        if wave + 1 >= WAVES and any(r["normal_status"] == 200 for r in reports[1:]):
            break  # (admission may refuse the normal request, 429, from its own estimate)
    for r in reports:
        assert r["normal_status"] in (200, 429), r  # 429: admission's own estimate
        if r["normal_status"] == 200:
            assert r["normal_s"] < r["limit_s"], reports
        assert r["reader_status"] in (200, 429), r
        if r["reader_status"] == 200:
            assert r["reader_done"] and not r["reader_cut"], r
        assert r["bursty_status"] in (200, 429), r
        if r["bursty_status"] == 200:
            assert r["bursty_done"] and not r["bursty_cut"], r
        assert r["rss_growth_mib"] < RSS_GROWTH_LIMIT_MIB, r
        # A never-reader's connection is closed once its stream was cancelled (it stayed open
        # until the client left), on both launchers.
        assert r["streams"] >= 1 and r["streams_closed"] == r["streams"], r
    assert any(r["normal_status"] == 200 for r in reports[1:]), reports
    cancelled = [r["cancelled_total"] for r in reports]
    assert all(b > a for a, b in zip(cancelled, cancelled[1:])), reports
    assert "server.stream_contended_stall_ms" in server.stderr


async def test_normal_readers_at_saturation_are_never_cut(serve_server: ServerProcess) -> None:
    """Only legitimate clients, more than the running slots (3): 10 reading 20-logprob streams as
    data arrives and 3 reading them in bursts every 100 ms, all at once (requests wait for
    admission the whole time, so every stall rule is armed): every one ends with [DONE], none is
    cut; the bursty ones may be parked meanwhile."""
    server = serve_server
    assert server.port is not None
    port = server.port
    before = value(scrape(server.url), "calserve_requests_finished_total", outcome="cancelled")
    results: list[tuple[int, bool, bool]] = []

    async def reading() -> None:
        results.append(await trio.to_thread.run_sync(_reading_stream, server.url, {}))

    async def in_bursts() -> None:
        results.append(await trio.to_thread.run_sync(_bursty_stream, port))

    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            for _ in range(10):
                n.start_soon(reading)
            for _ in range(3):
                n.start_soon(in_bursts)
    cancelled = value(scrape(server.url), "calserve_requests_finished_total",
                      outcome="cancelled") - before
    print("readers at saturation (status, done, cut):", sorted(results),
          [ln for ln in server.lines[-200:] if "stream cancelled" in ln])
    assert len(results) == 13 and cancelled == 0
    assert all(st == 429 or (done and not cut) for st, done, cut in results), results
    assert sum(st == 200 for st, _, _ in results) >= 10, results


async def test_a_never_reading_n4_stream_is_cut_like_a_single_one(
        serve_server: ServerProcess) -> None:
    """One connection, n = 4 choices, never read: every choice's pump reports the connection's
    socket probe, so (4 choices for 3 running slots: the 4th waits) each is parked and cut within
    ~1 s like a single stream, and the connection is closed CUT_CLOSE_S after; before, n > 1
    streams had no probe and no write watch: cut by the engine-side bound, their connection
    stayed open until the keep-alive timeout (10 s). A normal request afterwards is answered."""
    server = serve_server
    assert server.port is not None
    before = value(scrape(server.url), "calserve_requests_finished_total", outcome="cancelled")
    body = {**_NEVER_BODY, "n": 4, "max_tokens": 2000}
    t0 = time.monotonic()
    s = await trio.open_tcp_stream("127.0.0.1", server.port)
    try:
        await s.send_all(_raw_request("/v1/chat/completions", body, None))
        with trio.fail_after(30):
            while True:
                m = await trio.to_thread.run_sync(scrape, server.url)
                if not _busy(m):
                    break
                await trio.sleep(0.05)
        ended_s = time.monotonic() - t0
        cancelled = value(m, "calserve_requests_finished_total", outcome="cancelled") - before
        # The connection is closed by the server (what it wrote, then EOF or a reset).
        eof = False
        tail = b""
        # (well inside the keep-alive timeout, 10 s, which closes an idle connection anyway)
        with trio.move_on_after(CUT_CLOSE_S + 3):
            try:
                while data := await s.receive_some(1 << 20):
                    tail = (tail + data)[-2000:]
                eof = True
            except trio.BrokenResourceError:
                eof = True
        closed_s = time.monotonic() - t0
    finally:
        await s.aclose()
    print(f"n=4 never-reader: all choices ended after {ended_s:.2f} s, {cancelled} cancelled,"
          f" closed {eof} after {closed_s:.2f} s")
    assert cancelled == 4 and ended_s < 5.0
    assert eof and b"client_too_slow" in tail and b"[DONE]" not in tail
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "qwen3", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200


async def test_megabyte_prompts_do_not_stall_a_running_stream(
        default_server: ServerProcess) -> None:
    """While one stream runs, ~1 MiB prompts (completions, chat, /tokenize of 500k characters)
    arrive: they are refused before tokenizing (400 naming the field) and the stream's largest
    inter-token gap stays under 0.5 s (it was 2.9 s with three such prompts)."""
    server = default_server
    assert server.port is not None
    huge = "a b " * 261000
    hostile = [
        ("/v1/completions", {"model": "qwen3", "prompt": huge, "max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"model": "qwen3", "messages": [
            {"role": "user", "content": huge}]}, "messages"),
        ("/v1/completions", {"model": "qwen3", "prompt": huge, "stream": True}, "prompt"),
        ("/tokenize", {"model": "qwen3", "prompt": "x" * 500000}, "prompt"),
    ]
    gaps: list[float] = []
    answers: list[tuple[int, str | None, float]] = []
    stream_done = trio.Event()
    started = trio.Event()

    async def running_stream() -> None:
        body = {"model": "qwen3", "prompt": "Count", "max_tokens": 1500, "ignore_eos": True,
                "stream": True}
        s = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with s:
            await s.send_all(_raw_request("/v1/completions", body, None))
            last = None
            buf = b""
            while b"[DONE]" not in buf:
                data = await s.receive_some(65536)
                assert data, buf[-200:]
                now = time.monotonic()
                n = data.count(b"data: ")
                if n:
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    if len(gaps) > 20:
                        started.set()
                buf = buf[-64:] + data
        stream_done.set()

    # Pre-encoded, sent and read with trio: the test process does no JSON work meanwhile (its
    # own GIL would otherwise delay the reader of the running stream).
    raw = [(_raw_request(path, body, None, close=True), param) for path, body, param in hostile]

    async def post(req: bytes) -> tuple[int, str | None, float]:
        t = time.monotonic()
        s = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with s:
            await s.send_all(req)
            resp = b""
            while True:  # the head, then content-length bytes of body
                data = await s.receive_some(65536)
                assert data, resp
                resp += data
                head, sep, body = resp.partition(b"\r\n\r\n")
                if sep:
                    clen = [int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                            if k.strip().lower() == b"content-length"]
                    if clen and len(body) >= clen[0]:
                        break
        took = time.monotonic() - t
        status = int(head.split(b" ", 2)[1])
        err = json.loads(body).get("error", {}) if body.startswith(b"{") else {}
        return status, err.get("param"), took

    async with trio.open_nursery() as n:
        n.start_soon(running_stream)
        await started.wait()
        first_gap = len(gaps)
        async with trio.open_nursery() as posts:
            for _ in range(3):
                for req, _param in raw:
                    async def one(req: bytes = req) -> None:
                        answers.append(await post(req))
                    posts.start_soon(one)
        during = len(gaps)
        await stream_done.wait()
    worst = max(gaps[first_gap:during + 1]) if during > first_gap else max(gaps)
    print(f"largest inter-token gap while the prompts arrived: {worst * 1000:.1f} ms;"
          f" answers {sorted(a[:2] for a in answers)}; slowest answer"
          f" {max(a[2] for a in answers) * 1000:.0f} ms")
    assert sorted(a[:2] for a in answers) == sorted(
        (400, param) for _ in range(3) for _p, _b, param in hostile)
    assert worst < 0.5, worst
    assert max(gaps) < 0.5, max(gaps)


_PLAIN_BODY = {"model": "qwen3", "messages": [{"role": "user", "content": "Write forever"}],
               "max_tokens": 1000, "stream": True, "ignore_eos": True}


async def plain_never_readers(server: ServerProcess) -> dict[str, float]:
    """NEVER_READERS plain-text streams (1,000 tokens: each fits the kernels' socket buffers, so
    the socket probe never sees the client behind) that are never read, then a normal request of
    the same tenant beside them; then the never-readers' clients leave and every request ends,
    every lane back. (normal's status, its seconds, seconds until idle)."""
    assert server.port is not None
    req = _raw_request("/v1/chat/completions", _PLAIN_BODY, None)
    socks: list[trio.SocketStream] = []

    def normal() -> tuple[int, float]:
        t = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"model": "qwen3", "max_tokens": 16, "ignore_eos": True,
                             "messages": [{"role": "user", "content": "Hello"}]})
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] == "length", r.text
        return r.status_code, time.monotonic() - t

    try:
        await _open_never_readers(server, req, socks)
        status, secs = await trio.to_thread.run_sync(normal)
    finally:
        for s in socks:
            await s.aclose()
    t0 = time.monotonic()
    with trio.fail_after(90):
        while _busy(await trio.to_thread.run_sync(scrape, server.url)):
            await trio.sleep(0.2)
    return {"normal_status": status, "normal_s": secs, "idle_after_s": time.monotonic() - t0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["serve", "cli"])
async def test_one_tenant_a_normal_request_beside_60_plain_never_readers_within_3s(
        launcher: str, calserve_home: Path, tmp_path: Path) -> None:
    """Single-tenant defaults (a fresh server, both launchers): 60 never-read plain-text streams
    whose whole answer fits the kernels' buffers look like readers (nothing parks or cuts them for
    their client); without time-slicing a normal request queued behind them waited ~20-38 s for
    them to finish, 3 at a time. Now the running ones take turns with it (engine/timeslice.py,
    on by default): it is answered within 3 s, the turns show in calserve_timeslices_total, and
    every request ends once the never-readers' clients leave."""
    launch = serving_calserve(calserve_home, tmp_path) if launcher == "serve" else serving(
        calserve_home, tmp_path)
    with launch as server:
        report = await plain_never_readers(server)
        m = await trio.to_thread.run_sync(scrape, server.url)
    report["limit_s"] = normal_limit_s()
    report["timeslices"] = value(m, "calserve_timeslices_total")
    report["parked_after"] = value(m, "calserve_requests_parked")
    print(f"plain never-readers, one tenant, {launcher}:", report)
    assert report["normal_status"] == 200, report
    assert report["normal_s"] < report["limit_s"], report
    assert report["timeslices"] >= 1 and report["parked_after"] == 0, report

