"""Admission control and per-tenant weighted fair queuing (spec §5).

The controller is a pure object: every method takes ``now`` (seconds, from the caller's clock) and
nothing here reads a clock or blocks. The engine calls:

- :meth:`AdmissionController.offer` when a request arrives: RejectInvalid (can never fit), RejectCapacity
  (queue/token budget/tenant quota full, with ``retry_after_s``), RejectUnavailable (model not
  accepting), Deadline (already expired) or Queue (it is now waiting).
- :meth:`AdmissionController.pop_admissible` whenever lanes/KV free up: the waiting items to admit
  now, in fair order. Popped items count as active for their tenant until :meth:`release`.
- :meth:`remove` on cancel while queued, :meth:`expire` at :meth:`next_deadline`.
- :meth:`charge` as service is delivered (tokens prefilled / decoded) and :meth:`release` when the
  sequence ends: a request that stops early is only charged what it got (refund).

Fairness (spec §5.3, VTC-style): ``cost = prompt_tokens + output_token_cost * max_new_tokens`` and
``virtual_finish = max(tenant_virtual_time, global_virtual_time) + cost / weight``, where the max is
taken when the tenant's queue goes from empty to non-empty (afterwards its own tags chain). A tenant's
virtual
time is its delivered service divided by its weight plus the not-yet-delivered estimate of its active
requests; the estimate shrinks as :meth:`charge` turns it into delivered service and is dropped on
:meth:`release`. A tenant that arrives with an empty queue is lifted to the global virtual time, so
idleness banks no credit. Weights and limits come from the control plane (config), never from request
parameters.

Inside a tenant the queue is split by prefill class (short/medium/long, spec §6) and the classes share
the tenant's turns by cost with the class weights (4:2:1 by default), the same virtual-time rule one
level down: short prompts are not stuck behind a tenant's long ones, and long ones keep their share
(never starved). Within a class, FIFO.

Overload (spec §5.2 "Queue: only while there is hope"): with a :class:`ServiceModel`, :meth:`offer`
refuses (REJECT_CAPACITY, Retry-After = the excess) a request whose expected wait
(:mod:`calserve.core.wait_estimate`) exceeds ``min(max_expected_wait_s, deadline - now)``, and
:meth:`pop_admissible` holds at most ``max_running`` sequences active (TPOT bound).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Literal

from calserve.config import QueuesConfig
from calserve.core.admission_types import (
    AdmissionDecision,
    AdmissionStats,
    CapacityBudget,
    Outcome,
    TenantPolicy,
    TenantStats,
    WorkItem,
)
from calserve.core.prefill import QueueClass, classify, weights_from_config
from calserve.core.service_tracker import ServiceTracker
from calserve.core.wait_estimate import FlowLoad, ServiceModel, WaitEstimate, expected_wait

__all__ = [
    "CapacityBudget",
    "Outcome",
    "AdmissionDecision",
    "TenantPolicy",
    "WorkItem",
    "TenantStats",
    "AdmissionStats",
    "AdmissionController",
]


# A hint for clients when a queue/token budget is full: roughly one decode round of a busy device.
QUEUE_FULL_RETRY_S = 1.0
MIN_RETRY_S = 0.1  # the smallest Retry-After hint for an expected-wait refusal
RECENT_CLASS_S = 1.0  # a class offered within this counts as busy for the other classes' estimate
_CLASSES = (QueueClass.SHORT, QueueClass.MEDIUM, QueueClass.LONG)
UNAVAILABLE_RETRY_S = 5.0
_EPS = 1e-9


@dataclasses.dataclass(eq=False)
class _Tenant:
    """Per-tenant mutable state; only :class:`AdmissionController` touches it."""

    name: str
    policy: TenantPolicy
    # FIFO per prefill class; may hold removed items (dropped lazily at the front).
    queues: dict[QueueClass, deque[WorkItem]] = dataclasses.field(
        default_factory=lambda: {c: deque() for c in _CLASSES})
    flows: dict[QueueClass, FlowLoad] = dataclasses.field(
        default_factory=lambda: {c: FlowLoad() for c in _CLASSES})  # live waiting load per class
    load: FlowLoad = dataclasses.field(default_factory=FlowLoad)  # live waiting load, all classes
    # Class virtual times (cost / class weight) and the tenant's class clock (the start tag of the
    # last item taken), for the within-tenant class share (module doc).
    cvt: dict[QueueClass, float] = dataclasses.field(default_factory=lambda: {c: 0.0 for c in _CLASSES})
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
    # Decode-lane VTC counter: delivered / weight, lifted on return from idle (see module doc).
    lane_vt: float = 0.0
    bucket: float = 0.0  # QPS token bucket level
    bucket_at: float | None = None  # when the bucket was last refilled
    version: int = 0  # heap entries with another version are stale
    in_heap: bool = False  # a live heap entry exists

    @property
    def weight(self) -> float:
        return self.policy.weight

    def effective_vt(self) -> float:
        return self.vt + self.est / self.policy.weight


class AdmissionController:
    """Spec §5: budgets, the five outcomes, and the per-tenant weighted fair queue.

    ``policy="fcfs"`` keeps all checks but pops in arrival order (for side-by-side benchmarks).

    Not thread-safe: one owner (the engine's scheduler task) calls it.
    """

    def __init__(
        self,
        budget: CapacityBudget,
        max_seq: int,
        tenants: Mapping[str, TenantPolicy],
        default_policy: TenantPolicy = TenantPolicy(),
        output_token_cost: float = 2.0,
        policy: Literal["wfq", "fcfs"] = "wfq",
        *,
        queues: QueuesConfig | None = None,
        service: ServiceModel | None = None,
        max_expected_wait_s: float | None = None,
        max_running: int | None = None,
    ) -> None:
        """``queues``: prefill class thresholds and weights (default :class:`QueuesConfig`);
        ``service``: how fast the device serves (None = unknown: no expected-wait refusals);
        ``max_expected_wait_s``: the queue-wait SLO (None = deadlines only); ``max_running``: cap on
        active sequences (None = the free lanes the caller passes)."""
        if policy not in ("wfq", "fcfs"):
            raise ValueError(f"policy must be 'wfq' or 'fcfs', got {policy!r}")
        if output_token_cost <= 0:
            raise ValueError(f"output_token_cost must be > 0, got {output_token_cost}")
        if max_seq < 2:
            raise ValueError(f"max_seq must be >= 2, got {max_seq}")
        for name, p in [*tenants.items(), ("<default>", default_policy)]:
            if not p.weight > 0:
                raise ValueError(f"tenants.{name}.weight must be > 0, got {p.weight}")
        if max_expected_wait_s is not None and not max_expected_wait_s > 0:
            raise ValueError(f"max_expected_wait_s must be > 0, got {max_expected_wait_s}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.budget = budget
        self.max_seq = max_seq
        self.queues_cfg = queues if queues is not None else QueuesConfig()
        self._cw = weights_from_config(self.queues_cfg)
        self.service = service if service is not None else ServiceModel(0.0, 1)
        self.max_expected_wait_s = max_expected_wait_s
        self.max_running = max_running
        self._svc = ServiceTracker(self.service)  # what the active requests still need; speed
        self._load = FlowLoad()  # all waiting requests (FCFS estimate)
        self._rejected_wait = 0
        self._last_wait = 0.0
        self.output_token_cost = output_token_cost
        self.policy = policy
        self._policies = dict(tenants)
        self._default = default_policy
        self._tenants: dict[str, _Tenant] = {}
        self._items: dict[int, WorkItem] = {}  # waiting, by request id
        self._active: dict[int, str] = {}  # popped and not released: request id -> tenant
        self._remaining: dict[int, float] = {}  # active request id -> estimate not yet charged
        self._waiting_tokens = 0
        self._seq = itertools.count()
        # WFQ: (virtual_finish of the tenant's head, tie, version, tenant). Invariant: for a tenant
        # with in_heap, exactly one entry has its version, and its key <= the tenant's true key.
        self._heap: list[tuple[float, int, int, str]] = []
        self._fifo: deque[WorkItem] = deque()  # FCFS order (may hold removed items)
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline, tie, request id), lazy
        self._gvt = 0.0  # global virtual time: start tag of the last admitted item, monotone
        self._decisions = {o: 0 for o in Outcome}
        # Tenants with something waiting or active. Invariant: name in _busy <=> t.waiting or t.active.
        self._busy: set[str] = set()

    # -- helpers ------------------------------------------------------------------------------

    def _tenant(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            p = self._policies.get(name, self._default)
            t = _Tenant(name, p)
            t.bucket = float(self._burst(p))
            self._tenants[name] = t
        return t

    @staticmethod
    def _burst(p: TenantPolicy) -> int:
        if p.burst is not None:
            return p.burst
        return max(1, math.ceil(p.qps)) if p.qps is not None else 1

    def cost(self, item: WorkItem) -> float:
        """The fair-queue cost of a request (spec §5.3), in cost units."""
        return item.prompt_tokens + self.output_token_cost * item.max_new_tokens

    def qclass(self, item: WorkItem) -> QueueClass:
        """The prefill class of ``item`` (its sub-queue inside its tenant)."""
        return classify(item.prompt_tokens, self.queues_cfg)

    def _class_head(self, t: _Tenant, c: QueueClass) -> WorkItem | None:
        q = t.queues[c]
        while q and q[0].request_id not in self._items:
            q.popleft()
        return q[0] if q else None

    def _select(self, t: _Tenant) -> tuple[QueueClass, WorkItem] | None:
        """The tenant's next item: among its classes' heads, the least class virtual finish
        ``cvt[c] + cost / class_weight`` (ties: short, medium, long)."""
        best: tuple[QueueClass, WorkItem] | None = None
        best_key = math.inf
        for c in _CLASSES:
            h = self._class_head(t, c)
            if h is None:
                continue
            k = t.cvt[c] + self.cost(h) / self._cw[c]
            if best is None or k < best_key - _EPS:
                best, best_key = (c, h), k
        return best

    def _head(self, t: _Tenant) -> WorkItem | None:
        sel = self._select(t)
        return sel[1] if sel is not None else None

    def _key(self, t: _Tenant, head: WorkItem) -> float:
        # The tenant's start tag is its own virtual time: the lift to the global virtual time happens
        # once, when the tenant's queue goes from empty to non-empty (offer). Lifting here on every
        # decision would push a backlogged tenant's tag up each time another tenant is served.
        return t.effective_vt() + self.cost(head) / t.weight

    def _push(self, t: _Tenant) -> None:
        """(Re)insert ``t`` with its true key, invalidating older entries."""
        head = self._head(t)
        t.version += 1
        if head is None:
            t.in_heap = False
            return
        t.in_heap = True
        heapq.heappush(self._heap, (self._key(t, head), next(self._seq), t.version, t.name))

    def _decide(self, outcome: Outcome, reason: str, param: str | None = None,
                retry_after_s: float | None = None, quota: bool = False) -> AdmissionDecision:
        self._decisions[outcome] += 1
        return AdmissionDecision(outcome, reason, param, retry_after_s, quota)

    def _invalid(self, item: WorkItem) -> AdmissionDecision | None:
        b = self.budget
        if item.prompt_tokens < 1:
            return self._decide(Outcome.REJECT_INVALID, "the prompt is empty", "prompt")
        if item.max_new_tokens < 1:
            return self._decide(Outcome.REJECT_INVALID, "max_tokens must be >= 1", "max_tokens")
        for limit, what in ((self.max_seq, "the model's context (max_seq)"),
                            (b.max_kv_tokens, "the KV budget (max_kv_tokens)")):
            if item.prompt_tokens >= limit:
                return self._decide(
                    Outcome.REJECT_INVALID,
                    f"prompt of {item.prompt_tokens} tokens leaves no room in {what} of {limit}",
                    "prompt")
            if item.kv_tokens > limit:
                return self._decide(
                    Outcome.REJECT_INVALID,
                    f"prompt ({item.prompt_tokens}) + max_tokens ({item.max_new_tokens}) = "
                    f"{item.kv_tokens} tokens exceeds {what} of {limit}",
                    "max_tokens")
        if item.prompt_tokens > b.max_waiting_prompt_tokens:
            return self._decide(
                Outcome.REJECT_INVALID,
                f"prompt of {item.prompt_tokens} tokens exceeds max_waiting_prompt_tokens "
                f"{b.max_waiting_prompt_tokens}: it could never be queued", "prompt")
        p = self._policies.get(item.tenant, self._default)
        if p.max_waiting_tokens is not None and item.prompt_tokens > p.max_waiting_tokens:
            return self._decide(
                Outcome.REJECT_INVALID,
                f"prompt of {item.prompt_tokens} tokens exceeds tenant {item.tenant!r} "
                f"max_waiting_tokens {p.max_waiting_tokens}", "prompt")
        return None

    # -- decisions ----------------------------------------------------------------------------

    def offer(self, item: WorkItem, now: float, model_accepting: bool) -> AdmissionDecision:
        """Decide what happens to a new request. On QUEUE the item is now waiting here."""
        if item.request_id in self._items or item.request_id in self._active:
            raise ValueError(f"request {item.request_id} is already known to admission")
        bad = self._invalid(item)
        if bad is not None:
            return bad
        if not model_accepting:
            return self._decide(Outcome.REJECT_UNAVAILABLE, "the model is not accepting requests",
                                retry_after_s=UNAVAILABLE_RETRY_S)
        if item.deadline is not None and item.deadline <= now:
            return self._decide(Outcome.DEADLINE, "the deadline passed before admission")
        b = self.budget
        if len(self._items) + 1 > b.max_waiting_requests:
            return self._decide(Outcome.REJECT_CAPACITY,
                                f"max_waiting_requests ({b.max_waiting_requests}) reached",
                                retry_after_s=QUEUE_FULL_RETRY_S)
        if self._waiting_tokens + item.prompt_tokens > b.max_waiting_prompt_tokens:
            return self._decide(Outcome.REJECT_CAPACITY,
                                f"max_waiting_prompt_tokens ({b.max_waiting_prompt_tokens}) reached",
                                retry_after_s=QUEUE_FULL_RETRY_S)
        t = self._tenant(item.tenant)
        p = t.policy
        if p.max_waiting_tokens is not None and (
                t.waiting_tokens + item.prompt_tokens > p.max_waiting_tokens):
            return self._decide(Outcome.REJECT_CAPACITY,
                                f"tenant {t.name!r} max_waiting_tokens ({p.max_waiting_tokens}) "
                                f"reached", retry_after_s=QUEUE_FULL_RETRY_S, quota=True)
        if p.qps is not None:
            burst = self._burst(p)
            if t.bucket_at is not None and now > t.bucket_at:
                t.bucket = min(float(burst), t.bucket + (now - t.bucket_at) * p.qps)
            t.bucket_at = now if t.bucket_at is None else max(now, t.bucket_at)
            if t.bucket < 1.0 - _EPS:
                return self._decide(Outcome.REJECT_CAPACITY,
                                    f"tenant {t.name!r} qps ({p.qps}/s, burst {burst}) exceeded",
                                    retry_after_s=(1.0 - t.bucket) / p.qps, quota=True)
        t.last_seen[self.qclass(item)] = (now, self.cost(item), self.service.prefill_s(item.prompt_tokens),
                                          float(item.max_new_tokens - 1))
        if self.service.known or self._svc.lane_step_s is not None:
            limit = math.inf if self.max_expected_wait_s is None else self.max_expected_wait_s
            if item.deadline is not None:
                limit = min(limit, item.deadline - now)
            est = self.expected_wait(item, now).seconds
            self._last_wait = est
            if est > limit:
                self._rejected_wait += 1
                return self._decide(
                    Outcome.REJECT_CAPACITY,
                    f"overloaded: expected queue wait {est * 1e3:.0f} ms exceeds "
                    + (f"max_expected_wait_ms ({self.max_expected_wait_s * 1e3:.0f})"
                       if self.max_expected_wait_s is not None and limit == self.max_expected_wait_s
                       else "the request's deadline"),
                    retry_after_s=max(MIN_RETRY_S, est - limit))
        if p.qps is not None:
            t.bucket -= 1.0
        # Accepted: queue it.
        if t.name not in self._busy:
            # Idle -> busy: no banked credit for decode lanes (lift to the least-served busy tenant).
            floor = min((self._tenants[n].lane_vt for n in self._busy), default=t.lane_vt)
            t.lane_vt = max(t.lane_vt, floor)
            self._busy.add(t.name)
        if t.waiting == 0 and self.policy == "wfq":
            # Returning from idle (empty queue): no banked credit (spec §5.3, VTC lift).
            t.vt = max(t.vt, self._gvt - t.est / t.weight)
        c = self.qclass(item)
        if t.flows[c].n == 0:
            t.cvt[c] = max(t.cvt[c], t.cclock)  # an idle class banks no credit either
        self._items[item.request_id] = item
        t.queues[c].append(item)
        self._add_load(t, c, item, 1)
        t.waiting += 1
        t.waiting_tokens += item.prompt_tokens
        self._waiting_tokens += item.prompt_tokens
        if self.policy == "fcfs":
            self._fifo.append(item)
        else:
            self._push(t)  # a new class head may lower the tenant's key
        if item.deadline is not None:
            heapq.heappush(self._deadlines, (item.deadline, next(self._seq), item.request_id))
        return self._decide(Outcome.QUEUE, "queued")

    def _add_load(self, t: _Tenant, c: QueueClass, item: WorkItem, sign: int) -> None:
        args = (self.cost(item), self.service.prefill_s(item.prompt_tokens),
                float(item.max_new_tokens - 1), sign)
        t.flows[c].add(*args)
        t.load.add(*args)
        self._load.add(*args)

    def _take(self, item: WorkItem, t: _Tenant) -> None:
        """Move ``item`` from waiting to active (it must be the tenant's head in WFQ)."""
        del self._items[item.request_id]
        c = self.qclass(item)
        self._add_load(t, c, item, -1)
        t.cclock = max(t.cclock, t.cvt[c])
        t.cvt[c] += self.cost(item) / self._cw[c]
        self._svc.admit(item.request_id, item.prompt_tokens, item.max_new_tokens)
        t.waiting -= 1
        t.waiting_tokens -= item.prompt_tokens
        self._waiting_tokens -= item.prompt_tokens
        self._gvt = max(self._gvt, t.effective_vt())
        cost = self.cost(item)
        t.est += cost
        self._remaining[item.request_id] = cost
        t.active.add(item.request_id)
        self._active[item.request_id] = t.name
        self._decisions[Outcome.ADMIT] += 1

    def _capped(self, t: _Tenant) -> bool:
        cap = t.policy.max_active_sequences
        return cap is not None and len(t.active) >= cap

    def pop_admissible(self, now: float, free_sequences: int, free_kv_tokens: int) -> list[WorkItem]:
        """The waiting items to admit now, in fair order, within ``free_sequences`` lanes and
        ``free_kv_tokens`` KV tokens (each item needs ``item.kv_tokens``).

        Tenants at their active-sequence cap are passed over (their items stay queued). When the
        next item in fair order does not fit the free KV tokens, popping stops: skipping it for
        smaller ones would starve large requests. Call :meth:`expire` first so that no expired item
        is admitted. At most ``max_running`` requests are active at once (TPOT bound).
        """
        out: list[WorkItem] = []
        if self.max_running is not None:
            free_sequences = min(free_sequences, self.max_running - len(self._active))
        if self.policy == "fcfs":
            return self._pop_fcfs(free_sequences, free_kv_tokens)
        passed: list[_Tenant] = []
        while free_sequences > 0 and self._heap:
            key, tie, version, name = self._heap[0]
            t = self._tenants[name]
            if version != t.version:
                heapq.heappop(self._heap)
                continue
            sel = self._select(t)
            if sel is None:
                heapq.heappop(self._heap)
                t.in_heap = False
                continue
            c, head = sel
            true_key = self._key(t, head)
            if true_key > key + _EPS:
                heapq.heapreplace(self._heap, (true_key, tie, version, name))
                continue
            if self._capped(t):
                heapq.heappop(self._heap)
                t.in_heap = False
                passed.append(t)
                continue
            if head.kv_tokens > free_kv_tokens:
                break
            heapq.heappop(self._heap)
            t.queues[c].popleft()
            self._take(head, t)
            out.append(head)
            free_sequences -= 1
            free_kv_tokens -= head.kv_tokens
            self._push(t)
        for t in passed:
            self._push(t)
        return out

    def _pop_fcfs(self, free_sequences: int, free_kv_tokens: int) -> list[WorkItem]:
        out: list[WorkItem] = []
        passed: list[WorkItem] = []
        fifo = self._fifo
        while free_sequences > 0 and fifo:
            item = fifo[0]
            if item.request_id not in self._items:
                fifo.popleft()
                continue
            t = self._tenants[item.tenant]
            if self._capped(t):
                passed.append(fifo.popleft())
                continue
            if item.kv_tokens > free_kv_tokens:
                break
            fifo.popleft()
            t.queues[self.qclass(item)].remove(item)  # FCFS is the baseline: O(queue) is fine
            self._take(item, t)
            out.append(item)
            free_sequences -= 1
            free_kv_tokens -= item.kv_tokens
        fifo.extendleft(reversed(passed))
        return out

    def remove(self, request_id: int) -> WorkItem | None:
        """Take a waiting request out (cancel while queued). None if it is not waiting."""
        item = self._items.get(request_id)
        if item is None:
            return None
        t = self._tenants[item.tenant]
        c = self.qclass(item)
        was_head = self._class_head(t, c) is item
        del self._items[request_id]
        self._add_load(t, c, item, -1)
        t.waiting -= 1
        t.waiting_tokens -= item.prompt_tokens
        self._waiting_tokens -= item.prompt_tokens
        if self.policy == "wfq" and was_head:
            self._push(t)  # the head's cost changed: re-key
        if not t.waiting and not t.active:
            self._busy.discard(t.name)
        return item

    def expire(self, now: float) -> list[WorkItem]:
        """Remove and return the waiting items whose deadline is <= ``now`` (outcome DEADLINE)."""
        out: list[WorkItem] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, rid = heapq.heappop(self._deadlines)
            item = self.remove(rid)
            if item is not None:
                self._decisions[Outcome.DEADLINE] += 1
                out.append(item)
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline among waiting items (when to call :meth:`expire` next)."""
        while self._deadlines and self._deadlines[0][2] not in self._items:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def charge(self, tenant: str, prefill_tokens: int = 0, decode_tokens: int = 0, *,
               request_id: int | None = None) -> None:
        """Record service delivered to ``tenant``: tokens prefilled and decoded (spec §5.3).

        Pass ``request_id`` so the delivered service is taken off that request's estimate; without
        it the tenant's aggregate estimate is reduced instead.
        """
        if prefill_tokens < 0 or decode_tokens < 0:
            raise ValueError("charged tokens must be >= 0")
        amount = prefill_tokens + self.output_token_cost * decode_tokens
        t = self._tenant(tenant)
        t.service += amount
        t.vt += amount / t.weight
        t.lane_vt += amount / t.weight
        if request_id is not None and request_id in self._remaining:
            dec = min(amount, self._remaining[request_id])
            self._remaining[request_id] -= dec
        else:
            dec = min(amount, t.est)
        t.est = max(0.0, t.est - dec)
        self._svc.served(-1 if request_id is None else request_id, prefill_tokens > 0, decode_tokens)
        # The tenant's key can only grow here (overrun), which the lazy heap check handles.
        # Invariant: for every tenant with in_heap, its live entry's key <= its true key.

    def release(self, request_id: int) -> None:
        """An admitted request's sequence ended (any reason). Its undelivered estimate is dropped:
        an early stop is only charged what it got. Idempotent."""
        name = self._active.pop(request_id, None)
        if name is None:
            return
        t = self._tenants[name]
        t.active.discard(request_id)
        rem = self._remaining.pop(request_id, 0.0)
        self._svc.release(request_id)
        t.est = max(0.0, t.est - rem)
        if not t.active:
            t.est = 0.0  # no float residue when nothing is in flight
            if not t.waiting:
                self._busy.discard(t.name)
        if self.policy == "wfq" and t.waiting:
            self._push(t)  # key went down (refund) or a capped tenant became eligible

    # -- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    def is_active(self, request_id: int) -> bool:
        return request_id in self._active

    def virtual_finish(self, tenant: str, cost: float = 0.0) -> float:
        """The tag a request of ``cost`` from ``tenant`` would get now: the tie-break the decode
        scheduler uses after deadlines (spec §7.2)."""
        t = self._tenant(tenant)
        return max(t.effective_vt(), self._gvt) + cost / t.weight

    def observe(self, now: float) -> None:
        """Sample the decode speed (call every scheduler tick; see :class:`ServiceTracker`):
        saturated while at least a batch's worth of requests is active."""
        self._svc.observe(now, len(self._active) >= min(self.service.batch, self.slots()))

    @property
    def lane_step_s(self) -> float | None:
        """Observed seconds per decode lane-step at saturation (None before the first sample)."""
        return self._svc.lane_step_s

    def slots(self) -> int:
        """Lane slots a request competes for: ``min(max_sequences, max_running)``."""
        cap = self.budget.max_sequences
        return max(1, cap if self.max_running is None else min(cap, self.max_running))

    def expected_wait(self, item: WorkItem, now: float | None = None) -> WaitEstimate:
        """The expected wait before ``item``'s prefill would start if it were queued now
        (:func:`calserve.core.wait_estimate.expected_wait`; FCFS: everything waiting is ahead).

        With ``now``, another class of the tenant with nothing waiting but a request offered within
        ``RECENT_CLASS_S`` counts as busy with that request's profile: under overload the stream
        of (say) short prompts that a long one must let pass is refused or admitted at once, so the
        queue rarely shows it (measured in the simulation: a 1,024-token prompt waited 8x its
        estimate without this)."""
        c = self.qclass(item)
        t = self._tenants.get(item.tenant)
        weight = t.weight if t is not None else self.weight(item.tenant)
        own: Mapping[QueueClass, FlowLoad]
        others: list[tuple[float, FlowLoad]] = []
        fifo: Iterable[WorkItem] = ()
        if self.policy == "fcfs":
            own = {c: self._load}
            fifo = self._fifo
        elif t is None:
            own = {}
        else:
            own = dict(t.flows)
            fifo = t.queues[c]
            if now is not None:
                for c2, (seen, cost, pre, dec) in t.last_seen.items():
                    if c2 is not c and own[c2].n == 0 and now - seen <= RECENT_CLASS_S:
                        own[c2] = FlowLoad(1, cost, pre, dec)
            for name in self._busy:
                u = self._tenants[name]
                if u is not t and u.waiting:
                    others.append((u.weight, u.load))
        return expected_wait(
            self.service, slots=self.slots(), qclass=c, cost=self.cost(item), weight=weight,
            own=own, class_weights=self._cw, others=others,
            running_remaining=self._svc.running_remaining(),
            pending_prefill_s=self._svc.pending_prefill_s,
            pending_prefill_n=self._svc.pending_prefill_n,
            decode_ratio=self._svc.decode_ratio, lane_step_s=self._svc.lane_step_s,
            own_ahead=[float(w.max_new_tokens - 1) for w in fifo if w.request_id in self._items])

    def lane_virtual_time(self, tenant: str) -> float:
        """The tenant's decode-lane virtual time (VTC, see module doc): lower = served less."""
        t = self._tenants.get(tenant)
        return 0.0 if t is None else t.lane_vt

    def weight(self, tenant: str) -> float:
        """The tenant's configured weight (the default policy's for unknown tenants)."""
        t = self._tenants.get(tenant)
        return (t.policy if t is not None else self._policies.get(tenant, self._default)).weight

    def statistics(self) -> AdmissionStats:
        return AdmissionStats(
            waiting_requests=len(self._items),
            waiting_prompt_tokens=self._waiting_tokens,
            active_sequences=len(self._active),
            global_virtual_time=self._gvt,
            tenants={
                n: TenantStats(t.waiting, t.waiting_tokens, len(t.active), t.service,
                               t.effective_vt())
                for n, t in self._tenants.items()
            },
            decisions=dict(self._decisions),
            max_running=self.max_running,
            rejected_expected_wait=self._rejected_wait,
            last_expected_wait_s=self._last_wait,
            decode_ratio=self._svc.decode_ratio,
            lane_step_s=self._svc.lane_step_s,
        )
