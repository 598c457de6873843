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
from collections.abc import Collection, Mapping

from calserve.config import QueuesConfig

__all__ = ["QueueClass", "classify", "ServiceRoundRobin", "RoundRobinStats", "weights_from_config"]


class QueueClass(enum.Enum):
    DECODE = "decode"
    SHORT = "short"
    MEDIUM = "medium"
    LONG = "long"


def classify(prompt_tokens: int, queues_cfg: QueuesConfig) -> QueueClass:
    """The prefill class of a prompt of ``prompt_tokens`` tokens (never DECODE)."""
    raise NotImplementedError


def weights_from_config(queues_cfg: QueuesConfig) -> dict[QueueClass, int]:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class RoundRobinStats:
    picks: Mapping[QueueClass, int]  # service opportunities granted per class since creation
    weights: Mapping[QueueClass, int]


class ServiceRoundRobin:
    """Smooth weighted round robin over the classes that currently have work."""

    def __init__(self, weights: Mapping[QueueClass, int]) -> None:
        raise NotImplementedError

    @classmethod
    def from_config(cls, queues_cfg: QueuesConfig) -> ServiceRoundRobin:
        raise NotImplementedError

    def next(self, available: Collection[QueueClass]) -> QueueClass | None:
        """The class that gets the next service opportunity, among ``available`` (non-empty) ones;
        None when nothing is available."""
        raise NotImplementedError

    def statistics(self) -> RoundRobinStats:
        raise NotImplementedError
