"""Shared pieces of the named scenarios: configs, one load point, figures from summaries."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import trio

from bench.loadgen import LoadSpec, RunResult, headline, run_load, save_run
from bench.scrape import metric_value, parse_metrics
from bench.server import BENCH_OUT, Server
from bench.workload import Lengths, TenantSpec

__all__ = ["calserve_config", "run_point", "point_row", "write_json", "device_limit",
           "counters_at_rest", "BENCH_OUT"]


def calserve_config(*, profiles: list[int], timing: str, runtime: str = "sim-next",
                    null_compute: bool = False, max_inflight: int = 2,
                    window_us: int = 500, tenants: dict[str, Any] | None = None,
                    fairness: dict[str, Any] | None = None,
                    admission: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config document (``calserve.config`` schema) for one benchmark server.

    ``max_inflight`` defaults to 2 (PING/PONG), as ``configs/sim-next.yaml``: with one job in flight
    the host work of a step (sampling, dispatch, streaming) cannot overlap the next device step."""
    sched: dict[str, Any] = {
        "batch": {"profiles": profiles, "batching_window_us": window_us},
        "executor": {"max_inflight": max_inflight},
    }
    if len(profiles) == 1 and profiles[0] > 1:
        # Only one profile: select it whenever anything is ready.
        sched["batch"]["selection"] = {"b4_min_ready": 1, "b8_min_ready": 1, "b16_min_ready": 1}
    if fairness:
        sched["fairness"] = fairness
    if admission:
        sched["admission"] = admission
    cfg: dict[str, Any] = {
        "scheduler": sched,
        "runtime": {"profile": runtime, "null_compute": null_compute},
        "models": {"qwen3": {"package": None, "timing": timing}},
    }
    if tenants:
        cfg["tenants"] = tenants
    return cfg


def device_limit(batch: int, step_us: float) -> float:
    """Output tokens/s the timing model allows when every decode step is full: B lanes per step."""
    return batch * 1e6 / step_us


def workload_limit(batch: int, step_us: float, prompt_tokens: float, output_tokens: float,
                   prefill_base_us: float, prefill_us_per_token: float) -> float:
    """Output tokens/s the timing model allows for a workload: each request needs its prefill on the
    device (which serialises with decode when the PING/PONG overlap is 0) and output - 1 decode lane
    steps (its first token comes from the prefill), B lanes per step. :func:`device_limit` is the
    decode-only bound (no request ever starts)."""
    device_us = (prefill_base_us + prefill_us_per_token * prompt_tokens
                 + (output_tokens - 1) * step_us / batch)
    return output_tokens * 1e6 / device_us


def sat_prefill_us(step_us: float) -> tuple[float, float]:
    """(base, per token) prefill µs of sat-4k scaled to ``step_us`` (the bench-step-* profiles)."""
    scale = step_us / 4000.0
    return 2000.0 * scale, 20.0 * scale


def run_point(srv: Server | None, out: Path, *, base_url: str | None = None,
              tenants: tuple[TenantSpec, ...] | None = None, concurrency: int | None = None,
              rate: float | None = None, duration: float = 10.0, prompt: str = "32",
              output: str = "128", drain: float = 15.0, **kw: Any) -> RunResult:
    """One load point against ``srv``; saves the run directory and prints its headline."""
    if tenants is None:
        tenants = (TenantSpec("default", None, rate, concurrency, Lengths.parse(prompt),
                              Lengths.parse(output)),)
    spec = LoadSpec(base_url=base_url or (srv.url if srv else ""), tenants=tenants,
                    duration_s=duration, drain_timeout_s=drain,
                    server_pid=srv.pid if srv else None, **kw)
    res = trio.run(run_load, spec)
    save_run(res, out)
    print(f"--- {out.name}\n{headline(res.summary)}", flush=True)
    return res


def point_row(res: RunResult, **fields: Any) -> dict[str, Any]:
    s = res.summary
    return {
        **fields,
        "output_throughput": s["output_throughput"],
        "window_output_throughput": (s.get("window") or {}).get("output_throughput"),
        "request_throughput": s["request_throughput"],
        "ttft_p50_ms": s["ttft_ms"].get("p50", math.nan),
        "ttft_p99_ms": s["ttft_ms"].get("p99", math.nan),
        "tpot_p50_ms": s["tpot_ms"].get("p50", math.nan),
        "tpot_p99_ms": s["tpot_ms"].get("p99", math.nan),
        "batch_fill": s["batch_fill"]["mean"],
        "outcomes": s["outcomes"],
    }


def write_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))


REST_GAUGES = ("calserve_requests_running", "calserve_requests_waiting", "calserve_kv_tokens_reserved",
               "calserve_executor_inflight_jobs", "calserve_streams_active")


def counters_at_rest(srv: Server) -> dict[str, float | None]:
    """The gauges that must be back at zero when no load runs (spec §19 M0: nothing leaks)."""
    try:
        status, body = srv.get("/metrics")
    except OSError:
        return {"server_unreachable_exit_code": srv.exit_code}
    if status != 200:
        return {}
    m = parse_metrics(body.decode())
    out: dict[str, float | None] = {n: metric_value(m, n) for n in REST_GAUGES}
    live = 0.0
    for k, v in m.items():
        if k.startswith("calserve_kv_sequences{") and "state=free" not in k.lower():
            live += v
    out["calserve_kv_sequences(non-free)"] = live
    return out
