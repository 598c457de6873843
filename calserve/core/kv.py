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
import heapq
from collections.abc import Iterable
from itertools import repeat

from calserve.core.fsm import IllegalTransition
from calserve.core.kv_state import TRANSITIONS, KvEvent, KvSequenceState, fire

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


@dataclasses.dataclass(slots=True)
class _Lane:
    """Mutable per-lane record; only :class:`KvLaneManager` touches it (slotted: the per-token
    moves read and write four of its fields per lane per step)."""

    state: KvSequenceState = KvSequenceState.FREE
    request_id: int | None = None
    generation: int | None = None
    seq_id: int | None = None
    committed_len: int = 0
    reserved_len: int = 0
    pending: int = 0


_S = KvSequenceState
# The two per-token moves, read from the table once (begin_update / commit check the state they
# start from; fire() per call would hash two enums per lane per step).
_BEGIN_UPDATE_TO = TRANSITIONS[_S.ACTIVE][KvEvent.BEGIN_UPDATE]
_COMMIT_TO = TRANSITIONS[_S.UPDATING][KvEvent.COMMIT]
# The states those moves start from, as module constants: an Enum member read off its class costs
# ~70 ns on CPython 3.11 (EnumType defines ``__getattr__``, which puts every class attribute
# lookup on the slow path), a global ~10.
_ACTIVE = _S.ACTIVE
_UPDATING = _S.UPDATING


def _per_lane(n: int | list[int], lanes: list[int]) -> Iterable[int]:
    """A decode batch's tokens per lane: ``n`` for every one of ``lanes``, or ``n`` itself."""
    return repeat(n, len(lanes)) if isinstance(n, int) else n


class KvLaneManager:
    """Lanes of one configured calbin. Not thread-safe: one owner (the engine's scheduler task)."""

    def __init__(self, num_lanes: int, max_seq: int, max_kv_tokens: int) -> None:
        if num_lanes < 1:
            raise ValueError(f"num_lanes must be >= 1, got {num_lanes}")
        if max_seq < 1:
            raise ValueError(f"max_seq must be >= 1, got {max_seq}")
        if max_kv_tokens < 1:
            raise ValueError(f"max_kv_tokens must be >= 1, got {max_kv_tokens}")
        self.num_lanes = num_lanes
        self.max_seq = max_seq
        self.max_kv_tokens = max_kv_tokens
        self._lanes = [_Lane() for _ in range(num_lanes)]
        # Invariant: _free holds exactly the indices of Free lanes (lowest index is reused first, which
        # keeps lane numbers small and tests deterministic).
        self._free = list(range(num_lanes))
        self._by_request: dict[tuple[int, int], int] = {}  # (request_id, generation) -> lane
        self._tokens_reserved = 0
        self._tokens_committed = 0

    # -- transitions --------------------------------------------------------------------------

    def _lane(self, lane: int) -> _Lane:
        if not 0 <= lane < self.num_lanes:
            raise ValueError(f"lane {lane} out of range 0..{self.num_lanes - 1}")
        return self._lanes[lane]

    def _move(self, rec: _Lane, event: KvEvent) -> None:
        rec.state = fire(rec.state, event)

    def reserve(self, request_id: int, generation: int, reserved_len: int) -> KvLease | None:
        """Hold a Free lane and ``reserved_len`` tokens; None if no lane or not enough tokens."""
        if not 1 <= reserved_len <= self.max_seq:
            raise ValueError(f"reserved_len {reserved_len} outside 1..max_seq={self.max_seq}")
        key = (request_id, generation)
        if key in self._by_request:
            raise ValueError(f"request {request_id} already holds lane {self._by_request[key]} "
                             f"in generation {generation}")
        if not self._free or self._tokens_reserved + reserved_len > self.max_kv_tokens:
            return None
        lane = heapq.heappop(self._free)
        rec = self._lanes[lane]
        self._move(rec, KvEvent.RESERVE)
        rec.request_id, rec.generation, rec.seq_id = request_id, generation, None
        rec.committed_len, rec.reserved_len, rec.pending = 0, reserved_len, 0
        self._by_request[key] = lane
        self._tokens_reserved += reserved_len
        return KvLease(lane, request_id, generation, reserved_len)

    def bind(self, lane: int, seq_id: int) -> None:
        """Reserved -> Active once the runtime created sequence ``seq_id`` for the lane."""
        rec = self._lane(lane)
        self._move(rec, KvEvent.BIND)
        rec.seq_id = seq_id

    def begin_update(self, lane: int, position: int, n: int) -> None:
        """Active -> Updating before a job writing ``n`` tokens at ``position`` is submitted."""
        rec = self._lane(lane)
        if rec.state is not _ACTIVE:
            raise IllegalTransition("kv", rec.state, KvEvent.BEGIN_UPDATE)
        if position != rec.committed_len:
            raise ValueError(f"lane {lane}: position {position} != committed_len {rec.committed_len}")
        if n < 1 or rec.committed_len + n > rec.reserved_len:
            raise ValueError(f"lane {lane}: writing {n} tokens at {position} exceeds reserved_len "
                             f"{rec.reserved_len}")
        rec.state = _BEGIN_UPDATE_TO  # = fire(ACTIVE, BEGIN_UPDATE), checked above
        rec.pending = n

    def commit(self, lane: int, n: int) -> None:
        """Updating -> Active after device and output succeeded: ``committed_len += n``."""
        rec = self._lane(lane)
        if rec.state is not _UPDATING:
            raise IllegalTransition("kv", rec.state, KvEvent.COMMIT)
        if not 0 <= n <= rec.pending:
            raise ValueError(f"lane {lane}: commit of {n} tokens but {rec.pending} were submitted")
        rec.state = _COMMIT_TO  # = fire(UPDATING, COMMIT), checked above
        rec.committed_len += n
        rec.pending = 0
        self._tokens_committed += n

    def begin_decode(self, lanes: list[int], positions: list[int], n: int | list[int] = 1) -> None:
        """:meth:`begin_update` of ``n`` tokens (a multi-step decode's steps: one figure, or one per
        lane; 1 by default) for each ``lanes[k]`` at ``positions[k]``, in that order (a decode
        batch's lanes: one call per batch, the same checks and moves per lane)."""
        recs = self._lanes
        num = self.num_lanes
        for lane, position, k in zip(lanes, positions, _per_lane(n, lanes), strict=True):
            if k < 1:
                raise ValueError(f"lane {lane}: n must be >= 1")
            if not 0 <= lane < num:
                raise ValueError(f"lane {lane} out of range 0..{num - 1}")
            rec = recs[lane]
            if rec.state is not _ACTIVE:
                raise IllegalTransition("kv", rec.state, KvEvent.BEGIN_UPDATE)
            if position != rec.committed_len:
                raise ValueError(f"lane {lane}: position {position} != committed_len {rec.committed_len}")
            if rec.committed_len + k > rec.reserved_len:
                raise ValueError(f"lane {lane}: writing {k} tokens at {position} exceeds reserved_len "
                                 f"{rec.reserved_len}")
            rec.state = _BEGIN_UPDATE_TO
            rec.pending = k

    def commit_decode(self, lanes: list[int], n: int | list[int] = 1) -> None:
        """:meth:`commit` of ``n`` tokens (one figure, or one per lane) for each of ``lanes``, in
        that order (one call per decode batch, the same checks and moves per lane)."""
        recs = self._lanes
        num = self.num_lanes
        for lane, k in zip(lanes, _per_lane(n, lanes), strict=True):
            if not 0 <= lane < num:
                raise ValueError(f"lane {lane} out of range 0..{num - 1}")
            rec = recs[lane]
            if rec.state is not _UPDATING:
                raise IllegalTransition("kv", rec.state, KvEvent.COMMIT)
            if rec.pending != k:
                raise ValueError(f"lane {lane}: commit of {k} tokens but {rec.pending} were submitted")
            rec.state = _COMMIT_TO
            rec.committed_len += k
            rec.pending = 0
            self._tokens_committed += k

    def shorten_decode(self, lanes: list[int], n: list[int]) -> None:
        """Updating lanes whose job wrote fewer tokens than it was submitted for (a multi-step
        decode driven by the host, ended early): ``n[k]`` tokens pending for ``lanes[k]`` from now
        on, at least 1 and at most what was pending. Nothing is committed: :meth:`commit_decode`
        follows with the same counts."""
        recs = self._lanes
        for lane, k in zip(lanes, n, strict=True):
            rec = recs[lane]
            if rec.state is not _UPDATING:
                raise IllegalTransition("kv", rec.state, KvEvent.COMMIT)
            if not 1 <= k <= rec.pending:
                raise ValueError(f"lane {lane}: {k} tokens written but {rec.pending} were submitted")
            rec.pending = k

    def rollback(self, lane: int) -> None:
        """Updating -> Active when the job was refused before running (nothing written)."""
        rec = self._lane(lane)
        self._move(rec, KvEvent.ROLLBACK)
        rec.pending = 0

    def mark_unknown(self, lane: int) -> None:
        """After a timeout or device fault: quarantine the lane until ``clear_after_reset``.

        Idempotent on an Unknown lane (one fault may be reported by several completions)."""
        rec = self._lane(lane)
        if rec.state is _S.UNKNOWN:
            return
        self._move(rec, KvEvent.FAULT)
        rec.pending = 0

    def begin_release(self, lane: int) -> None:
        """Reserved/Active -> Releasing: the caller now asks the runtime to free the sequence.

        A Reserved lane has no runtime sequence: the caller may confirm at once."""
        rec = self._lane(lane)
        self._move(rec, KvEvent.BEGIN_RELEASE)

    def confirm_released(self, lane: int) -> None:
        """Releasing -> Free: the runtime confirmed; the lane and its tokens are reusable."""
        rec = self._lane(lane)
        self._move(rec, KvEvent.CONFIRM_RELEASE)
        self._to_free(lane, rec)

    def clear_after_reset(self) -> list[KvLaneInfo]:
        """After a device reset every sequence is invalid: all lanes -> Free. Returns what was held."""
        held: list[KvLaneInfo] = []
        for lane, rec in enumerate(self._lanes):
            if rec.state is _S.FREE:
                continue
            held.append(self.info(lane))
            self._move(rec, KvEvent.RESET)
            self._to_free(lane, rec)
        return held

    def _to_free(self, lane: int, rec: _Lane) -> None:
        assert rec.request_id is not None and rec.generation is not None
        del self._by_request[(rec.request_id, rec.generation)]
        self._tokens_reserved -= rec.reserved_len
        self._tokens_committed -= rec.committed_len
        rec.request_id = rec.generation = rec.seq_id = None
        rec.committed_len = rec.reserved_len = rec.pending = 0
        heapq.heappush(self._free, lane)

    # -- queries ------------------------------------------------------------------------------

    def lane_of(self, request_id: int, generation: int) -> int | None:
        return self._by_request.get((request_id, generation))

    def info(self, lane: int) -> KvLaneInfo:
        r = self._lane(lane)
        return KvLaneInfo(lane, r.state, r.request_id, r.generation, r.seq_id, r.committed_len,
                          r.reserved_len, r.pending)

    def free_lanes(self) -> int:
        """Number of Free lanes (O(1); :meth:`statistics` counts every state)."""
        return len(self._free)

    def free_tokens(self) -> int:
        """KV tokens not reserved by any lane (O(1); ``statistics().free_tokens``)."""
        return self.max_kv_tokens - self._tokens_reserved

    def statistics(self) -> KvStats:
        counts = {s: 0 for s in KvSequenceState}
        for r in self._lanes:
            counts[r.state] += 1
        return KvStats(
            num_lanes=self.num_lanes,
            max_kv_tokens=self.max_kv_tokens,
            free=counts[_S.FREE],
            reserved=counts[_S.RESERVED],
            active=counts[_S.ACTIVE],
            updating=counts[_S.UPDATING],
            unknown=counts[_S.UNKNOWN],
            releasing=counts[_S.RELEASING],
            tokens_reserved=self._tokens_reserved,
            tokens_committed=self._tokens_committed,
        )

    def check_invariants(self) -> None:
        """Assert every ``# Invariant:`` of this module (used by tests; cheap enough for debug)."""
        free = sorted(i for i, r in enumerate(self._lanes) if r.state is _S.FREE)
        assert sorted(self._free) == free, (self._free, free)
        keys: dict[tuple[int, int], int] = {}
        seqs: dict[tuple[int, int], int] = {}
        reserved = committed = 0
        for i, r in enumerate(self._lanes):
            if r.state is _S.FREE:
                assert r.request_id is None and r.reserved_len == 0 and r.committed_len == 0
                continue
            assert r.request_id is not None and r.generation is not None
            key = (r.request_id, r.generation)
            assert key not in keys, f"request {key} on lanes {keys[key]} and {i}"
            keys[key] = i
            if r.seq_id is not None and r.state is not _S.UNKNOWN:
                skey = (r.seq_id, r.generation)
                assert skey not in seqs, f"seq {skey} on lanes {seqs[skey]} and {i}"
                seqs[skey] = i
            assert 0 <= r.committed_len <= r.reserved_len <= self.max_seq, r
            assert (r.pending > 0) == (r.state is _S.UPDATING), r
            assert r.committed_len + r.pending <= r.reserved_len, r
            assert (r.seq_id is None) == (r.state is _S.RESERVED) or r.state in (
                _S.RELEASING, _S.UNKNOWN), r
            reserved += r.reserved_len
            committed += r.committed_len
        assert keys == self._by_request, (keys, self._by_request)
        assert reserved == self._tokens_reserved <= self.max_kv_tokens
        assert committed == self._tokens_committed
