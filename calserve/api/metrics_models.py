"""Prometheus families of the model control plane (spec §16 "model" row, issue 14), read from the
engine's :class:`~calserve.engine.control.ModelControl` on each scrape (duck-typed: the web layer
imports no engine module). Labels are bounded: alias, state, phase, op, result.

- ``calserve_model_phase_seconds{phase}``: histogram of load / configure / warmup / drain / unload
- ``calserve_model_switches_total{alias}``: replacements published (a rollback is one)
- ``calserve_model_operations_total{op,result}``: admin operations (load/unload/rollback/auto_rollback)
- ``calserve_model_generations{state}``: generations held, by state (a draining old one included)
- ``calserve_model_waiting_requests``: requests waiting for a single-resident switch (WaitingModel)
- ``calserve_model_dram_mismatch_total``: unloads that freed other than the DRAM they were charged
- ``calserve_device_dram_used_bytes`` / ``calserve_device_dram_capacity_bytes``
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector

__all__ = ["ModelControlCollector"]


class ModelControlCollector(Collector):
    def __init__(self, engine: Callable[[], Any]) -> None:
        self._engine = engine  # the running engine or None

    def collect(self) -> Iterator[Metric]:
        eng = self._engine()
        ctl = getattr(eng, "control", None)
        if ctl is None:
            return
        from calserve.engine.unload import PHASE_BUCKETS  # lazy: only with a real engine

        h = HistogramMetricFamily("calserve_model_phase_seconds",
                                  "Duration of model lifecycle phases", labels=["phase"])
        for phase, hist in ctl.phases.items():
            buckets = [(str(b), float(c)) for b, c in zip(PHASE_BUCKETS, hist.buckets)]
            buckets.append(("+Inf", float(hist.count)))
            h.add_metric([phase], buckets, hist.total)
        yield h
        sw = CounterMetricFamily("calserve_model_switches", "Replacements published per alias",
                                 labels=["alias"])
        for alias, n in sorted(ctl.switches_total.items()):
            sw.add_metric([alias], n)
        yield sw
        ops = CounterMetricFamily("calserve_model_operations", "Model lifecycle operations",
                                  labels=["op", "result"])
        for (op, result), n in sorted(ctl.operations_total.items()):
            ops.add_metric([op, result], n)
        yield ops
        gens = GaugeMetricFamily("calserve_model_generations", "Generations held, by state",
                                 labels=["state"])
        counts: dict[str, int] = {}
        for g in list(ctl.models.generations.values()):
            counts[g.state.value] = counts.get(g.state.value, 0) + 1
        for state, n in sorted(counts.items()):
            gens.add_metric([state], n)
        yield gens
        yield GaugeMetricFamily("calserve_model_waiting_requests",
                                "Requests waiting for a model switch (WaitingModel)",
                                value=ctl.waiting_model)
        yield CounterMetricFamily("calserve_model_dram_mismatch",
                                  "Unloads that freed other than the device DRAM they were charged",
                                  value=ctl.unloader.dram_mismatch_total)
        cap, used = ctl.backend.dram()
        yield GaugeMetricFamily("calserve_device_dram_used_bytes", "Device DRAM in use",
                                value=used)
        yield GaugeMetricFamily("calserve_device_dram_capacity_bytes", "Device DRAM capacity",
                                value=cap)
