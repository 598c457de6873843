"""Periodic ``/metrics`` sampling: calserve's batch fill, queue depth and resource gauges over time.

Any ``calserve_*`` sample is kept (histogram buckets dropped: they are large and the load generator
measures latencies itself). Servers without calserve metrics just yield empty samples. Parsing uses
``prometheus_client.parser``; scraping once per ``interval`` costs the server one small response.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.httpclient import ConnectionPool, HttpError

__all__ = ["parse_metrics", "Scraper", "derive_series", "metric_value"]


def _key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def parse_metrics(text: str, prefix: str = "calserve_") -> dict[str, float]:
    """Flatten the exposition text into ``{"name{k=v,...}": value}`` for samples named ``prefix*``."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith(prefix) or s.name.endswith(("_bucket", "_created")):
                continue
            if math.isnan(s.value):
                continue
            out[_key(s.name, s.labels)] = float(s.value)
    return out


def metric_value(sample: dict[str, float], name: str, **labels: str) -> float | None:
    """Sum of all series of ``name`` whose labels include ``labels`` (None when absent)."""
    total = None
    for k, v in sample.items():
        base, _, rest = k.partition("{")
        if base != name:
            continue
        have = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if "=" in p)
        if all(have.get(lk) == lv for lk, lv in labels.items()):
            total = (total or 0.0) + v
    return total


class Scraper:
    """Samples ``GET /metrics`` every ``interval`` seconds until cancelled."""

    def __init__(self, pool: ConnectionPool, interval: float = 0.5, path: str = "/metrics") -> None:
        self.pool = pool
        self.interval = interval
        self.path = path
        self.samples: list[dict[str, Any]] = []  # {"t": s from t0, "values": {...}}
        self.errors = 0
        self.supported = True

    async def scrape_once(self, t0: float) -> dict[str, float] | None:
        try:
            resp = await self.pool.request("GET", self.path, None, {})
            body = await resp.read_all()
            await self.pool.release(resp.conn)
        except (HttpError, OSError, trio.BrokenResourceError):
            self.errors += 1
            return None
        if resp.status != 200:
            self.supported = resp.status != 404
            return None
        try:
            values = parse_metrics(body.decode("utf-8", "replace"))
        except ValueError:
            self.errors += 1
            return None
        self.samples.append({"t": round(trio.current_time() - t0, 4), "values": values})
        return values

    async def run(self, t0: float) -> None:
        while self.supported:
            await self.scrape_once(t0)
            await trio.sleep(self.interval)


def _counter_rate(samples: Sequence[dict[str, Any]], num: str, den: str) -> list[tuple[float, float]]:
    """Per-interval ratio of increments of two counters (e.g. active lanes / offered lanes)."""
    out = []
    prev: tuple[float, float] | None = None
    for s in samples:
        a, b = metric_value(s["values"], num), metric_value(s["values"], den)
        if a is None or b is None:
            continue
        if prev is not None and b - prev[1] > 0:
            out.append((s["t"], (a - prev[0]) / (b - prev[1])))
        prev = (a, b)
    return out


# Names tried in order; the HTTP layer's metric names (see calserve/api) are the first candidates.
FILL_GAUGES = ("calserve_batch_fill_ratio",)
FILL_COUNTERS = (("calserve_batch_lanes_active_total", "calserve_batch_lanes_total"),)
QUEUE_GAUGES = ("calserve_requests_waiting",)
RUNNING_GAUGES = ("calserve_requests_running",)


def derive_series(samples: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Time series the plots and summary use: batch fill, queue depth, running requests, plus any
    gauge whose name mentions ``fill``."""
    out: dict[str, list[tuple[float, float]]] = {}

    def gauge(names: Sequence[str]) -> list[tuple[float, float]]:
        for n in names:
            pts = [(s["t"], v) for s in samples if (v := metric_value(s["values"], n)) is not None]
            if pts:
                return pts
        return []

    fill: list[tuple[float, float]] = []
    for num, den in FILL_COUNTERS:
        fill = _counter_rate(samples, num, den)
        if fill:
            break
    if not fill:
        fill = gauge(FILL_GAUGES)
    if not fill:  # a histogram of per-batch fill: use its sum/count increments
        names = {k.partition("{")[0] for s in samples for k in s["values"]}
        for n in sorted(names):
            if "fill" in n and n.endswith("_sum") and n[:-4] + "_count" in names:
                fill = _counter_rate(samples, n, n[:-4] + "_count")
                break
    out["batch_fill"] = fill
    out["queue_depth"] = gauge(QUEUE_GAUGES)
    out["running"] = gauge(RUNNING_GAUGES)
    return out
