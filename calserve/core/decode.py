"""Decode policy (spec §7–§8): build one decode batch, pick a profile, and the batching window.

All functions are pure: candidates and ``now`` in, a plain frozen :class:`DecodeBatch` out.

Selection (spec §7.2): exclude cancelled / deadline-expired / generation-mismatched / full-length
candidates (each recorded in ``skipped`` with the reason); order the rest by earliest deadline, then
virtual finish, then request id; cap one tenant's share of lanes unless no other candidate is left;
fill lanes in that order. Inactive lanes get ``valid=0`` and the profile's declared inactive token and
position (spec §7.3: never assume token 0 means "nothing").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from typing import TypeVar

from calserve.config import ProfileSelection
from calserve.errors import ConfigError

__all__ = [
    "BatchProfile",
    "DecodeCandidate",
    "DecodeBatch",
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
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class DecodeCandidate:
    request_id: int
    seq_id: int  # runtime KV sequence id
    tenant: str
    generation: int  # model generation the request is pinned to
    last_token: int  # the token to feed (sampled by the previous step)
    position: int  # == the sequence's committed KV length (spec §9.2)
    deadline: float | None  # absolute, caller's clock; None = none
    virtual_finish: float  # fair-queue tag: tie-break after the deadline
    cancelled: bool = False
    lane: int | None = None  # KV lane (KvLaneManager), carried through for the executor


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


def build_decode_batch(
    profile: BatchProfile,
    ready: Iterable[DecodeCandidate],
    now: float,
    generation: int,
    tenant_max_lane_share: float = 1.0,
) -> DecodeBatch:
    raise NotImplementedError


def select_profile(
    ready_count: int,
    oldest_wait_s: float,
    available_profiles: Collection[int],
    selection_cfg: ProfileSelection,
    fixed: int | None = None,
) -> int:
    raise NotImplementedError


def batching_window(
    now: float,
    ready_count: int,
    compiled_batch: int,
    oldest_ready_since: float | None,
    earliest_deadline: float | None,
    window_us: int,
    step_estimate_s: float = 0.0,
) -> tuple[bool, float | None]:
    raise NotImplementedError


P = TypeVar("P")


def profile_or_fail(requested: int, available: Mapping[int, P]) -> P:
    raise NotImplementedError
