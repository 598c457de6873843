"""The model generation lifecycle (spec §10–§12) as one transition table.

::

    Unloaded ─LOAD─> Validating ─VALIDATED─> Configuring ─CONFIGURED─> Warming ─WARMED─> Ready
    Ready ─DRAIN─> Draining ─DRAINED─> Unloading ─UNLOADED─> Unloaded
    Configuring/Warming/Ready/Draining/Unloading ─FAULT─> Recovering ─RECOVERED─> Ready
    Recovering ─DRAINED─> Unloading          (the fault happened while unloading/draining)
    Recovering ─DRAIN─> Draining             (a draining generation recovered before its deadline)
    any but Failed ─FAIL─> Failed            (terminal for this generation; a new one is built)

Spec §12: a drain deadline with a submitted job still on the device goes to Recovering (FAULT), never
straight to Unloading: a forced delete is not a cancel.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from calserve.core.fsm import check_table, fire_table

__all__ = [
    "ModelState",
    "ModelEvent",
    "TRANSITIONS",
    "TERMINAL",
    "fire",
    "accepts_requests",
    "is_loading",
    "serves_jobs",
]


class ModelState(enum.Enum):
    UNLOADED = "Unloaded"
    VALIDATING = "Validating"
    CONFIGURING = "Configuring"
    WARMING = "Warming"
    READY = "Ready"
    DRAINING = "Draining"
    UNLOADING = "Unloading"
    RECOVERING = "Recovering"
    FAILED = "Failed"


class ModelEvent(enum.Enum):
    LOAD = enum.auto()
    VALIDATED = enum.auto()
    CONFIGURED = enum.auto()
    WARMED = enum.auto()
    DRAIN = enum.auto()
    DRAINED = enum.auto()
    UNLOADED = enum.auto()
    FAULT = enum.auto()
    RECOVERED = enum.auto()
    FAIL = enum.auto()


S = ModelState
E = ModelEvent
TERMINAL: frozenset[ModelState] = frozenset({S.FAILED})

_t: dict[ModelState, dict[ModelEvent, ModelState]] = {s: {} for s in ModelState}
_t[S.UNLOADED][E.LOAD] = S.VALIDATING
_t[S.VALIDATING][E.VALIDATED] = S.CONFIGURING
_t[S.CONFIGURING][E.CONFIGURED] = S.WARMING
_t[S.WARMING][E.WARMED] = S.READY
_t[S.READY][E.DRAIN] = S.DRAINING
_t[S.DRAINING][E.DRAINED] = S.UNLOADING
_t[S.UNLOADING][E.UNLOADED] = S.UNLOADED
for _s in (S.CONFIGURING, S.WARMING, S.READY, S.DRAINING, S.UNLOADING):
    _t[_s][E.FAULT] = S.RECOVERING
_t[S.RECOVERING].update({E.RECOVERED: S.READY, E.DRAINED: S.UNLOADING, E.DRAIN: S.DRAINING})
for _s in ModelState:
    if _s not in TERMINAL:
        _t[_s][E.FAIL] = S.FAILED

TRANSITIONS: Mapping[ModelState, Mapping[ModelEvent, ModelState]] = _t
check_table("model", TRANSITIONS, ModelState, TERMINAL)


def fire(state: ModelState, event: ModelEvent) -> ModelState:
    """The state ``event`` leads to; raises :class:`IllegalTransition` if the table has no such move."""
    return fire_table("model", TRANSITIONS, state, event)


def accepts_requests(state: ModelState) -> bool:
    """Only a Ready generation admits new requests (spec §5.2: otherwise RejectUnavailable, 503)."""
    return state is S.READY


def is_loading(state: ModelState) -> bool:
    """A generation on its way to Ready: requests pinned to it wait (WaitingModel) instead of 503."""
    return state in (S.VALIDATING, S.CONFIGURING, S.WARMING)


def serves_jobs(state: ModelState) -> bool:
    """Jobs of the generation's admitted requests are dispatched: Ready, and Draining (its running
    requests finish on it, spec §12)."""
    return state is S.READY or state is S.DRAINING
