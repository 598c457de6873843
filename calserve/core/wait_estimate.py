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
  WFQ) a flow of share ``phi_u`` is served ``phi_u / phi_r * X_r`` before the new request's flow has
  received ``X_r`` (its own backlog plus the request). Inside the tenant a busy class is assumed to
  stay busy (its arrivals keep coming under overload and pass the request); across tenants only what
  is waiting now counts, ``min(W_u, phi_u / phi_r * X_r)`` (a tenant's requests never jump the
  tenant's own queue). Quantities are taken from each flow's current mix (counts, prefill and
  decode work in proportion to cost). The estimate is monotone in the work ahead: more running
  work, or more requests of the request's own flow (tested); adding a costlier-than-average request
  to another partially served flow can lower its count share slightly (proportional mix).
- **Lane wait.** The request needs one of ``K`` lane slots (``min(max_sequences, max_running)``). The
  running sequences and the ``n_ahead`` waiting ones ahead occupy slots first, so
  ``excess = running + n_ahead + 1 - K`` of them must finish before it gets one (0 when a slot is
  free). While requests wait, every released slot is refilled at once, so the K occupants share the
  ``B_eff = min(B, K)`` compiled lanes (fair decode lanes: processor sharing) and each gets a token
  every ``K / B_eff`` steps: slot ``i`` frees when its sequence's remaining ``r_i`` steps are done,
  at ``r_i * K * step / B_eff``, and then again every ``mean_len * K * step / B_eff`` (its refills,
  ``mean_len`` the mean decode length of the requests ahead); the request gets the slot of the
  ``excess``-th release of that merge. (Measured in a simulation: assuming the survivors speed up
  after a release, as plain processor sharing would, underestimated B1 waits by ~2x; a steady
  release rate after the running set ran out underestimated B4 by ~25 %.)
- **Observed speed.** The modeled step is a floor (the software runtime's timing model; real devices and
  a loaded host are slower), so the controller also measures seconds per delivered decode lane-step
  over windows in which at least a batch of sequences holds lanes (saturated) and uses that (EWMA)
  instead of ``step / B_eff`` once it has a sample. Unsaturated windows are not sampled: a quiet
  period must not make the next burst look slow.
- **Prefill wait.** The prefill jobs that run before its own: admitted requests not yet prefilled
  plus the prefills of the waiting requests ahead, each with the decode steps the service round robin
  runs per prefill opportunity of its class (decode:short 8:4 = 2 steps). The wait is the prefill
  time plus the larger of the lane wait and those interleaved decode steps (they are the same
  device time; measured in the simulation: a burst admitted at once waits on the prefill queue, a
  steady overload on the slots).

The request's *own* prefill is not part of its wait: an idle server estimates 0 and never refuses.
Decode lengths are ``max_new_tokens - 1`` (prefill returns the first token) scaled by the observed
ratio of delivered to requested decode tokens (early EOS, cancels), which starts at 1.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

from calserve.config import AdmissionConfig
from calserve.core.prefill import QueueClass

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
    def from_profile(
        cls,
        batch: int,
        *,
        decode_step_us: Mapping[int, float] | None = None,
        prefill_base_us: float = 0.0,
        prefill_us_per_token: float = 0.0,
    ) -> ServiceModel:
        """From a timing profile's figures in microseconds (the caller unpacks its runtime's timing
        profile: core knows no runtime types): ``decode_step_us`` per compiled batch, of which the
        one for ``batch`` is used, else the nearest larger (else the largest) batch's; no figures
        read as unknown (0)."""
        steps = decode_step_us if decode_step_us is not None else {}
        step_us = steps.get(batch)
        if step_us is None and steps:  # the nearest larger (else largest) profile
            larger = [b for b in steps if b >= batch]
            step_us = steps[min(larger) if larger else max(steps)]
        return cls((step_us or 0.0) * 1e-6, batch, prefill_base_us * 1e-6, prefill_us_per_token * 1e-6)

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
    seconds: float  # prefill_wait_s + max(lane_wait_s, decode steps interleaved with the prefills)
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
    running_remaining: Sequence[float],
    pending_prefill_s: float,
    pending_prefill_n: int = 0,
    decode_ratio: float = 1.0,
    lane_step_s: float | None = None,
    own_ahead: Sequence[float] | None = None,
) -> WaitEstimate:
    """The expected wait before a new request's prefill starts (module doc).

    ``own``: the waiting flows of the request's tenant by prefill class; ``others``: (weight, total
    waiting load) of every other tenant with requests waiting; ``running_remaining``: the decode steps
    left of each lane-holding sequence, ascending (already scaled by ``decode_ratio``);
    ``pending_prefill_s``/``pending_prefill_n``: the prefill time and count of those not yet
    prefilled; ``slots``: lane slots K
    (>= 1); ``lane_step_s``: observed seconds per decode lane-step at saturation (replaces
    ``step / B_eff``; it includes the prefill time interleaved with decode, so the estimate then
    counts prefill twice: on the safe side); ``own_ahead``: the decode lengths of the requests ahead
    in the request's own flow, in FIFO order (None: that flow's mean length for each).
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if not model.known and lane_step_s is None:
        return _ZERO
    same = own.get(qclass)
    # Inside the tenant: the request's class is FIFO, the other classes share by class weight.
    n_own = same.n if same else 0
    c_ahead = same.cost if same else 0.0
    pre = same.prefill_s if same else 0.0
    n = 0.0  # requests ahead from the other flows
    ahead: list[tuple[float, float]] = []  # (count, mean decode length) per other flow
    x_class = c_ahead + cost
    cw = class_weights[qclass]
    for c, fl in own.items():
        if c is qclass or fl.n == 0 or fl.cost <= 0:
            continue
        # A backlogged class keeps its share while this request waits: under overload its queue is
        # refilled by new arrivals, which pass a request of a class with a smaller share (measured:
        # without this a 1,024-token prompt behind a stream of short ones waited 10x its estimate).
        f = class_weights[c] / cw * x_class / fl.cost
        n += f * fl.n
        c_ahead += f * fl.cost
        pre += f * fl.prefill_s
        ahead.append((f * fl.n, fl.decode_len / fl.n))
    # Across tenants: by tenant weight, against everything the tenant gets up to this request.
    x_tenant = c_ahead + cost
    for w, fl in others:
        f = _served(fl, w / weight, x_tenant)
        if f > 0:
            n += f * fl.n
            pre += f * fl.prefill_s
            ahead.append((f * fl.n, fl.decode_len / fl.n))
    b_eff = min(model.batch, slots)
    per = lane_step_s if lane_step_s is not None else model.decode_step_s / b_eff
    lane = 0.0
    if len(running_remaining) + n + n_own + 1 > slots and per > 0:
        if own_ahead is None:
            mean = same.decode_len / same.n if same and same.n else 0.0
            own_ahead = [mean] * n_own
        lane = _slot_free_at(running_remaining, slots, max(slots, b_eff) * per,
                             [(k, decode_ratio * m) for k, m in ahead],
                             [decode_ratio * x for x in own_ahead])
    # Prefill jobs ahead, each with the decode steps the round robin interleaves per opportunity of
    # the request's class (decode:short 8:4 -> 2 steps per short prefill while anything decodes).
    jobs = pending_prefill_n + n + n_own
    interleaved = jobs * class_weights.get(QueueClass.DECODE, 0) / cw * per * b_eff
    prefill = pending_prefill_s + pre
    # The device runs the prefills ahead plus decode steps: those that free its slot, or those the
    # round robin interleaves with the prefills ahead, whichever are more.
    return WaitEstimate(prefill + max(lane, interleaved), lane, prefill, n + n_own, slots)


def _slot_free_at(remaining: Sequence[float], slots: int, token_s: float,
                  other: Sequence[tuple[float, float]], own_ahead: Sequence[float]) -> float:
    """When a lane slot is free for the request (module doc): list scheduling on ``slots`` slots.

    Slot ``i`` first frees when its running sequence's ``r_i`` remaining steps are done (a free slot
    at once); every occupant gets a token every ``token_s`` seconds (the slots stay full while
    anything waits). The requests ahead take the earliest free slot in turn, each holding it for its
    decode length: first the other flows' shares (``other``: (count, mean length) per flow, a
    fractional count ends in a shortened request), then the request's own flow in FIFO order; the
    request gets the earliest slot after them.
    # Invariant: "replace the earliest slot time t by t + L" is monotone in the sorted slot times, so
    #   more running work, a longer or an extra request anywhere in the list never makes it earlier.
    """
    free = [0.0] * (slots - len(remaining)) + [r * token_s for r in remaining]
    heapq.heapify(free)
    lengths: list[Iterable[float]] = []
    for count, mean in other:
        whole = math.floor(count)
        lengths.append(itertools.repeat(mean, whole))
        if count > whole:
            lengths.append((mean * (count - whole),))
    for length in itertools.chain(*lengths, own_ahead):
        heapq.heapreplace(free, free[0] + length * token_s)
    return free[0]
