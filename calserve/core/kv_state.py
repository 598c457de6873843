"""The KV sequence (lane) lifecycle (spec §9.1) as one transition table.

::

    Free ─RESERVE─> Reserved ─BIND─> Active ─BEGIN_UPDATE─> Updating ─COMMIT/ROLLBACK─> Active
    Reserved/Active ─BEGIN_RELEASE─> Releasing ─CONFIRM_RELEASE─> Free
    Reserved/Active/Updating/Releasing ─FAULT─> Unknown      (timeout / CCU fault / DMA unknown)
    any ─RESET─> Free                                          (device reset invalidated every sequence)

Invariant (spec §9.2): a lane returns to Free only after the runtime confirmed the release, or after
a device reset; an Unknown lane is never reassigned until recovery clears it with RESET. An Updating
lane cannot be released: its job is still on the device and must drain first.
There is no terminal state: a lane cycles for the life of its calbin.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from calserve.core.fsm import check_table, fire_table

__all__ = ["KvSequenceState", "KvEvent", "TRANSITIONS", "TERMINAL", "fire"]


class KvSequenceState(enum.Enum):
    # Identity hash in C (members are singletons, equality is identity): Enum's own
    # __hash__ is a Python call, and these key the transition tables, looked up per token.
    __hash__ = object.__hash__

    FREE = "Free"
    RESERVED = "Reserved"  # lane and tokens held for a request; no runtime sequence yet
    ACTIVE = "Active"  # bound to a runtime KV sequence; committed_len is exact
    UPDATING = "Updating"  # a job writing this sequence is on the device
    UNKNOWN = "Unknown"  # contents unknown after a fault: quarantined until reset
    RELEASING = "Releasing"  # free requested, runtime has not confirmed yet


class KvEvent(enum.Enum):
    # Identity hash in C (members are singletons, equality is identity): Enum's own
    # __hash__ is a Python call, and these key the transition tables, looked up per token.
    __hash__ = object.__hash__

    RESERVE = enum.auto()
    BIND = enum.auto()
    BEGIN_UPDATE = enum.auto()
    COMMIT = enum.auto()
    ROLLBACK = enum.auto()
    BEGIN_RELEASE = enum.auto()
    CONFIRM_RELEASE = enum.auto()
    FAULT = enum.auto()
    RESET = enum.auto()


S = KvSequenceState
E = KvEvent
TERMINAL: frozenset[KvSequenceState] = frozenset()

_t: dict[KvSequenceState, dict[KvEvent, KvSequenceState]] = {s: {} for s in KvSequenceState}
_t[S.FREE][E.RESERVE] = S.RESERVED
_t[S.RESERVED].update({E.BIND: S.ACTIVE, E.BEGIN_RELEASE: S.RELEASING})
_t[S.ACTIVE].update({E.BEGIN_UPDATE: S.UPDATING, E.BEGIN_RELEASE: S.RELEASING})
_t[S.UPDATING].update({E.COMMIT: S.ACTIVE, E.ROLLBACK: S.ACTIVE})
_t[S.RELEASING][E.CONFIRM_RELEASE] = S.FREE
for _s in (S.RESERVED, S.ACTIVE, S.UPDATING, S.RELEASING):
    _t[_s][E.FAULT] = S.UNKNOWN
for _s in KvSequenceState:
    _t[_s][E.RESET] = S.FREE

TRANSITIONS: Mapping[KvSequenceState, Mapping[KvEvent, KvSequenceState]] = _t
check_table("kv", TRANSITIONS, KvSequenceState, TERMINAL)


def fire(state: KvSequenceState, event: KvEvent) -> KvSequenceState:
    """The state ``event`` leads to; raises :class:`IllegalTransition` if the table has no such move."""
    return fire_table("kv", TRANSITIONS, state, event)
