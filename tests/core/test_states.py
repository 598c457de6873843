"""Lifecycle tables (spec §2, §4, §9.1, §10): legal paths, illegal moves raise, cancel semantics."""

from __future__ import annotations

import pytest

from calserve.core import kv_state, model_state, request_state
from calserve.core.fsm import IllegalTransition
from calserve.core.kv_state import KvEvent, KvSequenceState
from calserve.core.model_state import ModelEvent, ModelState, accepts_requests, is_loading
from calserve.core.request_state import (
    TERMINAL,
    CancelEffect,
    RequestEvent as E,
    RequestState as S,
    cancel_effect,
    fire,
)


def run(state: S, *events: E) -> S:
    for ev in events:
        state = fire(state, ev)
    return state


def test_happy_path_reaches_completed() -> None:
    s = run(S.NEW, E.ENQUEUE, E.ADMIT, E.PREFILL_SUBMIT, E.PREFILL_DONE,
            E.DECODE_SUBMIT, E.DECODE_DONE, E.DECODE_SUBMIT, E.FINISH, E.COMPLETE)
    assert s is S.COMPLETED


def test_waiting_model_path() -> None:
    assert run(S.NEW, E.MODEL_PENDING, E.MODEL_READY, E.ADMIT) is S.PREFILL_READY


@pytest.mark.parametrize("state", [S.NEW, S.WAITING_MODEL, S.WAITING_ADMISSION, S.PREFILL_READY,
                                   S.DECODE_READY])
def test_cancel_waiting_or_ready_ends_at_once(state: S) -> None:
    assert cancel_effect(state) is CancelEffect.END_NOW
    assert fire(state, E.CANCEL) is S.CANCELLED


@pytest.mark.parametrize("state", [S.PREFILL_RUNNING, S.DECODE_RUNNING])
def test_cancel_running_sets_flag_and_drains(state: S) -> None:
    assert cancel_effect(state) is CancelEffect.DRAIN
    assert fire(state, E.CANCEL) is state  # still running: the job must drain
    assert fire(fire(state, E.CANCEL), E.DRAINED) is S.CANCELLED


@pytest.mark.parametrize("state", sorted(TERMINAL | {S.FINISHING}, key=lambda s: s.value))
def test_cancel_is_idempotent_noop_when_finishing_or_terminal(state: S) -> None:
    assert cancel_effect(state) is CancelEffect.NOOP
    assert fire(state, E.CANCEL) is state


def test_terminal_entered_once() -> None:
    for t in TERMINAL:
        for ev in E:
            if ev is E.CANCEL:
                continue
            with pytest.raises(IllegalTransition):
                fire(t, ev)


def test_only_table_moves_into_terminal_come_from_non_terminal() -> None:
    for src, row in request_state.TRANSITIONS.items():
        for ev, dst in row.items():
            if dst in TERMINAL and src in TERMINAL:
                assert src is dst and ev is E.CANCEL


def test_illegal_move_names_state_and_event() -> None:
    with pytest.raises(IllegalTransition, match="DECODE_DONE is illegal in state PREFILL_READY"):
        fire(S.PREFILL_READY, E.DECODE_DONE)


def test_expire() -> None:
    assert fire(S.WAITING_ADMISSION, E.EXPIRE) is S.FAILED
    assert fire(S.DECODE_READY, E.EXPIRE) is S.FINISHING  # partial output is delivered
    with pytest.raises(IllegalTransition):
        fire(S.DECODE_RUNNING, E.EXPIRE)  # a running job drains first


def test_fail_from_every_non_terminal() -> None:
    for s in S:
        if s not in TERMINAL:
            assert fire(s, E.FAIL) is S.FAILED


def test_kv_table() -> None:
    K, KE = KvSequenceState, KvEvent
    s = K.FREE
    for ev in (KE.RESERVE, KE.BIND, KE.BEGIN_UPDATE, KE.COMMIT, KE.BEGIN_RELEASE,
               KE.CONFIRM_RELEASE):
        s = kv_state.fire(s, ev)
    assert s is K.FREE
    with pytest.raises(IllegalTransition):
        kv_state.fire(K.UPDATING, KE.BEGIN_RELEASE)  # in-flight job must drain first
    with pytest.raises(IllegalTransition):
        kv_state.fire(K.UNKNOWN, KE.BEGIN_RELEASE)  # only a reset clears Unknown
    with pytest.raises(IllegalTransition):
        kv_state.fire(K.UNKNOWN, KE.RESERVE)
    assert kv_state.fire(K.UNKNOWN, KE.RESET) is K.FREE


def test_model_table() -> None:
    M, ME = ModelState, ModelEvent
    s = M.UNLOADED
    for ev in (ME.LOAD, ME.VALIDATED, ME.CONFIGURED, ME.WARMED):
        assert not accepts_requests(s)
        s = model_state.fire(s, ev)
    assert s is M.READY and accepts_requests(s)
    assert is_loading(M.WARMING) and not is_loading(M.RECOVERING)
    s = model_state.fire(s, ME.DRAIN)
    assert not accepts_requests(s)
    assert model_state.fire(s, ME.FAULT) is M.RECOVERING  # drain deadline with a job in flight
    with pytest.raises(IllegalTransition):
        model_state.fire(M.FAILED, ME.LOAD)
    with pytest.raises(IllegalTransition):
        model_state.fire(M.DRAINING, ME.UNLOADED)  # never skip Unloading
