from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

from calserve.api.app import CalserveApp, create_app, get_state
from calserve.config import CalserveConfig, decode_config

from .fake_engine import FakeEngine, fake_factory


def make_config(**sections: Any) -> CalserveConfig:
    data = msgspec.to_builtins(CalserveConfig())
    # Chunking must not depend on how busy the test machine is: adaptive grouping off unless a
    # test turns it on (tests/api/test_stream_pacing.py).
    data["server"]["stream_busy_interval_ms"] = 0
    for k, v in sections.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict) and k not in ("models", "tenants"):
            data[k].update(v)
        else:
            data[k] = v
    return decode_config(data)


async def engine_opened(app: CalserveApp) -> None:
    """Wait until the app's engine opened (listen first: start-up returns while it opens)."""
    host = get_state(app).host
    assert host is not None
    await host.opened.wait()


class Harness:
    def __init__(self, app: CalserveApp, client: Any) -> None:
        self.app = app
        self.client = client

    @property
    def engine(self) -> FakeEngine:
        host = get_state(self.app).host
        assert host is not None and host.engine is not None
        eng = host.engine
        assert isinstance(eng, FakeEngine)
        return eng

    async def post(self, path: str, body: Any = None, *, data: bytes | None = None,
                   headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
        if data is None:
            data = msgspec.json.encode(body)
        r = await self.client.post(path, data=data, headers=headers or {})
        raw = await r.get_data()
        ctype = r.headers.get("content-type", "")
        parsed = msgspec.json.decode(raw) if ctype.startswith("application/json") else raw
        return r.status_code, parsed, r.headers

    async def post_ok(self, path: str, body: Any) -> dict[str, Any]:
        """``post`` that must answer 200 with a JSON object: the object."""
        status, parsed, _ = await self.post(path, body)
        assert status == 200, parsed
        assert isinstance(parsed, dict)
        return parsed


@pytest.fixture
def harness_factory() -> Callable[..., Any]:
    import contextlib

    @contextlib.asynccontextmanager
    async def make(config: CalserveConfig | None = None, **engine_kw: Any) -> AsyncIterator[Harness]:
        app = create_app(config or make_config(), engine_factory=fake_factory(**engine_kw))
        async with app.test_app() as t:
            await engine_opened(app)
            yield Harness(app, t.test_client())

    return make


@pytest.fixture
async def h(harness_factory: Callable[..., Any]) -> AsyncIterator[Harness]:
    async with harness_factory(token_delay=0.001) as harness:
        yield harness
