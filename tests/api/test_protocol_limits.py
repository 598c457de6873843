"""The pieces of the protocol limits on their own: request-head checks, deep JSON, the rewriting of
hypercorn's error answers, the connection cap's clamp, the rate-limited log."""

from __future__ import annotations

import logging
import resource
from typing import Any

import msgspec
import pytest

from calserve.api import listener
from calserve.api.bodies import MAX_JSON_DEPTH, decode, json_too_deep
from calserve.api.errors import ApiError
from calserve.api.hygiene import RateLimitedLog, head_error
from calserve.api.listener import FD_RESERVE, connection_cap, rewrite_error_response
from calserve.api.schemas import ChatBody, CompletionBody, TokenizeBody

from .conftest import Harness


def _scope(*headers: tuple[bytes, bytes], path: bytes = b"/v1/completions") -> dict[str, Any]:
    return {"type": "http", "raw_path": path, "query_string": b"", "headers": list(headers)}


def test_head_error() -> None:
    assert head_error(_scope((b"content-length", b"3")), 1024) is None
    err = head_error(_scope((b"content-length", b"3"), (b"transfer-encoding", b"chunked")), 1024)
    assert err is not None and (err.status, err.code) == (400, "invalid_http_framing")
    assert err.headers() == {"Connection": "close"}
    err = head_error(_scope((b"x-big", b"a" * 2000)), 1024)
    assert err is not None and (err.status, err.code) == (431, "headers_too_large")
    assert head_error(_scope(path=b"/" + b"a" * 2000), 1024) is not None  # the target counts


def _nest(depth: int, leaf: bytes = b"1") -> bytes:
    return b'{"a":' * depth + leaf + b"}" * depth


@pytest.mark.parametrize("data, deep", [
    (b"[]", False), (b"[" * 64 + b"]" * 64, False), (b"[" * 65 + b"]" * 65, True),
    (_nest(65), True), (_nest(64), False),
    (b'["' + b"[" * 100 + b'"]', False),  # brackets inside a string do not nest
    (b'["\\"' + b"[" * 100 + b'"]', False),  # nor after an escaped quote
    (b'["\\\\",' + b"[" * 65 + b"]" * 65 + b"]", True),  # an escaped backslash ends no string
    (b"[" + b"[]," * 500 + b"[]]", False),  # many brackets, shallow
])
def test_json_too_deep(data: bytes, deep: bool) -> None:
    msgspec.json.decode(data)  # valid JSON
    assert json_too_deep(data) is deep


def test_deep_free_form_values_are_400_invalid_json_naming_the_field() -> None:
    ok = {"prompt": "x", "tools": msgspec.json.decode(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)}
    assert decode(CompletionBody, msgspec.json.encode(ok)).tools is not None
    cases = [
        (CompletionBody, b'{"prompt":"x","tools":' + b"[" * 65 + b"]" * 65 + b"}", "tools"),
        (CompletionBody, b'{"prompt":' + b"[" * 65 + b"]" * 65 + b"}", "prompt"),
        (ChatBody, b'{"messages":[{"role":"user","content":"x"},{"role":"assistant",'
         b'"tool_calls":' + _nest(70) + b"}]}", "messages[1].tool_calls"),
        (ChatBody, b'{"messages":[],"response_format":' + _nest(70) + b"}", "response_format"),
        (TokenizeBody, b'{"messages":[{"role":"user","tool_calls":' + _nest(70) + b"}]}",
         "messages[0].tool_calls"),
        # Past msgspec's own recursion limit (it raised RecursionError: a 500 before).
        (CompletionBody, b'{"prompt":"x","tools":' + b"[" * 100000 + b"]" * 100000 + b"}", None),
    ]
    for kind, data, param in cases:
        with pytest.raises(ApiError) as e:
            decode(kind, data)
        assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_json", param)


async def test_deep_json_on_both_transports(h: Harness) -> None:
    deep = b'{"prompt":"x","tools":' + b"[" * 3000 + b"]" * 3000 + b"}"
    status, body, _ = await h.post("/v1/completions", data=deep)
    assert status == 400 and body["error"]["code"] == "invalid_json"
    deep = b'{"messages":[{"role":"user","tool_calls":' + _nest(3000) + b"}]}"
    status, body, _ = await h.post("/tokenize", data=deep)
    assert status == 400 and body["error"]["code"] == "invalid_json"


async def test_ambiguous_framing_in_process(h: Harness) -> None:
    data = b'{"prompt":"x"}'
    status, body, headers = await h.post("/v1/completions", data=data, headers={
        "Transfer-Encoding": "chunked", "Content-Length": str(len(data))})
    assert status == 400 and body["error"]["code"] == "invalid_http_framing"
    assert headers["Connection"] == "close"


def test_rewrite_of_hypercorns_error_answers() -> None:
    raw = (b"HTTP/1.1 400 \r\ncontent-length: 0\r\nconnection: close\r\n"
           b"date: Tue, 01 Dec 2026 12:00:00 GMT\r\nserver: hypercorn-h11\r\n\r\n")
    new = rewrite_error_response(raw, 16384)
    assert new is not None
    head, _, body = new.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 400 "
    assert b"content-type: application/json" in lines and b"connection: close" in lines
    assert b"date: Tue, 01 Dec 2026 12:00:00 GMT" in lines and b"server: hypercorn-h11" in lines
    assert f"content-length: {len(body)}".encode() in lines
    err = msgspec.json.decode(body)["error"]
    assert err == {"message": err["message"], "type": "invalid_request_error", "param": None,
                   "code": "invalid_http"}
    new = rewrite_error_response(raw.replace(b" 400 ", b" 431 "), 8192)
    assert new is not None and b"headers_too_large" in new and b"8192" in new
    new = rewrite_error_response(raw.replace(b" 400 ", b" 500 "), 8192)
    assert new is not None and b'"internal_error"' in new and b"Traceback" not in new
    # The app's own answers pass untouched.
    app = b"HTTP/1.1 400 \r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    assert rewrite_error_response(app, 16384) is None
    assert rewrite_error_response(b"HTTP/1.1 200 \r\ncontent-length: 0\r\n\r\n", 16384) is None


def test_connection_cap_is_clamped_to_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = {"soft": 256, "hard": 256}
    monkeypatch.setattr(listener.resource, "getrlimit",
                        lambda _: (limits["soft"], limits["hard"]))
    raised: list[tuple[int, int]] = []
    monkeypatch.setattr(listener.resource, "setrlimit", lambda _, v: raised.append(v))
    assert connection_cap(1024) == 256 - FD_RESERVE
    assert connection_cap(100) == 100
    limits.update(soft=256, hard=4096)  # the soft limit is raised when the cap needs it
    assert connection_cap(1024) == 1024 and raised == [(1024 + FD_RESERVE, 4096)]
    limits.update(soft=40, hard=40)
    assert connection_cap(1024) == 20  # tiny limits: half of it
    limits.update(soft=resource.RLIM_INFINITY, hard=resource.RLIM_INFINITY)
    assert connection_cap(1024) == 1024


def test_rate_limited_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
                          ) -> None:
    now = [100.0]
    monkeypatch.setattr("calserve.api.hygiene.time.monotonic", lambda: now[0])
    rl = RateLimitedLog(logging.getLogger("test.ratelimited"), window_s=10.0)
    with caplog.at_level(logging.WARNING, "test.ratelimited"):
        for _ in range(1000):
            rl.warning("k", "refused %s", "x")
        rl.warning("other", "another kind")
        now[0] += 11
        rl.warning("k", "refused %s", "y")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["refused x", "another kind", "refused y (+999 more in the last 11 s)"]
