"""Decode policy (spec §7–§8, §17.1): lane selection, skips, tenant share, window, profiles."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calserve.config import ConfigError, ProfileSelection
from calserve.core.decode import (
    BatchProfile,
    DecodeBatch,
    DecodeCandidate,
    LaneOrder,
    MissingProfile,
    SkipReason,
    batching_window,
    build_decode_batch,
    profile_or_fail,
    select_profile,
)

B4 = BatchProfile(compiled_batch=4, max_seq=64, inactive_token_id=151643, inactive_position=0)


def cand(rid: int, tenant: str = "a", deadline: float | None = 100.0, vf: float = 0.0,
         gen: int = 1, pos: int = 5, cancelled: bool = False) -> DecodeCandidate:
    return DecodeCandidate(rid, seq_id=1000 + rid, tenant=tenant, generation=gen, last_token=rid,
                           position=pos, deadline=deadline, virtual_finish=vf, cancelled=cancelled)


@pytest.mark.parametrize("n", range(0, 6))  # ready queue 0..B+1 for B=4
def test_ready_queue_0_to_b_plus_1(n: int) -> None:
    ready = [cand(i, deadline=10.0 + i) for i in range(n)]
    b = build_decode_batch(B4, ready, now=0.0, generation=1)
    k = min(n, 4)
    assert b.active == k and b.fill_ratio == k / 4
    assert len(b.lanes) == len(b.token_ids) == len(b.positions) == len(b.valid_mask) == 4
    assert [c.request_id if c else None for c in b.lanes] == [*range(k), *[None] * (4 - k)]
    assert b.valid_mask == (1,) * k + (0,) * (4 - k)
    assert b.token_ids == tuple(range(k)) + (151643,) * (4 - k)  # declared filler, not token 0
    assert b.positions == (5,) * k + (0,) * (4 - k)
    assert b.seq_ids == tuple(1000 + i for i in range(k)) + (-1,) * (4 - k)
    assert b.skipped == tuple((i, SkipReason.BATCH_FULL) for i in range(4, n))
    assert b.empty == (n == 0)


def test_cancelled_expired_generation_and_length_are_skipped() -> None:
    ready = [cand(1, cancelled=True), cand(2, deadline=5.0), cand(3, gen=0), cand(4, pos=64),
             cand(5), cand(6, deadline=None)]
    b = build_decode_batch(B4, ready, now=5.0, generation=1)
    assert [c.request_id for c in b.lanes if c] == [5, 6]  # no deadline sorts last
    assert dict(b.skipped) == {1: SkipReason.CANCELLED, 2: SkipReason.DEADLINE,
                               3: SkipReason.GENERATION, 4: SkipReason.LENGTH}


def ids(b: DecodeBatch) -> list[int]:
    return [c.request_id for c in b.lanes if c]


def test_at_risk_deadlines_first_edf_then_least_served_tenant() -> None:
    # now=0, horizon 2 s: 2 and 3 are at risk (EDF among them), the rest go by tenant service.
    ready = [cand(1, "a", deadline=9.0, vf=1.0), cand(2, "b", deadline=1.5, vf=5.0),
             cand(3, "a", deadline=0.5, vf=0.5), cand(4, "b", deadline=90.0, vf=0.5),
             cand(5, "a", deadline=20.0, vf=0.0)]
    order = LaneOrder(urgency_s=2.0, tenant_vt={"a": 10.0, "b": 3.0})
    b = build_decode_batch(B4, ready, now=0.0, generation=1, order=order)
    # 3, 2 at risk; then b (3 + 2 = 5 after lane 2 < 10) -> 4; then a (least recently served) -> 5
    assert ids(b) == [3, 2, 4, 5]
    assert dict(b.skipped) == {1: SkipReason.BATCH_FULL}


def test_far_deadlines_do_not_turn_the_order_into_fcfs() -> None:
    """With default deadlines (arrival + 120 s) EDF would be FCFS: the heavy tenant that arrived
    first would hold every lane. The least-served tenant goes first instead."""
    heavy = [cand(i, "heavy", deadline=120.0 + i, vf=float(i)) for i in range(8)]
    light = [cand(100 + i, "light", deadline=200.0 + i, vf=float(i)) for i in range(2)]
    order = LaneOrder(tenant_vt={"heavy": 500.0, "light": 100.0})
    b = build_decode_batch(B4, heavy + light, now=0.0, generation=1, order=order)
    assert ids(b) == [100, 101, 0, 1]


def test_equal_service_splits_lanes_by_weight() -> None:
    ready = [cand(i, "w1", vf=float(i)) for i in range(10)]
    ready += [cand(100 + i, "w3", vf=float(i)) for i in range(10)]
    order = LaneOrder(tenant_vt={"w1": 0.0, "w3": 0.0}, tenant_weight={"w1": 1.0, "w3": 3.0})
    b = build_decode_batch(BatchProfile(8, 64), ready, now=0.0, generation=1, order=order)
    tenants = [c.tenant for c in b.lanes if c]
    assert tenants.count("w1") == 2 and tenants.count("w3") == 6


def test_round_robin_within_a_tenant_least_recently_served_first() -> None:
    ready = [cand(1, vf=3.0), cand(2, vf=1.0), cand(3, vf=2.0), cand(4, vf=1.0), cand(5, vf=9.0)]
    b = build_decode_batch(B4, ready, now=0.0, generation=1)
    assert ids(b) == [2, 4, 3, 1]


def test_fcfs_policy_is_arrival_order_at_decode() -> None:
    ready = [DecodeCandidate(i, i, "ab"[i % 2], 1, 0, 5, deadline=1.0 + i, virtual_finish=-i,
                             arrival=float(10 - i)) for i in range(6)]
    order = LaneOrder(policy="fcfs", tenant_vt={"a": 1e9, "b": 0.0})
    b = build_decode_batch(B4, ready, now=0.0, generation=1, order=order)
    assert ids(b) == [5, 4, 3, 2]


def test_lane_order_validates() -> None:
    with pytest.raises(ValueError, match="policy"):
        LaneOrder(policy="edf")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="urgency_s"):
        LaneOrder(urgency_s=-1.0)
    with pytest.raises(ValueError, match="token_cost"):
        LaneOrder(token_cost=0.0)


def test_tenant_max_lane_share_caps_unless_no_other_candidate() -> None:
    b8 = BatchProfile(8, 64)
    ready = [cand(i, "big", deadline=float(i)) for i in range(10)]
    ready += [cand(100 + i, f"s{i}", deadline=50.0) for i in range(3)]
    b = build_decode_batch(b8, ready, now=-1.0, generation=1, tenant_max_lane_share=0.5)
    tenants = [c.tenant for c in b.lanes if c]
    # 4 lanes for "big" (50 % of 8), the 3 small tenants, and the 8th lane goes back to "big"
    # because no other candidate exists.
    assert tenants.count("big") == 5 and len(tenants) == 8
    assert sum(r == SkipReason.TENANT_SHARE for _, r in b.skipped) == 5
    alone = build_decode_batch(b8, ready[:10], now=-1.0, generation=1, tenant_max_lane_share=0.25)
    assert alone.active == 8  # a lone tenant still fills the batch


def test_duplicate_candidate_and_bad_share_raise() -> None:
    with pytest.raises(ValueError, match="twice"):
        build_decode_batch(B4, [cand(1), cand(1)], 0.0, 1)
    with pytest.raises(ValueError, match="share"):
        build_decode_batch(B4, [cand(1)], 0.0, 1, tenant_max_lane_share=0.0)


def test_profile_without_mask_contract_is_refused() -> None:
    with pytest.raises(ValueError, match="valid mask"):
        BatchProfile(8, 64, valid_mask=False)
    with pytest.raises(ValueError, match="valid mask"):
        BatchProfile(8, 64, inactive_writes_kv=True)
    BatchProfile(1, 64, valid_mask=False)  # B1 has no inactive lanes


@given(
    n=st.integers(0, 40),
    b=st.sampled_from([1, 4, 8, 16]),
    share=st.sampled_from([0.25, 0.5, 1.0]),
    data=st.data(),
)
def test_batch_properties(n: int, b: int, share: float, data: st.DataObject) -> None:
    """Every candidate is either in a lane or skipped with a reason; no candidate twice; chosen ones
    are eligible; a tenant exceeds its cap only when no other eligible candidate was left out."""
    prof = BatchProfile(b, 64)
    ready = [
        cand(i, tenant=data.draw(st.sampled_from("abc")),
             deadline=data.draw(st.one_of(st.none(), st.floats(0, 10))),
             vf=data.draw(st.floats(0, 10)), gen=data.draw(st.sampled_from([1, 1, 1, 2])),
             pos=data.draw(st.integers(0, 64)), cancelled=data.draw(st.booleans()))
        for i in range(n)
    ]
    batch = build_decode_batch(prof, ready, now=5.0, generation=1, tenant_max_lane_share=share)
    chosen = [c.request_id for c in batch.lanes if c]
    skipped = [r for r, _ in batch.skipped]
    assert sorted(chosen + skipped) == list(range(n))
    for c in batch.lanes:
        if c:
            assert not c.cancelled and c.generation == 1 and c.position < 64
            assert c.deadline is None or c.deadline > 5.0
    cap = max(1, int(share * b))
    left_eligible = [r for r, why in batch.skipped if why in (SkipReason.BATCH_FULL,
                                                               SkipReason.TENANT_SHARE)]
    if batch.active < b:
        assert not left_eligible  # a partial batch only when nothing eligible is left
    by_tenant: dict[str, int] = {}
    for c in batch.lanes:
        if c:
            by_tenant[c.tenant] = by_tenant.get(c.tenant, 0) + 1
    over = [t for t, k in by_tenant.items() if k > cap]
    if over:
        assert not any(why == SkipReason.BATCH_FULL for _, why in batch.skipped)


# -- batching window ----------------------------------------------------------------------------


def test_window_zero_or_full_fires_at_once_and_empty_never() -> None:
    assert batching_window(1.0, 0, 4, None, None, 500) == (False, None)
    assert batching_window(1.0, 1, 4, 1.0, None, 0) == (True, None)
    assert batching_window(1.0, 4, 4, 1.0, None, 10**6) == (True, None)


def test_window_fires_when_due_and_never_starves() -> None:
    fire, wake = batching_window(10.0, 2, 16, 10.0, None, 2000)
    assert not fire and wake == pytest.approx(10.002)
    assert wake is not None
    assert batching_window(wake, 2, 16, 10.0, None, 2000) == (True, None)
    assert batching_window(50.0, 2, 16, 10.0, None, 2000) == (True, None)


def test_window_never_delays_past_earliest_deadline() -> None:
    fire, wake = batching_window(10.0, 2, 16, 10.0, 10.001, 5000, step_estimate_s=0.0005)
    assert not fire and wake == pytest.approx(10.0005)
    assert batching_window(10.0005, 2, 16, 10.0, 10.001, 5000, 0.0005) == (True, None)


@given(now=st.floats(0, 100), since=st.floats(0, 100), window=st.integers(0, 10**6),
       deadline=st.one_of(st.none(), st.floats(0, 200)), ready=st.integers(1, 20))
def test_window_property(now: float, since: float, window: int, deadline: float | None,
                         ready: int) -> None:
    since = min(since, now)
    fire, wake = batching_window(now, ready, 16, since, deadline, window)
    if not fire:
        assert wake is not None and now < wake <= since + window * 1e-6 + 1e-12
        assert deadline is None or wake <= deadline
        assert batching_window(wake, ready, 16, since, deadline, window)[0]


# -- profiles ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("ready", "want"), [(0, 1), (1, 1), (2, 1), (3, 4), (5, 4), (6, 8),
                                             (11, 8), (12, 16), (99, 16)])
def test_select_profile_thresholds(ready: int, want: int) -> None:
    assert select_profile(ready, 0.0, [1, 4, 8, 16], ProfileSelection()) == want


def test_select_profile_only_among_available_and_fixed_pool() -> None:
    sel = ProfileSelection()
    assert select_profile(20, 0.0, [1], sel) == 1
    assert select_profile(20, 0.0, [1, 4], sel) == 4
    assert select_profile(1, 0.0, [8, 16], sel) == 8  # partial batch on the smallest we have
    assert select_profile(1, 0.0, [1, 16], sel, fixed=16) == 16
    with pytest.raises(MissingProfile):
        select_profile(1, 0.0, [1], sel, fixed=8)
    with pytest.raises(MissingProfile):
        select_profile(1, 0.0, [], sel)


def test_missing_profile_fails_fast() -> None:
    avail = {1: BatchProfile(1, 64)}
    assert profile_or_fail(1, avail) is avail[1]
    with pytest.raises(MissingProfile, match="B8 is not available") as ei:
        profile_or_fail(8, avail)
    assert isinstance(ei.value, ConfigError) and ei.value.param == "scheduler.batch.profiles"
