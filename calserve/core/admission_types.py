"""The admission controller's plain data (spec §5): budgets, outcomes, decisions, tenant policies,
work items and statistics. Re-exported by :mod:`calserve.core.admission`."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

__all__ = [
    "CapacityBudget",
    "Outcome",
    "AdmissionDecision",
    "TenantPolicy",
    "WorkItem",
    "TenantStats",
    "AdmissionStats",
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
    # REJECT_CAPACITY because of the tenant's own limit (QPS, waiting tokens), not the server's.
    quota: bool = False


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
    # Overload admission: the cap on active sequences (None = free lanes only), REJECT_CAPACITY
    # decisions caused by the expected wait, and the wait estimated for the last offered request.
    max_running: int | None = None
    rejected_expected_wait: int = 0
    last_expected_wait_s: float = 0.0
    decode_ratio: float = 1.0  # observed delivered / requested decode tokens (EWMA)
    lane_step_s: float | None = None  # observed seconds per decode lane-step at saturation
