"""The generation routes (calserve.api.asgi, their one implementation) answer exactly as the quart
routes did, mounted or not.

The quart generation routes were the reference: their answers to CASES are recorded in
``generation_golden.json`` and every case is compared byte for byte (ids and timestamps normalised),
sent plainly and to the app mounted under a ``root_path`` (which quart used to serve). Also: refusals
before the body is read, disconnects in every phase, one response count per request, nothing built
for a request the engine refuses, and what still goes to quart.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from calserve.api import asgi

from .conftest import Harness, make_config
from .sse_util import send_and_read

C = "/v1/completions"
CHAT = "/v1/chat/completions"
ROOT = "/mnt"  # the app mounted under a root_path (quart's routing rules apply to the path)

_IDS = re.compile(rb'"id":"(cmpl|chatcmpl)-[0-9a-f]{24}"')
_CREATED = re.compile(rb'"created":\d+')
_RID = re.compile(rb',"request_id":"[^"]*"')  # not in the recorded answers (test_request_ids)


def _norm(raw: bytes) -> bytes:
    return _RID.sub(b"", _CREATED.sub(b'"created":0', _IDS.sub(rb'"id":"\1-x"', raw)))


async def _call(h: Harness, path: str, body: bytes, *, mounted: bool,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """POST ``body`` (read while it is produced) to the app, or to it mounted under ROOT."""
    conn = h.client.request(path=(ROOT + path) if mounted else path, method="POST",
                            root_path=ROOT if mounted else "",
                            headers={"content-type": "application/json",
                                     "x-request-id": "fast-path-1", **(headers or {})})
    c, raw = await send_and_read(conn, body)
    assert c.status_code is not None and c.headers is not None
    assert c.headers["x-request-id"] == "fast-path-1"
    keep = {k.lower(): v for k, v in c.headers.items()
            if k.lower() in ("content-type", "retry-after", "cache-control", "x-accel-buffering")}
    return c.status_code, keep, raw


CASES: list[tuple[str, Any]] = [
    (C, {"prompt": "hello", "max_tokens": 5}),
    (C, {"prompt": "hello", "max_tokens": 5, "stream": True}),
    (C, {"prompt": [104, 105], "max_tokens": 4, "stream": True, "echo": True, "seed": 3}),
    (C, {"prompt": "hi", "max_tokens": 3, "stream": True, "logprobs": 2,
         "stream_options": {"include_usage": True}}),
    (C, {"prompt": "hi", "max_tokens": 3, "logprobs": 1}),
    (C, {"prompt": "hi", "max_tokens": 6, "stop": ["q"], "stream": True}),
    (CHAT, {"messages": [{"role": "user", "content": "hey"}], "max_tokens": 4}),
    (CHAT, {"messages": [{"role": "user", "content": "hey"}], "max_tokens": 4, "stream": True,
            "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}}),
    # refusals: 400 (field named), 404 model, 400 invalid JSON, 400 unsupported
    (C, {"prompt": "hi", "max_tokens": 0}),
    (C, {"prompt": "hi", "model": "nope"}),
    (C, b'{"prompt": '),
    (CHAT, {"messages": [{"role": "function", "content": "x"}]}),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 9, "stream": True}),
]


@pytest.mark.parametrize("path,body", CASES)
async def test_mounted_answers_exactly_like_unmounted(harness_factory: Any,
                                                     autojump_clock: Any, path: str,
                                                     body: Any) -> None:
    data = body if isinstance(body, bytes) else msgspec.json.encode(body)
    answers = []
    for mounted in (False, True):
        async with harness_factory(token_delay=0.01, coalesce=True) as h:
            status, headers, raw = await _call(h, path, data, mounted=mounted)
            text = await (await h.client.get("/metrics")).get_data(as_text=True)
            counted = re.findall(r'calserve_http_responses_total\{outcome="(\d+)"\} 1\.0', text)
            answers.append((status, headers, _norm(raw), counted))
            assert h.engine.active == {}
    assert answers[0] == answers[1]
    assert answers[0][3] == [str(answers[0][0])]  # exactly one response counted


#: The answers to CASES as the quart routes (the reference implementation then) gave them, recorded
#: before the generation routes became one raw-ASGI path: status, the headers above, the body
#: (ids and timestamps normalised) and the response counted. Both engine handle kinds: one that
#: hands everything queued at once (``receive_many``) and one that hands one event per read.
GOLDEN = json.loads((Path(__file__).parent / "generation_golden.json").read_text())


@pytest.mark.parametrize("coalesce", [True, False], ids=["receive_many", "one_by_one"])
@pytest.mark.parametrize("case", range(len(CASES)))
async def test_answers_are_the_recorded_reference(harness_factory: Any, autojump_clock: Any,
                                                  case: int, coalesce: bool) -> None:
    path, body = CASES[case]
    data = body if isinstance(body, bytes) else msgspec.json.encode(body)
    want = GOLDEN["receive_many" if coalesce else "one_by_one"][case]
    for mounted in (False, True):
        async with harness_factory(token_delay=0.01, coalesce=coalesce) as h:
            status, headers, raw = await _call(h, path, data, mounted=mounted)
            text = await (await h.client.get("/metrics")).get_data(as_text=True)
            counted = re.findall(r'calserve_http_responses_total\{outcome="(\d+)"\} 1\.0', text)
            got = {"status": status, "headers": headers, "raw": _norm(raw).decode(),
                   "counted": counted}
            assert got == want, (mounted, got)
            assert h.engine.active == {}


async def test_quota_refusal_is_the_same_429_mounted_or_not(harness_factory: Any) -> None:
    answers = []
    for mounted in (False, True):
        async with harness_factory(max_running=0) as h:
            answers.append(await _call(h, C, b'{"prompt": "x", "stream": true}', mounted=mounted))
    assert answers[0] == answers[1]
    status, headers, raw = answers[0]
    assert status == 429 and headers["retry-after"] == "2"
    assert msgspec.json.decode(raw)["error"]["code"] == "rate_limit_exceeded"


async def test_refused_request_builds_no_stream_objects(harness_factory: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 429 is decided before anything per-request is built (formatter, encoder, lease, pump)."""
    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("built for a refused request")

    async with harness_factory(max_running=0) as h:
        for name in ("LogprobFormatter", "StreamEncoder", "pump_stream", "run_json",
                     "RequestLease"):
            monkeypatch.setattr(asgi, name, boom)
        for stream in (True, False):
            status, _, _ = await _call(h, C, msgspec.json.encode(
                {"prompt": "x", "stream": stream, "logprobs": 2}), mounted=False)
            assert status == 429


async def test_auth_is_checked_before_the_body_is_read(harness_factory: Any) -> None:
    cfg = make_config(tenants={"a": {"api_keys": ["ka"]}}, server={"max_body_bytes": 100})
    async with harness_factory(cfg) as h:
        big = msgspec.json.encode({"prompt": "x" * 500})
        for mounted in (False, True):
            status, _, raw = await _call(h, C, big, mounted=mounted)
            assert status == 401, raw
            status, _, raw = await _call(h, C, big, mounted=mounted,
                                         headers={"Authorization": "Bearer ka"})
            assert status == 413 and b"max_body_bytes (100)" in raw
            status, _, _ = await _call(h, C, b'{"prompt": "x", "max_tokens": 2}', mounted=mounted,
                                       headers={"Authorization": "Bearer ka"})
            assert status == 200
        assert [r.tenant for r in h.engine.submitted] == ["a", "a"]


async def test_declared_length_over_limit_is_413_before_reading(harness_factory: Any) -> None:
    async with harness_factory(make_config(server={"max_body_bytes": 50})) as h:
        conn = h.client.request(path=C, method="POST", headers={
            "content-type": "application/json", "content-length": "100000"})
        async with conn as c:
            # nothing sent yet: the answer cannot depend on the bytes
            raw = await c.receive()
            await c.send(b"x" * 10)
            await c.send_complete()
        assert c.status_code == 413
        assert msgspec.json.decode(raw)["error"]["code"] == "request_too_large"
        assert h.engine.submitted == []


async def test_client_leaving_during_the_body_gets_nothing_submitted(
        harness_factory: Any, autojump_clock: Any) -> None:
    async with harness_factory() as h:
        conn = h.client.request(path=C, method="POST",
                                headers={"content-type": "application/json"})
        async with conn as c:
            await c.send(b'{"prompt": "x"')
            await c.disconnect()
            c._client_send.close()  # type: ignore[attr-defined]  # see test_stream._disconnect
        await trio.sleep(0.01)
        assert h.engine.submitted == []
        assert c.status_code is None  # no answer to a client that left


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [C, "/v1/responses"])
async def test_disconnect_cancels_json_and_stream_at_once(harness_factory: Any,
                                                          autojump_clock: Any,
                                                          stream: bool, path: str) -> None:
    body = ({"prompt": "x", "max_tokens": 400} if path == C
            else {"input": "x", "max_output_tokens": 400})
    async with harness_factory(token_delay=1.0) as h:
        conn = h.client.request(path=path, method="POST",
                                headers={"content-type": "application/json"})
        async with conn as c:
            await c.send(msgspec.json.encode({**body, "stream": stream}))
            await c.send_complete()
            await trio.sleep(3.5)  # a few tokens in
            assert len(h.engine.active) == 1
            rid = next(iter(h.engine.active))
            t0 = trio.current_time()
            await c.disconnect()
            c._client_send.close()  # type: ignore[attr-defined]
        await trio.sleep(0.01)
        assert rid in h.engine.cancelled_ids and h.engine.active == {}
        assert trio.current_time() - t0 < 0.5
        text = await (await h.client.get("/metrics")).get_data(as_text=True)
        assert "calserve_streams_active 0.0" in text


async def test_other_methods_and_paths_still_go_to_quart(h: Harness) -> None:
    assert (await h.client.get(C)).status_code == 405
    assert (await h.client.post(C + "/")).status_code == 404
    assert asgi.fast_route({"method": "POST", "path": C, "root_path": ""}) == "completion"
    assert asgi.fast_route({"method": "POST", "path": CHAT}) == "chat"
    assert asgi.fast_route({"method": "GET", "path": C}) is None
    assert asgi.fast_route({"method": "POST", "path": C, "root_path": "/x"}) is None


async def test_mounted_paths_are_routed_as_quart_routes_them(h: Harness) -> None:
    """Under a ``root_path`` the generation routes are found where quart finds routes: the path
    less the prefix; outside the prefix there is no route; other methods still get quart's 405."""
    fr = asgi.fast_route
    assert fr({"method": "POST", "path": "/x" + C, "root_path": "/x"}) == "completion"
    assert fr({"method": "POST", "path": "/x/y" + CHAT, "root_path": "/x/y"}) == "chat"
    assert fr({"method": "POST", "path": "/x", "root_path": "/x"}) is None
    assert fr({"method": "POST", "path": "/xx" + C, "root_path": "/x/"}) is None
    assert fr({"method": "POST", "path": "http://h:1" + C}) == "completion"  # absolute form
    assert fr({"method": "POST", "path": "http://h:1/x" + C, "root_path": "/x"}) == "completion"
    # werkzeug folds leading slashes (what quart then routes), but not inner ones (a 308)
    assert fr({"method": "POST", "path": "//" + C}) == "completion"
    assert fr({"method": "POST", "path": "/x//" + C, "root_path": "/x"}) == "completion"
    assert fr({"method": "POST", "path": "/x" + CHAT, "root_path": "/x/"}) == "chat"
    assert fr({"method": "POST", "path": "/v1//completions"}) is None
    assert fr({"method": "POST", "path": C, "root_path": "/v1"}) is None  # "/completions"
    ok = {"prompt": "x", "max_tokens": 2}
    r = await h.client.post(ROOT + C, json=ok, root_path=ROOT)
    assert r.status_code == 200 and (await r.get_json())["choices"][0]["text"]
    assert (await h.client.post(C, json=ok, root_path=ROOT)).status_code == 404  # outside it
    r = await h.client.get(ROOT + CHAT, root_path=ROOT)
    assert r.status_code == 405 and (await r.get_json())["error"]["code"] == "method_not_allowed"
    r = await h.client.options(C)
    assert r.status_code == 200 and "POST" in r.headers["Allow"]
    r = await h.client.post("/v1//completions", json=ok)
    assert r.status_code == 308 and r.headers["Location"].endswith(C)  # quart's redirect
    r = await h.client.post("//" + C, json=ok)
    assert r.status_code == 200 and (await r.get_json())["choices"][0]["text"]
