"""``GET /admin/v1/trace`` (behind the admin gate) returns Chrome trace JSON of the device jobs and
request phases, from which the PING/PONG overlap is computed; the degradation and reset-budget
metric families move when a crosstalk degrades PING/PONG. In-process on the real engine over the
fake device (fake clock)."""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from calserve.engine.trace import overlap_fraction
from calserve.runtime.types import FaultKind, JobEngine

from .conftest import make_config
from .real_engine import real_app, value
from .test_recovery_metrics import wait_idle

C = "/v1/completions"
TOKEN = {"Authorization": "Bearer tr4ce"}


def pp_config() -> Any:
    return make_config(admin={"token": "tr4ce"},
                       scheduler={"batch": {"profiles": [1, 4]}, "executor": {"max_inflight": 2}})


async def test_trace_is_chrome_json_with_jobs_on_both_engines_and_request_phases(
        autojump_clock: Any) -> None:
    async with real_app(pp_config()) as h:
        async def one(i: int) -> None:
            s, resp, _ = await h.post(C, {"prompt": f"req {i}", "max_tokens": 8, "ignore_eos": True})
            assert s == 200

        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(one, i)
        await wait_idle(h)
        r = await h.client.get("/admin/v1/trace")
        assert r.status_code == 401  # the admin gate
        r = await h.client.get("/admin/v1/trace", headers=TOKEN)
        assert r.status_code == 200 and r.content_type == "application/json"
        doc = msgspec.json.decode(await r.get_data())
        evs = doc["traceEvents"]
        jobs = [e for e in evs if e["ph"] == "X"]
        assert {e["args"]["engine"] for e in jobs} == {"PING", "PONG"}
        assert {e["name"].split()[0] for e in jobs} == {"prefill", "decode"}
        assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["args"]["lanes"] >= 1 for e in jobs)
        names = {e["name"] for e in evs if e["ph"] == "b"}
        assert names == {"queued", "prefill", "decode"}
        begins = sum(1 for e in evs if e["ph"] == "b")
        assert begins == sum(1 for e in evs if e["ph"] == "e")
        threads = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
        assert threads == {"PING", "PONG"}
        ov = overlap_fraction(doc)
        assert 0.0 <= ov["overlap"] <= 1.0 and ov["busy_s"] > 0
        assert doc["otherData"]["overlap"] == ov["overlap"]
        assert doc["otherData"]["pingpong_state"] == "dual"
        r = await h.client.get("/admin/v1/trace?last=3", headers=TOKEN)
        assert r.status_code == 200
        assert msgspec.json.decode(await r.get_data())["otherData"]["entries"] == 3
        r = await h.client.get("/admin/v1/trace?last=0", headers=TOKEN)
        body = msgspec.json.decode(await r.get_data())
        assert r.status_code == 400 and body["error"]["param"] == "last"


async def test_degradation_metrics_move_on_crosstalk(autojump_clock: Any) -> None:
    async with real_app(pp_config()) as h:
        m = await wait_idle(h)
        assert value(m, "calserve_pingpong_state", state="dual") == 1
        assert value(m, "calserve_reset_budget_state", state="ok") == 1
        h.backend.inject_fault(FaultKind.CROSSTALK, JobEngine.PONG, 2)

        async def one(i: int) -> None:
            s, resp, _ = await h.post(C, {"prompt": f"p{i}", "max_tokens": 10, "ignore_eos": True})
            assert s == 200 and resp["usage"]["completion_tokens"] == 10  # nobody noticed

        async with trio.open_nursery() as n:
            for i in range(6):
                n.start_soon(one, i)
        m = await wait_idle(h)
        assert value(m, "calserve_pingpong_state", state="single") == 1
        assert value(m, "calserve_pingpong_state", state="dual") == 0
        assert value(m, "calserve_pingpong_degradations_total", reason="crosstalk") == 1
        assert value(m, "calserve_resets_in_window") == 1
        # exported per fault reason (0 s here: the fake device's reset takes no fake time)
        assert value(m, "calserve_recovery_episodes_total", reason="crosstalk") == 1
        assert ("calserve_recovery_episode_max_seconds", (("reason", "crosstalk"),)) in m
        # the trace shows the faulted job and the requests the fault re-admitted
        r = await h.client.get("/admin/v1/trace", headers=TOKEN)
        doc = msgspec.json.decode(await r.get_data())
        statuses = {e["args"]["status"] for e in doc["traceEvents"] if e["ph"] == "X"}
        assert "ok" in statuses
        assert any(e["ph"] == "n" and e["name"] == "lost" for e in doc["traceEvents"])
