"""The generation lifecycle moves the control plane relies on (spec §10-§12)."""

from __future__ import annotations

import pytest

from calserve.core.fsm import IllegalTransition
from calserve.core.model_state import ModelEvent as E
from calserve.core.model_state import ModelState as S
from calserve.core.model_state import accepts_requests, fire, serves_jobs


def walk(*events: E, start: S = S.UNLOADED) -> S:
    s = start
    for e in events:
        s = fire(s, e)
    return s


def test_load_drain_unload() -> None:
    ready = walk(E.LOAD, E.VALIDATED, E.CONFIGURED, E.WARMED)
    assert ready is S.READY and accepts_requests(ready) and serves_jobs(ready)
    draining = fire(ready, E.DRAIN)
    assert not accepts_requests(draining) and serves_jobs(draining)  # its running ones finish
    assert walk(E.DRAINED, E.UNLOADED, start=draining) is S.UNLOADED


def test_drain_deadline_with_a_job_on_the_device_goes_through_recovering() -> None:
    rec = walk(E.DRAIN, E.FAULT, start=S.READY)
    assert rec is S.RECOVERING and not serves_jobs(rec)
    assert fire(rec, E.DRAINED) is S.UNLOADING  # the job came back: free, then Unloaded
    assert fire(rec, E.DRAIN) is S.DRAINING  # a reset during the drain, before its deadline
    with pytest.raises(IllegalTransition):
        fire(S.DRAINING, E.WARMED)  # a draining generation is never Ready again by a load step
