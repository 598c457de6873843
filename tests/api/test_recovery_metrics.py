"""Spec §16 recovery family (``calserve_faults_total{reason}``, resets, quarantined jobs / KV,
recovery seconds) and the model-state metric, driven over HTTP by device faults injected into a
running decode on the real engine (FakeBackend, fake clock).

What a client sees (issue 6): a streamed request gets an error event and no ``[DONE]``; a
non-streamed one a 500 ``device_error``; while the device resets the model is ``Recovering`` (``/ready``
503, new requests 503 with Retry-After); afterwards the next request succeeds and every running /
KV / in-flight gauge is back to zero."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from calserve.api.app import get_state
from calserve.runtime.types import FaultKind, JobEngine

from .conftest import make_config
from .real_engine import RealHarness, Samples, labels_of, parse_metrics, real_app, value
from .sse_util import parse_sse, stream_post

C = "/v1/completions"
CH = "/v1/chat/completions"

IDLE_GAUGES: tuple[tuple[str, dict[str, str]], ...] = (
    ("calserve_requests_running", {}),
    ("calserve_requests_waiting", {}),
    ("calserve_kv_tokens_reserved", {}),
    ("calserve_kv_tokens_used", {}),
    ("calserve_kv_sequences", {"state": "Active"}),
    ("calserve_kv_sequences", {"state": "Reserved"}),
    ("calserve_kv_sequences", {"state": "Unknown"}),
    ("calserve_executor_inflight_jobs", {}),
    ("calserve_streams_active", {}),
)


async def wait_idle(h: RealHarness, timeout: float = 5.0) -> Samples:
    """Scrape until every running/KV/in-flight gauge is 0 (the engine frees lanes asynchronously
    after the terminal event); fail with the busy gauges otherwise."""
    with trio.move_on_after(timeout):
        while True:
            m = await h.metrics()
            if all(value(m, n, **lb) == 0 for n, lb in IDLE_GAUGES):
                return m
            await trio.sleep(0.01)
    m = await h.metrics()
    busy = {(n, tuple(lb.items())): value(m, n, **lb) for n, lb in IDLE_GAUGES}
    raise AssertionError(f"not idle: {busy}")


def hook_resets(h: RealHarness, hook: Callable[[], Awaitable[None]]) -> None:
    """Run ``hook`` at the start of every device reset (recovery has marked the model
    Recovering and paused the scheduler at that point)."""
    be = h.backend
    orig = be.reset

    async def reset() -> None:
        await hook()
        await orig()

    be.reset = reset  # type: ignore[method-assign]


def moved(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def fault_config() -> Any:
    # re-admission off: the faulted request fails, which is what these metric tests observe
    return make_config(scheduler={"executor": {"wait_timeout_ms": 200},
                                  "recovery": {"max_request_retries": 0}})


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("kind", [FaultKind.CCU_FAULT, FaultKind.TIMEOUT],
                         ids=["ccu_fault", "timeout"])
async def test_device_fault_moves_recovery_metrics(autojump_clock: Any, kind: FaultKind,
                                                   stream: bool) -> None:
    async with real_app(fault_config()) as h:
        s, _, _ = await h.post(C, {"prompt": "warm", "max_tokens": 4})
        assert s == 200
        before = await wait_idle(h)
        assert value(before, "calserve_model_state", alias="qwen3", state="Ready") == 1
        assert value(before, "calserve_resets_total") == 0

        during: list[tuple[Samples, int, int, dict[str, Any], str | None]] = []

        async def observe() -> None:
            # What a scraper / probe / new client sees while the device resets.
            m = parse_metrics(get_state(h.app).metrics.render().decode())
            r = await h.client.get("/ready")
            status, body, headers = await h.post(C, {"prompt": "during", "max_tokens": 2})
            during.append((m, r.status_code, status, body, headers.get("Retry-After")))

        hook_resets(h, observe)
        # prefill = job 1 of this request, decode steps = jobs 2, 3, ...: the 3rd job (second
        # decode step) faults, after two tokens reached the client.
        h.backend.inject_fault(kind, JobEngine.PING, 3)
        with trio.fail_after(10):
            status, resp, _ = await h.post(
                C, {"prompt": "hello", "max_tokens": 50, "stream": stream, "ignore_eos": True})
        if stream:
            assert status == 200
            events = parse_sse(resp)
            assert "[DONE]" not in events
            *chunks, last = events
            assert len(chunks) == 2 and all(c["choices"][0]["text"] for c in chunks)
            assert set(last) == {"error"}
            assert last["error"]["code"] == "device_error"
            assert last["error"]["type"] == "server_error"
        else:
            assert status == 500
            assert resp["error"]["code"] == "device_error"
            assert set(resp["error"]) == {"message", "type", "param", "code"}

        # The error event may reach the client before the recovery task resets the device.
        with trio.fail_after(5):
            while not during:
                await trio.sleep(0.001)
        # during the reset: Recovering, not ready, new requests 503 + Retry-After
        assert len(during) == 1
        m_during, ready_status, new_status, new_body, retry_after = during[0]
        assert value(m_during, "calserve_model_state", alias="qwen3", state="Recovering") == 1
        assert value(m_during, "calserve_model_state", alias="qwen3", state="Ready") == 0
        assert ready_status == 503
        assert new_status == 503 and new_body["error"]["code"] == "model_unavailable"
        assert retry_after is not None and int(retry_after) >= 1

        after = await wait_idle(h)
        reason = "ccu_fault" if kind is FaultKind.CCU_FAULT else "timeout"
        faults = labels_of(after, "calserve_faults_total", "reason")
        assert {k: v for k, v in faults.items() if v} == {reason: 1.0}
        assert set(faults) >= {"timeout", "ccu_fault", "crosstalk"}  # known reasons exist at 0
        assert moved(after, before, "calserve_resets_total") == 1
        assert moved(after, before, "calserve_quarantined_kv_total") == 1
        assert moved(after, before, "calserve_recovery_seconds_total") > 0
        assert moved(after, before, "calserve_requests_finished_total", outcome="failed") == 1
        assert moved(after, before, "calserve_rejected_total", outcome="unavailable") == 1
        if kind is FaultKind.TIMEOUT:
            assert moved(after, before, "calserve_executor_jobs_timeouts_total", engine="ping") == 1
        else:
            # the faulted job itself (a timed-out job is aborted by the reset, not reported)
            assert moved(after, before, "calserve_quarantined_jobs_total") == 1
            assert moved(after, before, "calserve_executor_jobs_failed_total", engine="ping") == 1
        assert value(after, "calserve_model_state", alias="qwen3", state="Ready") == 1
        assert value(after, "calserve_model_generation", alias="qwen3") == 1
        r = await h.client.get("/ready")
        assert r.status_code == 200

        # the next request succeeds (both shapes) and everything returns to zero
        s, resp, _ = await h.post(C, {"prompt": "again", "max_tokens": 6, "ignore_eos": True})
        assert s == 200 and resp["usage"]["completion_tokens"] == 6
        s, raw, _ = await h.post(CH, {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 3, "stream": True})
        assert s == 200 and parse_sse(raw)[-1] == "[DONE]"
        final = await wait_idle(h)
        assert moved(final, after, "calserve_requests_finished_total", outcome="completed") == 2
        assert moved(final, before, "calserve_resets_total") == 1


async def test_reset_budget_spent_fails_the_model(autojump_clock: Any) -> None:
    """Two faults with a budget of one reset: the model goes Recovering -> Failed, the engine
    reports failure, and the server answers 503 (not ready, not serving) instead of hanging."""
    cfg = make_config(scheduler={"executor": {"wait_timeout_ms": 200},
                                 "recovery": {"max_resets_per_10min": 1,
                                              "degraded_resets_per_10min": 0,
                                              "max_request_retries": 0}})
    async with real_app(cfg) as h:
        states: list[dict[str, float]] = []

        async def observe() -> None:
            m = parse_metrics(get_state(h.app).metrics.render().decode())
            states.append({k: v for k, v in labels_of(m, "calserve_model_state", "state").items()
                           if v})

        hook_resets(h, observe)
        for _ in range(2):
            h.backend.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, 3)
            s, resp, _ = await h.post(C, {"prompt": "boom", "max_tokens": 20, "ignore_eos": True})
            assert s == 500 and resp["error"]["code"] == "device_error"
            await trio.sleep(0.5)
        assert states == [{"Recovering": 1.0}, {"Recovering": 1.0}]
        m = await h.metrics()
        assert value(m, "calserve_engine_up") == 0  # Failed beyond recovery: the host let go
        r = await h.client.get("/ready")
        assert r.status_code == 503
        s, resp, headers = await h.post(C, {"prompt": "x", "max_tokens": 2})
        assert s == 503 and resp["error"]["code"] == "engine_unavailable"
        assert "Retry-After" in headers


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("kind", [FaultKind.CCU_FAULT, FaultKind.TIMEOUT, FaultKind.CROSSTALK],
                         ids=["ccu_fault", "timeout", "crosstalk"])
async def test_device_fault_is_invisible_to_the_client_with_readmission(
        autojump_clock: Any, kind: FaultKind, stream: bool) -> None:
    """Re-admission on (the default): the same mid-stream fault costs the client nothing — the
    answer is complete (``[DONE]`` on a stream, 200 otherwise) and its text equals a fault-free
    run's; the reset still happened."""
    cfg = make_config(scheduler={"executor": {"wait_timeout_ms": 200}})
    doc = {"prompt": "hello", "max_tokens": 30, "stream": stream, "ignore_eos": True,
           "temperature": 0}

    def text_of(status: int, resp: Any) -> str:
        assert status == 200, resp
        if not stream:
            return str(resp["choices"][0]["text"])
        events = parse_sse(resp)
        assert events[-1] == "[DONE]", events[-2:]
        return "".join(c["choices"][0]["text"] for c in events[:-1] if c["choices"])

    async def post() -> tuple[int, Any]:
        with trio.fail_after(10):
            if stream:
                return await stream_post(h.client, C, doc)
            status, resp, _ = await h.post(C, doc)
            return status, resp

    async with real_app(cfg) as h:
        clean = text_of(*(await post()))
        before = await wait_idle(h)
        h.backend.inject_fault(kind, JobEngine.PING, 3)  # the 2nd decode step of the next request
        assert text_of(*(await post())) == clean
        after = await wait_idle(h)
        assert value(after, "calserve_resets_total") - value(before, "calserve_resets_total") == 1
        assert value(after, "calserve_requests_running") == 0
