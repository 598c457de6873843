"""The admission controller's waiting room (spec §5.3, §6): the hierarchical weighted fair queue
(tenants by weight, inside a tenant the prefill classes by class weight, FIFO within a class), the
FCFS baseline order, the deadline heap, and what is ahead of a new request (for the expected wait).

The fairness rules are described in :mod:`calserve.core.admission`. Pure: no clock, no I/O. Only
:class:`~calserve.core.admission.AdmissionController` uses it; the accounting of admitted requests
(estimates, service) stays there and is reached through the ``admit`` callback of :meth:`FairQueue.pop`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Literal, NamedTuple

from calserve.config import QueuesConfig
from calserve.core.admission_tenants import CLASSES, EPS, TenantBook, TenantState
from calserve.core.admission_types import WorkItem
from calserve.core.prefill import QueueClass, classify, weights_from_config
from calserve.core.wait_estimate import FlowLoad, ServiceModel

__all__ = ["RECENT_CLASS_S", "Ahead", "FairQueue"]

RECENT_CLASS_S = 1.0  # a class offered within this counts as busy for the other classes' estimate


class Ahead(NamedTuple):
    """What is ahead of a new request, in the terms of :func:`calserve.core.wait_estimate.expected_wait`."""

    own: Mapping[QueueClass, FlowLoad]  # the request's tenant's waiting flows by prefill class
    others: list[tuple[float, FlowLoad]]  # (weight, waiting load) of the other waiting tenants
    own_ahead: list[float]  # decode lengths of the requests ahead in its own flow, FIFO order


class FairQueue:
    """The waiting requests: WFQ (or FCFS) order, per-tenant class queues, deadlines.

    # Invariant (WFQ): for a tenant with in_heap, exactly one heap entry has its version, and that
    #   entry's key <= the tenant's true key (keys only grow between re-keys; pop re-checks lazily).
    """

    def __init__(
        self,
        policy: Literal["wfq", "fcfs"],
        queues: QueuesConfig,
        output_token_cost: float,
        service: ServiceModel,
        tenants: TenantBook,
    ) -> None:
        self.policy = policy
        self.queues_cfg = queues
        self.class_weights = weights_from_config(queues)
        self.output_token_cost = output_token_cost
        self.service = service
        self._tenants = tenants
        self._items: dict[int, WorkItem] = {}  # waiting, by request id
        self.waiting_tokens = 0
        self._load = FlowLoad()  # all waiting requests (FCFS estimate)
        self._seq = itertools.count()
        # WFQ: (virtual_finish of the tenant's head, tie, version, tenant).
        self._heap: list[tuple[float, int, int, str]] = []
        self._fifo: deque[WorkItem] = deque()  # FCFS order (may hold removed items)
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline, tie, request id), lazy
        self.gvt = 0.0  # global virtual time: delivered virtual time of the last admitted tenant, monotone

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    # -- pricing ----------------------------------------------------------------------------------

    def cost(self, item: WorkItem) -> float:
        """The fair-queue cost of a request (spec §5.3), in cost units."""
        return item.prompt_tokens + self.output_token_cost * item.max_new_tokens

    def qclass(self, item: WorkItem) -> QueueClass:
        """The prefill class of ``item`` (its sub-queue inside its tenant)."""
        return classify(item.prompt_tokens, self.queues_cfg)

    # -- order ------------------------------------------------------------------------------------

    def _class_head(self, t: TenantState, c: QueueClass) -> WorkItem | None:
        q = t.queues[c]
        while q and q[0].request_id not in self._items:
            q.popleft()
        return q[0] if q else None

    def _select(self, t: TenantState) -> tuple[QueueClass, WorkItem] | None:
        """The tenant's next item: among its classes' heads, the least class virtual finish
        ``cvt[c] + cost / class_weight`` (ties: short, medium, long)."""
        best: tuple[QueueClass, WorkItem] | None = None
        best_key = math.inf
        for c in CLASSES:
            h = self._class_head(t, c)
            if h is None:
                continue
            k = t.cvt[c] + self.cost(h) / self.class_weights[c]
            if best is None or k < best_key - EPS:
                best, best_key = (c, h), k
        return best

    def _key(self, t: TenantState, head: WorkItem) -> float:
        # The tenant's start tag is its own virtual time: the lift to the global virtual time happens
        # once, when the tenant's queue goes from empty to non-empty (enqueue). Lifting here on every
        # decision would push a backlogged tenant's tag up each time another tenant is served.
        return t.effective_vt() + self.cost(head) / t.weight

    def _push(self, t: TenantState) -> None:
        """(Re)insert ``t`` with its true key, invalidating older entries."""
        sel = self._select(t)
        t.version += 1
        if sel is None:
            t.in_heap = False
            return
        t.in_heap = True
        heapq.heappush(self._heap, (self._key(t, sel[1]), next(self._seq), t.version, t.name))

    def rekey(self, t: TenantState) -> None:
        """``t``'s key may have gone down (a refund) or it became eligible (below its cap): WFQ
        re-inserts it if it has something waiting."""
        if self.policy == "wfq" and t.waiting:
            self._push(t)

    # -- in and out -------------------------------------------------------------------------------

    def _add_load(self, t: TenantState, c: QueueClass, item: WorkItem, sign: int) -> None:
        args = (self.cost(item), self.service.prefill_s(item.prompt_tokens),
                float(item.max_new_tokens - 1), sign)
        t.flows[c].add(*args)
        t.load.add(*args)
        self._load.add(*args)

    def enqueue(self, item: WorkItem, t: TenantState) -> None:
        """Queue an accepted request of tenant ``t``."""
        if t.waiting == 0 and self.policy == "wfq":
            # Returning from idle (empty queue): no banked credit (spec §5.3, VTC lift) — lifted to
            # the global virtual time, which counts delivered service only (see _dequeue).
            t.vt = max(t.vt, self.gvt)
        c = self.qclass(item)
        if t.flows[c].n == 0:
            t.cvt[c] = max(t.cvt[c], t.cclock)  # an idle class banks no credit either
        self._items[item.request_id] = item
        t.queues[c].append(item)
        self._add_load(t, c, item, 1)
        t.waiting += 1
        t.waiting_tokens += item.prompt_tokens
        self.waiting_tokens += item.prompt_tokens
        if self.policy == "fcfs":
            self._fifo.append(item)
        else:
            self._push(t)  # a new class head may lower the tenant's key
        if item.deadline is not None:
            heapq.heappush(self._deadlines, (item.deadline, next(self._seq), item.request_id))

    def _dequeue(self, item: WorkItem, t: TenantState) -> None:
        """Take ``item`` out of the waiting set as admitted (it must be the tenant's head in WFQ)."""
        del self._items[item.request_id]
        c = self.qclass(item)
        self._add_load(t, c, item, -1)
        t.cclock = max(t.cclock, t.cvt[c])
        t.cvt[c] += self.cost(item) / self.class_weights[c]
        t.waiting -= 1
        t.waiting_tokens -= item.prompt_tokens
        self.waiting_tokens -= item.prompt_tokens
        # The global virtual time is the delivered virtual time of the tenant served last, not its
        # effective one: with the not-yet-delivered estimate in it, a tenant that took every free
        # lane at once would lift each tenant arriving after it to its reservations (as if they had
        # been served as much), and keep that head start for good (measured: 8 tenants, the first
        # two holding 48 lanes at t=0 kept 0.34 of the service each after 20 s).
        self.gvt = max(self.gvt, t.vt)

    def remove(self, request_id: int) -> tuple[WorkItem, TenantState] | None:
        """Take a waiting request out (not admitted). None if it is not waiting."""
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
        self.waiting_tokens -= item.prompt_tokens
        if self.policy == "wfq" and was_head:
            self._push(t)  # the head's cost changed: re-key
        return item, t

    def due(self, now: float) -> Iterator[int]:
        """Pop and yield the request ids whose deadline is <= ``now`` (some may no longer wait)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            yield heapq.heappop(self._deadlines)[2]

    def next_deadline(self) -> float | None:
        """The earliest deadline among waiting items."""
        while self._deadlines and self._deadlines[0][2] not in self._items:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def pop(self, free_sequences: int, free_kv_tokens: int,
            admit: Callable[[WorkItem, TenantState], None]) -> list[WorkItem]:
        """The waiting items to admit, in fair order (see
        :meth:`~calserve.core.admission.AdmissionController.pop_admissible`); ``admit`` is called for
        each as it leaves the queue, before its tenant is re-keyed."""
        if self.policy == "fcfs":
            return self._pop_fcfs(free_sequences, free_kv_tokens, admit)
        out: list[WorkItem] = []
        passed: list[TenantState] = []
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
            if true_key > key + EPS:
                heapq.heapreplace(self._heap, (true_key, tie, version, name))
                continue
            if t.capped():
                heapq.heappop(self._heap)
                t.in_heap = False
                passed.append(t)
                continue
            if head.kv_tokens > free_kv_tokens:
                break
            heapq.heappop(self._heap)
            t.queues[c].popleft()
            self._dequeue(head, t)
            admit(head, t)
            out.append(head)
            free_sequences -= 1
            free_kv_tokens -= head.kv_tokens
            self._push(t)
        for t in passed:
            self._push(t)
        return out

    def _pop_fcfs(self, free_sequences: int, free_kv_tokens: int,
                  admit: Callable[[WorkItem, TenantState], None]) -> list[WorkItem]:
        out: list[WorkItem] = []
        passed: list[WorkItem] = []
        fifo = self._fifo
        while free_sequences > 0 and fifo:
            item = fifo[0]
            if item.request_id not in self._items:
                fifo.popleft()
                continue
            t = self._tenants[item.tenant]
            if t.capped():
                passed.append(fifo.popleft())
                continue
            if item.kv_tokens > free_kv_tokens:
                break
            fifo.popleft()
            t.queues[self.qclass(item)].remove(item)  # FCFS is the baseline: O(queue) is fine
            self._dequeue(item, t)
            admit(item, t)
            out.append(item)
            free_sequences -= 1
            free_kv_tokens -= item.kv_tokens
        fifo.extendleft(reversed(passed))
        return out

    # -- the expected wait ------------------------------------------------------------------------

    def ahead(self, c: QueueClass, t: TenantState | None, now: float | None) -> Ahead:
        """What is ahead of a new request of class ``c`` from tenant ``t`` (None: not seen yet) if it
        were queued now (FCFS: everything waiting). With ``now``, another class of the tenant with
        nothing waiting but a request offered within ``RECENT_CLASS_S`` counts as busy with that
        request's profile (see :meth:`~calserve.core.admission.AdmissionController.expected_wait`)."""
        own: dict[QueueClass, FlowLoad]
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
            others = self._tenants.others_waiting(t)
        return Ahead(own, others, [float(w.max_new_tokens - 1) for w in fifo if w.request_id in self._items])
