"""The capacity plan (spec §11 step 4, §13.1): device DRAM reservation and the admission budget.

Reservation of one loaded profile = parameters + KV for ``max_sequences × max_seq`` tokens + job
pools (input/output buffers of the in-flight jobs: two engines × compiled_batch lanes × (fp32 logits +
token/position/valid/echo/checksum)). All figures come from the manifest (``capacity`` section, what
the compiler promises); the plan is made outside the lifecycle lock, before anything is loaded.

Each co-resident profile is its own configured calbin with its own weights and KvManager, so a plan
for several profiles sums their reservations. The implied admission budget is conservative: a
sequence may be decoded by any loaded profile, so ``max_sequences`` is the smallest profile's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from calserve.config import AdmissionConfig
from calserve.core.admission import CapacityBudget
from calserve.models.manifest import Manifest
from calserve.runtime.reference import ModelConfig

__all__ = [
    "ProfileReservation",
    "CapacityPlan",
    "plan_capacity",
    "pool_bytes",
    "profile_reservation_bytes",
]


def pool_bytes(cfg: ModelConfig, compiled_batch: int) -> int:
    """Job buffer pools of one profile: 2 engines × B lanes × (fp32 logits + token, position, valid,
    3×int64 echo, uint64 checksum)."""
    per_lane = cfg.vocab_size * 4 + 4 + 4 + 1 + 3 * 8 + 8
    return 2 * compiled_batch * per_lane


@dataclasses.dataclass(frozen=True)
class ProfileReservation:
    compiled_batch: int
    parameter_bytes: int
    kv_bytes: int  # max_sequences × max_seq × kv bytes_per_token
    pool_bytes: int  # the manifest's reservation minus parameters and KV

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.kv_bytes + self.pool_bytes


def profile_reservation_bytes(manifest: Manifest, compiled_batch: int) -> int:
    """params + KV + pools for one profile, from the manifest."""
    return _reservation(manifest, compiled_batch).total_bytes


def _reservation(manifest: Manifest, b: int) -> ProfileReservation:
    p = manifest.profile(b)
    params = manifest.capacity.parameter_bytes
    kv = p.max_sequences * p.max_seq * p.kv_layout.bytes_per_token
    total = manifest.capacity.dram_reservation_bytes.get(b, params + kv)
    return ProfileReservation(b, params, kv, max(0, total - params - kv))


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    profiles: tuple[ProfileReservation, ...]
    total_bytes: int  # what loading all ``profiles`` reserves
    dram_capacity: int
    dram_used: int  # already resident before this load
    fits: bool
    reason: str  # why it does not fit ("" when it fits)
    # The implied admission budget (spec §5.1), config overrides applied:
    max_sequences: int
    max_kv_tokens: int
    max_waiting_requests: int
    max_waiting_prompt_tokens: int
    max_inflight_jobs: int

    @property
    def dram_free_after(self) -> int:
        return self.dram_capacity - self.dram_used - self.total_bytes

    def budget(self) -> CapacityBudget:
        """The ``calserve.core.admission.CapacityBudget`` this plan implies."""
        return CapacityBudget(
            max_sequences=self.max_sequences,
            max_kv_tokens=self.max_kv_tokens,
            max_waiting_requests=self.max_waiting_requests,
            max_waiting_prompt_tokens=self.max_waiting_prompt_tokens,
            max_inflight_jobs=self.max_inflight_jobs,
        )


def plan_capacity(
    manifest: Manifest,
    profiles: Sequence[int],
    dram_capacity: int,
    dram_used: int,
    overrides: AdmissionConfig,
    *,
    max_inflight: int = 1,
    shared_kv: bool = False,
) -> CapacityPlan:
    """Plan loading ``profiles`` of ``manifest`` next to ``dram_used`` bytes already resident.

    A shortfall is an answer (``fits=False`` + ``reason``), not an exception: the model manager
    decides (refuse the load, or drain the old generation first). An admission override larger than
    what the package's KV can hold also makes ``fits`` false. ``shared_kv``: the profiles load as one
    shared-KV group (one set of weights and KV, charged once; each further member adds its pools).
    """
    if not profiles:
        raise ValueError("plan_capacity: no profiles")
    res = tuple(_reservation(manifest, b) for b in sorted(set(profiles)))
    total = sum(r.total_bytes for r in res)
    if shared_kv and len(res) > 1:
        total = res[0].total_bytes + sum(r.pool_bytes for r in res[1:])
    specs = [manifest.profile(r.compiled_batch) for r in res]
    plan_seqs = min(p.max_sequences for p in specs)
    plan_kv = min(p.max_sequences * p.max_seq for p in specs)
    seqs = overrides.max_sequences if overrides.max_sequences is not None else plan_seqs
    kv_tokens = overrides.max_kv_tokens if overrides.max_kv_tokens is not None else plan_kv
    inflight = (
        overrides.max_inflight_jobs if overrides.max_inflight_jobs is not None else max_inflight
    )
    reasons = []
    free = dram_capacity - dram_used
    if total > free:
        reasons.append(
            f"needs {total / 2**30:.3f} GiB of device DRAM"
            f" ({', '.join(f'B{r.compiled_batch} {r.total_bytes / 2**30:.3f}' for r in res)}),"
            f" {free / 2**30:.3f} GiB free of {dram_capacity / 2**30:.3f} GiB"
        )
    if seqs > plan_seqs:
        reasons.append(f"scheduler.admission.max_sequences {seqs} > package max_sequences {plan_seqs}")
    if kv_tokens > plan_kv:
        reasons.append(f"scheduler.admission.max_kv_tokens {kv_tokens} > package KV capacity {plan_kv}")
    return CapacityPlan(
        profiles=res,
        total_bytes=total,
        dram_capacity=dram_capacity,
        dram_used=dram_used,
        fits=not reasons,
        reason="; ".join(reasons),
        max_sequences=seqs,
        max_kv_tokens=kv_tokens,
        max_waiting_requests=overrides.max_waiting_requests,
        max_waiting_prompt_tokens=overrides.max_waiting_prompt_tokens,
        max_inflight_jobs=inflight,
    )
