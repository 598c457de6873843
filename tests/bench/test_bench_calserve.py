"""The load generator against a real calserve process (demo package built in an isolated
CALSERVE_HOME): every request accounted for, calserve's /metrics scraped, gauges back to zero."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from bench.loadgen import LoadSpec, run_load
from bench.scenario_lib import calserve_config, counters_at_rest
from bench.server import Server
from bench.workload import Lengths, TenantSpec


@pytest.mark.e2e
def test_loadgen_against_calserve(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    home = tmp_path_factory.mktemp("calserve-home")
    cfg = calserve_config(profiles=[1, 4, 8, 16], timing="fast", max_inflight=2,
                          tenants={"a": {"api_keys": ["key-a"]}, "b": {"api_keys": ["key-b"]}})
    with Server.calserve(cfg, tmp_path / "run", core=None, env={"CALSERVE_HOME": str(home)},
                         ready_timeout=120) as srv:
        spec = LoadSpec(base_url=srv.url, duration_s=2.0, progress=False, scrape_interval_s=0.25,
                        server_pid=srv.pid, disconnect_prob=0.1, tenants=(
                            TenantSpec("a", "key-a", rate=20, prompt_len=Lengths(4, 64),
                                       output_len=Lengths(4, 24)),
                            TenantSpec("b", "key-b", concurrency=4, output_len=Lengths(8, 8),
                                       prompt_len=Lengths(8, 8))))
        res = trio.run(run_load, spec)
        bad = LoadSpec(base_url=srv.url, num_requests=3, progress=False, scrape_interval_s=None,
                       tenants=(TenantSpec("x", "wrong-key", rate=100),))
        res_bad = trio.run(run_load, bad)
        rest = _wait_rest(srv)
    s = res.summary
    assert s["sent"] == len(res.records) == sum(s["outcomes"].values()) > 10
    assert s["outcomes"]["ok"] > 0 and s["outcomes"]["failed"] == 0 and s["outcomes"]["timeout"] == 0
    for r in res.records:
        if r.outcome == "ok":
            # ignore_eos + max_tokens pin the output length; usage and events agree
            assert r.finish_reason == "length" and r.output_tokens >= len(r.token_times) > 0
    st = s["ttft_ms"]
    assert st["min"] <= st["p50"] <= st["p90"] <= st["p99"] <= st["max"]
    assert res.metrics and any(k.startswith("calserve_") for k in res.metrics[-1]["values"])
    assert s["queue_depth"]["max"] is not None
    assert res.proc and s["server_proc"]["cpu_s"] > 0
    assert [r.status for r in res_bad.records] == [401] * 3
    assert all(v == 0 for v in rest.values()), rest


def _wait_rest(srv: Server) -> dict[str, float | None]:
    import time

    rest: dict[str, float | None] = {}
    for _ in range(50):
        rest = counters_at_rest(srv)
        if rest and all(v == 0 for v in rest.values()):
            break
        time.sleep(0.1)
    return rest
