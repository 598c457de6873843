"""Bad input on the paths the fake-engine fuzz does not reach: the real engine's admission and
sampler (random sampling fields, no 5xx), bodies without Content-Length over the limit (413), and
an engine stream that breaks mid-way (an error event, never a truncated 200)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calserve.engine.types import TokenEvent

from .conftest import make_config
from .fake_engine import FakeEngine
from .real_engine import parse_metrics, real_app, total, value
from .sse_util import parse_sse, stream_post
from .test_fuzz import check

C = "/v1/completions"
CH = "/v1/chat/completions"

edge_numbers = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, 1, -1, 2, 20, 21, 127, 128, 255, 256, 511, 512, 2**31, 2**63 - 1, -(2**63),
                     2**64, 0.0, 1e-300, 0.5, 1.0, 1.5, 2.0, 2.0000001, -0.0, 1e300]),
    st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5), st.lists(st.integers(-2, 600), max_size=4),
    st.lists(st.text(max_size=4), max_size=3),
)
sampling = st.dictionaries(
    st.sampled_from(["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                     "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "echo",
                     "ignore_eos", "min_tokens", "stream_options", "n", "best_of"]),
    edge_numbers, max_size=6,
)
prompts = st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(-1, 130), max_size=8))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60)
@given(chat=st.booleans(), prompt=prompts, fields=sampling, stream=st.booleans())
async def test_real_engine_random_sampling_never_5xx(chat: bool, prompt: Any,
                                                     fields: dict[str, Any],
                                                     stream: bool) -> None:
    for k in ("max_tokens", "max_completion_tokens"):
        if isinstance(fields.get(k), int) and not isinstance(fields[k], bool) and fields[k] > 6:
            fields[k] = 6  # keep generation short (real time)
    fields.setdefault("max_tokens", 4)
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": str(prompt)}]} if chat
                            else {"prompt": prompt})
    doc = {**base, **fields, "stream": stream}
    async with real_app(make_config()) as h:
        with trio.fail_after(20):
            status, raw = await stream_post(h.client, CH if chat else C, doc)
        check(status, None, raw)
        if status == 200 and stream:
            events = parse_sse(raw)
            assert events[-1] == "[DONE]", events[-1]


async def test_chunked_body_over_limit_is_413(harness_factory: Any) -> None:
    """No Content-Length (chunked upload): the limit is enforced while reading."""
    async with harness_factory(make_config(server={"max_body_bytes": 1000})) as h:
        conn = h.client.request(path=C, method="POST",
                                headers={"content-type": "application/json"})
        async with conn as c:
            await c.send(b'{"prompt": "')
            for _ in range(20):
                await c.send(b"x" * 100)
            await c.send(b'"}')
            await c.send_complete()
            raw = bytearray()
            while True:
                try:
                    raw += await c.receive()
                except trio.EndOfChannel:
                    break
        assert c.status_code == 413
        err = msgspec.json.decode(bytes(raw))["error"]
        assert err["code"] == "request_too_large"
        assert h.engine.submitted == []


class _BrokenHandle:
    """An engine stream that raises after one token (an engine bug / a lost device thread); the
    rest of the handle protocol is the fake's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.request_id = inner.request_id
        self._reads = 0

    async def events(self) -> AsyncIterator[Any]:
        yield TokenEvent((97,), "a")
        raise RuntimeError("engine stream broke")

    async def receive_many(self) -> list[Any]:
        self._reads += 1
        if self._reads == 1:
            return [TokenEvent((97,), "a")]
        raise RuntimeError("engine stream broke")

    def cancel(self) -> None:
        self._inner.cancel()

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_engine_stream_failure_is_an_error_event(harness_factory: Any) -> None:
    async with harness_factory(token_delay=0.01) as h:
        eng = h.engine
        orig = FakeEngine.submit

        async def submit(req: Any) -> Any:
            return _BrokenHandle(await orig(eng, req))

        eng.submit = submit
        status, raw = await stream_post(h.client, C, {"prompt": "x", "max_tokens": 50,
                                                      "stream": True})
        assert status == 200
        events = parse_sse(raw)
        assert "[DONE]" not in events
        assert events[0]["choices"][0]["text"] == "a"
        assert set(events[-1]) == {"error"}
        assert events[-1]["error"]["type"] == "server_error"
        assert "Traceback" not in events[-1]["error"]["message"]
        with trio.fail_after(1):
            while eng.active:
                await trio.sleep(0.01)
        assert len(eng.cancelled_ids) == 1  # the request was cancelled, its lane freed
        m = parse_metrics(await (await h.client.get("/metrics")).get_data(as_text=True))
        assert value(m, "calserve_streams_active") == 0
        assert total(m, "calserve_stream_disconnects_total") == 0  # not a client disconnect
        s, resp, _ = await h.post(C, {"prompt": "x", "max_tokens": 50})
        assert s == 500 and resp["error"]["code"] == "internal_error"
