"""The per-batch / inlined forms of the per-token bookkeeping (issue 18) against the general calls
they stand for: same state afterwards, same errors.

- ``KvLaneManager.begin_decode`` / ``commit_decode`` against ``begin_update(lane, pos, 1)`` /
  ``commit(lane, 1)`` lane by lane (a random lane table: active, updating, free lanes, positions
  right or wrong);
- ``AdmissionController.charge_decoded`` against ``charge(tenant, decode_tokens=1,
  request_id=...)`` through a random history of offers, admissions, charges and releases (the
  tenants' service, virtual times and estimates, and the service tracker's figures, exactly).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.core.admission import AdmissionController, CapacityBudget, TenantPolicy, WorkItem
from calserve.core.kv import KvLaneManager


def _kv_table(spec: list[tuple[int, int]]) -> KvLaneManager:
    """Lanes per ``(kind, committed)``: kind 0 free, 1 active, 2 updating."""
    kv = KvLaneManager(len(spec), 64, 64 * len(spec))
    for i, (kind, committed) in enumerate(spec):
        if kind == 0:
            continue
        if kind == 2:
            committed = min(committed, 39)  # room for the token in flight
        lease = kv.reserve(100 + i, 1, 40)
        assert lease is not None
        kv.bind(lease.lane, 500 + i)
        if committed:
            kv.begin_update(lease.lane, 0, committed)
            kv.commit(lease.lane, committed)
        if kind == 2:
            kv.begin_update(lease.lane, committed, 1)
    return kv


def _snapshot(kv: KvLaneManager) -> Any:
    return [kv.info(i) for i in range(kv.num_lanes)], kv.statistics()


def _outcome(fn: Any) -> Any:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the same error either way is the point
        return type(e), str(e)
    return None


_lanes_spec = st.lists(st.tuples(st.integers(0, 2), st.sampled_from([0, 3, 39, 40])),
                       min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(spec=_lanes_spec, data=st.data())
def test_begin_and_commit_decode_equal_the_per_lane_calls(spec: list[tuple[int, int]],
                                                          data: st.DataObject) -> None:
    n = len(spec)
    picks = data.draw(st.lists(st.integers(-1, n), max_size=n, unique=True))
    bad_pos = data.draw(st.sets(st.integers(0, n), max_size=2))
    positions = []
    for k, lane in enumerate(picks):
        kind, committed = spec[lane] if 0 <= lane < n else (0, 0)
        committed = min(committed, 39) if kind == 2 else committed
        positions.append(committed + (1 if k in bad_pos else 0))
    a, b = _kv_table(spec), _kv_table(spec)

    def one_by_one() -> None:
        for lane, pos in zip(picks, positions, strict=True):
            a.begin_update(lane, pos, 1)

    assert _outcome(one_by_one) == _outcome(lambda: b.begin_decode(picks, positions))
    assert _snapshot(a) == _snapshot(b)

    def commits() -> None:
        for lane in picks:
            a.commit(lane, 1)

    assert _outcome(commits) == _outcome(lambda: b.commit_decode(picks))
    assert _snapshot(a) == _snapshot(b)


BUDGET = CapacityBudget(max_sequences=16, max_kv_tokens=1 << 20, max_waiting_requests=100,
                        max_waiting_prompt_tokens=1 << 20, max_inflight_jobs=1)
_op = st.one_of(
    st.tuples(st.just("offer"), st.sampled_from(["a", "b", "c"]), st.integers(1, 40)),
    st.tuples(st.just("admit"), st.integers(1, 4)),
    st.tuples(st.just("charge"), st.integers(0, 30)),  # an index into the admitted ids
    st.tuples(st.just("stray"), st.sampled_from(["a", "b", "zz"])),  # an id admission never saw
    st.tuples(st.just("release"), st.integers(0, 30)),
)


def _admission_state(a: AdmissionController) -> Any:
    st_ = a.statistics()
    return (dataclasses.asdict(st_),
            {n: (t.service, t.vt, t.lane_vt, t.est) for n, t in a._tenants.items()},
            dict(a._remaining), a._svc.running_remaining(), a._svc._decode_total)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, max_size=60), weight=st.sampled_from([1.0, 0.5, 3.0]),
       cost=st.sampled_from([1.0, 0.25, 2.0]))
def test_charge_decoded_equals_charge_of_one_decode_token(ops: list[tuple[Any, ...]],
                                                          weight: float, cost: float) -> None:
    pol = {"b": TenantPolicy(weight=weight)}

    def make() -> AdmissionController:
        return AdmissionController(BUDGET, 1024, pol, policy="wfq",  # type: ignore[arg-type]
                                   output_token_cost=cost)

    fast, ref = make(), make()
    admitted: list[WorkItem] = []
    rid = 0
    now = 0.0
    for op in ops:
        now += 0.5
        if op[0] == "offer":
            rid += 1
            w = WorkItem(rid, op[1], 10, op[2], now, None, 0)
            assert fast.offer(w, now, True).outcome == ref.offer(w, now, True).outcome
        elif op[0] == "admit":
            got = fast.pop_admissible(now, op[1], 1 << 20)
            assert [w.request_id for w in got] == [w.request_id for w in ref.pop_admissible(
                now, op[1], 1 << 20)]
            admitted += got
        elif op[0] == "charge" and admitted:
            w = admitted[op[1] % len(admitted)]
            fast.charge_decoded(w.tenant, w.request_id)
            ref.charge(w.tenant, decode_tokens=1, request_id=w.request_id)
        elif op[0] == "stray":
            fast.charge_decoded(op[1], 10**6)
            ref.charge(op[1], decode_tokens=1, request_id=10**6)
        elif op[0] == "release" and admitted:
            w = admitted.pop(op[1] % len(admitted))
            fast.release(w.request_id)
            ref.release(w.request_id)
        assert _admission_state(fast) == _admission_state(ref)


@pytest.mark.parametrize("layout", ["AAA-", "A-A-", "----", "AAAA", "-AAA", "A--A"])
def test_device_job_lanes_layouts(layout: str) -> None:
    from calserve.engine.state import DeviceJob

    gen = type("G", (), {"calbin": object()})()
    lanes: list[Any] = [object() if c == "A" else None for c in layout]
    job = DeviceJob("decode", gen, lanes, None, None, None, 0.0)  # type: ignore[arg-type]
    assert job.active == [i for i, s in enumerate(lanes) if s is not None]
    assert job.seqs == [s for s in lanes if s is not None]
    assert all(a is b for a, b in zip(job.seqs, [s for s in lanes if s is not None], strict=True))


def test_charge_decoded_history_reaches_admitted_requests() -> None:
    """The property above is not vacuous: offers are admitted and charged (a fixed history)."""
    ops = [("offer", "a", 5), ("offer", "b", 7), ("admit", 2), ("charge", 0), ("charge", 1),
           ("charge", 1), ("release", 0), ("charge", 0)]
    test_charge_decoded_equals_charge_of_one_decode_token.hypothesis.inner_test(  # type: ignore[attr-defined]
        ops, 3.0, 0.25)
    a = AdmissionController(BUDGET, 1024, {}, policy="wfq")  # type: ignore[arg-type]
    a.offer(WorkItem(1, "a", 10, 5, 0.0, None, 0), 0.0, True)
    assert [w.request_id for w in a.pop_admissible(0.0, 1, 1 << 20)] == [1]
    a.charge_decoded("a", 1)
    assert a.statistics().tenants["a"].service == a.output_token_cost
