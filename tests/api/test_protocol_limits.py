"""The pieces of the protocol limits on their own: request-head checks, the rate-limited log."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from calserve.api.hygiene import RateLimitedLog, head_error

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


async def test_ambiguous_framing_in_process(h: Harness) -> None:
    data = b'{"prompt":"x"}'
    status, body, headers = await h.post("/v1/completions", data=data, headers={
        "Transfer-Encoding": "chunked", "Content-Length": str(len(data))})
    assert status == 400 and body["error"]["code"] == "invalid_http_framing"
    assert headers["Connection"] == "close"


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
