"""Scenario ``lifecycle`` (spec §19 M4, scaled): model load/serve/unload cycles and a switching soak
through the admin API of a real server (sim-next, demo architecture, ``fast`` timing).

1. **Cycles**: N times (100; 10 with ``--quick``) load a package as alias ``cyc`` (alternating two
   packages with different weights), serve a few requests on it, unload it; after each cycle the
   device DRAM in use (``calserve_device_dram_used_bytes``) must be back to its baseline exactly,
   and the serving process's RSS is sampled (``/proc``).
2. **Switching soak**: closed-loop streaming clients on two aliases while ``qwen3`` is hot-replaced
   every few seconds (a <-> b); every request must end 200 with ``[DONE]`` (0 lost), and each
   replacement is counted.
3. **Time-switching soak** (calrt-0.7.6, one resident calbin, two aliases, spec §13): closed-loop
   clients on both aliases; every request must end 200 (0 lost); the switches are counted
   (``calserve_model_switches_total``; bounded by the minimum residency, 1 s here).
"""

from __future__ import annotations

import json
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench import procstat
from bench.server import BENCH_OUT, Server

__all__ = ["run"]

TOKEN = "bench-lifecycle"
_H = {"Authorization": f"Bearer {TOKEN}"}


def _packages(root: Path) -> None:
    from calserve.models.demo import ensure_demo_package, pack_demo_variant
    from calserve.models.signing import dev_key

    home = BENCH_OUT / ".home"
    demo = ensure_demo_package(home)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "a").exists():
        shutil.copytree(demo, root / "a")
    if not (root / "b" / "SHA256SUMS.sig").exists():
        pack_demo_variant(root / "b", dev_key(home), seed=7)


def _dram(c: httpx.Client) -> int:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("calserve_device_dram_used_bytes "):
            return int(float(line.split()[1]))
    raise RuntimeError("no calserve_device_dram_used_bytes in /metrics")


def _admin(c: httpx.Client, alias: str, op: str, body: dict[str, Any]) -> tuple[int, float]:
    t0 = time.monotonic()
    r = c.post(f"/admin/v1/models/{alias}/{op}", json=body, headers=_H)
    if r.status_code != 200:
        raise RuntimeError(f"{op} {alias}: {r.status_code} {r.text[:300]}")
    return r.status_code, time.monotonic() - t0


def _stream_ok(c: httpx.Client, model: str, n: int) -> bool:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": n, "temperature": 0,
            "stream": True}
    try:
        with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return False
            last = ""
            for line in r.iter_lines():
                if line.startswith("data: "):
                    last = line[6:]
                    if '"error"' in last:
                        return False
            return last == "[DONE]"
    except httpx.HTTPError:
        return False


def _cycles(srv: Server, c: httpx.Client, n: int) -> dict[str, Any]:
    base = _dram(c)
    rss0 = procstat.sample(srv.pid)
    loads, unloads, drams, rss = [], [], [], []
    bad = 0
    for i in range(n):
        pkg = "a" if i % 2 == 0 else "b"
        loads.append(_admin(c, "cyc", "load", {"package": pkg})[1])
        for _ in range(4):
            bad += not _stream_ok(c, "cyc", 8)
        unloads.append(_admin(c, "cyc", "unload", {"drain_timeout_s": 5})[1])
        drams.append(_dram(c) - base)
        s = procstat.sample(srv.pid)
        rss.append(s.rss_bytes if s else 0)
    rss1 = procstat.sample(srv.pid)
    half = rss[len(rss) // 2] if rss else 0
    return {
        "cycles": n,
        "dram_baseline_bytes": base,
        "dram_back_to_baseline_every_cycle": all(d == 0 for d in drams),
        "dram_max_delta_bytes": max((abs(d) for d in drams), default=0),
        "requests_failed": bad,
        "load_s_p50": round(statistics.median(loads), 3),
        "unload_s_p50": round(statistics.median(unloads), 3),
        "rss_start_mib": round((rss0.rss_bytes if rss0 else 0) / 2**20, 1),
        "rss_mid_mib": round(half / 2**20, 1),
        "rss_end_mib": round((rss1.rss_bytes if rss1 else 0) / 2**20, 1),
        "rss_growth_second_half_mib": round(((rss1.rss_bytes if rss1 else 0) - half) / 2**20, 1),
    }


class _ClosedLoop:
    """One closed-loop streaming client thread per entry of ``models`` (24-token streams) until
    :meth:`stop`; ``counts`` = requests ok / lost."""

    def __init__(self, url: str, models: tuple[str, ...], timeout_s: float) -> None:
        self.counts = {"ok": 0, "lost": 0}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._url, self._timeout_s = url, timeout_s
        self._threads = [threading.Thread(target=self._client, args=(m,), daemon=True)
                         for m in models]
        for t in self._threads:
            t.start()

    def _client(self, model: str) -> None:
        with httpx.Client(base_url=self._url, timeout=self._timeout_s) as c:
            while not self._stop.is_set():
                ok = _stream_ok(c, model, 24)
                with self._lock:
                    self.counts["ok" if ok else "lost"] += 1

    def stop(self) -> dict[str, int]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self._timeout_s)
        return self.counts


def _soak(srv: Server, seconds: float, every_s: float) -> dict[str, Any]:
    clients = _ClosedLoop(srv.url, ("qwen3", "qwen3", "qwen3", "other", "other"), 60)
    switches = 0
    t_end = time.monotonic() + seconds
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        while time.monotonic() < t_end:
            time.sleep(every_s)
            _admin(c, "qwen3", "load", {"package": "b" if switches % 2 == 0 else "a"})
            switches += 1
    counts = clients.stop()
    return {"seconds": seconds, "replacements": switches, "requests_ok": counts["ok"],
            "requests_lost": counts["lost"]}


def _metric_sum(c: httpx.Client, name: str) -> float:
    return sum(float(line.split()[-1]) for line in c.get("/metrics").text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _timeswitch_soak(out: Path, root: Path, seconds: float) -> dict[str, Any]:
    cfg = {
        "runtime": {"profile": "calrt-0.7.6"},
        "trust": {"model_root": str(root)},
        "admin": {"token": TOKEN},
        "switching": {"min_residency_s": 1.0},
        "models": {"m1": {"package": "a", "timing": "fast"},
                   "m2": {"package": "b", "timing": "fast"}},
    }
    with Server.calserve(cfg, out / "server-timeswitch") as srv:
        clients = _ClosedLoop(srv.url, ("m1", "m1", "m2", "m2"), 120)
        time.sleep(seconds)
        counts = clients.stop()
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            switches = _metric_sum(c, "calserve_model_switches_total")
    return {"seconds": seconds, "min_residency_s": 1.0, "switches": int(switches),
            "requests_ok": counts["ok"], "requests_lost": counts["lost"]}


def run(out: Path, quick: bool, minutes: float | None = None) -> dict[str, Any]:
    root = out / "models"
    _packages(root)
    n = 10 if quick else 100
    soak_s = (minutes * 60) if minutes else (20.0 if quick else 180.0)
    cfg = {
        "scheduler": {"batch": {"profiles": [1, 4, 8, 16]}, "executor": {"max_inflight": 2}},
        "runtime": {"profile": "sim-next"},
        "trust": {"model_root": str(root)},
        "admin": {"token": TOKEN},
        "models": {"qwen3": {"package": "a", "timing": "fast"},
                   "other": {"package": "b", "timing": "fast"}},
    }
    with Server.calserve(cfg, out / "server") as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            cyc = _cycles(srv, c, n)
        soak = _soak(srv, soak_s, 3.0)
    ts = _timeswitch_soak(out, root, 15.0 if quick else 60.0)
    doc = {"cycles": cyc, "switching_soak": soak, "timeswitch_soak_calrt_076": ts}
    (out / "lifecycle.json").write_text(json.dumps(doc, indent=1))
    return doc
