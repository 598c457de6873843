"""Fair decode lanes (spec §5.3/§7.2): VTC lane clock in admission + bounded weighted service gap."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.core.admission import AdmissionController, CapacityBudget, TenantPolicy, WorkItem
from calserve.core.decode import BatchProfile, DecodeCandidate, LaneOrder, build_decode_batch

BUDGET = CapacityBudget(max_sequences=8, max_kv_tokens=8 * 256, max_waiting_requests=100,
                        max_waiting_prompt_tokens=10_000, max_inflight_jobs=1)


def item(rid: int, tenant: str) -> WorkItem:
    return WorkItem(rid, tenant, prompt_tokens=4, max_new_tokens=4, arrival=0.0, deadline=None,
                    generation=1)


def admit(adm: AdmissionController, rid: int, tenant: str) -> None:
    adm.offer(item(rid, tenant), 0.0, True)
    assert [w.request_id for w in adm.pop_admissible(0.0, 8, 10_000)] == [rid]


def test_lane_clock_counts_delivered_service_over_weight() -> None:
    adm = AdmissionController(BUDGET, 256, {"w2": TenantPolicy(weight=2.0)})
    admit(adm, 1, "w2")
    adm.charge("w2", prefill_tokens=4, decode_tokens=3, request_id=1)  # 4 + 2*3 = 10 units
    assert adm.lane_virtual_time("w2") == 5.0
    assert adm.weight("w2") == 2.0 and adm.weight("other") == 1.0
    assert adm.lane_virtual_time("never-seen") == 0.0


def test_returning_tenant_is_lifted_but_a_busy_one_keeps_its_deficit() -> None:
    adm = AdmissionController(BUDGET, 256, {})
    admit(adm, 1, "a")
    adm.charge("a", decode_tokens=500, request_id=1)  # a: 1000
    admit(adm, 2, "b")  # b was idle: lifted to the least-served busy tenant (a)
    assert adm.lane_virtual_time("b") == 1000.0
    adm.charge("a", decode_tokens=500, request_id=1)  # a: 2000, b still busy: keeps its claim
    assert adm.lane_virtual_time("b") == 1000.0
    admit(adm, 3, "b")  # b was busy: no lift
    assert adm.lane_virtual_time("b") == 1000.0
    adm.release(2)
    adm.release(3)  # b idle now
    adm.charge("a", decode_tokens=1000, request_id=1)  # a: 4000
    admit(adm, 4, "b")
    assert adm.lane_virtual_time("b") == 4000.0  # no banked credit for the idle stretch
    adm.release(1)
    adm.release(4)
    admit(adm, 5, "c")  # nobody busy: nothing to lift to
    assert adm.lane_virtual_time("c") == 0.0


@settings(max_examples=150)
@given(
    weights=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=2, max_size=5),
    b=st.sampled_from([1, 4, 8, 16]),
    steps=st.integers(1, 60),
    data=st.data(),
)
def test_backlogged_tenants_weighted_service_gap_stays_bounded(
        weights: list[float], b: int, steps: int, data: st.DataObject) -> None:
    """Every tenant keeps >= B ready sequences (backlogged); sequences finish at random and are
    replaced. After every batch the weighted delivered service of any two tenants differs by at
    most one decode token's cost over the smallest weight — VTC's bound for unit-cost picks."""
    cost = 2.0
    names = [f"t{i}" for i in range(len(weights))]
    w = dict(zip(names, weights))
    service = dict.fromkeys(names, 0.0)
    served_at: dict[int, float] = {}
    owner: dict[int, str] = {}
    next_id = 0
    for t in names:
        for _ in range(b + data.draw(st.integers(0, 3))):
            owner[next_id], served_at[next_id] = t, -1.0
            next_id += 1
    prof = BatchProfile(b, 1 << 20)
    bound = cost / min(weights) + 1e-9
    for step in range(steps):
        cands = [DecodeCandidate(rid, rid, t, 1, 0, 1, None, served_at[rid])
                 for rid, t in owner.items()]
        order = LaneOrder(tenant_vt={t: service[t] / w[t] for t in names}, tenant_weight=w,
                          token_cost=cost)
        batch = build_decode_batch(prof, cands, float(step), 1, order=order)
        assert batch.active == b
        for c in batch.lanes:
            assert c is not None
            service[c.tenant] += cost
            served_at[c.request_id] = float(step)
            if data.draw(st.integers(0, 9)) == 0:  # the sequence finished; a new one replaces it
                del owner[c.request_id]
                owner[next_id], served_at[next_id] = c.tenant, float(step)
                next_id += 1
        vts = [service[t] / w[t] for t in names]
        assert max(vts) - min(vts) <= bound, (step, service)


def test_fcfs_gap_is_not_bounded_which_is_why_fair_exists() -> None:
    """Control for the property above: FCFS on the same shape lets the early tenant take all."""
    cands = [DecodeCandidate(i, i, "early" if i < 16 else "late", 1, 0, 1, None, 0.0,
                             arrival=float(i)) for i in range(32)]
    batch = build_decode_batch(BatchProfile(16, 64), cands, 0.0, 1,
                               order=LaneOrder(policy="fcfs"))
    assert {c.tenant for c in batch.lanes if c} == {"early"}
    fair = build_decode_batch(BatchProfile(16, 64), cands, 0.0, 1)
    assert [c.tenant for c in fair.lanes if c].count("late") == 8
