"""What an engine crash does, start-up failure, the asyncio refusal, and `calserve serve` exit codes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
import trio

from calserve.api.app import ASYNCIO_REFUSAL, create_app, get_state
from calserve.api.serve import apply_cli, build_parser, main, serve_app
from calserve.config import CalserveConfig
from calserve.errors import CalserveError

from .conftest import Harness, make_config
from .fake_engine import FakeEngine, fake_factory
from .rawconn import wait_ready


async def test_crash_drops_readiness_and_503s(h: Harness) -> None:
    host = get_state(h.app).host
    assert host is not None
    assert (await h.client.get("/ready")).status_code == 200
    h.engine.crash()
    await host.failed.wait()
    assert host.engine is None and isinstance(host.failure, BaseException)
    r = await h.client.get("/ready")
    assert r.status_code == 503 and r.headers["Retry-After"]
    status, body, headers = await h.post("/v1/completions", {"prompt": "x"})
    assert status == 503 and body["error"]["code"] == "engine_unavailable"
    assert headers["Retry-After"]
    r = await h.client.get("/health")
    assert r.status_code == 200
    assert msgspec.json.decode(await r.get_data())["engine"] == "failed"
    text = (await (await h.client.get("/metrics")).get_data()).decode()
    assert "calserve_engine_up 0.0" in text


async def test_model_not_ready_is_503_on_ready(h: Harness) -> None:
    h.engine.not_ready = True
    r = await h.client.get("/ready?model=qwen3")
    assert r.status_code == 503
    assert msgspec.json.decode(await r.get_data())["state"] == "Loading"


async def test_startup_failure_refuses_to_start(caplog: Any) -> None:
    """A refused package at start-up: `calserve serve` exits 1 after logging the reason once
    (quart-trio's test_app cannot host this case: hypercorn's lifespan can)."""

    @contextlib.asynccontextmanager
    async def broken(config: CalserveConfig) -> AsyncIterator[Any]:
        raise CalserveError("package refused: bad signature")
        yield  # pragma: no cover

    with trio.fail_after(30):
        rc = await serve_app(_args(), make_config(server={"port": 0}), engine_factory=broken)
    assert rc == 1
    said = [r for r in caplog.records if "bad signature" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None, caplog.text  # once, no traceback


def test_asyncio_worker_is_refused_with_a_message() -> None:
    app = create_app(make_config(), engine_factory=fake_factory())
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        msgs = [{"type": "lifespan.startup"}]

        async def receive() -> dict[str, Any]:
            return msgs.pop(0)

        async def send(m: dict[str, Any]) -> None:
            sent.append(m)

        await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)

    asyncio.run(run())
    assert sent[0]["type"] == "lifespan.startup.failed"
    assert "-k trio" in sent[0]["message"] and sent[0]["message"] == ASYNCIO_REFUSAL


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_cli_overrides(tmp_path: Any) -> None:
    pkg = tmp_path / "mypkg"
    cfg = apply_cli(CalserveConfig(), _args("--model", str(pkg), "--port", "9001", "--host",
                                            "0.0.0.0", "--trusted-key", str(tmp_path / "k.pub")))
    assert list(cfg.models) == ["mypkg"] and cfg.scheduler.model_alias == "mypkg"
    assert cfg.models["mypkg"].package == str(pkg)
    assert cfg.trust.model_root == str(tmp_path)
    assert cfg.trust.trusted_keys == [str(tmp_path / "k.pub")]
    assert (cfg.server.port, cfg.server.host) == (9001, "0.0.0.0")
    assert cfg.runtime.device == 0
    assert apply_cli(CalserveConfig(), _args("--device", "3")).runtime.device == 3
    with pytest.raises(CalserveError, match="device"):
        apply_cli(CalserveConfig(), _args("--device", "-1"))
    cfg = apply_cli(CalserveConfig(), _args("--model", str(pkg), "--alias", "m"))
    assert list(cfg.models) == ["m"]
    with pytest.raises(CalserveError):
        apply_cli(CalserveConfig(), _args("--alias", "m"))


def test_serve_bad_config_exits_1(tmp_path: Any, capsys: Any) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("server: {port: -5}\n")
    assert main(["--config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "port" in err and "Traceback" not in err


async def test_serve_exits_nonzero_when_engine_fails() -> None:
    cfg = make_config(server={"port": 0})
    engines: list[FakeEngine] = []

    @contextlib.asynccontextmanager
    async def factory(config: CalserveConfig) -> AsyncIterator[FakeEngine]:
        async with FakeEngine.open(config, token_delay=0.001) as eng:
            engines.append(eng)
            yield eng

    result: list[int] = []

    async def run(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        result.append(await serve_app(_args(), cfg, engine_factory=factory,
                                      task_status=task_status))

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            binds = await n.start(run)
            url = binds[0]
            await wait_ready(url)
            async with httpx.AsyncClient(base_url=url) as client:
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 200
                engines[0].crash()
    assert result == [1]
