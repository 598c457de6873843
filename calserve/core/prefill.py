"""Prefill policy (spec §6): size classes and a weighted round robin of service opportunities.

Queues: decode, short (≤ ``short_prefill_max_tokens``, 512), medium (≤ ``medium_prefill_max_tokens``,
4096), long (> 4096). Each time the device can take a job, :class:`ServiceRoundRobin` picks which
class gets the opportunity, decode:short:medium:long = 8:4:2:1 by default (``scheduler.queues``).

It is a *smooth* weighted round robin (nginx): over any window of ``sum(weights)`` consecutive picks in
which a class is continuously non-empty it receives exactly its weight's worth, and its picks are
spread out rather than bunched. Empty classes are skipped (their share goes to the others), so the
device never idles while work exists; a long prefill that is waiting keeps its guaranteed share
``long / (decode + short + medium + long)`` under sustained decode and short traffic.

No chunked prefill: a prompt is prefilled in one job unless the runtime declares incremental prefill
(``RuntimeCapabilities.incremental_prefill``; no 0.7.6 profile does), so long work is controlled
only through this share, admission and per-tenant quotas (spec §6).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Mapping, Sequence

from calserve.config import QueuesConfig

__all__ = ["QueueClass", "classify", "ServiceRoundRobin", "RoundRobinStats", "weights_from_config",
           "fair_prefill_index"]


class QueueClass(enum.Enum):
    DECODE = "decode"
    SHORT = "short"
    MEDIUM = "medium"
    LONG = "long"

    # Members are singletons compared by identity: the identity hash is the same dict semantics as
    # Enum's ``hash(self._name_)``, without a Python-level call per lookup (the planner looks up
    # queues by class several times per decode step).
    __hash__ = object.__hash__


_CLASSES: tuple[QueueClass, ...] = tuple(QueueClass)  # iterating the Enum itself is a generator


def classify(prompt_tokens: int, queues_cfg: QueuesConfig) -> QueueClass:
    """The prefill class of a prompt of ``prompt_tokens`` tokens (never DECODE)."""
    if prompt_tokens <= queues_cfg.short_prefill_max_tokens:
        return QueueClass.SHORT
    if prompt_tokens <= queues_cfg.medium_prefill_max_tokens:
        return QueueClass.MEDIUM
    return QueueClass.LONG


def weights_from_config(queues_cfg: QueuesConfig) -> dict[QueueClass, int]:
    return {
        QueueClass.DECODE: queues_cfg.decode_weight,
        QueueClass.SHORT: queues_cfg.short_prefill_weight,
        QueueClass.MEDIUM: queues_cfg.medium_prefill_weight,
        QueueClass.LONG: queues_cfg.long_prefill_weight,
    }


@dataclasses.dataclass(frozen=True)
class RoundRobinStats:
    picks: Mapping[QueueClass, int]  # service opportunities granted per class since creation
    weights: Mapping[QueueClass, int]


class ServiceRoundRobin:
    """Smooth weighted round robin over the classes that currently have work.

    Each pick adds every available class's weight to its credit, grants the class with the most
    credit (ties: decode, short, medium, long order) and takes the total available weight off it.
    # Invariant: the credits of all classes sum to 0 after every pick, and every credit stays within
    #   (-W, W) for W the total weight: an unavailable class keeps (freezes) its credit, so an empty
    #   class can bank at most one round's worth, and a class that was just served keeps its debt.
    Hence in any run of ``n`` picks in which a class stays available with a fixed set of available
    classes of total weight W, it gets at least ``floor(n * w / W) - 1`` opportunities (tested with
    a sustained decode+short load: the long class is never starved).
    """

    def __init__(self, weights: Mapping[QueueClass, int]) -> None:
        for c in QueueClass:
            w = weights.get(c)
            if w is None or w < 1:
                raise ValueError(f"weight of queue class {c.value} must be an int >= 1, got {w}")
        self._weights = {c: int(weights[c]) for c in QueueClass}
        self._credit = {c: 0 for c in QueueClass}
        self._picks = {c: 0 for c in QueueClass}

    @classmethod
    def from_config(cls, queues_cfg: QueuesConfig) -> ServiceRoundRobin:
        return cls(weights_from_config(queues_cfg))

    def next(self, available: Collection[QueueClass]) -> QueueClass | None:
        """The class that gets the next service opportunity, among ``available`` (non-empty) ones;
        None when nothing is available."""
        best = self.peek(available)
        if best is None:
            return None
        if len(available) > 1:  # one class: its credit goes +w -w (unchanged)
            total = 0
            for c in _CLASSES:
                if c in available:
                    self._credit[c] += self._weights[c]
                    total += self._weights[c]
            self._credit[best] -= total
        self._picks[best] += 1
        return best

    def peek(self, available: Collection[QueueClass]) -> QueueClass | None:
        """The class :meth:`next` grants for ``available`` now, without granting it: the most
        credit once each available class's weight is added (ties: decode, short, medium, long)."""
        if len(available) == 1:
            for only in available:
                return only
        best: QueueClass | None = None
        best_credit = 0
        for c in _CLASSES:
            if c in available:
                credit = self._credit[c] + self._weights[c]
                if best is None or credit > best_credit:
                    best, best_credit = c, credit
        return best

    def statistics(self) -> RoundRobinStats:
        return RoundRobinStats(picks=dict(self._picks), weights=dict(self._weights))


def fair_prefill_index(tenants: Sequence[str], tenant_vt: Mapping[str, float]) -> int:
    """Which of a prefill class's queued prompts (``tenants``: each one's tenant, in queue order)
    runs next under the fair policy: the first one of the tenant with the least weighted delivered
    service (``tenant_vt``, the decode lanes' VTC counter; a tenant missing counts as 0.0).

    Admission already hands requests out in fair order, one at a time while lanes free up one at a
    time; but when many lanes are free at once (start-up, a burst of endings) it admits everything
    that fits in arrival order, and a FIFO prefill queue would then give one tenant's prompts the
    device back to back (measured: 24 prompts of one tenant ahead of another's, a 7,000 cost-unit
    gap at start-up). Picking by the counter charges the prompts as VTC charges input tokens: to the
    least-served tenant first. Within a tenant: queue order. ``tenants`` must not be empty."""
    best = 0
    best_vt = tenant_vt.get(tenants[0], 0.0)
    for i in range(1, len(tenants)):
        v = tenant_vt.get(tenants[i], 0.0)
        if v < best_vt:
            best, best_vt = i, v
    return best
