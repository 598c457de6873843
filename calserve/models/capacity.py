"""The capacity plan (spec §11 step 4, §13.1): device DRAM reservation and the admission budget.

Reservation of one loaded profile = parameters + KV for ``max_sequences × max_seq`` tokens + job
pools (input/output buffers of the in-flight jobs: two engines × compiled_batch × (vocab logits +
tokens)). Planned outside the lifecycle lock, before anything is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from calserve.config import AdmissionConfig
from calserve.models.manifest import Manifest

__all__ = ["ProfileReservation", "CapacityPlan", "plan_capacity", "profile_reservation_bytes"]


def profile_reservation_bytes(manifest: Manifest, compiled_batch: int) -> int:
    """params + KV (max_sequences × max_seq × bytes_per_token) + pools, for one profile."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ProfileReservation:
    compiled_batch: int
    parameter_bytes: int
    kv_bytes: int
    pool_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.kv_bytes + self.pool_bytes


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    profiles: tuple[ProfileReservation, ...]
    total_bytes: int  # what loading all ``profiles`` reserves
    dram_capacity: int
    dram_used: int  # already resident before this load
    fits: bool
    reason: str  # why it does not fit ("" when it fits)
    # Implied admission budget (config overrides applied):
    max_sequences: int
    max_kv_tokens: int
    max_waiting_requests: int
    max_waiting_prompt_tokens: int
    max_inflight_jobs: int

    def budget(self) -> object:
        """The ``calserve.core.admission.CapacityBudget`` this plan implies."""
        raise NotImplementedError


def plan_capacity(
    manifest: Manifest,
    profiles: Sequence[int],
    dram_capacity: int,
    dram_used: int,
    overrides: AdmissionConfig,
    *,
    max_inflight: int = 1,
) -> CapacityPlan:
    raise NotImplementedError
