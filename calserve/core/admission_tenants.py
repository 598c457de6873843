"""Per-tenant bookkeeping of the admission controller (spec §5): each tenant's state, its QPS token
bucket, and the book of tenants seen so far with the set of busy ones.

Pure, like :mod:`calserve.core.admission`: nothing here reads a clock (``now`` is passed in). The
controller, its fair queue (:mod:`calserve.core.admission_queue`) and its checks
(:mod:`calserve.core.admission_checks`) are the only users.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import ItemsView, Mapping

from calserve.core.admission_types import TenantPolicy, WorkItem
from calserve.core.prefill import QueueClass
from calserve.core.wait_estimate import FlowLoad

__all__ = ["CLASSES", "EPS", "burst_size", "TokenBucket", "TenantState", "TenantBook"]

CLASSES = (QueueClass.SHORT, QueueClass.MEDIUM, QueueClass.LONG)  # the prefill classes, in tie order
EPS = 1e-9


def burst_size(p: TenantPolicy) -> int:
    """The tenant's token-bucket size: ``burst``, else ``max(1, ceil(qps))`` (1 without a QPS limit)."""
    if p.burst is not None:
        return p.burst
    return max(1, math.ceil(p.qps)) if p.qps is not None else 1


@dataclasses.dataclass(eq=False)
class TokenBucket:
    """A QPS token bucket: ``level`` tokens, refilled at the tenant's rate up to its burst size."""

    level: float
    at: float | None = None  # when the bucket was last refilled

    def refill(self, now: float, rate: float, size: int) -> None:
        """Add what ``rate`` (tokens/s) brought since the last refill, up to ``size``; a clock that
        went back adds nothing and keeps the later refill time."""
        if self.at is not None and now > self.at:
            self.level = min(float(size), self.level + (now - self.at) * rate)
        self.at = now if self.at is None else max(now, self.at)

    @property
    def empty(self) -> bool:
        """Less than one whole token (within rounding)."""
        return self.level < 1.0 - EPS

    def wait_s(self, rate: float) -> float:
        """Seconds until one whole token is back at ``rate``."""
        return (1.0 - self.level) / rate

    def take(self) -> None:
        self.level -= 1.0


@dataclasses.dataclass(eq=False)
class TenantState:
    """Per-tenant mutable state; only the admission controller and its parts touch it."""

    name: str
    policy: TenantPolicy
    bucket: TokenBucket  # QPS token bucket
    # FIFO per prefill class; may hold removed items (dropped lazily at the front).
    queues: dict[QueueClass, deque[WorkItem]] = dataclasses.field(
        default_factory=lambda: {c: deque() for c in CLASSES})
    flows: dict[QueueClass, FlowLoad] = dataclasses.field(
        default_factory=lambda: {c: FlowLoad() for c in CLASSES})  # live waiting load per class
    load: FlowLoad = dataclasses.field(default_factory=FlowLoad)  # live waiting load, all classes
    # Class virtual times (cost / class weight) and the tenant's class clock (the start tag of the
    # last item taken), for the within-tenant class share (see calserve.core.admission).
    cvt: dict[QueueClass, float] = dataclasses.field(default_factory=lambda: {c: 0.0 for c in CLASSES})
    cclock: float = 0.0
    # Per class: (when, cost, prefill seconds, decode length) of its last offered request (demand,
    # accepted or not): a class seen lately counts as busy in the expected wait (its arrivals pass).
    last_seen: dict[QueueClass, tuple[float, float, float, float]] = dataclasses.field(default_factory=dict)
    waiting: int = 0  # live items in queue
    waiting_tokens: int = 0
    active: set[int] = dataclasses.field(default_factory=set)
    # Virtual time from delivered service: sum(charged cost) / weight, lifted on return from idle.
    vt: float = 0.0
    # Estimated cost not yet delivered of this tenant's active requests (cost units).
    est: float = 0.0
    service: float = 0.0  # delivered cost units, never lifted (a metric)
    # Decode-lane VTC counter: delivered / weight, lifted on return from idle.
    lane_vt: float = 0.0
    version: int = 0  # fair-queue heap entries with another version are stale
    in_heap: bool = False  # a live fair-queue heap entry exists

    @property
    def weight(self) -> float:
        return self.policy.weight

    def effective_vt(self) -> float:
        return self.vt + self.est / self.policy.weight

    def capped(self) -> bool:
        """At its ``max_active_sequences``: passed over by the fair queue until one ends."""
        cap = self.policy.max_active_sequences
        return cap is not None and len(self.active) >= cap

    def deliver(self, amount: float) -> None:
        """``amount`` cost units of service delivered: the metric and both virtual clocks grow."""
        self.service += amount
        self.vt += amount / self.weight
        self.lane_vt += amount / self.weight


class TenantBook:
    """The tenants seen so far (created on first use with their configured policy) and the busy set.

    # Invariant: name in busy <=> that tenant has something waiting or active (callers keep it by
    #   calling mark_busy before queueing and settle after a request leaves the queue or ends).
    """

    def __init__(self, policies: Mapping[str, TenantPolicy], default: TenantPolicy) -> None:
        self._policies = dict(policies)
        self._default = default
        self._tenants: dict[str, TenantState] = {}
        #: The tenants created so far by name (read-only for callers: :meth:`get` creates them).
        self.states: Mapping[str, TenantState] = self._tenants
        self.busy: set[str] = set()

    def policy(self, name: str) -> TenantPolicy:
        """The configured policy of ``name`` (the default one for unknown tenants)."""
        return self._policies.get(name, self._default)

    def get(self, name: str) -> TenantState:
        """The tenant's state, created (full token bucket) on first use."""
        t = self._tenants.get(name)
        if t is None:
            p = self.policy(name)
            t = TenantState(name, p, TokenBucket(float(burst_size(p))))
            self._tenants[name] = t
        return t

    def find(self, name: str) -> TenantState | None:
        """The tenant's state if it was seen, else None (nothing is created)."""
        return self._tenants.get(name)

    def __getitem__(self, name: str) -> TenantState:
        return self._tenants[name]

    def items(self) -> ItemsView[str, TenantState]:
        return self._tenants.items()

    def weight(self, name: str) -> float:
        t = self._tenants.get(name)
        return (t.policy if t is not None else self.policy(name)).weight

    def lane_virtual_time(self, name: str) -> float:
        t = self._tenants.get(name)
        return 0.0 if t is None else t.lane_vt

    def mark_busy(self, t: TenantState) -> None:
        """``t`` is about to have something waiting. Idle -> busy: no banked credit for decode lanes
        (its lane clock is lifted to the least-served busy tenant's)."""
        if t.name not in self.busy:
            floor = min((self._tenants[n].lane_vt for n in self.busy), default=t.lane_vt)
            t.lane_vt = max(t.lane_vt, floor)
            self.busy.add(t.name)

    def settle(self, t: TenantState) -> None:
        """``t`` lost a waiting or active request: not busy any more once it has neither."""
        if not t.waiting and not t.active:
            self.busy.discard(t.name)

    def others_waiting(self, t: TenantState) -> list[tuple[float, FlowLoad]]:
        """(weight, total waiting load) of every other busy tenant with requests waiting."""
        out: list[tuple[float, FlowLoad]] = []
        for name in self.busy:
            u = self._tenants[name]
            if u is not t and u.waiting:
                out.append((u.weight, u.load))
        return out
