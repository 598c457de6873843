"""Operator metrics (issue 20): process/GC/platform collectors, build info, prompt tokens, KV usage
ratio, job status breakdown, load phase durations, device restarts, and known label values
exported at 0 before their first event."""

from __future__ import annotations

from typing import Any

from calserve import __version__
from calserve.api.metrics import FAULT_REASONS, JOB_STATUSES, LOAD_PHASES, MODEL_STATES

from .conftest import make_config
from .real_engine import labels_of, real_app, value

C = "/v1/completions"


async def test_operator_metrics_on_the_real_engine(autojump_clock: Any) -> None:
    async with real_app(make_config()) as h:
        m = await h.metrics()
        names = {n for n, _ in m}
        for name in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                     "process_open_fds", "process_start_time_seconds",
                     "python_gc_collections_total", "python_info"):
            assert name in names, name
        build = [labels for n, labels in m if n == "calserve_build_info"]
        assert len(build) == 1 and dict(build[0])["version"] == __version__
        # before any request or fault: the known label values are there, at 0
        assert set(labels_of(m, "calserve_faults_total", "reason")) == set(FAULT_REASONS)
        assert not any(labels_of(m, "calserve_faults_total", "reason").values())
        assert set(labels_of(m, "calserve_executor_job_status_total", "status")) == set(JOB_STATUSES)
        assert set(labels_of(m, "calserve_model_state", "state")) == set(MODEL_STATES)
        assert value(m, "calserve_stream_disconnects_total", alias="qwen3") == 0
        assert ("calserve_stream_disconnects_total", (("alias", "qwen3"),)) in m
        assert value(m, "calserve_kv_usage_ratio") == 0
        assert value(m, "calserve_device_restarts_total") == 0
        phases = labels_of(m, "calserve_model_load_phase_seconds", "phase")
        assert set(phases) == set(LOAD_PHASES) and all(v >= 0 for v in phases.values())

        s, body, _ = await h.post(C, {"prompt": "hello there", "max_tokens": 4, "ignore_eos": True})
        assert s == 200
        m = await h.metrics()
        assert value(m, "calserve_prompt_tokens_total", alias="qwen3", tenant="default") == \
            body["usage"]["prompt_tokens"]
        assert value(m, "calserve_completion_tokens_total", alias="qwen3", tenant="default") == 4
        # one prefill + 3 decode steps came back ok (the 4th token is sampled from the 3rd)
        assert value(m, "calserve_executor_job_status_total", status="ok") >= 3
        assert 0 <= value(m, "calserve_kv_usage_ratio") <= 1


async def test_kv_usage_ratio_while_a_request_holds_its_lane(autojump_clock: Any) -> None:
    import trio

    async with real_app(make_config()) as h:
        seen: list[float] = []

        async def run() -> None:
            await h.post(C, {"prompt": "x", "max_tokens": 40, "ignore_eos": True})

        async with trio.open_nursery() as n:
            n.start_soon(run)
            for _ in range(200):
                await trio.sleep(0.005)
                m = await h.metrics()
                if value(m, "calserve_requests_running"):
                    seen.append(value(m, "calserve_kv_usage_ratio"))
                    break
        assert seen and 0 < seen[0] <= 1
