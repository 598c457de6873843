"""X-Request-Id: accepted (a short token) or generated, echoed on every response of both
transports, and in JSON error bodies beside ``error``."""

from __future__ import annotations

import re

import msgspec

from .conftest import Harness

C = "/v1/completions"
_HEX32 = re.compile(r"[0-9a-f]{32}")


async def test_client_id_is_echoed_on_both_transports(h: Harness) -> None:
    rid = {"X-Request-Id": "client-42.a:b"}
    status, body, headers = await h.post(C, {"prompt": "x", "max_tokens": 2}, headers=rid)
    assert status == 200 and headers["x-request-id"] == "client-42.a:b"
    r = await h.client.get("/v1/models", headers=rid)
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-42.a:b"
    # errors: the id in the body too (raw-ASGI route, quart route, unknown route)
    status, body, headers = await h.post(C, {"prompt": "x", "max_tokens": 0}, headers=rid)
    assert status == 400 and body["request_id"] == headers["x-request-id"] == "client-42.a:b"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    for path in ("/v1/models/nope", "/no/such/route"):
        r = await h.client.get(path, headers=rid)
        got = msgspec.json.decode(await r.get_data())
        assert r.status_code == 404 and got["request_id"] == "client-42.a:b", got


async def test_missing_or_unsafe_ids_are_generated(h: Harness) -> None:
    seen = set()
    for given in (None, "x" * 129, "has space", "semi;colon", ""):
        headers = {} if given is None else {"X-Request-Id": given}
        status, body, got = await h.post(C, {"prompt": "x", "max_tokens": 0}, headers=headers)
        assert status == 400
        rid = got["x-request-id"]
        assert _HEX32.fullmatch(rid) and body["request_id"] == rid
        seen.add(rid)
    assert len(seen) == 5  # a new one each time
