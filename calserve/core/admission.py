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
idleness banks no credit. The global virtual time is the *delivered* virtual time of the tenant
admitted last (monotone): reservations (the estimates of running requests) never lift anybody, so a
tenant that took every free lane at once leaves the tenants arriving after it behind by exactly the
service it then gets, which they are given back while backlogged. Weights and limits come from the control plane (config), never from request
parameters.

Inside a tenant the queue is split by prefill class (short/medium/long, spec §6) and the classes share
the tenant's turns by cost with the class weights (4:2:1 by default), the same virtual-time rule one
level down: short prompts are not stuck behind a tenant's long ones, and long ones keep their share
(never starved). Within a class, FIFO.

Overload (spec §5.2 "Queue: only while there is hope"): with a :class:`ServiceModel`, :meth:`offer`
refuses (REJECT_CAPACITY, Retry-After = the excess) a request whose expected wait
(:mod:`calserve.core.wait_estimate`) exceeds ``min(max_expected_wait_s, deadline - now)``, and
:meth:`pop_admissible` holds at most ``max_running`` sequences active (TPOT bound).

The parts (one job each): :mod:`.admission_types` (plain data, re-exported here),
:mod:`.admission_checks` (validity, budgets, tenant quotas and QPS, the expected-wait refusal),
:mod:`.admission_tenants` (per-tenant state, token buckets, the busy set), :mod:`.admission_queue`
(the fair queue, FCFS order, deadlines, what is ahead of a request). This module decides in which order
they are consulted and keeps the accounting of admitted requests (estimates, service, speed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from calserve.config import QueuesConfig
from calserve.core.admission_checks import (
    MIN_RETRY_S,
    QUEUE_FULL_RETRY_S,
    UNAVAILABLE_RETRY_S,
    invalid,
    over_budget,
    over_expected_wait,
    over_quota,
)
from calserve.core.admission_queue import RECENT_CLASS_S, FairQueue
from calserve.core.admission_tenants import TenantBook, TenantState
from calserve.core.admission_types import (
    AdmissionDecision,
    AdmissionStats,
    CapacityBudget,
    Outcome,
    TenantPolicy,
    TenantStats,
    WorkItem,
)
from calserve.core.prefill import QueueClass
from calserve.core.service_tracker import ServiceTracker
from calserve.core.wait_estimate import ServiceModel, WaitEstimate, expected_wait

__all__ = [
    "tenant_capped",
    "admission_room",
    "CapacityBudget",
    "Outcome",
    "AdmissionDecision",
    "TenantPolicy",
    "WorkItem",
    "TenantStats",
    "AdmissionStats",
    "AdmissionController",
    "QUEUE_FULL_RETRY_S",
    "MIN_RETRY_S",
    "RECENT_CLASS_S",
    "UNAVAILABLE_RETRY_S",
]


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
        self.service = service if service is not None else ServiceModel(0.0, 1)
        self.max_expected_wait_s = max_expected_wait_s
        self.max_running = max_running
        self.output_token_cost = output_token_cost
        self.policy = policy
        self._tenants = TenantBook(tenants, default_policy)
        self._queue = FairQueue(policy, self.queues_cfg, output_token_cost, self.service, self._tenants)
        self._svc = ServiceTracker(self.service)  # what the active requests still need; speed
        self._rejected_wait = 0
        self._last_wait = 0.0
        self._active: dict[int, str] = {}  # popped and not released: request id -> tenant
        self._remaining: dict[int, float] = {}  # active request id -> estimate not yet charged
        self._decisions = {o: 0 for o in Outcome}

    def _counted(self, d: AdmissionDecision) -> AdmissionDecision:
        self._decisions[d.outcome] += 1
        return d

    def cost(self, item: WorkItem) -> float:
        """The fair-queue cost of a request (spec §5.3), in cost units."""
        return self._queue.cost(item)

    def qclass(self, item: WorkItem) -> QueueClass:
        """The prefill class of ``item`` (its sub-queue inside its tenant)."""
        return self._queue.qclass(item)

    # -- decisions ----------------------------------------------------------------------------

    def offer(self, item: WorkItem, now: float, model_accepting: bool) -> AdmissionDecision:
        """Decide what happens to a new request. On QUEUE the item is now waiting here."""
        if item.request_id in self._queue or item.request_id in self._active:
            raise ValueError(f"request {item.request_id} is already known to admission")
        bad = invalid(item, self.budget, self.max_seq, self._tenants.policy(item.tenant))
        if bad is not None:
            return self._counted(bad)
        if not model_accepting:
            return self._counted(AdmissionDecision(
                Outcome.REJECT_UNAVAILABLE, "the model is not accepting requests",
                retry_after_s=UNAVAILABLE_RETRY_S))
        if item.deadline is not None and item.deadline <= now:
            return self._counted(AdmissionDecision(Outcome.DEADLINE, "the deadline passed before admission"))
        full = over_budget(item, self.budget, len(self._queue), self._queue.waiting_tokens)
        if full is not None:
            return self._counted(full)
        t = self._tenants.get(item.tenant)
        quota = over_quota(item, t, now)
        if quota is not None:
            return self._counted(quota)
        t.last_seen[self.qclass(item)] = (now, self.cost(item), self.service.prefill_s(item.prompt_tokens),
                                          float(item.max_new_tokens - 1))
        slow = self._refuse_expected_wait(item, now)
        if slow is not None:
            return self._counted(slow)
        if t.policy.qps is not None:
            t.bucket.take()
        # Accepted: queue it.
        self._tenants.mark_busy(t)
        self._queue.enqueue(item, t)
        return self._counted(AdmissionDecision(Outcome.QUEUE, "queued"))

    def _refuse_expected_wait(self, item: WorkItem, now: float) -> AdmissionDecision | None:
        """REJECT_CAPACITY when ``item``'s expected wait exceeds the SLO or its deadline (only with
        a known or observed service speed); records the estimate for the statistics."""
        if not (self.service.known or self._svc.lane_step_s is not None):
            return None
        limit = math.inf if self.max_expected_wait_s is None else self.max_expected_wait_s
        if item.deadline is not None:
            limit = min(limit, item.deadline - now)
        est = self.expected_wait(item, now).seconds
        self._last_wait = est
        refusal = over_expected_wait(est, limit, self.max_expected_wait_s)
        if refusal is not None:
            self._rejected_wait += 1
        return refusal

    def _admit(self, item: WorkItem, t: TenantState) -> None:
        """``item`` left the queue as admitted: it is active for its tenant until :meth:`release`."""
        self._svc.admit(item.request_id, item.prompt_tokens, item.max_new_tokens)
        cost = self.cost(item)
        t.est += cost
        self._remaining[item.request_id] = cost
        t.active.add(item.request_id)
        self._active[item.request_id] = t.name
        self._decisions[Outcome.ADMIT] += 1

    def pop_admissible(self, now: float, free_sequences: int, free_kv_tokens: int,
                       parked: int = 0) -> list[WorkItem]:
        """The waiting items to admit now, in fair order, within ``free_sequences`` lanes and
        ``free_kv_tokens`` KV tokens (each item needs ``item.kv_tokens``).

        Tenants at their active-sequence cap are passed over (their items stay queued). When the
        next item in fair order does not fit the free KV tokens, popping stops: skipping it for
        smaller ones would starve large requests. Call :meth:`expire` first so that no expired item
        is admitted. At most ``max_running`` requests are active at once (TPOT bound), not
        counting the ``parked`` ones (their client is behind: engine/parking.py).
        """
        return self._queue.pop(admission_room(self, free_sequences, parked), free_kv_tokens,
                               self._admit)

    def remove(self, request_id: int) -> WorkItem | None:
        """Take a waiting request out (cancel while queued). None if it is not waiting."""
        out = self._queue.remove(request_id)
        if out is None:
            return None
        item, t = out
        self._tenants.settle(t)
        return item

    def expire(self, now: float) -> list[WorkItem]:
        """Remove and return the waiting items whose deadline is <= ``now`` (outcome DEADLINE)."""
        out: list[WorkItem] = []
        for rid in self._queue.due(now):
            item = self.remove(rid)
            if item is not None:
                self._decisions[Outcome.DEADLINE] += 1
                out.append(item)
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline among waiting items (when to call :meth:`expire` next)."""
        return self._queue.next_deadline()

    def charge(self, tenant: str, prefill_tokens: int = 0, decode_tokens: int = 0, *,
               request_id: int | None = None) -> None:
        """Record service delivered to ``tenant``: tokens prefilled and decoded (spec §5.3).

        Pass ``request_id`` so the delivered service is taken off that request's estimate; without
        it the tenant's aggregate estimate is reduced instead.
        """
        if prefill_tokens < 0 or decode_tokens < 0:
            raise ValueError("charged tokens must be >= 0")
        amount = prefill_tokens + self.output_token_cost * decode_tokens
        t = self._tenants.get(tenant)
        t.deliver(amount)
        if request_id is not None and request_id in self._remaining:
            dec = min(amount, self._remaining[request_id])
            self._remaining[request_id] -= dec
        else:
            dec = min(amount, t.est)
        t.est = max(0.0, t.est - dec)
        self._svc.served(-1 if request_id is None else request_id, prefill_tokens > 0, decode_tokens)
        # The tenant's key can only grow here (overrun), which the lazy heap check handles.
        # Invariant: for every tenant with in_heap, its live entry's key <= its true key.

    def charge_decoded(self, tenant: str, request_id: int) -> None:
        """``charge(tenant, decode_tokens=1, request_id=request_id)``, the same arithmetic in the
        same order without its generality: the step handler's once-per-token call."""
        amount = self.output_token_cost
        t = self._tenants.states.get(tenant)
        if t is None:
            t = self._tenants.get(tenant)
        # t.deliver(amount), inlined (the same three updates in the same order)
        t.service += amount
        w = t.policy.weight
        t.vt += amount / w
        t.lane_vt += amount / w
        # min(amount, x) and max(0.0, x) as conditionals: the same values, no builtin call
        rem = self._remaining
        r = rem.get(request_id)
        if r is not None:
            dec = r if r < amount else amount
            rem[request_id] = r - dec
        else:
            est = t.est
            dec = est if est < amount else amount
        left = t.est - dec
        t.est = left if left > 0.0 else 0.0
        self._svc.served_decode(request_id)

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
        self._tenants.settle(t)
        self._queue.rekey(t)  # key went down (refund) or a capped tenant became eligible

    # -- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._queue

    def is_active(self, request_id: int) -> bool:
        return request_id in self._active

    def virtual_finish(self, tenant: str, cost: float = 0.0) -> float:
        """The tag a request of ``cost`` from ``tenant`` would get now: the tie-break the decode
        scheduler uses after deadlines (spec §7.2)."""
        t = self._tenants.get(tenant)
        return max(t.effective_vt(), self._queue.gvt) + cost / t.weight

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
        t = self._tenants.find(item.tenant)
        weight = t.weight if t is not None else self.weight(item.tenant)
        ahead = self._queue.ahead(c, t, now)
        return expected_wait(
            self.service, slots=self.slots(), qclass=c, cost=self.cost(item), weight=weight,
            own=ahead.own, class_weights=self._queue.class_weights, others=ahead.others,
            running_remaining=self._svc.running_remaining(),
            pending_prefill_s=self._svc.pending_prefill_s,
            pending_prefill_n=self._svc.pending_prefill_n,
            decode_ratio=self._svc.decode_ratio, lane_step_s=self._svc.lane_step_s,
            own_ahead=ahead.own_ahead)

    def lane_virtual_time(self, tenant: str) -> float:
        """The tenant's decode-lane virtual time (VTC, see module doc): lower = served less."""
        return self._tenants.lane_virtual_time(tenant)

    def weight(self, tenant: str) -> float:
        """The tenant's configured weight (the default policy's for unknown tenants)."""
        return self._tenants.weight(tenant)

    def statistics(self) -> AdmissionStats:
        return AdmissionStats(
            waiting_requests=len(self._queue),
            waiting_prompt_tokens=self._queue.waiting_tokens,
            active_sequences=len(self._active),
            global_virtual_time=self._queue.gvt,
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


def tenant_capped(admission: AdmissionController, tenant: str) -> bool:
    """``tenant`` is at its ``max_active_sequences`` in ``admission`` (its queued items are passed
    over until one of its active ones ends)."""
    return admission._tenants.get(tenant).capped()


def admission_room(adm: AdmissionController, free_sequences: int, parked: int = 0) -> int:
    """How many requests ``adm.pop_admissible`` may admit into ``free_sequences`` free lanes with
    ``parked`` requests parked (<= 0: none, whatever waits), under its ``max_running``."""
    if adm.max_running is None:
        return free_sequences
    return min(free_sequences, adm.max_running - len(adm._active) + parked)
