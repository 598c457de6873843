"""KV lane manager (spec §9.2, §17.2): random reserve/append/cancel/free/fault/reset sequences checked
against a plain in-memory reference model, asserting lane uniqueness, length bounds, resources
reclaimed, and that an Unknown lane is never handed out again before a reset."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from calserve.core.fsm import IllegalTransition
from calserve.core.kv import KvLaneManager
from calserve.core.kv_state import KvSequenceState as K

LANES, MAX_SEQ, MAX_KV = 4, 32, 80


@dataclasses.dataclass
class RefLane:
    state: K = K.FREE
    rid: int | None = None
    gen: int | None = None
    seq: int | None = None
    committed: int = 0
    reserved: int = 0
    pending: int = 0


class KvMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KvLaneManager(LANES, MAX_SEQ, MAX_KV)
        self.ref = [RefLane() for _ in range(LANES)]
        self.next_rid = 0
        self.next_seq = 0
        self.gen = 1
        self.quarantined: set[int] = set()  # lanes that went Unknown since the last reset

    def lanes_in(self, *states: K) -> list[int]:
        return [i for i, r in enumerate(self.ref) if r.state in states]

    def tokens(self) -> int:
        return sum(r.reserved for r in self.ref if r.state is not K.FREE)

    @rule(n=st.integers(1, MAX_SEQ), new_gen=st.booleans())
    def reserve(self, n: int, new_gen: bool) -> None:
        if new_gen:
            self.gen += 1  # requests of a new generation share the lanes of the calbin
        rid = self.next_rid
        self.next_rid += 1
        lease = self.m.reserve(rid, self.gen, n)
        free = self.lanes_in(K.FREE)
        if not free or self.tokens() + n > MAX_KV:
            assert lease is None  # refusal is an answer, not an exception
            return
        assert lease is not None and lease.lane == min(free)
        assert lease.lane not in self.quarantined
        self.ref[lease.lane] = RefLane(K.RESERVED, rid, self.gen, None, 0, n, 0)

    @rule(data=st.data())
    def reserve_twice_is_a_bug(self, data: st.DataObject) -> None:
        held = self.lanes_in(K.RESERVED, K.ACTIVE, K.UPDATING)
        if not held:
            return
        r = self.ref[data.draw(st.sampled_from(held))]
        assert r.rid is not None and r.gen is not None
        with pytest.raises(ValueError, match="already holds"):
            self.m.reserve(r.rid, r.gen, 1)

    @precondition(lambda self: self.lanes_in(K.RESERVED))
    @rule(data=st.data())
    def bind(self, data: st.DataObject) -> None:
        lane = data.draw(st.sampled_from(self.lanes_in(K.RESERVED)))
        self.m.bind(lane, self.next_seq)
        self.ref[lane].state, self.ref[lane].seq = K.ACTIVE, self.next_seq
        self.next_seq += 1

    @precondition(lambda self: self.lanes_in(K.ACTIVE))
    @rule(data=st.data(), n=st.integers(1, 8), wrong_pos=st.booleans())
    def begin_update(self, data: st.DataObject, n: int, wrong_pos: bool) -> None:
        lane = data.draw(st.sampled_from(self.lanes_in(K.ACTIVE)))
        r = self.ref[lane]
        pos = r.committed + (1 if wrong_pos else 0)
        if wrong_pos or r.committed + n > r.reserved:
            with pytest.raises(ValueError):
                self.m.begin_update(lane, pos, n)
            return
        self.m.begin_update(lane, pos, n)
        r.state, r.pending = K.UPDATING, n

    @precondition(lambda self: self.lanes_in(K.UPDATING))
    @rule(data=st.data(), ok=st.booleans())
    def append_done(self, data: st.DataObject, ok: bool) -> None:
        """The job came back: commit (device and output OK) or roll back (refused before running)."""
        lane = data.draw(st.sampled_from(self.lanes_in(K.UPDATING)))
        r = self.ref[lane]
        if ok:
            self.m.commit(lane, r.pending)
            r.committed += r.pending
        else:
            self.m.rollback(lane)
        r.state, r.pending = K.ACTIVE, 0

    @rule(data=st.data())
    def cancel_or_free(self, data: st.DataObject) -> None:
        """Cancel/finish: release the lane. Illegal while Updating (must drain) or Unknown/Free."""
        lane = data.draw(st.integers(0, LANES - 1))
        r = self.ref[lane]
        if r.state in (K.RESERVED, K.ACTIVE):
            self.m.begin_release(lane)
            r.state = K.RELEASING
        else:
            with pytest.raises(IllegalTransition):
                self.m.begin_release(lane)

    @precondition(lambda self: self.lanes_in(K.RELEASING))
    @rule(data=st.data())
    def runtime_confirms_free(self, data: st.DataObject) -> None:
        lane = data.draw(st.sampled_from(self.lanes_in(K.RELEASING)))
        self.m.confirm_released(lane)
        self.ref[lane] = RefLane()

    @rule(data=st.data())
    def confirm_without_release_is_a_bug(self, data: st.DataObject) -> None:
        lane = data.draw(st.integers(0, LANES - 1))
        if self.ref[lane].state is not K.RELEASING:
            with pytest.raises(IllegalTransition):
                self.m.confirm_released(lane)

    @rule(data=st.data())
    def fault(self, data: st.DataObject) -> None:
        lane = data.draw(st.integers(0, LANES - 1))
        r = self.ref[lane]
        if r.state is K.FREE:
            with pytest.raises(IllegalTransition):
                self.m.mark_unknown(lane)
            return
        self.m.mark_unknown(lane)
        r.state, r.pending = K.UNKNOWN, 0
        self.quarantined.add(lane)

    @rule()
    def reset(self) -> None:
        held = {i for i, r in enumerate(self.ref) if r.state is not K.FREE}
        cleared = self.m.clear_after_reset()
        assert {c.lane for c in cleared} == held
        self.ref = [RefLane() for _ in range(LANES)]
        self.quarantined.clear()

    @invariant()
    def matches_reference(self) -> None:
        self.m.check_invariants()
        for i, r in enumerate(self.ref):
            info = self.m.info(i)
            assert (info.state, info.request_id, info.generation, info.committed_len,
                    info.reserved_len, info.pending) == (
                r.state, r.rid, r.gen, r.committed, r.reserved, r.pending)
            if r.state not in (K.FREE, K.RESERVED):
                assert info.seq_id == r.seq
            assert 0 <= info.committed_len <= info.reserved_len <= MAX_SEQ
        for lane in self.quarantined:
            assert self.ref[lane].state is K.UNKNOWN  # never reused until reset
        s = self.m.statistics()
        assert s.tokens_reserved == self.tokens() <= MAX_KV
        assert s.free + s.reserved + s.active + s.updating + s.unknown + s.releasing == LANES
        assert s.free == len(self.lanes_in(K.FREE)) == self.m.free_lanes()
        assert s.free_tokens == self.m.free_tokens() == MAX_KV - self.tokens()
        assert s.tokens_committed == sum(r.committed for r in self.ref)
        live = [(r.rid, r.gen) for r in self.ref if r.state is not K.FREE]
        assert len(live) == len(set(live))  # one lane per request per generation
        for rid, gen in live:
            assert rid is not None and gen is not None
            assert self.m.lane_of(rid, gen) is not None


KvMachine.TestCase.settings = settings(
    settings.default,
    max_examples=max(200, settings.default.max_examples),
    stateful_step_count=50,
)
test_kv_lane_manager_against_reference = KvMachine.TestCase


def test_refusal_and_bad_arguments() -> None:
    m = KvLaneManager(1, 16, 16)
    with pytest.raises(ValueError, match="reserved_len"):
        m.reserve(1, 1, 17)
    lease = m.reserve(1, 1, 10)
    assert lease is not None and m.reserve(2, 1, 1) is None  # no lane: refusal
    m.begin_release(lease.lane)
    assert m.reserve(2, 1, 1) is None  # not reusable until the runtime confirmed
    m.confirm_released(lease.lane)
    assert m.reserve(2, 1, 1) is not None
    with pytest.raises(ValueError):
        m.info(5)
    with pytest.raises(ValueError):
        KvLaneManager(0, 16, 16)
