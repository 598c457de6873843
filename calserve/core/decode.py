"""Decode policy (spec §7–§8): build one decode batch, pick a profile, and the batching window.

All functions are pure: candidates and ``now`` in, a plain frozen :class:`DecodeBatch` out.

Selection (spec §7.2 + §5.3): exclude cancelled / deadline-expired / generation-mismatched /
full-length candidates (each recorded in ``skipped`` with the reason), then fill lanes:

1. requests whose deadline is *at risk* (``deadline - now <= LaneOrder.urgency_s``), earliest
   deadline first. Only at-risk deadlines count: with the default deadline (arrival + 120 s) plain
   EDF would be arrival order, i.e. FCFS, and fairness would be gone;
2. then the tenant with the least weighted delivered service (VTC virtual time, supplied by the
   caller from the admission controller, which lifts returning tenants so idleness banks no
   credit), each pick charging the tenant one decode token so lanes inside one batch are split by
   weight; within a tenant, least recently served first (``virtual_finish`` = when the sequence
   last became ready), then request id;
3. one tenant holds at most ``tenant_max_lane_share`` of the lanes unless no other candidate is left.

``LaneOrder.policy == "fcfs"`` orders by arrival only (the comparison baseline). Inactive lanes get
``valid=0`` and the profile's declared inactive token and position (spec §7.3: never assume token 0
means "nothing").
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Collection, Iterable, Mapping
from typing import Literal, NamedTuple, TypeVar

from calserve.config import ProfileSelection
from calserve.errors import ConfigError

__all__ = [
    "BatchProfile",
    "DecodeCandidate",
    "DecodeBatch",
    "LaneOrder",
    "SkipReason",
    "MissingProfile",
    "build_decode_batch",
    "select_profile",
    "batching_window",
    "profile_or_fail",
]


class MissingProfile(ConfigError):
    """A configured batch profile the package/runtime does not have (spec §15: fail at start-up)."""


@dataclasses.dataclass(frozen=True)
class BatchProfile:
    """Spec §2 BatchProfile: what a compiled decode graph takes. ``compiled_batch`` comes from the
    validated calbin, never from config."""

    compiled_batch: int
    max_seq: int
    # Spec §7.3: a B>1 profile is only usable with a per-lane valid mask and inactive lanes that do
    # not write KV; the token/position an inactive lane carries are declared by the package.
    valid_mask: bool = True
    inactive_writes_kv: bool = False
    inactive_token_id: int = 0  # declared filler token (e.g. the pad id); meaningless when valid=0
    inactive_position: int = 0  # declared filler position

    def __post_init__(self) -> None:
        if self.compiled_batch < 1:
            raise ValueError(f"compiled_batch must be >= 1, got {self.compiled_batch}")
        if self.max_seq < 1:
            raise ValueError(f"max_seq must be >= 1, got {self.max_seq}")
        if self.compiled_batch > 1 and (not self.valid_mask or self.inactive_writes_kv):
            # Spec §7.3: without a mask contract a B>1 profile must not be used at all.
            raise ValueError(
                f"B{self.compiled_batch} profile needs a valid mask and inactive lanes that do not "
                f"write KV (valid_mask={self.valid_mask}, inactive_writes_kv="
                f"{self.inactive_writes_kv})")
        if not 0 <= self.inactive_position < self.max_seq:
            raise ValueError(f"inactive_position {self.inactive_position} outside 0..max_seq-1")


class DecodeCandidate(NamedTuple):
    """One decode-ready sequence as the batch builder sees it. (A NamedTuple: the engine builds one
    per ready sequence per decode batch, ~3x cheaper than a frozen dataclass.)"""

    request_id: int
    seq_id: int  # runtime KV sequence id
    tenant: str
    generation: int  # model generation the request is pinned to
    last_token: int  # the token to feed (sampled by the previous step)
    position: int  # == the sequence's committed KV length (spec §9.2)
    deadline: float | None  # absolute, caller's clock; None = none
    # Order key inside one tenant: the engine passes when the sequence last became decode-ready,
    # so the least recently served sequence of a tenant goes first (round robin). Lower = earlier.
    virtual_finish: float
    cancelled: bool = False
    lane: int | None = None  # KV lane (KvLaneManager), carried through for the executor
    arrival: float = 0.0  # when the request arrived (FCFS order)


@dataclasses.dataclass(frozen=True)
class LaneOrder:
    """How eligible candidates are ordered (spec §5.3/§7.2); see the module docstring.

    ``tenant_vt``: the tenant's weighted delivered service (cost units / weight) — a tenant
    missing here counts as the least-served among those given (0.0). ``tenant_weight``: weights
    (missing = 1.0). ``token_cost``: cost units of one decoded token (§5.3 ``output_token_cost``),
    charged per pick inside the batch so one batch is already split by weight.
    """

    policy: Literal["fair", "fcfs"] = "fair"
    urgency_s: float = 2.0
    tenant_vt: Mapping[str, float] = dataclasses.field(default_factory=dict)
    tenant_weight: Mapping[str, float] = dataclasses.field(default_factory=dict)
    token_cost: float = 2.0

    def __post_init__(self) -> None:
        if self.policy not in ("fair", "fcfs"):
            raise ValueError(f"LaneOrder.policy must be 'fair' or 'fcfs', got {self.policy!r}")
        if self.urgency_s < 0:
            raise ValueError(f"urgency_s must be >= 0, got {self.urgency_s}")
        if not self.token_cost > 0:
            raise ValueError(f"token_cost must be > 0, got {self.token_cost}")


_DEFAULT_ORDER = LaneOrder()


class SkipReason:
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    GENERATION = "generation"
    LENGTH = "length"  # position already at max_seq: nothing more can be written
    TENANT_SHARE = "tenant_share"  # over the tenant's lane cap and other candidates existed
    BATCH_FULL = "batch_full"  # eligible but all lanes were taken


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    generation: int  # every active lane belongs to this model generation
    profile: BatchProfile  # the compiled graph this batch is for
    lanes: tuple[DecodeCandidate | None, ...]  # len == compiled_batch; None = inactive lane
    token_ids: tuple[int, ...]  # input token per lane; inactive lanes: profile.inactive_token_id
    positions: tuple[int, ...]  # write position per lane (== committed len); inactive: declared filler
    valid_mask: tuple[int, ...]  # 1 = active lane, 0 = inactive (must not write KV or be sampled)
    seq_ids: tuple[int, ...]  # KV reservation: runtime sequence id per lane, -1 for inactive lanes
    skipped: tuple[tuple[int, str], ...]  # (request_id, SkipReason) for each candidate not chosen
    active: int  # number of valid lanes

    @property
    def fill_ratio(self) -> float:
        """Active lanes / compiled lanes (spec §16 batch fill ratio)."""
        return self.active / self.profile.compiled_batch

    @property
    def empty(self) -> bool:
        return self.active == 0


def _exclusion(c: DecodeCandidate, profile: BatchProfile, now: float, generation: int) -> str | None:
    if c.cancelled:
        return SkipReason.CANCELLED
    if c.generation != generation:
        return SkipReason.GENERATION
    if c.deadline is not None and c.deadline <= now:
        return SkipReason.DEADLINE
    if c.position >= profile.max_seq:
        return SkipReason.LENGTH
    return None


def build_decode_batch(
    profile: BatchProfile,
    ready: Iterable[DecodeCandidate],
    now: float,
    generation: int,
    tenant_max_lane_share: float = 1.0,
    order: LaneOrder = _DEFAULT_ORDER,
) -> DecodeBatch:
    """Choose up to ``profile.compiled_batch`` candidates and lay out the host tensors (spec §7).

    Order: see the module docstring and :class:`LaneOrder`. ``tenant_max_lane_share`` (0, 1]: one
    tenant gets at most ``max(1, floor(share * B))`` lanes while other eligible candidates are
    waiting; leftover lanes go back to capped tenants rather than run empty ("unless no other
    candidate exists"). Under low traffic this returns a partial batch: it never waits (waiting is
    :func:`batching_window`'s decision). O(n log n) in the number of candidates.
    """
    if not 0.0 < tenant_max_lane_share <= 1.0:
        raise ValueError(f"tenant_max_lane_share must be in (0, 1], got {tenant_max_lane_share}")
    b = profile.compiled_batch
    skipped: list[tuple[int, str]] = []
    eligible: list[DecodeCandidate] = []
    seen: set[int] = set()
    for c in ready:
        if c.request_id in seen:
            raise ValueError(f"request {c.request_id} appears twice among decode candidates")
        seen.add(c.request_id)
        why = _exclusion(c, profile, now, generation)
        if why is not None:
            skipped.append((c.request_id, why))
            continue
        eligible.append(c)
    cap = max(1, math.floor(tenant_max_lane_share * b + 1e-9))
    chosen: list[DecodeCandidate] = []
    deferred: list[DecodeCandidate] = []
    per_tenant: dict[str, int] = {}

    def take(c: DecodeCandidate) -> bool:
        """Put ``c`` in a lane unless its tenant is at the cap (then defer it)."""
        n = per_tenant.get(c.tenant, 0)
        if n >= cap:
            deferred.append(c)
            return False
        per_tenant[c.tenant] = n + 1
        chosen.append(c)
        return True

    rest: list[DecodeCandidate] = []  # eligible, not considered because the lanes were full
    if order.policy == "fcfs":
        eligible.sort(key=lambda c: (c.arrival, c.request_id))
        for i, c in enumerate(eligible):
            if len(chosen) == b:
                rest = eligible[i:]
                break
            take(c)
    else:
        horizon = now + order.urgency_s
        urgent = sorted((c for c in eligible if c.deadline is not None and c.deadline <= horizon),
                        key=lambda c: (c.deadline, c.virtual_finish, c.request_id))
        by_tenant: dict[str, list[DecodeCandidate]] = {}
        for c in eligible:
            if c.deadline is None or c.deadline > horizon:
                by_tenant.setdefault(c.tenant, []).append(c)
        vt = {t: order.tenant_vt.get(t, 0.0) for t in by_tenant}
        for i, c in enumerate(urgent):
            if len(chosen) == b:
                rest = urgent[i:]
                break
            if take(c) and c.tenant in vt:
                vt[c.tenant] += order.token_cost / order.tenant_weight.get(c.tenant, 1.0)
        # Invariant: each tenant's list is sorted so that pop() gives its least recently served.
        heap: list[tuple[float, str]] = []
        for t, cs in by_tenant.items():
            cs.sort(key=lambda c: (c.virtual_finish, c.request_id), reverse=True)
            heap.append((vt[t], t))
        heapq.heapify(heap)
        while heap and len(chosen) < b:
            v, t = heapq.heappop(heap)
            cs = by_tenant[t]
            if per_tenant.get(t, 0) >= cap:
                deferred.extend(reversed(cs))
                cs.clear()
                continue
            take(cs.pop())
            if cs:
                heapq.heappush(heap, (v + order.token_cost / order.tenant_weight.get(t, 1.0), t))
        for _, t in sorted(heap):
            rest.extend(reversed(by_tenant[t]))
    # No other candidate exists: over-cap candidates fill what is left, in the same order.
    while deferred and len(chosen) < b:
        chosen.append(deferred.pop(0))
    skipped.extend((c.request_id, SkipReason.TENANT_SHARE) for c in deferred)
    skipped.extend((c.request_id, SkipReason.BATCH_FULL) for c in rest)
    lanes: list[DecodeCandidate | None] = [*chosen, *([None] * (b - len(chosen)))]
    return DecodeBatch(
        generation=generation,
        profile=profile,
        lanes=tuple(lanes),
        token_ids=tuple(profile.inactive_token_id if c is None else c.last_token for c in lanes),
        positions=tuple(profile.inactive_position if c is None else c.position for c in lanes),
        valid_mask=tuple(0 if c is None else 1 for c in lanes),
        seq_ids=tuple(-1 if c is None else c.seq_id for c in lanes),
        skipped=tuple(skipped),
        active=len(chosen),
    )


def select_profile(
    ready_count: int,
    oldest_wait_s: float,
    available_profiles: Collection[int],
    selection_cfg: ProfileSelection,
    fixed: int | None = None,
) -> int:
    """The compiled batch size to use for the next decode job (spec §8).

    With ``fixed`` (profiles cannot co-reside: this instance serves one pool, ``batch.instance_pool``)
    the answer is always ``fixed``. Otherwise the largest available profile whose ``bN_min_ready``
    threshold ``ready_count`` reaches; if none does, the smallest available one (a partial batch
    beats waiting, spec §7.2 item 5). ``oldest_wait_s`` is part of the §8 signature; the 0.7.6 config
    has ready-count thresholds only, so it does not change the choice today.
    """
    if not available_profiles:
        raise MissingProfile("no batch profile is available")
    if fixed is not None:
        return profile_or_fail(fixed, {p: p for p in available_profiles})
    thresholds = {1: 1, 4: selection_cfg.b4_min_ready, 8: selection_cfg.b8_min_ready,
                  16: selection_cfg.b16_min_ready}
    best: int | None = None
    for p in sorted(available_profiles):
        if ready_count >= thresholds.get(p, p):
            best = p
    return best if best is not None else min(available_profiles)


def batching_window(
    now: float,
    ready_count: int,
    compiled_batch: int,
    oldest_ready_since: float | None,
    earliest_deadline: float | None,
    window_us: int,
    step_estimate_s: float = 0.0,
) -> tuple[bool, float | None]:
    """Whether to send the decode batch now, else when to look again (spec §7.2 items 4–5).

    Returns ``(True, None)`` to fire now, ``(False, wake_at)`` to wait until ``wake_at`` at the
    latest, ``(False, None)`` when there is nothing to send. Fires at once when the batch is full or
    the window is 0; otherwise waits at most ``window_us`` after the oldest candidate became ready,
    and never past ``earliest_deadline - step_estimate_s`` (so the step still ends before the SLA).
    Invariant: ``wake_at`` is finite and > ``now``; at ``wake_at`` this function returns fire.
    """
    if ready_count <= 0:
        return (False, None)
    if ready_count >= compiled_batch or window_us <= 0:
        return (True, None)
    since = now if oldest_ready_since is None else oldest_ready_since
    due = since + window_us * 1e-6
    if earliest_deadline is not None:
        due = min(due, earliest_deadline - step_estimate_s)
    if now >= due:
        return (True, None)
    return (False, due)


P = TypeVar("P")


def profile_or_fail(requested: int, available: Mapping[int, P]) -> P:
    """The profile for ``requested``; :class:`MissingProfile` if the package/runtime lacks it
    (spec §15: a configured B8 that does not exist fails start-up, it is never emulated)."""
    try:
        return available[requested]
    except KeyError:
        raise MissingProfile(
            f"batch profile B{requested} is not available (have: "
            f"{', '.join(f'B{p}' for p in sorted(available)) or 'none'})",
            param="scheduler.batch.profiles") from None
