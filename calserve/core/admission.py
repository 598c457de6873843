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
``virtual_finish = max(tenant_virtual_time, global_virtual_time) + cost / weight``. A tenant's virtual
time is its delivered service divided by its weight plus the not-yet-delivered estimate of its active
requests; the estimate shrinks as :meth:`charge` turns it into delivered service and is dropped on
:meth:`release`. A tenant that arrives with an empty queue is lifted to the global virtual time, so
idleness banks no credit. Weights and limits come from the control plane (config), never from request
parameters.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Literal

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


@dataclasses.dataclass(frozen=True)
class CapacityBudget:
    """Spec §5.1. Built from the package's capacity plan and ``scheduler.admission`` overrides."""

    max_sequences: int  # concurrent KV sequences (lanes)
    max_kv_tokens: int  # KV tokens over all sequences
    max_waiting_requests: int  # queued requests (all tenants)
    max_waiting_prompt_tokens: int  # prompt tokens of queued requests (all tenants)
    max_inflight_jobs: int  # jobs on the device at once (executor.max_inflight)


class Outcome(enum.Enum):
    ADMIT = "admit"  # handed out by pop_admissible: go to PrefillReady
    QUEUE = "queue"  # waiting in the fair queue
    REJECT_INVALID = "reject_invalid"  # can never fit (api: 400)
    REJECT_CAPACITY = "reject_capacity"  # full right now (api: 429)
    REJECT_UNAVAILABLE = "reject_unavailable"  # model draining/recovering/failed (api: 503)
    DEADLINE = "deadline"  # deadline passed before admission


@dataclasses.dataclass(frozen=True)
class AdmissionDecision:
    outcome: Outcome
    reason: str  # human-readable, names the limit that was hit
    param: str | None = None  # the request field at fault (OpenAI style), for REJECT_INVALID
    retry_after_s: float | None = None  # for REJECT_CAPACITY / REJECT_UNAVAILABLE


@dataclasses.dataclass(frozen=True)
class TenantPolicy:
    """Control-plane limits of one tenant (``tenants.<name>`` in config)."""

    weight: float = 1.0
    max_active_sequences: int | None = None  # None = unlimited
    max_waiting_tokens: int | None = None  # prompt tokens queued for this tenant; None = unlimited
    qps: float | None = None  # token-bucket refill rate (requests/s); None = unlimited
    burst: int | None = None  # bucket size; None = max(1, ceil(qps))


@dataclasses.dataclass(frozen=True)
class WorkItem:
    request_id: int
    tenant: str
    prompt_tokens: int
    max_new_tokens: int
    arrival: float  # caller's clock, seconds
    deadline: float | None  # absolute, caller's clock; None = no deadline
    generation: int  # the model generation the request is pinned to

    @property
    def kv_tokens(self) -> int:
        """KV tokens this request may need: what admission reserves."""
        return self.prompt_tokens + self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class TenantStats:
    waiting_requests: int
    waiting_tokens: int  # prompt tokens queued
    active_sequences: int
    service: float  # delivered cost units (prefill tokens x1 + decode tokens x output_token_cost)
    virtual_time: float  # the tenant's effective virtual time (delivered + active estimate) / weight


@dataclasses.dataclass(frozen=True)
class AdmissionStats:
    waiting_requests: int
    waiting_prompt_tokens: int
    active_sequences: int
    global_virtual_time: float
    tenants: Mapping[str, TenantStats]  # only tenants seen so far
    decisions: Mapping[Outcome, int]  # count per outcome (ADMIT counted by pop_admissible)


class AdmissionController:
    """Spec §5: budgets, the five outcomes, and the per-tenant weighted fair queue.

    ``policy="fcfs"`` keeps all checks but pops in arrival order (for side-by-side benchmarks).
    """

    def __init__(
        self,
        budget: CapacityBudget,
        max_seq: int,
        tenants: Mapping[str, TenantPolicy],
        default_policy: TenantPolicy = TenantPolicy(),
        output_token_cost: float = 2.0,
        policy: Literal["wfq", "fcfs"] = "wfq",
    ) -> None:
        raise NotImplementedError

    def offer(self, item: WorkItem, now: float, model_accepting: bool) -> AdmissionDecision:
        raise NotImplementedError

    def pop_admissible(self, now: float, free_sequences: int, free_kv_tokens: int) -> list[WorkItem]:
        raise NotImplementedError

    def remove(self, request_id: int) -> WorkItem | None:
        raise NotImplementedError

    def expire(self, now: float) -> list[WorkItem]:
        raise NotImplementedError

    def release(self, request_id: int) -> None:
        raise NotImplementedError

    def charge(self, tenant: str, prefill_tokens: int = 0, decode_tokens: int = 0,
               request_id: int | None = None) -> None:
        raise NotImplementedError

    def next_deadline(self) -> float | None:
        raise NotImplementedError

    def statistics(self) -> AdmissionStats:
        raise NotImplementedError
