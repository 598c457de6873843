"""Overload admission (calserve.core.wait_estimate + AdmissionController): the expected-wait refusal,
the running-sequence cap, short-before-long inside a tenant, and a simulated device run.

Pure logic, plain float clock (spec §17.1). The simulation is a single serialised device with the
real controller and the real prefill round robin: what is admitted is served within the bound.
"""

from __future__ import annotations

import collections
import heapq
import random
from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from calserve.config import AdmissionConfig, QueuesConfig
from calserve.core.admission import AdmissionController, CapacityBudget, Outcome, WorkItem
from calserve.core.prefill import QueueClass, ServiceRoundRobin
from calserve.core.wait_estimate import FlowLoad, ServiceModel, expected_wait, running_cap

BUDGET = CapacityBudget(max_sequences=64, max_kv_tokens=64 * 2048, max_waiting_requests=10_000,
                        max_waiting_prompt_tokens=10**8, max_inflight_jobs=1)
SAT4K = ServiceModel.from_profile(16, decode_step_us={16: 4000.0}, prefill_base_us=2000.0,
                                  prefill_us_per_token=20.0)
_ids = iter(range(10**9))


def item(tenant: str = "a", prompt: int = 16, new: int = 64, now: float = 0.0,
         deadline: float | None = 120.0) -> WorkItem:
    return WorkItem(next(_ids), tenant, prompt, new, now, deadline, 0)


def ctl(service: ServiceModel = SAT4K, slo_s: float | None = 1.0, max_running: int | None = 32,
        policy: str = "wfq", weights: dict[str, float] | None = None) -> AdmissionController:
    from calserve.core.admission import TenantPolicy
    tenants = {n: TenantPolicy(weight=w) for n, w in (weights or {}).items()}
    return AdmissionController(BUDGET, 2048, tenants, policy=policy,  # type: ignore[arg-type]
                               service=service, max_expected_wait_s=slo_s, max_running=max_running)


# -- the estimate ---------------------------------------------------------------------------------

def test_service_model_from_profile_and_running_cap() -> None:
    m = ServiceModel.from_profile(16, decode_step_us={1: 4000.0, 16: 8000.0}, prefill_base_us=2000.0,
                                  prefill_us_per_token=20.0)
    assert (m.decode_step_s, m.batch, m.prefill_s(100)) == (0.008, 16, pytest.approx(0.004))
    assert ServiceModel.from_profile(4, decode_step_us={}).known is False
    assert ServiceModel.from_profile(4).known is False
    assert ServiceModel.from_profile(8, decode_step_us={16: 4000.0}).decode_step_s == 0.004
    cfg = AdmissionConfig()
    assert running_cap(cfg, 16, 0.004) == 48  # default max_tpot_steps 3
    assert running_cap(AdmissionConfig(max_tpot_ms=50), 1, 0.004) == 12
    assert running_cap(AdmissionConfig(max_tpot_ms=3), 16, 0.004) == 16  # never below one batch
    assert running_cap(AdmissionConfig(max_tpot_ms=50), 4, 0.0) == 12  # step unknown: steps rule
    assert running_cap(AdmissionConfig(max_tpot_steps=None), 4, 0.004) is None
    with pytest.raises(ValueError, match="batch"):
        ServiceModel(0.004, 0)


def test_lane_wait_processor_sharing_then_steady_releases() -> None:
    kw = dict(qclass=QueueClass.SHORT, cost=144.0, weight=1.0,
              class_weights={c: 1 for c in QueueClass}, others=[], pending_prefill_s=0.0)
    # B16, 32 slots, 32 running with 1..32 steps left, 9 waiting ahead: the 10th release is the
    # 10th-smallest remaining under sharing (32 sequences on 16 lanes: 2 steps per token at first).
    rem = [float(r) for r in range(1, 33)]
    own = {QueueClass.SHORT: FlowLoad(9, 9 * 144.0, 9 * 0.00232, 9 * 63.0)}
    est = expected_wait(SAT4K, slots=32, own=own, running_remaining=rem, **kw)  # type: ignore[arg-type]
    assert est.lane_wait_s == pytest.approx(10 * 32 * 0.004 / 16)
    assert est.prefill_wait_s == pytest.approx(9 * 0.00232)
    assert est.ahead == 9
    # B1, 2 slots, both running just started (63 steps): they share the lane and finish together
    # after 126 steps, freeing both slots (the probe and the one ahead of it)...
    b1 = ServiceModel(0.004, 1)
    one = {QueueClass.SHORT: FlowLoad(1, 144.0, 0.0, 63.0)}
    est = expected_wait(b1, slots=2, own=one, running_remaining=[63.0, 63.0], **kw)  # type: ignore[arg-type]
    assert est.lane_wait_s == pytest.approx(126 * 0.004)
    # ... with 1 slot, the one ahead must run its 63 steps too (a steady release).
    est = expected_wait(b1, slots=1, own=one, running_remaining=[63.0], **kw)  # type: ignore[arg-type]
    assert est.lane_wait_s == pytest.approx((63 + 63) * 0.004)
    # Nothing ahead and a free slot: no lane wait.
    est = expected_wait(b1, slots=2, own={}, running_remaining=[63.0], **kw)  # type: ignore[arg-type]
    assert est.seconds == 0.0


@settings(max_examples=60)
@given(prompt=st.integers(1, 1500), new=st.integers(1, 500), slo=st.floats(1e-3, 5.0),
       step=st.floats(0.0, 0.1), batch=st.sampled_from([1, 4, 16]), policy=st.sampled_from(["wfq", "fcfs"]))
def test_idle_server_never_refuses(prompt: int, new: int, slo: float, step: float, batch: int,
                                   policy: str) -> None:
    svc = ServiceModel(step, batch, 0.03, 0.001)
    a = ctl(svc, slo, batch * 2, policy)
    x = item(prompt=prompt, new=new)
    assert a.expected_wait(x).seconds == 0.0
    assert a.offer(x, 0.0, True).outcome is Outcome.QUEUE


@st.composite
def backlog(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    return draw(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from([16, 400, 1000, 1800]),
                                   st.integers(1, 200)), max_size=30))


@settings(max_examples=80)
@given(waiting=backlog(), running=backlog(), probe=st.tuples(st.sampled_from("abc"),
       st.sampled_from([16, 1000, 1800]), st.integers(1, 200)), extra=st.integers(1, 200),
       policy=st.sampled_from(["wfq", "fcfs"]), slots=st.integers(1, 8),
       progress=st.lists(st.integers(0, 200), max_size=30))
def test_estimate_is_monotone_in_the_work_ahead(waiting: list[tuple[str, int, int]],
                                               running: list[tuple[str, int, int]],
                                               probe: tuple[str, int, int], extra: int,
                                               policy: str, slots: int, progress: list[int]) -> None:
    """More running decode work, or one more request in the probe's own tenant and class (FIFO:
    ahead of it), never lowers the probe's expected wait (``slots`` lane slots, so the lane wait is
    exercised; running requests have made some decode progress)."""

    def build(more_running: bool, more_waiting: bool) -> AdmissionController:
        a = ctl(slo_s=None, max_running=slots, policy=policy)
        global _ids
        _ids = iter(range(10**9))  # the same request ids in every build
        run = running[:slots - 1] + ([(probe[0], probe[1], extra)] if more_running else [])
        for k, (t, p, n) in enumerate(run):
            x = item(t, p, n)
            a.offer(x, 0.0, True)
            assert a.pop_admissible(0.0, 1, 10**9)
            if k < len(progress) and k < len(running[:slots - 1]):
                a.charge(t, prefill_tokens=p, request_id=x.request_id)
                a.charge(t, decode_tokens=min(progress[k], n - 1), request_id=x.request_id)
        for t, p, n in waiting + ([(probe[0], probe[1], extra)] if more_waiting else []):
            a.offer(item(t, p, n), 0.0, True)
        return a

    x = item(*probe)
    base = build(False, False).expected_wait(x).seconds
    assert build(True, False).expected_wait(x).seconds >= base - 1e-12
    assert build(False, True).expected_wait(x).seconds >= base - 1e-12


def test_refusal_names_the_slo_and_retry_after_is_the_excess() -> None:
    a = ctl(slo_s=0.6)
    n_ok = 0
    while True:
        d = a.offer(item(), 0.0, True)
        if d.outcome is not Outcome.QUEUE:
            break
        n_ok += 1
        a.pop_admissible(0.0, 64, 10**9)  # fill the 32 running slots first
    assert d.outcome is Outcome.REJECT_CAPACITY and not d.quota
    assert "max_expected_wait_ms (600)" in d.reason
    assert d.retry_after_s is not None and d.retry_after_s >= 0.1
    s = a.statistics()
    assert s.rejected_expected_wait == 1 and s.active_sequences == 32 and s.max_running == 32
    assert s.last_expected_wait_s > 0.6
    # 32 running ones just admitted: 63 steps each at 2 steps per token (32 on 16 lanes) = 0.504 s
    # until they all finish together, plus their 32 pending prefills (2.32 ms each); each request
    # queued ahead adds its prefill: 0.504 + 0.0742 + k * 0.00232 <= 0.6 for k = 0..9.
    assert n_ok == 32 + 10, n_ok
    # The request's own deadline bounds the wait too (it would expire before being served).
    b = ctl(slo_s=None)
    for _ in range(40):
        b.offer(item(), 0.0, True)
        b.pop_admissible(0.0, 64, 10**9)
    d = b.offer(item(deadline=0.05), 0.0, True)
    assert d.outcome is Outcome.REJECT_CAPACITY and "deadline" in d.reason
    assert b.offer(item(deadline=100.0), 0.0, True).outcome is Outcome.QUEUE


def test_running_cap_and_unknown_timing_keep_the_old_behaviour() -> None:
    a = ctl(max_running=3)
    for _ in range(5):
        a.offer(item(), 0.0, True)
    assert len(a.pop_admissible(0.0, 64, 10**9)) == 3
    assert a.pop_admissible(0.0, 64, 10**9) == []
    rid = next(iter(a._active))  # noqa: SLF001 - the one active request to end
    a.release(rid)
    assert len(a.pop_admissible(0.0, 64, 10**9)) == 1
    # No service model: no expected-wait refusals, whatever is queued.
    u = ctl(ServiceModel(0.0, 16), slo_s=0.001)
    assert all(u.offer(item(), 0.0, True).outcome is Outcome.QUEUE for _ in range(500))


def test_observed_speed_replaces_the_modeled_step_only_when_saturated() -> None:
    a = ctl(max_running=16)
    xs = [item() for _ in range(16)]
    for x in xs:
        a.offer(x, 0.0, True)
    a.pop_admissible(0.0, 64, 10**9)
    a.observe(0.0)
    for k in range(1, 41):  # 16 lane-steps every 10 ms: 0.625 ms per lane-step (model: 0.25)
        for x in xs:
            a.charge("a", decode_tokens=1, request_id=x.request_id)
        a.observe(k * 0.01)
    assert a.lane_step_s == pytest.approx(0.000625, rel=0.02)
    for x in xs[:8]:
        a.release(x.request_id)
    a.observe(1.0)  # unsaturated: no sample, the window restarts
    a.observe(2.0)
    assert a.lane_step_s == pytest.approx(0.000625, rel=0.02)


def test_short_prompts_pass_long_ones_within_a_tenant_but_long_keeps_a_share() -> None:
    a = ctl(slo_s=None, max_running=None)
    longs = [item(prompt=1000, new=64) for _ in range(10)]
    shorts = [item(prompt=16, new=64) for _ in range(40)]
    for x in longs + shorts:  # the long ones arrived first
        a.offer(x, 0.0, True)
    order = [w.request_id for w in a.pop_admissible(0.0, 50, 10**9)]
    first20 = set(order[:20])
    n_long = sum(1 for x in longs if x.request_id in first20)
    assert 1 <= n_long <= 4, n_long  # medium:short 2:4 by cost -> ~1 long per 16 shorts
    assert order.index(shorts[0].request_id) == 0
    assert sorted(order) == sorted(x.request_id for x in longs + shorts)  # everything served


# -- a simulated device -----------------------------------------------------------------------------

@dataclass
class _Seq:
    item: WorkItem
    remaining: int = 0


def simulate(seed: int, batch: int, step_s: float, slo_s: float, load: float = 3.0,
             seconds: float = 20.0) -> tuple[dict[int, float], int, int, float]:
    """Poisson arrivals at ``load`` x decode capacity, 80 % 16-token / 20 % 1,024-token prompts,
    64 output tokens, onto one serialised device (prefill round robin 8:4:2:1, fair decode
    lanes). Returns (queue waits of admitted requests: arrival -> prefill start, admitted, refused,
    device busy fraction)."""
    rng = random.Random(seed)
    svc = ServiceModel(step_s, batch, 0.002, 20e-6)
    a = AdmissionController(BUDGET, 2048, {}, service=svc, max_expected_wait_s=slo_s,
                            max_running=running_cap(AdmissionConfig(), batch, step_s))
    rr = ServiceRoundRobin.from_config(QueuesConfig())
    rate = load * batch / step_s / 64
    arrivals: list[tuple[float, int]] = []
    t = 0.0
    while t < seconds:
        t += rng.expovariate(rate)
        arrivals.append((t, 1024 if rng.random() < 0.2 else 16))
    prefill: dict[QueueClass, collections.deque[_Seq]] = {c: collections.deque() for c in
                                                          (QueueClass.SHORT, QueueClass.MEDIUM)}
    ready: collections.OrderedDict[int, _Seq] = collections.OrderedDict()
    waits: dict[int, float] = {}
    refused = admitted = 0
    now = busy = 0.0
    i = 0
    events: list[float] = []
    while i < len(arrivals) or a.statistics().active_sequences or len(a):
        while i < len(arrivals) and arrivals[i][0] <= now:  # offers see the state at their time
            at, p = arrivals[i]
            d = a.offer(WorkItem(i, "t", p, 64, at, at + 120.0, 0), at, True)
            refused += d.outcome is Outcome.REJECT_CAPACITY
            i += 1
        a.observe(now)
        for w in a.pop_admissible(now, 64, 10**9):
            admitted += 1
            prefill[a.qclass(w)].append(_Seq(w))
        avail = {c for c, q in prefill.items() if q} | ({QueueClass.DECODE} if ready else set())
        cls = rr.next(avail)
        if cls is None:  # idle until the next arrival
            if i >= len(arrivals):
                break
            now = arrivals[i][0]
            continue
        if cls is QueueClass.DECODE:
            lanes = [ready.pop(k) for k in list(ready)[:batch]]
            dur = step_s
        else:
            s = prefill[cls].popleft()
            waits[s.item.request_id] = now - s.item.arrival
            lanes = [s]
            dur = svc.prefill_s(s.item.prompt_tokens)
        now += dur
        busy += dur
        heapq.heappush(events, now)
        for s in lanes:
            if cls is QueueClass.DECODE:
                a.charge("t", decode_tokens=1, request_id=s.item.request_id)
                s.remaining -= 1
            else:
                a.charge("t", prefill_tokens=s.item.prompt_tokens, request_id=s.item.request_id)
                s.remaining = s.item.max_new_tokens - 1
            if s.remaining <= 0:
                a.release(s.item.request_id)
            else:
                ready[s.item.request_id] = s
    return waits, admitted, refused, busy / max(now, 1e-9)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 1000), batch=st.sampled_from([1, 4, 16]), slo=st.sampled_from([0.3, 1.0]))
@example(seed=405, batch=1, slo=1.0)
def test_simulated_overload_admitted_requests_wait_within_the_bound(seed: int, batch: int,
                                                                    slo: float) -> None:
    by_id, admitted, refused, busy = simulate(seed, batch, 0.004, slo,
                                              seconds=6.0 if batch == 1 else 4.0)
    waits = sorted(by_id.values())
    p99 = waits[int(0.99 * (len(waits) - 1))]
    # 3x overload: ~2/3 to refuse, less the SLO's worth of queue admitted at the start (at B1 and
    # 1 s, ~4 requests of ~25) and the noise of 50-70 Poisson arrivals. "refused > admitted" failed
    # a random-seed run (seed 405, B1, 1 s: 25 refused, 28 admitted of 53 arrivals, 2 sigma few);
    # over 251 seeds x 6 shapes the refused share was at least 0.44-0.63 per shape, median 0.58-0.67.
    assert refused >= 0.4 * (refused + admitted), (refused, admitted)
    assert p99 <= 1.2 * slo, (p99, max(waits))
    # ... and the device kept busy (B1 with a 0.3 s SLO keeps at most ~1 request queued while a
    # request takes 0.25 s of device time: a gap now and then)
    assert busy > (0.85 if batch == 1 else 0.95), busy
