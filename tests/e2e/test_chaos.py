"""Chaos through HTTP (issue 15): real ``calserve serve`` processes on sim-next (B1..B16, PING/PONG)
whose software runtime injects faults at 1 % of jobs over every kind, under a few hundred
concurrent greedy requests with random client disconnects and deadlines.

- every request ends exactly once (one terminal event per stream / one body per JSON answer; the
  engine's finished + rejected counts cover every request), none hangs (bounded by its deadline);
- every completed greedy output equals the same prompt's output on a fault-free server (one cut
  by its deadline is a prefix of it), and no request noticed a fault (no error, no 5xx);
- afterwards the gauges are back to 0 (running, KV reserved, in-flight jobs, non-free sequences);
- the reset budget is enforced: with it spent, new requests get 503 + Retry-After and /ready
  503 (``recovery.exit_on_failed: false``), or (the default) the process answers its requests
  and exits 1.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml

from bench.chaos import check_outputs, gauges_at_rest, make_plans, run_chaos, summarise

from .server import ServerProcess, scrape, server_env, total

pytestmark = pytest.mark.timeout(240)

N_REQUESTS = 300
RATE = 30.0  # requests per second


def chaos_config(tmp: Path, name: str, *, rate: float, recovery: dict[str, Any] | None = None,
                 deadline_ms: int = 6000) -> Path:
    doc = {
        "scheduler": {
            "admission": {"deadline_default_ms": deadline_ms},
            "batch": {"profiles": [1, 4, 8, 16], "batching_window_us": 500},
            "executor": {"max_inflight": 2},
            "recovery": {"max_resets_per_10min": 1000, "state_dir": str(tmp / f"state-{name}"),
                         **(recovery or {})},
        },
        "runtime": {"profile": "sim-next",
                    "faults": {"rate": rate, "seed": 7,
                               "kinds": ["timeout", "ccu", "unknown_dma", "busy", "crosstalk"]}},
        "models": {"qwen3": {"package": None, "timing": "sat-4k"}},
    }
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def start(home: Path, cfg: Path, cwd: Path) -> ServerProcess:
    argv = [sys.executable, "-m", "calserve.cli", "serve", "--config", str(cfg), "--port", "0"]
    return ServerProcess(argv, server_env(home), cwd)


@pytest.fixture(scope="module")
def servers(calserve_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    tmp = tmp_path_factory.mktemp("chaos")
    cfgs = {
        "faulty": chaos_config(tmp, "faulty", rate=0.01),
        "reference": chaos_config(tmp, "reference", rate=0.0),
        # the first fault spends the budget (none left to degrade): Failed
        "budget": chaos_config(tmp, "budget", rate=0.05,
                               recovery={"max_resets_per_10min": 0, "degraded_resets_per_10min": 0,
                                         "exit_on_failed": False}),
        "exit": chaos_config(tmp, "exit", rate=0.05,
                             recovery={"max_resets_per_10min": 0, "degraded_resets_per_10min": 0}),
    }
    procs = {k: start(calserve_home, p, tmp) for k, p in cfgs.items()}  # start in parallel
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def test_chaos_costs_the_clients_nothing(servers: dict[str, ServerProcess]) -> None:
    faulty, reference = servers["faulty"], servers["reference"]
    plans = make_plans(N_REQUESTS, seed=3, rate=RATE)
    t0 = time.monotonic()
    outcomes = trio.run(run_chaos, faulty.url, plans)
    took = time.monotonic() - t0
    ref_plans = [dataclasses.replace(p, stream=False, disconnect_after=None) for p in plans]
    ref = trio.run(run_chaos, reference.url, ref_plans)
    refmap = {o.plan.i: o.text for o in ref if o.kind == "ok"}
    s = summarise(outcomes)
    detail = json.dumps(s)

    # none hangs: bounded by the 6 s deadline (+ the time to send the requests, + slack)
    assert took < N_REQUESTS / RATE + 40, detail
    assert s["max_seconds"] < 30, detail
    # exactly one terminal event per answered request
    assert s["terminals_not_one"] == 0, detail
    assert s["outcomes"].get("transport", 0) == 0, detail
    # nobody noticed the faults: no error event, no 5xx; refusals are overload 429s only
    assert s["noticed_fault"] == 0, detail
    assert all(o.code == "rate_limit_exceeded" and o.retry_after for o in outcomes
               if o.kind == "rejected"), detail
    assert check_outputs(outcomes, refmap) == []
    compared = sum(1 for o in outcomes if o.kind in ("ok", "truncated") and o.plan.i in refmap)
    assert compared >= N_REQUESTS // 2, detail

    # the faults happened, and were recovered
    m = scrape(faulty.url)
    assert total(m, "calserve_faults_total") >= 3, m
    assert total(m, "calserve_resets_total") >= 3

    # every request that reached the engine ended exactly once: finished + refused at admission
    finished = total(m, "calserve_requests_finished_total")
    rejected = total(m, "calserve_rejected_total")
    json_disconnects = sum(1 for o in outcomes if o.kind == "disconnected" and not o.plan.stream)
    assert N_REQUESTS - json_disconnects <= finished + rejected <= N_REQUESTS, (finished, rejected)

    # gauges back to 0 (lanes are freed just after the terminal events)
    deadline = time.monotonic() + 10
    while True:
        rest = gauges_at_rest(httpx.get(faulty.url + "/metrics", timeout=10).text)
        if all(v == 0 for v in rest.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(v == 0 for v in rest.values()), rest
    assert httpx.get(faulty.url + "/ready", timeout=10).status_code == 200


def _drive_until_failed(url: str, n: int = 40) -> list[tuple[int, dict[str, Any], str | None]]:
    """Requests until the model fails (the first fault spends the budget)."""
    out = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in range(n):
            try:
                r = c.post("/v1/completions", json={"prompt": f"budget {i}", "max_tokens": 24,
                                                    "temperature": 0, "ignore_eos": True})
            except httpx.HTTPError:
                break  # the process exited (exit_on_failed)
            out.append((r.status_code, r.json(), r.headers.get("Retry-After")))
            if r.status_code == 503:
                break
    return out


def test_budget_spent_clients_get_503_with_retry_after_and_ready_503(
        servers: dict[str, ServerProcess]) -> None:
    srv = servers["budget"]
    answers = _drive_until_failed(srv.url)
    status, body, retry = answers[-1]
    assert status == 503 and body["error"]["code"] == "model_unavailable", answers[-3:]
    assert retry is not None and int(retry) >= 1
    time.sleep(0.5)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert r.json()["error"]["code"] == "model_unavailable"
    ready = httpx.get(srv.url + "/ready", timeout=10)
    assert ready.status_code == 503 and "Retry-After" in ready.headers
    assert srv.proc.poll() is None  # still up: exit_on_failed is false
    m = scrape(srv.url)
    assert m.get(("calserve_reset_budget_state", (("state", "failed"),))) == 1


def test_budget_spent_process_answers_then_exits_1(servers: dict[str, ServerProcess]) -> None:
    srv = servers["exit"]
    answers = _drive_until_failed(srv.url)
    assert answers and all(s in (200, 503) for s, _, _ in answers), answers  # answered, no 500
    assert any(s == 503 for s, _, _ in answers) or srv.proc.poll() is not None
    srv.proc.wait(30)
    assert srv.proc.returncode == 1
    assert "Traceback" not in srv.stderr, srv.stderr[-3000:]
    assert "every model generation failed" in srv.stderr
