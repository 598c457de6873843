"""Scenario ``scaleout``: several boards behind HAProxy (``calserve cluster``).

1. Scaling: 1, 2 and 4 replicas (one simulated board each) of a B16 sim-next instance with the
   device-bound ``qwen3-dual`` timing (B16 step 56 ms, prefill 30 ms + 0.35 ms/token: ~250 output
   tokens/s per board for this workload, so the simulated boards, not the host's 2 cores, bound
   throughput), closed-loop load of 24 streams per replica through HAProxy. Figure: delivered
   output tokens/s in the steady window, and its ratio to 1 replica (ideal: N).
2. Pools: ``deploy/pools``-style cluster — a latency pool (1 replica, B1, ``max_inflight`` 1) and a
   throughput pool (2 replicas, B16 PING/PONG) — with the throughput pool saturated (48 streams, no
   header: the default pool) while a light stream of short requests goes to the latency pool
   (``X-Calserve-Pool: latency``) and, for comparison, the same requests to the throughput pool.
   Figure: TTFT P99 of each.

The replicas and HAProxy are not pinned (the load generator is, to core 1): on this 2-core VM they
share the cores with it. Every replica opens its own board (``--device i``).
"""

from __future__ import annotations

import csv
import io
import sys
import time
from pathlib import Path
from typing import Any

import trio
import yaml

from bench.loadgen import LoadSpec, RunResult, headline, run_load, save_run
from bench.scenario_lib import calserve_config, workload_limit
from bench.server import Server, free_port
from bench.workload import Lengths, TenantSpec

__all__ = ["scaleout"]

STEP_B16_US = 56_000.0  # qwen3-dual
PREFILL_US = (30_000.0, 350.0)
PROMPT, OUTPUT = 16, 64
PER_REPLICA = 32  # closed-loop streams per replica: both engines' B16 jobs full


def _throughput_config() -> dict[str, Any]:
    cfg = calserve_config(profiles=[16], timing="qwen3-dual",
                          admission={"max_waiting_requests": 512})
    cfg["scheduler"]["batch"]["instance_pool"] = 16
    return cfg


def _latency_config() -> dict[str, Any]:
    cfg = calserve_config(profiles=[1], timing="qwen3-dual", runtime="calrt-0.7.6",
                          max_inflight=1, window_us=0)
    cfg["scheduler"]["batch"]["instance_pool"] = 1
    return cfg


def _wait_all_up(stats_port: int, n: int, timeout: float = 240.0) -> None:
    import http.client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", stats_port, timeout=2)
            conn.request("GET", "/;csv")
            text = conn.getresponse().read().decode().lstrip("# ")
            conn.close()
            rows = [r for r in csv.DictReader(io.StringIO(text))
                    if r["svname"] not in ("FRONTEND", "BACKEND") and r["pxname"] != "stats"]
            if len(rows) == n and all(r["status"].startswith("UP") for r in rows):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"not all {n} replicas came UP in HAProxy within {timeout:.0f} s")


def _cluster_argv(run: Path, stats_port: int, *, replicas: int | None = None,
                  config: Path | None = None, pools: Path | None = None) -> list[str]:
    argv = [sys.executable, "-m", "calserve.cli", "cluster", "--port", "{port}",
            "--stats-port", str(stats_port), "--run-dir", str(run / "cluster"),
            "--check-interval-ms", "500", "--log-level", "warning"]
    if pools is not None:
        argv += ["--pool-config", str(pools)]
    else:
        argv += ["--replicas", str(replicas), "--config", str(config)]
    return argv


def _run(spec: LoadSpec, out: Path) -> RunResult:
    res = trio.run(run_load, spec)
    save_run(res, out)
    print(f"--- {out.name}\n{headline(res.summary)}", flush=True)
    return res


def _window_tps(res: RunResult) -> float:
    w = res.summary.get("window")
    return float(w["output_throughput"]) if w else float(res.summary["output_throughput"])


def scaleout(out: Path, quick: bool) -> dict[str, Any]:
    dur = 16.0 if quick else 40.0
    steady = 4.0 if quick else 8.0
    bound = workload_limit(16, STEP_B16_US, PROMPT, OUTPUT, *PREFILL_US)
    rows = []
    cfg_path = out / "throughput.yaml"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(yaml.safe_dump(_throughput_config(), sort_keys=False))
    for n in (1, 2, 4):
        run = out / f"replicas-{n}"
        stats = free_port()
        with Server.start(_cluster_argv(run, stats, replicas=n, config=cfg_path), run, core=None,
                          ready_timeout=240.0, log_name="cluster.log") as srv:
            _wait_all_up(stats, n)
            spec = LoadSpec(base_url=srv.url, tenants=(TenantSpec(
                "default", None, None, PER_REPLICA * n, Lengths(PROMPT, PROMPT),
                Lengths(OUTPUT, OUTPUT)),), duration_s=dur, drain_timeout_s=30.0,
                steady_start_s=steady, scrape_interval_s=None, progress=False)
            res = _run(spec, run / "load")
        tps = _window_tps(res)
        rows.append({"replicas": n, "concurrency": PER_REPLICA * n,
                     "output_tokens_per_s": round(tps, 1),
                     "device_bound_tokens_per_s": round(bound * n, 1),
                     "efficiency": round(tps / (bound * n), 3),
                     "outcomes": res.summary["outcomes"]})
    base = rows[0]["output_tokens_per_s"] or 1.0
    for r in rows:
        r["ratio_to_1"] = round(r["output_tokens_per_s"] / base, 2)

    # pools: latency pool TTFT while the throughput pool is saturated
    run = out / "pools"
    run.mkdir(parents=True, exist_ok=True)
    (run / "latency.yaml").write_text(yaml.safe_dump(_latency_config(), sort_keys=False))
    (run / "throughput.yaml").write_text(yaml.safe_dump(_throughput_config(), sort_keys=False))
    (run / "pools.yaml").write_text(yaml.safe_dump({"default_pool": "throughput", "pools": {
        "latency": {"config": "latency.yaml", "replicas": 1},
        "throughput": {"config": "throughput.yaml", "replicas": 2}}}, sort_keys=False))
    stats = free_port()
    lat_rate = 1.0  # 8-token requests: ~0.32 s of B1 device time each
    with Server.start(_cluster_argv(run, stats, pools=run / "pools.yaml"), run, core=None,
                      ready_timeout=240.0, log_name="cluster.log") as srv:
        _wait_all_up(stats, 3)
        short = Lengths(PROMPT, PROMPT), Lengths(8, 8)
        spec = LoadSpec(base_url=srv.url, tenants=(
            TenantSpec("saturating", None, None, PER_REPLICA * 2, Lengths(PROMPT, PROMPT),
                       Lengths(OUTPUT, OUTPUT)),
            TenantSpec("latency-pool", None, lat_rate, None, *short, start_s=steady,
                       headers=(("X-Calserve-Pool", "latency"),)),
            TenantSpec("same-on-throughput-pool", None, lat_rate, None, *short, start_s=steady,
                       headers=(("X-Calserve-Pool", "throughput"),)),
        ), duration_s=dur + steady, drain_timeout_s=30.0, steady_start_s=steady,
            scrape_interval_s=None, progress=False)
        res = _run(spec, run / "load")
    ten = res.summary["tenants"]

    def p(name: str, q: str) -> float:
        return round(float(ten[name]["ttft_ms"].get(q, float("nan"))), 1)

    pools = {
        "throughput_pool_output_tokens_per_s": round(ten["saturating"]["output_throughput"], 1),
        "latency_pool_ttft_p50_ms": p("latency-pool", "p50"),
        "latency_pool_ttft_p99_ms": p("latency-pool", "p99"),
        "latency_requests": ten["latency-pool"]["sent"],
        "same_requests_on_throughput_pool_ttft_p50_ms": p("same-on-throughput-pool", "p50"),
        "same_requests_on_throughput_pool_ttft_p99_ms": p("same-on-throughput-pool", "p99"),
        "latency_outcomes": ten["latency-pool"]["outcomes"],
    }
    return {
        "timing": "qwen3-dual (B16 step 56 ms, B1 40 ms, prefill 30 ms + 0.35 ms/token)",
        "workload": f"{PROMPT}-token prompts, {OUTPUT} output tokens, {PER_REPLICA} streams/replica",
        "device_bound_per_replica_tokens_per_s": round(bound, 1),
        "scaling": rows,
        "ratio_2": rows[1]["ratio_to_1"], "ratio_4": rows[2]["ratio_to_1"],
        "pools": pools,
    }
