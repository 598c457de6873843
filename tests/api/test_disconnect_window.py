"""Disconnect in every window: a client that goes away after its streaming request was accepted
but before the SSE body started (headers not yet sent) still cancels the engine request at once.
No event has been read in that window, so only the handler's ``RequestLease`` can cancel it;
without it the request would hold its lane until max_tokens."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio

from calserve.api.app import create_app, get_state

from .conftest import engine_opened, make_config
from .fake_engine import FakeEngine, fake_factory


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 400, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 400, "stream": True}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 400, "stream": True}),
])
async def test_disconnect_before_the_body_starts_cancels(autojump_clock: Any, path: str,
                                                         body: dict[str, Any]) -> None:
    app = create_app(make_config(), engine_factory=fake_factory(token_delay=1.0))
    in_window = trio.Event()

    def stalling(asgi_send: Any) -> Any:
        # Holds the connection between "request accepted by the engine" and "headers sent": the
        # window a disconnect can hit in production (the send of the headers). The generation
        # routes are raw ASGI (calserve.api.asgi), so the window is the ASGI send itself.
        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                in_window.set()
                await trio.sleep(10)
            await asgi_send(message)
        return send

    async with app.test_app() as t:
        await engine_opened(app)
        client = t.test_client()
        host = get_state(app).host
        assert host is not None and isinstance(host.engine, FakeEngine)
        eng = host.engine
        conn = client.request(path=path, method="POST",
                              headers={"content-type": "application/json"})
        conn._asgi_send = stalling(conn._asgi_send)  # type: ignore[attr-defined]
        async with conn as c:
            await c.send(msgspec.json.encode(body))
            await c.send_complete()
            await in_window.wait()
            assert len(eng.active) == 1
            rid = next(iter(eng.active))
            t0 = trio.current_time()
            await c.disconnect()
            c._client_send.close()  # type: ignore[attr-defined]  # see test_stream._disconnect
        await trio.sleep(0.01)
        assert rid in eng.cancelled_ids
        assert eng.active == {}
        assert trio.current_time() - t0 < 0.5
        text = (await (await client.get("/metrics")).get_data(as_text=True))
        assert "calserve_streams_active 0.0" in text
        r = await client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200
