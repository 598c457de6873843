"""What a client sees around a device fault with transparent recovery on, in-process on the real
engine (fake device, fake clock): a request that arrives while the device resets waits for it
and is answered (no 503), and once the reset budget is spent new requests get 503 + Retry-After
and /ready answers 503 (``recovery.exit_on_failed: false`` keeps the process up)."""

from __future__ import annotations

from typing import Any

import trio

from calserve.runtime.types import FaultKind, JobEngine

from .conftest import make_config
from .real_engine import real_app
from .test_recovery_metrics import hook_resets, wait_idle

C = "/v1/completions"


async def test_request_arriving_during_the_reset_waits_and_is_answered(autojump_clock: Any) -> None:
    async with real_app(make_config(scheduler={"executor": {"wait_timeout_ms": 200}})) as h:
        during: list[tuple[int, int]] = []
        later: list[tuple[int, dict[str, Any]]] = []

        async def observe() -> None:
            r = await h.client.get("/ready")
            during.append((r.status_code, 0))

            async def newcomer() -> None:  # cannot be answered before the reset: do not wait here
                status, body, _ = await h.post(C, {"prompt": "during", "max_tokens": 3,
                                                   "ignore_eos": True})
                later.append((status, body))

            h.app.nursery.start_soon(newcomer)
            await trio.sleep(0.01)

        hook_resets(h, observe)
        h.backend.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 3)
        status, body, _ = await h.post(C, {"prompt": "hello", "max_tokens": 12, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 12
        with trio.fail_after(5):
            while not later:
                await trio.sleep(0.01)
        assert during[0][0] == 503  # /ready tells load balancers the device is resetting
        assert later[0][0] == 200 and later[0][1]["usage"]["completion_tokens"] == 3
        await wait_idle(h)


async def test_budget_spent_503_with_retry_after_and_ready_503(autojump_clock: Any) -> None:
    cfg = make_config(scheduler={"executor": {"wait_timeout_ms": 200},
                                 "recovery": {"max_resets_per_10min": 0,
                                              "degraded_resets_per_10min": 0,
                                              "exit_on_failed": False}})
    async with real_app(cfg) as h:
        h.backend.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 3)
        status, body, headers = await h.post(C, {"prompt": "boom", "max_tokens": 12,
                                                 "ignore_eos": True})
        assert status == 503 and body["error"]["code"] == "model_unavailable"
        assert "reset budget" in body["error"]["message"] and int(headers["Retry-After"]) >= 1
        await trio.sleep(0.5)
        r = await h.client.get("/ready")
        assert r.status_code == 503 and "Retry-After" in r.headers
        status, body, headers = await h.post(C, {"prompt": "next", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "model_unavailable"
        assert "Retry-After" in headers
        m = await h.metrics()
        assert m[("calserve_engine_up", ())] == 1  # still up, answering 503 (exit_on_failed off)
        assert m[("calserve_reset_budget_state", (("state", "failed"),))] == 1
