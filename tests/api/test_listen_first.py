"""Listen first: `calserve serve` answers HTTP while the model loads; a failed load exits 1 once.

The engine factory here blocks its start-up on an event the test sets, so "while loading" is a
state the test holds, not a race against a timer.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from calserve import __version__
from calserve.api.readiness import REASONS, not_ready_reason
from calserve.api.serve import build_parser, serve_app
from calserve.config import CalserveConfig
from calserve.errors import CalserveError

from .conftest import make_config
from .fake_engine import FakeEngine


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["--log-level", "warning", *argv])


async def test_slow_load_is_live_but_not_ready_until_loaded() -> None:
    loaded = trio.Event()
    opening = trio.Event()

    @contextlib.asynccontextmanager
    async def slow(config: CalserveConfig) -> AsyncIterator[FakeEngine]:
        opening.set()
        await loaded.wait()  # the model load
        async with FakeEngine.open(config, token_delay=0.001) as eng:
            yield eng

    result: list[int] = []

    async def run(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        result.append(await serve_app(_args(), make_config(server={"port": 0}),
                                      engine_factory=slow, task_status=task_status))

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url = (await n.start(run))[0]
            await opening.wait()
            async with httpx.AsyncClient(base_url=url) as client:
                r = await client.get("/health")
                assert r.status_code == 200 and r.json()["engine"] == "starting"
                r = await client.get("/ready")
                assert r.status_code == 503 and r.headers["Retry-After"] == "1"
                assert r.json() == {"status": "not_ready", "reason": "loading"}
                for path in ("/v1/completions", "/v1/chat/completions"):
                    r = await client.post(path, json={"prompt": "x", "messages": []})
                    assert r.status_code == 503 and r.headers["Retry-After"], r.text
                    assert r.json()["error"]["code"] == "engine_unavailable"
                    assert "loading" in r.json()["error"]["message"]
                assert (await client.get("/version")).json()["version"] == __version__
                loaded.set()
                with trio.fail_after(10):
                    while (r := await client.get("/ready")).status_code != 200:
                        await trio.sleep(0.01)
                assert r.json()["status"] == "ready" and r.json()["state"] == "Ready"
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 200
                models = (await client.get("/v1/models")).json()["data"]
                assert models and all(m["server_version"] == __version__ for m in models)
            n.cancel_scope.cancel()


async def test_failed_load_exits_1_and_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    @contextlib.asynccontextmanager
    async def failing(config: CalserveConfig) -> AsyncIterator[Any]:
        await trio.sleep(0.05)  # fails after the port opened
        raise CalserveError("qwen3: package signature does not verify")
        yield  # pragma: no cover

    with trio.fail_after(30):
        rc = await serve_app(_args(), make_config(server={"port": 0}), engine_factory=failing)
    assert rc == 1
    said = [r for r in caplog.records if "signature does not verify" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert said[0].exc_info is None  # a deliberate refusal: one line, no traceback


async def test_a_bug_in_loading_is_logged_with_its_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    @contextlib.asynccontextmanager
    async def buggy(config: CalserveConfig) -> AsyncIterator[Any]:
        raise ZeroDivisionError("oops")
        yield  # pragma: no cover

    with trio.fail_after(30):
        rc = await serve_app(_args(), make_config(server={"port": 0}), engine_factory=buggy)
    assert rc == 1
    said = [r for r in caplog.records if "oops" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is not None


def test_reasons_are_the_documented_ones() -> None:
    assert REASONS == ("loading", "draining", "recovering", "failed")
    assert not_ready_reason(None, None, None, False) == "loading"
