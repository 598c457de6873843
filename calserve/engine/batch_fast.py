"""The decode batch of the common case, picked straight from the ready sequences (issue 18).

:func:`calserve.core.decode.build_decode_batch` is the one definition of the fair lane order; it
takes one :class:`~calserve.core.decode.DecodeCandidate` per ready sequence per batch and sorts
them through urgency, tenant heap, lane caps and skip reasons. When the ready set is the plain
case — one tenant, no cancelled sequence, no deadline inside the urgency horizon, no sequence at
the profile's length — all of that reduces to "the ``B`` least recently served, by
``(ready_since, request id)``" (each tenant's own order in the fair policy; the tenant heap has one
entry, urgency and exclusions pick nothing). :func:`single_tenant_lanes` answers exactly that, one
scan and a partial sort, and None whenever the ready set is not that case (the caller then takes
the general builder). ``tests/engine/test_batch_fast.py`` checks with hypothesis that both give
the same lanes in the same order and the same skip reasons.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from operator import attrgetter
from typing import Protocol, TypeVar

__all__ = ["single_tenant_lanes", "earliest_deadline", "ReadySeq"]


class _Req(Protocol):
    @property
    def tenant(self) -> str: ...


class ReadySeq(Protocol):
    """What the pick reads of a ready sequence (:class:`~calserve.engine.state.Seq`)."""

    @property
    def rid(self) -> int: ...
    @property
    def req(self) -> _Req: ...
    @property
    def position(self) -> int: ...
    @property
    def deadline(self) -> float | None: ...
    @property
    def ready_since(self) -> float: ...
    @property
    def pending_reason(self) -> object: ...


S = TypeVar("S", bound=ReadySeq)

_ORDER = attrgetter("ready_since", "rid")  # the fair policy's order inside one tenant
_PENDING = attrgetter("pending_reason")
_POSITION = attrgetter("position")
_DEADLINE = attrgetter("deadline")
_TENANT = attrgetter("req.tenant")


def earliest_deadline(seqs: Iterable[ReadySeq]) -> float | None:
    """The earliest deadline of ``seqs`` (None: none has one), in one C-level pass."""
    deadlines = list(map(_DEADLINE, seqs))
    if None in deadlines:
        deadlines = [d for d in deadlines if d is not None]
    return min(deadlines) if deadlines else None


BATCH_FULL = "batch_full"
TENANT_SHARE = "tenant_share"


def single_tenant_lanes(ready: Mapping[int, S], now: float, b: int, max_seq: int,
                        urgency_s: float, lane_share: float, earliest: float | None
                        ) -> tuple[list[S], str] | None:
    """The sequences of the next decode batch in lane order, and the skip reason of every ready
    sequence not chosen (``batch_full``, or ``tenant_share`` when the one tenant's lane cap is
    below ``b``: it took the leftover lanes because no other candidate existed); None when the
    ready set is not the plain one-tenant case (see the module docstring). ``earliest``: the ready
    set's :func:`earliest_deadline` (the planner has it from the batching window)."""
    if not ready:
        return None
    vals = list(ready.values())
    # The checks of every ready sequence, each one C-level pass over the batch (no side effects:
    # the order they run in does not matter): none has an ending pending, none is at the
    # profile's length, none has a deadline inside the urgency horizon, all are one tenant's.
    if list(map(_PENDING, vals)).count(None) != len(vals):
        return None
    if max(map(_POSITION, vals)) >= max_seq:
        return None
    if earliest is not None and earliest <= now + urgency_s:
        return None
    if len(set(map(_TENANT, vals))) != 1:
        return None
    # ``heapq.nsmallest(b, ..., key)`` is documented as ``sorted(..., key)[:b]`` (ties in input
    # order; the keys are unique anyway): the C sort of a few dozen keys costs less than its
    # Python-level heap loop.
    chosen = sorted(vals, key=_ORDER)
    if len(chosen) > b:
        del chosen[b:]
    cap = max(1, math.floor(lane_share * b + 1e-9))
    return chosen, (TENANT_SHARE if cap < b else BATCH_FULL)
