"""KV lane manager (spec §9): the mapping request/sequence <-> lane, with the §9.2 invariants.

A *lane* is one of the ``num_lanes`` KV sequence slots of a configured calbin. Every lane is driven
through :mod:`calserve.core.kv_state`'s table; this class adds the bookkeeping and asserts:

# Invariant: a request holds at most one non-Free lane per generation (spec §9.2, first bullet).
# Invariant: a lane becomes reusable (Free) only after ``confirm_released`` (the runtime confirmed the
#   free) or ``clear_after_reset`` (the device was reset).
# Invariant: 0 <= committed_len <= reserved_len <= max_seq, and sum(reserved_len) <= max_kv_tokens
#   over non-Free lanes (Unknown and Releasing lanes keep their tokens until cleared/confirmed).
# Invariant: a job writes at position == committed_len (``begin_update`` checks it); committed_len
#   grows only on ``commit``, i.e. after the device AND the output succeeded.
# Invariant: an Unknown lane is never handed out again until ``clear_after_reset``.

Capacity shortfall is an answer (``reserve`` returns None), not an exception; misuse (a wrong state,
a wrong position) raises :class:`IllegalTransition` / :class:`ValueError` because it is a bug.
"""

from __future__ import annotations

import dataclasses

from calserve.core.kv_state import KvSequenceState

__all__ = ["KvLease", "KvLaneInfo", "KvStats", "KvLaneManager"]


@dataclasses.dataclass(frozen=True)
class KvLease:
    lane: int
    request_id: int
    generation: int
    reserved_len: int


@dataclasses.dataclass(frozen=True)
class KvLaneInfo:
    lane: int
    state: KvSequenceState
    request_id: int | None  # None when Free
    generation: int | None
    seq_id: int | None  # runtime sequence id once bound
    committed_len: int
    reserved_len: int
    pending: int  # tokens being written by the in-flight job (Updating), else 0


@dataclasses.dataclass(frozen=True)
class KvStats:
    num_lanes: int
    max_kv_tokens: int
    free: int
    reserved: int
    active: int
    updating: int
    unknown: int
    releasing: int
    tokens_reserved: int  # over all non-Free lanes
    tokens_committed: int  # over all non-Free lanes

    @property
    def free_tokens(self) -> int:
        return self.max_kv_tokens - self.tokens_reserved


class KvLaneManager:
    def __init__(self, num_lanes: int, max_seq: int, max_kv_tokens: int) -> None:
        raise NotImplementedError

    def reserve(self, request_id: int, generation: int, reserved_len: int) -> KvLease | None:
        """Hold a Free lane and ``reserved_len`` tokens; None if no lane or not enough tokens."""
        raise NotImplementedError

    def bind(self, lane: int, seq_id: int) -> None:
        """Reserved -> Active once the runtime created sequence ``seq_id`` for the lane."""
        raise NotImplementedError

    def begin_update(self, lane: int, position: int, n: int) -> None:
        """Active -> Updating before a job writing ``n`` tokens at ``position`` is submitted."""
        raise NotImplementedError

    def commit(self, lane: int, n: int) -> None:
        """Updating -> Active after device and output succeeded: ``committed_len += n``."""
        raise NotImplementedError

    def rollback(self, lane: int) -> None:
        """Updating -> Active when the job was refused before running (nothing written)."""
        raise NotImplementedError

    def mark_unknown(self, lane: int) -> None:
        """After a timeout or device fault: quarantine the lane until ``clear_after_reset``."""
        raise NotImplementedError

    def begin_release(self, lane: int) -> None:
        """Reserved/Active -> Releasing: the caller now asks the runtime to free the sequence."""
        raise NotImplementedError

    def confirm_released(self, lane: int) -> None:
        """Releasing -> Free: the runtime confirmed; the lane and its tokens are reusable."""
        raise NotImplementedError

    def clear_after_reset(self) -> list[KvLaneInfo]:
        """After a device reset every sequence is invalid: all lanes -> Free. Returns what was held."""
        raise NotImplementedError

    def lane_of(self, request_id: int, generation: int) -> int | None:
        raise NotImplementedError

    def info(self, lane: int) -> KvLaneInfo:
        raise NotImplementedError

    def statistics(self) -> KvStats:
        raise NotImplementedError

    def check_invariants(self) -> None:
        """Assert every ``# Invariant:`` of this module (used by tests; cheap enough for debug)."""
        raise NotImplementedError
