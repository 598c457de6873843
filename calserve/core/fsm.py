"""A tiny helper for lifecycle transition tables (STYLE.md item 2, after h11's ``_state.py``).

Every lifecycle in calserve (request, KV sequence, model generation) is one module with one table
``TRANSITIONS[state][event] -> state`` and one ``fire()`` that raises :class:`IllegalTransition` on a
move the table does not list. Nothing else in the code base assigns a state by hand, so an illegal
move is caught where it happens instead of surfacing later as a leak or a double completion.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["IllegalTransition", "Table", "fire_table", "check_table"]

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)

Table = Mapping[S, Mapping[E, S]]


class IllegalTransition(Exception):
    """An event that the lifecycle's table does not allow in the current state.

    This is a programming error (a bug in the engine's wiring), never a user error: it is not part of
    :mod:`calserve.errors` and must not be mapped to an HTTP status.
    """

    def __init__(self, machine: str, state: enum.Enum, event: enum.Enum) -> None:
        super().__init__(f"{machine}: event {event.name} is illegal in state {state.name}")
        self.machine = machine
        self.state = state
        self.event = event


def fire_table(machine: str, table: Mapping[S, Mapping[E, S]], state: S, event: E) -> S:
    """Return the state that ``event`` leads to from ``state``, or raise :class:`IllegalTransition`."""
    try:
        return table[state][event]
    except KeyError:
        raise IllegalTransition(machine, state, event) from None


def check_table(
    machine: str,
    table: Mapping[S, Mapping[E, S]],
    states: type[S],
    terminal: frozenset[S],
    self_loops_allowed_in_terminal: frozenset[E] = frozenset(),
) -> None:
    """Assert a table's shape at import time: every state has a row, and a terminal state is left by
    no event (only the listed idempotent self-loops, e.g. a repeated cancel, may stay put)."""
    for s in states:
        if s not in table:
            raise AssertionError(f"{machine}: state {s.name} has no row")
    for s in terminal:
        for ev, dst in table[s].items():
            if dst is not s or ev not in self_loops_allowed_in_terminal:
                raise AssertionError(f"{machine}: terminal {s.name} has an exit on {ev.name}")
