"""The request lifecycle (spec §2, §4) as one transition table.

::

    New ─ENQUEUE─> WaitingAdmission ─ADMIT─> PrefillReady ─PREFILL_SUBMIT─> PrefillRunning
     │  └MODEL_PENDING─> WaitingModel ─MODEL_READY─┘ (to WaitingAdmission)     │ PREFILL_DONE
     └ADMIT (fast path) ─> PrefillReady                                         v
                      DecodeRunning <─DECODE_SUBMIT─ DecodeReady <─DECODE_DONE─ DecodeRunning
    PrefillRunning/DecodeRunning/DecodeReady ─FINISH─> Finishing ─COMPLETE─> Completed
    PrefillRunning ─REQUEUE─> PrefillReady, DecodeRunning ─REQUEUE─> DecodeReady (refused: DeviceBusy)
    *Ready/*Running ─LOST─> PrefillReady (a fault lost its KV: re-prefill prompt + generated tokens)
    New/Waiting*/*Ready ─CANCEL─> Cancelled          *Running ─CANCEL─> (same state: flag + drain)
    *Running ─DRAINED─> Cancelled (the job of a cancelled request came back; its output is dropped)
    New/Waiting*/PrefillReady ─EXPIRE─> Failed        DecodeReady ─EXPIRE─> Finishing (partial output)
    any non-terminal ─FAIL─> Failed

Spec §4: cancel is idempotent; New/Waiting/Ready end at once, Running only sets a flag and the job
still drains; a terminal state is entered exactly once. So ``CANCEL`` is a self-loop on Running
states, on Finishing (too late to cancel: the result is already final) and on terminal states, and
:func:`cancel_effect` tells the caller which of the three things to do. A deadline that passes while a
job runs is handled like cancel by the engine (let the job drain, then ``FINISH`` or ``DRAINED``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from calserve.core.fsm import IllegalTransition, check_table, fire_table

__all__ = [
    "RequestState",
    "RequestEvent",
    "TRANSITIONS",
    "TERMINAL",
    "RUNNING",
    "fire",
    "CancelEffect",
    "cancel_effect",
    "IllegalTransition",
]


class RequestState(enum.Enum):
    # Identity hash in C (members are singletons, equality is identity): Enum's own
    # __hash__ is a Python call, and these key the transition tables, looked up per token.
    __hash__ = object.__hash__

    NEW = "New"
    WAITING_MODEL = "WaitingModel"  # the pinned generation is still loading/warming
    WAITING_ADMISSION = "WaitingAdmission"  # in the fair queue
    PREFILL_READY = "PrefillReady"  # admitted: KV reserved, waiting for a prefill opportunity
    PREFILL_RUNNING = "PrefillRunning"  # a prefill job is on the device
    DECODE_READY = "DecodeReady"  # waiting for a decode batch
    DECODE_RUNNING = "DecodeRunning"  # a decode job containing this request is on the device
    FINISHING = "Finishing"  # final result known; resources being returned, stream closing
    COMPLETED = "Completed"
    CANCELLED = "Cancelled"
    FAILED = "Failed"


class RequestEvent(enum.Enum):
    # Identity hash in C (members are singletons, equality is identity): Enum's own
    # __hash__ is a Python call, and these key the transition tables, looked up per token.
    __hash__ = object.__hash__

    MODEL_PENDING = enum.auto()  # New -> WaitingModel
    MODEL_READY = enum.auto()  # WaitingModel -> WaitingAdmission
    ENQUEUE = enum.auto()  # New -> WaitingAdmission (admission said Queue)
    ADMIT = enum.auto()  # New/WaitingAdmission -> PrefillReady
    PREFILL_SUBMIT = enum.auto()
    PREFILL_DONE = enum.auto()  # prefill job OK and first token sampled, more to come
    DECODE_SUBMIT = enum.auto()
    DECODE_DONE = enum.auto()  # decode job OK, token sampled, more to come
    FINISH = enum.auto()  # stop/length/deadline reached: final result known
    COMPLETE = enum.auto()  # Finishing -> Completed (resources returned, terminal event sent)
    CANCEL = enum.auto()  # client cancel / disconnect (idempotent)
    DRAINED = enum.auto()  # the in-flight job of a cancelled request came back
    REQUEUE = enum.auto()  # the device refused the job (DeviceBusy): nothing ran, ready again
    LOST = enum.auto()  # a fault lost its device KV: re-prefill from prompt + generated tokens
    EXPIRE = enum.auto()  # deadline passed while not running
    FAIL = enum.auto()  # device/model error, or refused


S = RequestState
E = RequestEvent

TERMINAL: frozenset[RequestState] = frozenset({S.COMPLETED, S.CANCELLED, S.FAILED})
# Invariant: a request in RUNNING has exactly one job on the device that must drain before any of its
# KV/buffers are reused.
RUNNING: frozenset[RequestState] = frozenset({S.PREFILL_RUNNING, S.DECODE_RUNNING})
_WAITING_OR_READY = (S.NEW, S.WAITING_MODEL, S.WAITING_ADMISSION, S.PREFILL_READY, S.DECODE_READY)

_t: dict[RequestState, dict[RequestEvent, RequestState]] = {s: {} for s in RequestState}
_t[S.NEW].update({E.MODEL_PENDING: S.WAITING_MODEL, E.ENQUEUE: S.WAITING_ADMISSION,
                  E.ADMIT: S.PREFILL_READY})
_t[S.WAITING_MODEL][E.MODEL_READY] = S.WAITING_ADMISSION
_t[S.WAITING_ADMISSION][E.ADMIT] = S.PREFILL_READY
_t[S.PREFILL_READY][E.PREFILL_SUBMIT] = S.PREFILL_RUNNING
_t[S.PREFILL_RUNNING].update({E.PREFILL_DONE: S.DECODE_READY, E.FINISH: S.FINISHING})
_t[S.DECODE_READY].update({E.DECODE_SUBMIT: S.DECODE_RUNNING, E.FINISH: S.FINISHING,
                           E.EXPIRE: S.FINISHING})
_t[S.DECODE_RUNNING].update({E.DECODE_DONE: S.DECODE_READY, E.FINISH: S.FINISHING})
_t[S.PREFILL_RUNNING][E.REQUEUE] = S.PREFILL_READY
_t[S.DECODE_RUNNING][E.REQUEUE] = S.DECODE_READY
for _s in (S.PREFILL_READY, S.PREFILL_RUNNING, S.DECODE_READY, S.DECODE_RUNNING):
    _t[_s][E.LOST] = S.PREFILL_READY  # re-admitted: its KV is rebuilt by a prefill
_t[S.FINISHING][E.COMPLETE] = S.COMPLETED
for _s in _WAITING_OR_READY:
    _t[_s][E.CANCEL] = S.CANCELLED
for _s in (S.NEW, S.WAITING_MODEL, S.WAITING_ADMISSION, S.PREFILL_READY):
    _t[_s][E.EXPIRE] = S.FAILED
for _s in RUNNING:
    _t[_s][E.CANCEL] = _s  # flag only: the job drains (spec §4)
    _t[_s][E.DRAINED] = S.CANCELLED
_t[S.FINISHING][E.CANCEL] = S.FINISHING
for _s in RequestState:
    if _s not in TERMINAL:
        _t[_s][E.FAIL] = S.FAILED
for _s in TERMINAL:
    _t[_s][E.CANCEL] = _s  # idempotent cancel; never re-enters the terminal state

TRANSITIONS: Mapping[RequestState, Mapping[RequestEvent, RequestState]] = _t
check_table("request", TRANSITIONS, RequestState, TERMINAL, frozenset({E.CANCEL}))


def fire(state: RequestState, event: RequestEvent) -> RequestState:
    """The state ``event`` leads to; raises :class:`IllegalTransition` if the table has no such move."""
    return fire_table("request", TRANSITIONS, state, event)


class CancelEffect(enum.Enum):
    END_NOW = "end_now"  # not on the device: end as Cancelled now and return its resources
    DRAIN = "drain"  # a job is in flight: set the cancel flag, drop the output when it drains
    NOOP = "noop"  # already terminal or finishing: nothing to do (cancel is idempotent)


def cancel_effect(state: RequestState) -> CancelEffect:
    """What cancelling a request in ``state`` must do (spec §4)."""
    if state in RUNNING:
        return CancelEffect.DRAIN
    if state in TERMINAL or state is S.FINISHING:
        return CancelEffect.NOOP
    return CancelEffect.END_NOW
