"""Admission (spec §5): outcomes, budgets, deadlines, tenant quotas and the weighted fair queue.

The clock is a plain float passed in (spec §17.1: fake clock, never sleep).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.core.admission import (
    AdmissionController,
    CapacityBudget,
    Outcome,
    TenantPolicy,
    WorkItem,
)

BUDGET = CapacityBudget(max_sequences=16, max_kv_tokens=4096, max_waiting_requests=100,
                        max_waiting_prompt_tokens=10_000, max_inflight_jobs=1)
_ids = iter(range(10**9))


def item(tenant: str = "a", prompt: int = 10, new: int = 10, arrival: float = 0.0,
         deadline: float | None = 100.0, rid: int | None = None) -> WorkItem:
    return WorkItem(next(_ids) if rid is None else rid, tenant, prompt, new, arrival, deadline, 0)


def ctl(tenants: dict[str, TenantPolicy] | None = None, budget: CapacityBudget = BUDGET,
        policy: str = "wfq", max_seq: int = 1024) -> AdmissionController:
    return AdmissionController(budget, max_seq, tenants or {}, policy=policy)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prompt", "new", "param"),
    [(0, 10, "prompt"), (10, 0, "max_tokens"), (1024, 1, "prompt"), (1000, 25, "max_tokens"),
     (2000, 100, "prompt")],
)
def test_never_fits_is_reject_invalid_and_never_queued(prompt: int, new: int, param: str) -> None:
    a = ctl()
    d = a.offer(item(prompt=prompt, new=new), 0.0, True)
    assert d.outcome is Outcome.REJECT_INVALID
    assert d.param == param
    assert len(a) == 0


def test_beyond_kv_budget_is_invalid() -> None:
    a = ctl(budget=CapacityBudget(16, 500, 100, 10_000, 1))
    d = a.offer(item(prompt=400, new=200), 0.0, True)
    assert d.outcome is Outcome.REJECT_INVALID and d.param == "max_tokens"
    assert "max_kv_tokens" in d.reason


def test_exact_fit_is_queued() -> None:
    a = ctl()
    assert a.offer(item(prompt=1000, new=24), 0.0, True).outcome is Outcome.QUEUE


def test_unavailable_when_model_not_accepting() -> None:
    a = ctl()
    d = a.offer(item(), 0.0, model_accepting=False)
    assert d.outcome is Outcome.REJECT_UNAVAILABLE and d.retry_after_s
    # Invalid wins over unavailable: retrying would never help.
    assert a.offer(item(prompt=0), 0.0, False).outcome is Outcome.REJECT_INVALID


def test_queue_and_token_budgets_give_reject_capacity_with_retry_after() -> None:
    a = ctl(budget=CapacityBudget(16, 4096, 2, 25, 1))
    assert a.offer(item(prompt=10), 0.0, True).outcome is Outcome.QUEUE
    d = a.offer(item(prompt=16), 0.0, True)
    assert d.outcome is Outcome.REJECT_CAPACITY and "max_waiting_prompt_tokens" in d.reason
    assert d.retry_after_s is not None and d.retry_after_s > 0
    assert a.offer(item(prompt=15), 0.0, True).outcome is Outcome.QUEUE
    d = a.offer(item(prompt=1), 0.0, True)
    assert d.outcome is Outcome.REJECT_CAPACITY and "max_waiting_requests" in d.reason
    # Popping frees the budget.
    assert len(a.pop_admissible(0.0, 1, 4096)) == 1
    assert a.offer(item(prompt=1), 0.0, True).outcome is Outcome.QUEUE


def test_tenant_waiting_tokens_limit() -> None:
    a = ctl({"a": TenantPolicy(max_waiting_tokens=30)})
    assert a.offer(item("a", prompt=20), 0.0, True).outcome is Outcome.QUEUE
    assert a.offer(item("a", prompt=20), 0.0, True).outcome is Outcome.REJECT_CAPACITY
    assert a.offer(item("b", prompt=20), 0.0, True).outcome is Outcome.QUEUE
    assert a.offer(item("a", prompt=31), 0.0, True).outcome is Outcome.REJECT_INVALID


def test_qps_token_bucket() -> None:
    a = ctl({"a": TenantPolicy(qps=2.0, burst=2)})
    assert a.offer(item("a"), 0.0, True).outcome is Outcome.QUEUE
    assert a.offer(item("a"), 0.0, True).outcome is Outcome.QUEUE
    d = a.offer(item("a"), 0.0, True)
    assert d.outcome is Outcome.REJECT_CAPACITY and "qps" in d.reason
    assert d.retry_after_s == pytest.approx(0.5)
    assert a.offer(item("b"), 0.0, True).outcome is Outcome.QUEUE  # other tenants unaffected
    assert a.offer(item("a"), 0.25, True).outcome is Outcome.REJECT_CAPACITY
    assert a.offer(item("a"), 0.5, True).outcome is Outcome.QUEUE  # refilled 1 token by t=0.5
    assert a.offer(item("a"), 10.0, True).outcome is Outcome.QUEUE
    assert a.offer(item("a"), 10.0, True).outcome is Outcome.QUEUE  # burst caps the refill at 2
    assert a.offer(item("a"), 10.0, True).outcome is Outcome.REJECT_CAPACITY


def test_deadline_already_passed_and_expiry_while_queued() -> None:
    a = ctl()
    assert a.offer(item(deadline=1.0), 1.0, True).outcome is Outcome.DEADLINE
    x, y, z = item(deadline=5.0), item(deadline=3.0), item(deadline=None)
    for w in (x, y, z):
        a.offer(w, 0.0, True)
    assert a.next_deadline() == 3.0
    assert a.expire(2.9) == []
    assert a.expire(3.0) == [y]
    assert a.next_deadline() == 5.0
    a.remove(x.request_id)  # cancelled while queued: its deadline no longer matters
    assert a.next_deadline() is None
    assert a.expire(100.0) == []
    assert [w.request_id for w in a.pop_admissible(4.0, 16, 4096)] == [z.request_id]
    s = a.statistics()
    assert s.decisions[Outcome.DEADLINE] == 2 and s.waiting_requests == 0


def test_remove_and_duplicate() -> None:
    a = ctl()
    x = item()
    a.offer(x, 0.0, True)
    with pytest.raises(ValueError, match="already known"):
        a.offer(x, 0.0, True)
    assert a.remove(x.request_id) == x
    assert a.remove(x.request_id) is None
    assert a.pop_admissible(0.0, 4, 4096) == []
    assert a.statistics().waiting_prompt_tokens == 0


def test_pop_respects_free_sequences_kv_and_tenant_cap() -> None:
    a = ctl({"a": TenantPolicy(max_active_sequences=2)})
    xs = [item("a", prompt=100, new=100, rid=i) for i in range(4)]
    ys = [item("b", prompt=100, new=100, rid=10 + i) for i in range(4)]
    for w in xs + ys:
        a.offer(w, 0.0, True)
    got = a.pop_admissible(0.0, free_sequences=8, free_kv_tokens=4096)
    assert sum(w.tenant == "a" for w in got) == 2  # capped at 2 active
    assert len(got) == 6
    assert a.pop_admissible(0.0, 8, 4096) == []  # a is capped, b drained
    a.release(got[0].request_id if got[0].tenant == "a" else xs[0].request_id)
    more = a.pop_admissible(0.0, 8, 150)
    assert more == []  # next a item needs 200 KV tokens, only 150 free: nothing is skipped past it
    more = a.pop_admissible(0.0, 8, 200)
    assert [w.tenant for w in more] == ["a"]


def _drain(a: AdmissionController, n: int) -> list[str]:
    """Admit one at a time, delivering each request's full service before the next."""
    order = []
    for _ in range(n):
        (w,) = a.pop_admissible(0.0, 1, 10**9)
        a.charge(w.tenant, w.prompt_tokens, w.max_new_tokens, request_id=w.request_id)
        a.release(w.request_id)
        order.append(w.tenant)
    return order


def test_weights_give_proportional_admissions() -> None:
    a = ctl({"a": TenantPolicy(weight=3.0), "b": TenantPolicy(weight=1.0)},
            budget=CapacityBudget(16, 10**6, 10**4, 10**7, 1))
    for i in range(200):
        a.offer(item("a", rid=i), 0.0, True)
        a.offer(item("b", rid=1000 + i), 0.0, True)
    order = _drain(a, 100)
    assert abs(order.count("a") - 75) <= 1
    s = a.statistics()
    assert s.tenants["a"].service == pytest.approx(3 * s.tenants["b"].service, rel=0.05)


def test_fcfs_policy_is_arrival_order() -> None:
    a = ctl(policy="fcfs", budget=CapacityBudget(16, 10**6, 10**4, 10**7, 1))
    for i in range(10):
        a.offer(item("a", rid=i), 0.0, True)
    for i in range(3):
        a.offer(item("b", rid=100 + i), 0.0, True)
    assert _drain(a, 13) == ["a"] * 10 + ["b"] * 3


def test_early_stop_refunds_undelivered_service() -> None:
    """A request that stops early is charged what it got: its tenant's next request goes first."""
    a = ctl(budget=CapacityBudget(16, 10**6, 10**4, 10**7, 1))
    x = item("a", prompt=10, new=500, rid=1)
    y = item("b", prompt=10, new=500, rid=2)
    a.offer(x, 0.0, True)
    a.offer(y, 0.0, True)
    got = a.pop_admissible(0.0, 2, 10**6)
    assert {w.request_id for w in got} == {1, 2}
    # a stops after 1 token (EOS), b runs to the end.
    a.charge("a", 10, 1, request_id=1)
    a.release(1)
    a.charge("b", 10, 500, request_id=2)
    a.release(2)
    s = a.statistics()
    assert s.tenants["a"].service == 12.0 and s.tenants["b"].service == 1010.0
    for i in range(3):
        a.offer(item("b", rid=20 + i), 0.0, True)
        a.offer(item("a", rid=10 + i), 0.0, True)
    assert [w.tenant for w in a.pop_admissible(0.0, 1, 10**6)] == ["a"]


def test_returning_from_idle_gets_no_banked_credit() -> None:
    """Tenant b idles while a is served a lot; when b returns it is not served exclusively."""
    a = ctl(budget=CapacityBudget(16, 10**6, 10**4, 10**7, 1))
    for i in range(50):
        a.offer(item("a", rid=i), 0.0, True)
    _drain(a, 40)  # a alone: served 40 requests worth of service
    for i in range(10):
        a.offer(item("b", rid=100 + i), 10.0, True)
    order = _drain(a, 10)
    # Without the lift b would take all 10 (a is 40 requests ahead); with it they alternate.
    assert 4 <= order.count("a") <= 6


def test_reservations_of_a_tenant_that_took_every_free_lane_lift_nobody() -> None:
    """a takes four free lanes at once (nothing waits, so nothing competes); b arrives while they
    run. b must not be lifted to a's reservations: once a's four requests delivered, b is the one
    behind and gets the next lanes until it caught up (before, the global virtual time counted a's
    undelivered estimate, b started level with a's four requests and never got them back)."""
    a = ctl(budget=CapacityBudget(16, 10**6, 10**4, 10**7, 1))
    for i in range(4):
        a.offer(item("a", rid=i), 0.0, True)
    assert len(a.pop_admissible(0.0, 4, 10**9)) == 4
    for i in range(6):
        a.offer(item("b", rid=100 + i), 0.1, True)  # no free lane: b waits behind a's four
    for i in range(4):
        a.charge("a", 10, 10, request_id=i)
        a.release(i)
    for i in range(6):
        a.offer(item("a", rid=10 + i), 1.0, True)
    order = _drain(a, 8)
    assert order[:4] == ["b"] * 4, order  # b is owed a's four requests first
    assert order[4:] == ["a", "b", "a", "b"] or order[4:] == ["b", "a", "b", "a"], order
    s = a.statistics().tenants
    assert s["a"].service == s["b"].service


def test_charge_without_request_id_and_release_idempotent() -> None:
    a = ctl()
    x = item("a", rid=1)
    a.offer(x, 0.0, True)
    a.pop_admissible(0.0, 1, 4096)
    a.charge("a", prefill_tokens=10)
    a.release(1)
    a.release(1)
    s = a.statistics().tenants["a"]
    assert s.active_sequences == 0 and s.service == 10.0
    with pytest.raises(ValueError):
        a.charge("a", decode_tokens=-1)


def test_statistics_are_frozen_snapshots() -> None:
    a = ctl()
    a.offer(item("a", prompt=7), 0.0, True)
    s = a.statistics()
    a.offer(item("a", prompt=7), 0.0, True)
    assert s.waiting_requests == 1 and s.waiting_prompt_tokens == 7
    assert s.tenants["a"].waiting_tokens == 7
    with pytest.raises(AttributeError):
        s.waiting_requests = 3  # type: ignore[misc]


@settings(max_examples=60)
@given(
    weights=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=2, max_size=5),
    sizes=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=5, max_size=40),
    steps=st.integers(20, 120),
)
def test_wfq_backlogged_service_gap_is_bounded(
    weights: list[float], sizes: list[tuple[int, int]], steps: int
) -> None:
    """Property: while every tenant is backlogged, the weighted delivered service of any two tenants
    differs by at most two maximal request costs (over the weights): no tenant falls behind."""
    tenants = {f"t{i}": TenantPolicy(weight=w) for i, w in enumerate(weights)}
    a = ctl(tenants, budget=CapacityBudget(16, 10**6, 10**5, 10**8, 1))
    rid = 0
    for name in tenants:
        for p, n in sizes:
            a.offer(item(name, prompt=p, new=n, rid=rid), 0.0, True)
            rid += 1
    max_cost = max(p + 2 * n for p, n in sizes)
    for _ in range(min(steps, len(sizes))):
        (w,) = a.pop_admissible(0.0, 1, 10**9)
        a.charge(w.tenant, w.prompt_tokens, w.max_new_tokens, request_id=w.request_id)
        a.release(w.request_id)
        st_ = a.statistics().tenants
        if all(st_[n].waiting_requests for n in tenants):
            norm = [st_[n].service / tenants[n].weight for n in tenants]
            assert max(norm) - min(norm) <= 2 * max_cost / min(weights) + 1e-6


def test_tenant_limits_are_quota_refusals_server_limits_are_not() -> None:
    from calserve.core.admission import AdmissionController, CapacityBudget, Outcome, TenantPolicy, WorkItem

    budget = CapacityBudget(8, 8 * 64, max_waiting_requests=2, max_waiting_prompt_tokens=1000,
                            max_inflight_jobs=1)
    adm = AdmissionController(budget, 64, {"q": TenantPolicy(qps=1.0, burst=1)})

    def w(rid: int, tenant: str) -> WorkItem:
        return WorkItem(rid, tenant, 4, 4, 0.0, None, 1)

    assert adm.offer(w(1, "q"), 0.0, True).outcome is Outcome.QUEUE
    d = adm.offer(w(2, "q"), 0.0, True)
    assert d.outcome is Outcome.REJECT_CAPACITY and d.quota and "qps" in d.reason
    assert adm.offer(w(3, "other"), 0.0, True).outcome is Outcome.QUEUE
    d = adm.offer(w(4, "other"), 0.0, True)  # the server's queue (max 2) is full
    assert d.outcome is Outcome.REJECT_CAPACITY and not d.quota
