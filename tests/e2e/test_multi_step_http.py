"""Multi-step decode through the real server (hypercorn, sim-next, the demo model computed).

Servers on 127.0.0.1, the same configuration but ``scheduler.batch.multi_step`` (1 and 8, the
latter also driven by the host: ``runtime.host_multi_step``): the same concurrent greedy requests
(streamed and not, some with stop strings, some cut by the client mid-stream) give the same text on
each; a multi-step server ran several device steps a decode batch (``calserve_decode_steps_total``
above ``calserve_batches_total``), and every lane and KV token came back once the cut streams were
gone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from .server import ServerProcess, scrape, serving, total
from .test_load import wait_idle

_CONFIG = """runtime:
  profile: sim-next
  host_multi_step: {host}
scheduler:
  batch:
    profiles: [1, 4, 8, 16]
    multi_step: {steps}
  executor:
    max_inflight: 2
  admission:
    max_expected_wait_ms: null
"""


def _server(home: Path, factory: pytest.TempPathFactory, steps: int, host: bool = False
            ) -> Iterator[ServerProcess]:
    cfg = _CONFIG.format(steps=steps, host="true" if host else "false")
    with serving(home, factory.mktemp(f"ms{steps}{'h' if host else ''}"), cfg) as proc:
        yield proc


@pytest.fixture(scope="module")
def single(calserve_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server(calserve_home, tmp_path_factory, 1)


@pytest.fixture(scope="module")
def multi(calserve_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server(calserve_home, tmp_path_factory, 8)


@pytest.fixture(scope="module")
def hosted(calserve_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server(calserve_home, tmp_path_factory, 8, host=True)


def _body(i: int, stream: bool) -> dict[str, object]:
    body: dict[str, object] = {"model": "qwen3", "prompt": [300 + 7 * i, 301, 302 + i], "max_tokens": 20 + 3 * i,
                               "temperature": 0, "stream": stream, "ignore_eos": i % 3 != 0}
    if i % 4 == 1:
        body["stop"] = ["e", "a "]
    return body


async def _texts(url: str, n: int) -> dict[tuple[int, bool], tuple[str, str]]:
    """Request i streamed and not, all at once: (text, finish_reason) of each."""
    out: dict[tuple[int, bool], tuple[str, str]] = {}

    async def one(client: httpx.AsyncClient, i: int, stream: bool) -> None:
        if not stream:
            r = await client.post("/v1/completions", json=_body(i, False))
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            out[(i, False)] = (ch["text"], ch["finish_reason"])
            return
        text, reason = "", None
        async with client.stream("POST", "/v1/completions", json=_body(i, True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])["choices"][0]
                text += ch["text"]
                if ch.get("finish_reason"):
                    assert reason is None, "two terminal events"
                    reason = ch["finish_reason"]
        assert reason is not None
        out[(i, True)] = (text, reason)

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async with trio.open_nursery() as nursery:
            for i in range(n):
                for stream in (False, True):
                    nursery.start_soon(one, client, i, stream)
    return out


async def _cut(url: str, n: int) -> None:
    """``n`` long streams read to their second event, then closed by the client."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "qwen3", "prompt": "cut", "max_tokens": 400, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def one() -> None:
        s = await trio.open_tcp_stream(host, int(port))
        await s.send_all(req)
        got = b""
        while got.count(b"data: ") < 2:
            chunk = await s.receive_some(4096)
            assert chunk
            got += chunk
        await s.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)


async def test_same_text_with_and_without_multi_step(single: ServerProcess, multi: ServerProcess) -> None:
    await _same_text(single, multi)


async def test_same_text_with_host_driven_multi_step(single: ServerProcess, hosted: ServerProcess) -> None:
    """The device runs one step a job there: the binding feeds the tokens back (ext/host_steps.c);
    the runs the cut streams were in (cancelled) and those prompts arrived during were ended
    early (``calserve_decode_runs_stopped_total``), the text the same."""
    await _same_text(single, hosted, stoppable=True)


async def _same_text(single: ServerProcess, multi: ServerProcess, stoppable: bool = False) -> None:
    before = await trio.to_thread.run_sync(scrape, multi.url)
    a = await _texts(single.url, 12)
    b = await _texts(multi.url, 12)
    assert a == b
    for i in range(12):  # streamed and not agree on each server
        assert a[(i, True)] == a[(i, False)]
    await _cut(multi.url, 16)
    after = await trio.to_thread.run_sync(wait_idle, multi.url)
    steps = total(after, "calserve_decode_steps_total") - total(before, "calserve_decode_steps_total")
    batches = total(after, "calserve_batches_total") - total(before, "calserve_batches_total")
    assert steps > 1.5 * batches, (steps, batches)
    stopped = total(after, "calserve_decode_runs_stopped_total") - total(before, "calserve_decode_runs_stopped_total")
    cut = total(after, "calserve_decode_steps_cut_total") - total(before, "calserve_decode_steps_cut_total")
    if stoppable:
        assert stopped >= 1 and cut >= stopped, (stopped, cut)
    else:  # the device's own runs cannot be cut short
        assert stopped == 0 == cut
    for name in ("calserve_requests_running", "calserve_kv_tokens_reserved", "calserve_executor_inflight_jobs"):
        assert total(after, name) == 0, name
