"""PingPongGuard (spec §14): each degradation condition on its own, and the re-enable policy, on
explicit times (the guard reads no clock)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from calserve.engine.degrade import DegradeReason, GuardSettings, PingPongGuard


def guard(**kw: object) -> PingPongGuard:
    return PingPongGuard(GuardSettings(**kw), pingpong=True)  # type: ignore[arg-type]


def test_crosstalk_degrades_at_once() -> None:
    g = guard()
    assert g.fault("crosstalk", 1.0) is DegradeReason.CROSSTALK
    assert not g.dual and g.state == "single" and g.reason is DegradeReason.CROSSTALK
    assert g.degradations_total == {"crosstalk": 1}


def test_status_anomaly_degrades() -> None:
    for status in ("invalid", "aborted"):
        g = guard()
        assert g.fault(status, 1.0) is DegradeReason.ANOMALY and not g.dual


def test_counter_anomaly_degrades_consistent_counters_do_not() -> None:
    g = guard()
    assert not g.counters(10, 8, 1, 1, 2, 0.0) and g.dual  # consistent
    assert g.counters(10, 9, 2, 0, 2, 0.0) and not g.dual  # completed + failed > submitted
    g = guard()
    assert g.counters(10, 5, 0, 3, 2, 0.0) and not g.dual  # in flight beyond the queue depth


def test_p99_beyond_factor_of_modeled_step() -> None:
    g = guard(p99_factor=3.0, p99_min_samples=64)
    assert not g.step_p99(0.05, 63, 0.01, 0.0)  # too few samples
    assert not g.step_p99(0.03, 64, 0.01, 0.0)  # exactly 3x: not above
    assert not g.step_p99(0.05, 64, None, 0.0)  # no timing model: the condition does not apply
    assert g.step_p99(0.031, 64, 0.01, 0.0) and g.reason is DegradeReason.P99
    off = guard(p99_factor=None)
    assert not off.step_p99(10.0, 1000, 0.01, 0.0)


def test_consecutive_busy_only() -> None:
    g = guard(busy_streak=3)
    assert not g.busy(0.0) and not g.busy(0.1)
    g.submitted()  # an accepted submit breaks the streak
    assert not g.busy(0.2) and not g.busy(0.3)
    assert g.busy(0.4) and g.reason is DegradeReason.BUSY


def test_consecutive_timeouts_or_ccu_faults() -> None:
    g = guard(fault_streak=2)
    assert g.fault("timeout", 0.0) is None and g.dual
    g.job_ok()  # a good job in between: the streak restarts
    assert g.fault("ccu_fault", 1.0) is None and g.dual
    assert g.fault("timeout", 2.0) is DegradeReason.FAULTS and not g.dual
    assert guard().fault("dma_unknown", 0.0) is None  # not a §14 condition by itself
    assert guard().fault("device_refused", 0.0) is None


def test_uncertain_recovery_degrades() -> None:
    g = guard()
    assert g.trigger(DegradeReason.UNCERTAIN, 5.0) and not g.dual


def test_probation_restarts_on_every_trigger_then_reenables() -> None:
    g = guard(probation_s=60.0)
    g.fault("crosstalk", 0.0)
    assert g.reenable_at() == 60.0
    assert not g.poll(59.9) and not g.dual
    assert not g.trigger(DegradeReason.BUSY, 30.0)  # already single: only restarts the probation
    assert g.reenable_at() == 90.0 and not g.poll(60.0)
    assert g.poll(90.0) and g.dual and g.reason is None and g.reenable_at() == math.inf
    assert g.degradations_total == {"crosstalk": 1}  # one degradation, one re-enable


def test_never_reenable_by_config() -> None:
    g = guard(probation_s=None)
    g.fault("crosstalk", 0.0)
    assert g.reenable_at() == math.inf and not g.poll(1e9) and not g.dual


def test_reset_budget_holds_single_whatever_the_probation() -> None:
    g = guard(probation_s=1.0)
    assert g.hold(True, 0.0) and g.reason is DegradeReason.RESET_BUDGET
    assert not g.poll(100.0) and not g.dual
    g.hold(False, 100.0)
    assert g.poll(101.0) and g.dual


def test_disabled_or_single_engine_never_degrades() -> None:
    g = guard(enabled=False)
    assert g.fault("crosstalk", 0.0) is None and g.dual
    one = PingPongGuard(GuardSettings(), pingpong=False)
    assert one.fault("crosstalk", 0.0) is None and one.state == "off"
    assert not one.poll(1e9) and one.state == "off"


_EVENTS = st.lists(st.tuples(st.sampled_from(["crosstalk", "timeout", "ok", "busy", "poll"]),
                             st.floats(0.0, 5.0)), max_size=40)


@given(_EVENTS)
def test_dual_again_only_after_a_full_probation_without_trigger(events: list[tuple[str, float]]) -> None:
    g = guard(probation_s=10.0, busy_streak=2, fault_streak=2)
    now = 0.0
    last_trigger = -math.inf
    for what, dt in events:
        now += dt
        was_dual = g.dual
        if what == "ok":
            g.job_ok()
        elif what == "busy":
            g.busy(now)
        elif what == "poll":
            g.poll(now)
        else:
            g.fault(what, now)
        if g.last_trigger == now:
            last_trigger = now
        if g.dual and not was_dual:  # re-enabled: a whole probation since the last trigger
            # (as the guard states it, the trigger time plus the probation: ``now - last >= 10``
            # can be 9.999999999999998 for the same instants, found by a random-seed run)
            assert now >= last_trigger + 10.0
        if not g.dual:
            assert g.reason is not None
