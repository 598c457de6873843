"""The fault and degradation metrics (spec §14, §16 "recovery"), read from one statistics snapshot.

Kept apart from :mod:`calserve.api.metrics` (the general collector calls :func:`fault_metrics`).
Labels are bounded: ``state`` (dual/single/off), ``reason`` (the §14 conditions), ``state`` of the
reset budget (ok/degraded/failed), fault ``reason``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from calserve.engine.types import EngineStatistics

__all__ = ["fault_metrics", "PINGPONG_STATES", "BUDGET_LEVELS", "DEGRADE_REASONS"]

PINGPONG_STATES = ("dual", "single", "off")
BUDGET_LEVELS = ("ok", "degraded", "failed")
DEGRADE_REASONS = ("crosstalk", "anomaly", "p99", "busy", "faults", "uncertain", "reset_budget")


def _one_hot(name: str, doc: str, states: tuple[str, ...], current: str) -> Metric:
    """A ``state``-labelled gauge: 1 for ``current``, 0 for every other known state."""
    g = GaugeMetricFamily(name, doc, labels=["state"])
    for state in states:
        g.add_metric([state], 1.0 if current == state else 0.0)
    return g


def fault_metrics(s: EngineStatistics) -> Iterator[Metric]:
    yield _one_hot("calserve_pingpong_state", "1 for the job engines' current mode: dual "
                   "(PING/PONG), single (degraded, spec §14), off (one engine configured)",
                   PINGPONG_STATES, s.pingpong_state)
    deg = CounterMetricFamily("calserve_pingpong_degradations", "PING/PONG degradations by reason",
                              labels=["reason"])
    for r in DEGRADE_REASONS:
        deg.add_metric([r], float(s.pingpong_degradations_total.get(r, 0)))
    yield deg
    yield _one_hot("calserve_reset_budget_state", "1 for the reset budget's level: ok, "
                   "degraded (spent: one engine, smallest profile), failed",
                   BUDGET_LEVELS, s.reset_budget_level)
    yield GaugeMetricFamily("calserve_resets_in_window", "Device resets in the last 10 minutes "
                            "on this board (persisted across restarts)", value=s.resets_in_window)
    yield CounterMetricFamily("calserve_uncertain_recoveries", "Recoveries whose reset failed or "
                              "left the device faulted", value=s.uncertain_recoveries_total)
    eps = CounterMetricFamily("calserve_recovery_episodes", "Recovery episodes by the fault "
                              "reason that started them", labels=["reason"])
    secs = CounterMetricFamily("calserve_recovery_episode_seconds", "Fault report to end of "
                               "recovery, summed per fault reason", labels=["reason"])
    worst = GaugeMetricFamily("calserve_recovery_episode_max_seconds", "Longest recovery episode "
                              "per fault reason", labels=["reason"])
    for r, (n, total, mx) in sorted(s.recovery_seconds_by_reason.items()):
        eps.add_metric([r], float(n))
        secs.add_metric([r], total)
        worst.add_metric([r], mx)
    yield from (eps, secs, worst)
