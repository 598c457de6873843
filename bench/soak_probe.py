"""The soak run with the in-process memory probe, and side-by-side soak variants.

``bench.scenarios soak`` runs :func:`soak_run` once (the serving policy). To tell a leak from
allocator or GC-threshold growth, run the variants on the same load and compare where RSS goes::

    python -m bench.soak_probe --minutes 3 --variants serving,default,collect:10,maxseq:16

- ``serving``: calserve as shipped (raised gen0 threshold + ``gc.freeze()`` after model load);
- ``default``: CPython's default GC thresholds, no freeze;
- ``gen0:N``: the serving policy with gen0 threshold N;
- ``collect:S``: the serving policy plus a full ``gc.collect()`` every S seconds from the probe;
- ``garbage``: the serving policy, plus every 15 s a full collection whose garbage is counted by
  type (``gc.DEBUG_SAVEALL``): names the cycles the raised threshold lets pile up;
- ``trace:N``: the serving policy with the engine's debugging trace capped at N entries
  (``server.trace_events``);
- ``maxseq:N``: the serving policy with ``scheduler.admission.max_sequences = N`` (caps how many
  runtime KV sequences are ever live at once, so it caps the KV high-water mark).

Each variant writes ``OUT/<variant>/`` (the run directory, ``probe.jsonl`` from
:mod:`bench.soak_entry`, ``summary.json``); the table printed at the end (and written to
``OUT/compare.json``) gives RSS at start / 25 % / end / idle, the slope after the first quarter, the
allocator split (Python blocks, malloc in-use, mmap'd chunks) and the GC collections that ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from bench import plots, procstat
from bench.scenario_lib import BENCH_OUT, calserve_config, counters_at_rest, device_limit, \
    run_point, write_json
from bench.server import Server, free_port, pin_self

__all__ = ["soak_run", "serve_probed", "probe_summary", "SOAK_STEP_US", "main"]

SOAK_STEP_US = 4000.0  # sat-4k
_MIB = 2**20


@contextlib.contextmanager
def serve_probed(config: dict[str, Any], run_dir: Path, *, gc_policy: str = "serving",
                 deep_s: float = 0.0, tracemalloc: bool = False,
                 garbage: bool = False, env: dict[str, str] | None = None) -> Iterator[Server]:
    """Like :meth:`Server.calserve`, but through :mod:`bench.soak_entry` with its probe writing
    ``run_dir/probe.jsonl`` once a second."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cfg = {**config, "server": {**config.get("server", {}), "host": "127.0.0.1", "port": port}}
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    probe = run_dir / "probe.jsonl"
    probe.unlink(missing_ok=True)
    env = {**(env or {}), "SOAK_PROBE": str(probe), "SOAK_GC": gc_policy, "SOAK_PROBE_DEEP_S": str(deep_s),
           "SOAK_TRACEMALLOC": "1" if tracemalloc else "0", "SOAK_GARBAGE": "1" if garbage else "0"}
    argv = [sys.executable, "-m", "bench.soak_entry", "--config", str(cfg_path),
            "--host", "127.0.0.1", "--port", "{port}"]
    with Server.start(argv, run_dir, port=port, env=env) as srv:
        yield srv


def _variant(name: str) -> tuple[str, dict[str, Any] | None, dict[str, Any]]:
    """(gc policy, admission overrides, ``server`` config overrides) of a variant name."""
    if name == "garbage":
        return "serving", None, {}
    if name.startswith("trace:"):
        return "serving", None, {"trace_events": int(name.split(":", 1)[1])}
    if name.startswith("maxseq:"):
        return "serving", {"max_sequences": int(name.split(":", 1)[1])}, {}
    return name, None, {}


def soak_run(out: Path, minutes: float, *, variant: str = "serving", deep_s: float = 0.0,
             tracemalloc: bool = False, idle_s: float = 5.0) -> dict[str, Any]:
    """Mixed bursty load with 20 % random disconnects for ``minutes`` on sim-next B1/4/8/16
    ping/pong, then ``idle_s`` of idle: RSS/fds over time, idle CPU, gauges back to zero, and the
    probe's allocator split (spec §19 M0, scaled down)."""
    dur = minutes * 60
    rate = 0.6 * device_limit(16, SOAK_STEP_US) / 96
    gc_policy, admission, server = _variant(variant)
    cfg = calserve_config(profiles=[1, 4, 8, 16], timing="sat-4k", max_inflight=2,
                          admission=admission)
    if server:
        cfg.setdefault("server", {}).update(server)
    if gc_policy == "default":  # the collector policy is a config key, not a patch
        cfg.setdefault("runtime", {})["gc_gen0_threshold"] = 0
    elif gc_policy.startswith("gen0:"):
        cfg.setdefault("runtime", {})["gc_gen0_threshold"] = int(gc_policy.split(":", 1)[1])
    garbage = variant == "garbage"
    with serve_probed(cfg, out / "server", gc_policy=gc_policy,
                      deep_s=deep_s or (15.0 if garbage else 0.0), tracemalloc=tracemalloc,
                      garbage=garbage) as srv:
        wall0 = time.time()
        res = run_point(srv, out / "run", rate=rate, duration=dur, prompt="8:512",
                        output="16:160", disconnect_prob=0.2, burstiness=0.5, drain=20.0,
                        scrape_interval_s=1.0)
        time.sleep(2.0)  # let cancelled requests drain
        idle0 = procstat.sample(srv.pid)
        t0 = time.monotonic()
        time.sleep(idle_s)
        idle1 = procstat.sample(srv.pid)
        idle_cpu = ((idle1.cpu_s - idle0.cpu_s) / (time.monotonic() - t0)
                    if idle0 and idle1 else None)
        rest = counters_at_rest(srv)
        died = srv.exit_code  # None = still running (good)
    proc = res.proc
    plots.proc_series(proc, out / "soak_proc.png", marks=[dur])
    s = res.summary
    sp = s.get("server_proc") or {}
    kv = kv_bound_bytes()
    return {
        "minutes": minutes,
        "variant": variant,
        "outcomes": s["outcomes"],
        "lost": s["sent"] - sum(s["outcomes"].values()),
        "server_proc": sp,
        # a leak is a steady climb after warm-up; the KV high-water mark and the allocator settle
        # first, so the slope is given after the first quarter and over the last half
        "rss_growth_after_warmup_mib_per_min": rss_slope(proc, dur * 0.25, dur),
        "rss_growth_last_half_mib_per_min": rss_slope(proc, dur * 0.5, dur),
        "kv_bound_mib": kv / _MIB if kv else None,
        "rss_growth_beyond_kv_bound_mib": ((sp["rss_max"] - sp["rss_start"] - kv) / _MIB
                                           if sp and kv else None),
        "server_died_exit_code": died,
        "idle_cpu_cores_after_load": idle_cpu,
        "idle_rss_bytes": idle1.rss_bytes if idle1 else None,
        "idle_fds": idle1.open_fds if idle1 else None,
        "counters_at_rest": rest,
        "all_back_to_zero": bool(rest) and all(not v for v in rest.values()),
        "probe": probe_summary(out / "server" / "probe.jsonl", wall0, dur),
    }


def rss_slope(proc: list[dict[str, Any]], t0: float, t1: float) -> float | None:
    """MiB/min of RSS between load times ``t0`` and ``t1`` (least squares over the samples)."""
    pts = [(p["t"], p["rss_bytes"] / _MIB) for p in proc if t0 <= p["t"] <= t1]
    if len(pts) < 2:
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mr = sum(r for _, r in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    return 60.0 * sum((t - mt) * (r - mr) for t, r in pts) / var if var else None


def kv_bound_bytes() -> int | None:
    """Host memory the software runtime's KV can take at most for the demo package: it keeps one
    ``max_seq``-token buffer per runtime sequence once used (zeroed, reused), so its resident share
    grows to the high-water mark of concurrent sequences, at most ``max_sequences`` of them (the
    capacity plan's ``kv_bytes``; one buffer set per shared-KV group)."""
    try:
        from calserve.models.demo import DEMO_MAX_SEQ, DEMO_MAX_SEQUENCES, demo_model_config
        from calserve.models.pack import kv_bytes_per_token
    except ImportError:
        return None
    return int(kv_bytes_per_token(demo_model_config(), "fp32") * DEMO_MAX_SEQ * DEMO_MAX_SEQUENCES)


def _load_probe(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def probe_summary(path: Path, wall0: float, dur: float) -> dict[str, Any]:
    """Start (first sample), quarter, end-of-load, last (idle) values of each probe series, in MiB
    (``py_blocks`` in thousands of objects), and the slope of each after the first quarter."""
    rows = _load_probe(path)
    if not rows:
        return {}
    # Probe samples carry wall-clock time; ``wall0`` is when the load generator started.
    keys = ("rss", "malloc_in_use", "malloc_free", "malloc_mmap", "malloc_arena")

    def at(t: float) -> dict[str, Any]:
        return min(rows, key=lambda r: abs(r["wall"] - t))

    pts = {"start": at(wall0), "quarter": at(wall0 + dur / 4), "end_load": at(wall0 + dur),
           "idle": rows[-1]}
    out: dict[str, Any] = {}
    for label, r in pts.items():
        out[label] = {k: round(r[k] / _MIB, 1) for k in keys if k in r}
        out[label]["py_kblocks"] = round(r["py_blocks"] / 1e3, 1)
        out[label]["gc_collections"] = r["gc_collections"]
    q, e = pts["quarter"], pts["end_load"]
    span_min = max(1e-9, (e["wall"] - q["wall"]) / 60)
    out["slope_after_quarter_per_min"] = {
        **{k + "_mib": round((e[k] - q[k]) / _MIB / span_min, 2) for k in keys if k in e},
        "py_kblocks": round((e["py_blocks"] - q["py_blocks"]) / 1e3 / span_min, 2)}
    last = rows[-1]
    if "gc_n" in last:  # every collection of the run (gen 0/1/2), start-up included
        out["gc_pauses"] = {"n": last["gc_n"], "max_ms": last["gc_max_ms"],
                            "cpu_max_ms": last.get("gc_cpu_max_ms"),
                            "total_ms": last["gc_total_ms"], "freed": last["gc_freed"]}
    deep = [r["deep"] for r in rows if "deep" in r]
    if deep:
        out["deep_last"] = deep[-1]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--variants", default="serving,default,collect:10,maxseq:16")
    ap.add_argument("--deep-s", type=float, default=0.0,
                    help="object-type count deltas every S seconds (0 = off)")
    ap.add_argument("--tracemalloc", action="store_true", help="tracemalloc deltas (slow)")
    ap.add_argument("--out", type=Path, default=BENCH_OUT / "soak-probe")
    a = ap.parse_args(argv)
    pin_self(1)
    docs = {}
    for v in a.variants.split(","):
        d = soak_run(a.out / v.replace(":", "-"), a.minutes, variant=v, deep_s=a.deep_s,
                     tracemalloc=a.tracemalloc)
        write_json(a.out / v.replace(":", "-") / "summary.json", d)
        docs[v] = d
        p = d["probe"]
        print(f"[{v}] lost={d['lost']} outcomes={d['outcomes']} slope={d['rss_growth_after_warmup_mib_per_min']}"
              f" idle_cpu={d['idle_cpu_cores_after_load']} rest0={d['all_back_to_zero']}\n"
              f"   start={p.get('start')}\n   quarter={p.get('quarter')}\n"
              f"   end={p.get('end_load')}\n   idle={p.get('idle')}\n"
              f"   slope={p.get('slope_after_quarter_per_min')}", flush=True)
    write_json(a.out / "compare.json", docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
