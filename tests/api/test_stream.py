"""SSE: chunk format, [DONE], usage chunk, stop strings, errors mid-stream, disconnect -> cancel."""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from .conftest import Harness
from .fake_engine import expected_token
from .sse_util import parse_sse

C = "/v1/completions"
CH = "/v1/chat/completions"


def expected_text(prompt: str, n: int, seed: int | None = None) -> str:
    ids = list(prompt.encode())
    return "".join(chr(expected_token(ids, seed, i)) for i in range(n))


async def test_completion_stream_format_and_done(h: Harness) -> None:
    status, raw, headers = await h.post(C, {"prompt": "hello", "max_tokens": 6, "stream": True,
                                            "seed": 3})
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for c in chunks:
        assert c["object"] == "text_completion"
        assert c["model"] == "qwen3"
        assert isinstance(c["created"], int)
        assert "usage" not in c  # only with stream_options.include_usage
        assert len(c["choices"]) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text("hello", 6, 3)


async def test_chat_stream_usage_chunk(h: Harness) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    status, raw, _ = await h.post(CH, body)
    assert status == 200
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    first, *middle, final, usage = events[:-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert final["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in events[:-1])
    assert all(c["usage"] is None for c in [first, *middle, final])
    assert usage["choices"] == []
    prompt_len = len("<user>hi\n<assistant>")
    assert usage["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 4,
                              "total_tokens": prompt_len + 4}


async def test_stop_string_cuts_and_is_not_emitted(h: Harness) -> None:
    full = expected_text("abc", 10)
    stop = full[4:6]
    status, resp, _ = await h.post(C, {"prompt": "abc", "max_tokens": 10, "stop": [stop]})
    assert status == 200
    assert resp["choices"][0]["text"] == full[: full.find(stop)]
    assert resp["choices"][0]["finish_reason"] == "stop"
    status, raw, _ = await h.post(C, {"prompt": "abc", "max_tokens": 10, "stop": stop,
                                      "stream": True})
    chunks = parse_sse(raw)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[: full.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_logprobs_shapes(h: Harness) -> None:
    status, resp, _ = await h.post(C, {"prompt": "ab", "max_tokens": 3, "logprobs": 2})
    lp = resp["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(lp["tokens"]) == resp["choices"][0]["text"]
    assert lp["text_offset"] == [0, 1, 2]
    assert all(len(t) == 2 for t in lp["top_logprobs"])
    status, resp, _ = await h.post(CH, {"messages": [{"role": "user", "content": "x"}],
                                        "max_tokens": 3, "logprobs": True, "top_logprobs": 1})
    content = resp["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode())
        assert len(item["top_logprobs"]) == 1


async def test_echo_prepends_prompt(h: Harness) -> None:
    status, resp, _ = await h.post(C, {"prompt": "hey", "max_tokens": 2, "echo": True})
    assert resp["choices"][0]["text"] == "hey" + expected_text("hey", 2)


async def test_token_id_prompt(h: Harness) -> None:
    status, resp, _ = await h.post(C, {"prompt": list(b"hey"), "max_tokens": 2})
    assert status == 200
    assert resp["choices"][0]["text"] == expected_text("hey", 2)


async def test_error_after_stream_started_is_an_error_event(harness_factory: Any) -> None:
    async with harness_factory(fail_after_tokens=2, token_delay=0.001) as h:
        status, raw, _ = await h.post(C, {"prompt": "x", "max_tokens": 5, "stream": True})
        assert status == 200
        events = parse_sse(raw)
        assert "[DONE]" not in events  # [DONE] only marks a complete answer
        *chunks, last = events
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text("x", 2)
        assert set(last) == {"error"}
        assert last["error"]["code"] == "device_error"


async def _disconnect(c: Any) -> None:
    """Client goes away. quart-trio's test connection then waits in ``__aexit__`` for a response
    body end that a cancelled app never sends (a real ASGI server does not wait): close its
    client-side channel so the context manager can exit."""
    await c.disconnect()
    c._client_send.close()


async def _open_stream(h: Harness, body: dict[str, Any]) -> Any:
    conn = h.client.request(path=C, method="POST",
                            headers={"content-type": "application/json"})
    return conn, msgspec.json.encode(body)


async def test_disconnect_cancels_at_once(harness_factory: Any, autojump_clock: Any) -> None:
    async with harness_factory(token_delay=1.0) as h:
        conn, data = await _open_stream(h, {"prompt": "x", "max_tokens": 400, "stream": True})
        async with conn as c:
            await c.send(data)
            await c.send_complete()
            got = b""
            while b"text" not in got:
                got += await c.receive()
            assert len(h.engine.active) == 1
            rid = next(iter(h.engine.active))
            t0 = trio.current_time()
            await _disconnect(c)
        await trio.sleep(0.01)
        assert rid in h.engine.cancelled_ids
        assert h.engine.active == {}
        assert trio.current_time() - t0 < 0.5  # not after the next token, not after max_tokens
        r = await h.client.get("/metrics")
        text = (await r.get_data()).decode()
        assert 'calserve_stream_disconnects_total{alias="qwen3"} 1.0' in text
        assert "calserve_streams_active 0.0" in text


async def test_many_disconnects_leave_nothing_behind(harness_factory: Any,
                                                     autojump_clock: Any) -> None:
    async with harness_factory(token_delay=0.05) as h:
        async def client(i: int) -> None:
            conn, data = await _open_stream(h, {"prompt": f"p{i}", "max_tokens": 400,
                                                "stream": True})
            async with conn as c:
                await c.send(data)
                await c.send_complete()
                got = b""
                while got.count(b"text") < 2:
                    got += await c.receive()
                await _disconnect(c)

        async with trio.open_nursery() as n:
            for i in range(50):
                n.start_soon(client, i)
        await trio.sleep(0.1)
        assert h.engine.active == {}
        assert len(set(h.engine.cancelled_ids)) == 50
        stats = h.engine.statistics()
        assert stats.kv_tokens_reserved == 0 and stats.requests_running == 0
        status, resp, _ = await h.post(C, {"prompt": "x", "max_tokens": 2})
        assert status == 200


async def test_non_stream_handler_cancel_also_cancels(harness_factory: Any,
                                                      autojump_clock: Any) -> None:
    async with harness_factory(token_delay=1.0) as h:
        conn, data = await _open_stream(h, {"prompt": "x", "max_tokens": 400})
        async with conn as c:
            await c.send(data)
            await c.send_complete()
            while not h.engine.active:
                await trio.sleep(0.1)
            await trio.sleep(3)
            await _disconnect(c)
        await trio.sleep(0.01)
        assert h.engine.active == {}
        assert len(h.engine.cancelled_ids) == 1


async def test_queued_events_are_coalesced_into_one_write(harness_factory: Any) -> None:
    """A slow reader: everything queued is sent as one write (receive_many), text unchanged.
    (quart-trio's test client buffers at most 10 body writes before it is read: keep it short.)"""
    async with harness_factory(token_delay=0.0, coalesce=True) as h:
        status, raw, _ = await h.post(C, {"prompt": "slow", "max_tokens": 9, "stream": True,
                                          "stream_options": {"include_usage": True}})
        events = parse_sse(raw)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text("slow", 9)
        assert events[-2]["usage"]["completion_tokens"] == 9
        assert max(h.engine.batches) > 1  # some answers carried several events
        assert sum(h.engine.batches) == 10  # 9 tokens + the finish event, none lost
