"""The expected queue wait of a new request, and the running-sequence cap (overload, spec §5.2).

Spec §5.2 keeps a request queued only while it "has hope of getting resources before its deadline".
Under heavy overload a queue that is merely bounded in *count* (``max_waiting_requests``) lets every
accepted request wait seconds. So :class:`~calserve.core.admission.AdmissionController` refuses (429
with Retry-After) a request whose *expected* wait exceeds ``min(max_expected_wait_ms, deadline - now)``,
and this module computes that expectation from what is ahead of the request. Pure functions and
plain data: no clock, no I/O.

The model (one device, its job engines serialised: ``pingpong_overlap`` 0, the conservative case):

- **Who is ahead.** The admission queue is a hierarchical weighted fair queue: tenants by weight
  (spec §5.3), and inside a tenant, prefill classes by the class weights (short:medium:long 4:2:1 by
  default, so short prompts are preferred but long ones keep a share). Under GPS (the fluid version of
  WFQ) a backlogged flow of share ``phi_u`` is served ``min(W_u, phi_u / phi_r * X_r)`` before the new
  request's flow has received ``X_r`` (its own backlog plus the request). Applied twice: across the
  classes of the request's tenant, then across tenants. Every term is non-decreasing in every
  backlog, so the estimate is monotone in the work ahead (tested).
- **Lane wait.** The request needs one of ``K`` lane slots (``min(max_sequences, max_running)``). The
  ``running`` sequences and the ``n_ahead`` waiting ones ahead occupy slots first, so
  ``excess = running + n_ahead + 1 - K`` of them must finish before it gets one. In steady state
  sequences finish at ``B_eff / (step * mean_len)`` per second (``B_eff = min(B, K)`` lane-steps per
  decode step, ``mean_len`` = mean decode length of the occupants, running and ahead), so the lane wait
  is ``excess * mean_len * step / B_eff`` (0 when a slot is free).
- **Observed speed.** The modeled step is a floor (the software runtime's timing model; real devices and
  a loaded host are slower), so the controller also measures seconds per delivered decode lane-step
  over windows in which at least a batch of sequences holds lanes (saturated) and uses that (EWMA)
  instead of ``step / B_eff`` once it has a sample. Unsaturated windows are not sampled: a quiet
  period must not make the next burst look slow.
- **Prefill wait.** The prefill jobs that run before its own: admitted requests not yet prefilled
  plus the prefills of the waiting requests ahead. Added to the lane wait (the device is shared).

The request's *own* prefill is not part of its wait: an idle server estimates 0 and never refuses.
Decode lengths are ``max_new_tokens - 1`` (prefill returns the first token) scaled by the observed
ratio of delivered to requested decode tokens (early EOS, cancels), which starts at 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from calserve.config import AdmissionConfig
from calserve.core.prefill import QueueClass
from calserve.runtime.types import Timing

__all__ = ["ServiceModel", "FlowLoad", "WaitEstimate", "expected_wait", "running_cap"]


@dataclasses.dataclass(frozen=True)
class ServiceModel:
    """How fast the device serves one generation (modeled by its timing profile, or observed)."""

    decode_step_s: float  # one decode step of the largest serving profile; 0 = unknown
    batch: int  # that profile's compiled batch B (lane-steps per decode step at most)
    prefill_base_s: float = 0.0
    prefill_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        for f in ("decode_step_s", "prefill_base_s", "prefill_per_token_s"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{f} must be finite and >= 0, got {v}")

    @classmethod
    def from_timing(cls, timing: Timing | None, batch: int) -> ServiceModel:
        """From a timing profile (``runtime.types.Timing``); a missing step reads as unknown (0)."""
        if timing is None:
            return cls(0.0, batch)
        step_us = timing.decode_step_us.get(batch)
        if step_us is None and timing.decode_step_us:  # the nearest larger (else largest) profile
            larger = [b for b in timing.decode_step_us if b >= batch]
            step_us = timing.decode_step_us[min(larger) if larger else max(timing.decode_step_us)]
        return cls((step_us or 0.0) * 1e-6, batch, timing.prefill_base_us * 1e-6,
                   timing.prefill_us_per_token * 1e-6)

    @property
    def known(self) -> bool:
        """Whether any service time is known (else every estimate is 0: only budgets refuse)."""
        return self.decode_step_s > 0 or self.prefill_base_s > 0 or self.prefill_per_token_s > 0

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * prompt_tokens


def running_cap(cfg: AdmissionConfig, batch: int, decode_step_s: float) -> int | None:
    """The cap on lane-holding sequences (None = only ``max_sequences``): ``B * k`` with
    ``k = max(1, floor(max_tpot_ms / step))`` when ``max_tpot_ms`` is set and the step known, else
    ``k = max_tpot_steps``. Why ``B * k``: with more than B running, the fair lane order time-shares
    the B compiled lanes, so each sequence gets a token every ``running / B`` steps; beyond one full
    batch per job engine this adds TPOT (and holds KV) without adding throughput, and at B1 under
    overload it makes every admitted request crawl (bench batching, B1 row)."""
    if cfg.max_tpot_ms is not None and decode_step_s > 0:
        return batch * max(1, math.floor(cfg.max_tpot_ms * 1e-3 / decode_step_s + 1e-9))
    if cfg.max_tpot_steps is not None:
        return batch * cfg.max_tpot_steps
    return None


@dataclasses.dataclass
class FlowLoad:
    """Aggregate of the waiting requests of one flow (a tenant, or a tenant's prefill class).

    # Invariant: each field is the sum over the flow's live waiting requests (n of them), so all are
    #   0 when n == 0 (recomputed from 0 when the flow empties: no float residue).
    """

    n: int = 0
    cost: float = 0.0  # fair-queue cost units (prompt + output_token_cost * max_new_tokens)
    prefill_s: float = 0.0  # modeled prefill seconds
    decode_len: float = 0.0  # decode lane-steps (max_new_tokens - 1 each, unscaled)

    def add(self, cost: float, prefill_s: float, decode_len: float, sign: int = 1) -> None:
        self.n += sign
        if self.n == 0:
            self.cost = self.prefill_s = self.decode_len = 0.0
            return
        self.cost += sign * cost
        self.prefill_s += sign * prefill_s
        self.decode_len += sign * decode_len


@dataclasses.dataclass(frozen=True)
class WaitEstimate:
    seconds: float  # lane_wait_s + prefill_wait_s
    lane_wait_s: float  # until a lane slot is free for it
    prefill_wait_s: float  # prefill jobs that run before its own
    ahead: float  # waiting requests expected to be admitted before it (fractional under GPS)
    slots: int  # the lane slots K it competes for


_ZERO = WaitEstimate(0.0, 0.0, 0.0, 0.0, 0)


def _served(flow: FlowLoad, share_ratio: float, x: float) -> float:
    """The fraction of ``flow`` a GPS server serves while the reference flow gets ``x`` cost units."""
    if flow.n == 0 or flow.cost <= 0:
        return 0.0
    return min(1.0, share_ratio * x / flow.cost)


def expected_wait(
    model: ServiceModel,
    *,
    slots: int,
    qclass: QueueClass,
    cost: float,
    weight: float,
    own: Mapping[QueueClass, FlowLoad],
    class_weights: Mapping[QueueClass, int],
    others: Iterable[tuple[float, FlowLoad]],
    running: int,
    running_decode_len: float,
    pending_prefill_s: float,
    decode_ratio: float = 1.0,
    lane_step_s: float | None = None,
) -> WaitEstimate:
    """The expected wait before a new request's prefill starts (module doc).

    ``own``: the waiting flows of the request's tenant by prefill class; ``others``: (weight, total
    waiting load) of every other tenant with requests waiting; ``running``: lane-holding sequences,
    ``running_decode_len`` their summed decode lengths, ``pending_prefill_s`` the prefill time of those
    not yet prefilled; ``slots``: lane slots K (>= 1); ``lane_step_s``: observed seconds per decode
    lane-step at saturation (replaces ``step / B_eff``; it includes the prefill time interleaved with
    decode, so the estimate then counts prefill twice: on the safe side).
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if not model.known and lane_step_s is None:
        return _ZERO
    same = own.get(qclass)
    # Inside the tenant: the request's class is FIFO, the other classes share by class weight.
    n = float(same.n) if same else 0.0
    c_ahead = same.cost if same else 0.0
    pre = same.prefill_s if same else 0.0
    dec = same.decode_len if same else 0.0
    x_class = c_ahead + cost
    cw = class_weights[qclass]
    for c, fl in own.items():
        if c is qclass:
            continue
        f = _served(fl, class_weights[c] / cw, x_class)
        n += f * fl.n
        c_ahead += f * fl.cost
        pre += f * fl.prefill_s
        dec += f * fl.decode_len
    # Across tenants: by tenant weight, against everything the tenant gets up to this request.
    x_tenant = c_ahead + cost
    for w, fl in others:
        f = _served(fl, w / weight, x_tenant)
        n += f * fl.n
        pre += f * fl.prefill_s
        dec += f * fl.decode_len
    occupants = running + n
    excess = max(0.0, occupants + 1 - slots)
    lane = 0.0
    per_step = lane_step_s if lane_step_s is not None else model.decode_step_s / min(model.batch, slots)
    if excess > 0 and per_step > 0:
        mean_len = decode_ratio * (running_decode_len + dec) / occupants
        lane = excess * mean_len * per_step
    prefill = pending_prefill_s + pre
    return WaitEstimate(lane + prefill, lane, prefill, n, slots)
