"""The admission controller's limits (spec §5.1, §5.2): what makes a request invalid (it can never
fit), what refuses it for now (the server's queue budget, the tenant's quotas and QPS bucket, the
expected wait), each as the :class:`~calserve.core.admission_types.AdmissionDecision` to return.

Pure functions: no clock (``now`` is passed in), no counting (the controller counts the decisions
it returns). Only the QPS check changes state: it refills the tenant's token bucket.
"""

from __future__ import annotations

from calserve.core.admission_tenants import TenantState, burst_size
from calserve.core.admission_types import AdmissionDecision, CapacityBudget, Outcome, TenantPolicy, WorkItem

__all__ = [
    "QUEUE_FULL_RETRY_S",
    "MIN_RETRY_S",
    "UNAVAILABLE_RETRY_S",
    "invalid",
    "over_budget",
    "over_quota",
    "over_expected_wait",
]

# A hint for clients when a queue/token budget is full: roughly one decode round of a busy device.
QUEUE_FULL_RETRY_S = 1.0
MIN_RETRY_S = 0.1  # the smallest Retry-After hint for an expected-wait refusal
UNAVAILABLE_RETRY_S = 5.0


def invalid(item: WorkItem, budget: CapacityBudget, max_seq: int,
            policy: TenantPolicy) -> AdmissionDecision | None:
    """REJECT_INVALID when ``item`` could never be served or queued (``policy``: its tenant's)."""
    b = budget
    if item.prompt_tokens < 1:
        return AdmissionDecision(Outcome.REJECT_INVALID, "the prompt is empty", "prompt")
    if item.max_new_tokens < 1:
        return AdmissionDecision(Outcome.REJECT_INVALID, "max_tokens must be >= 1", "max_tokens")
    for limit, what in ((max_seq, "the model's context (max_seq)"),
                        (b.max_kv_tokens, "the KV budget (max_kv_tokens)")):
        if item.prompt_tokens >= limit:
            return AdmissionDecision(
                Outcome.REJECT_INVALID,
                f"prompt of {item.prompt_tokens} tokens leaves no room in {what} of {limit}",
                "prompt")
        if item.kv_tokens > limit:
            return AdmissionDecision(
                Outcome.REJECT_INVALID,
                f"prompt ({item.prompt_tokens}) + max_tokens ({item.max_new_tokens}) = "
                f"{item.kv_tokens} tokens exceeds {what} of {limit}",
                "max_tokens")
    if item.prompt_tokens > b.max_waiting_prompt_tokens:
        return AdmissionDecision(
            Outcome.REJECT_INVALID,
            f"prompt of {item.prompt_tokens} tokens exceeds max_waiting_prompt_tokens "
            f"{b.max_waiting_prompt_tokens}: it could never be queued", "prompt")
    p = policy
    if p.max_waiting_tokens is not None and item.prompt_tokens > p.max_waiting_tokens:
        return AdmissionDecision(
            Outcome.REJECT_INVALID,
            f"prompt of {item.prompt_tokens} tokens exceeds tenant {item.tenant!r} "
            f"max_waiting_tokens {p.max_waiting_tokens}", "prompt")
    return None


def over_budget(item: WorkItem, budget: CapacityBudget, waiting_requests: int,
                waiting_tokens: int) -> AdmissionDecision | None:
    """REJECT_CAPACITY when the server's queue (all tenants) has no room for ``item`` now."""
    b = budget
    if waiting_requests + 1 > b.max_waiting_requests:
        return AdmissionDecision(Outcome.REJECT_CAPACITY,
                                 f"max_waiting_requests ({b.max_waiting_requests}) reached",
                                 retry_after_s=QUEUE_FULL_RETRY_S)
    if waiting_tokens + item.prompt_tokens > b.max_waiting_prompt_tokens:
        return AdmissionDecision(Outcome.REJECT_CAPACITY,
                                 f"max_waiting_prompt_tokens ({b.max_waiting_prompt_tokens}) reached",
                                 retry_after_s=QUEUE_FULL_RETRY_S)
    return None


def over_quota(item: WorkItem, t: TenantState, now: float) -> AdmissionDecision | None:
    """REJECT_CAPACITY (``quota``) when tenant ``t``'s own limits refuse ``item`` now: its waiting
    prompt tokens, or its QPS bucket (refilled to ``now`` here; the token is taken by the caller
    once the request is accepted)."""
    p = t.policy
    if p.max_waiting_tokens is not None and (
            t.waiting_tokens + item.prompt_tokens > p.max_waiting_tokens):
        return AdmissionDecision(Outcome.REJECT_CAPACITY,
                                 f"tenant {t.name!r} max_waiting_tokens ({p.max_waiting_tokens}) "
                                 f"reached", retry_after_s=QUEUE_FULL_RETRY_S, quota=True)
    if p.qps is not None:
        burst = burst_size(p)
        t.bucket.refill(now, p.qps, burst)
        if t.bucket.empty:
            return AdmissionDecision(Outcome.REJECT_CAPACITY,
                                     f"tenant {t.name!r} qps ({p.qps}/s, burst {burst}) exceeded",
                                     retry_after_s=t.bucket.wait_s(p.qps), quota=True)
    return None


def over_expected_wait(expected_s: float, limit_s: float,
                       max_expected_wait_s: float | None) -> AdmissionDecision | None:
    """REJECT_CAPACITY when the expected queue wait exceeds ``limit_s`` (the smaller of the SLO
    ``max_expected_wait_s`` and the time to the request's deadline), Retry-After = the excess."""
    if not expected_s > limit_s:
        return None
    return AdmissionDecision(
        Outcome.REJECT_CAPACITY,
        f"overloaded: expected queue wait {expected_s * 1e3:.0f} ms exceeds "
        + (f"max_expected_wait_ms ({max_expected_wait_s * 1e3:.0f})"
           if max_expected_wait_s is not None and limit_s == max_expected_wait_s
           else "the request's deadline"),
        retry_after_s=max(MIN_RETRY_S, expected_s - limit_s))
