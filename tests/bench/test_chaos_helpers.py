"""bench.chaos's pure parts: the plan is deterministic for a seed, outputs are judged against the
reference (completed: equal; deadline-cut: a prefix), and who "noticed" a fault."""

from __future__ import annotations

from bench.chaos import Outcome, check_outputs, gauges_at_rest, make_plans, summarise


def test_plans_are_deterministic_and_mixed() -> None:
    a, b = make_plans(200, 4, rate=50.0), make_plans(200, 4, rate=50.0)
    assert a == b and a != make_plans(200, 5, rate=50.0)
    assert any(p.stream for p in a) and any(not p.stream for p in a)
    assert any(p.disconnect_after for p in a) and any(p.max_tokens == 400 for p in a)
    assert all(x.at < y.at for x, y in zip(a, a[1:]))


def test_check_outputs_and_noticed() -> None:
    p = make_plans(3, 1, rate=10.0)
    ok = Outcome(p[0], kind="ok", text="abc", terminals=1)
    cut = Outcome(p[1], kind="truncated", text="ab", terminals=1)
    wrong = Outcome(p[2], kind="ok", text="abd", terminals=1)
    ref = {0: "abc", 1: "abc", 2: "abc"}
    bad = check_outputs([ok, cut, wrong], ref)
    assert len(bad) == 1 and "request 2" in bad[0]
    err = Outcome(p[0], kind="error", code="device_unavailable", terminals=1)
    busy = Outcome(p[1], kind="rejected", status=429, terminals=1)
    down = Outcome(p[2], kind="rejected", status=503, terminals=1)
    assert err.noticed and not busy.noticed and down.noticed
    s = summarise([ok, err, busy, Outcome(p[2], kind="ok", terminals=2)])
    assert s["noticed_fault"] == 1 and s["terminals_not_one"] == 1


def test_gauges_at_rest_sums_non_free_sequences() -> None:
    text = "\n".join([
        "# TYPE calserve_requests_running gauge", "calserve_requests_running 0",
        "# TYPE calserve_kv_sequences gauge",
        'calserve_kv_sequences{state="Free"} 16', 'calserve_kv_sequences{state="Unknown"} 2',
        'calserve_kv_sequences{state="Active"} 1', ""])
    g = gauges_at_rest(text)
    assert g["calserve_requests_running"] == 0 and g["calserve_kv_sequences(non-free)"] == 3
