"""The time-switcher's residency hold ends when the resident alias has been idle for the grace,
whatever the float rounding of the instants (found by a random-seed run of
``test_control_machine_fake``: the hold tested ``now - idle_since >= grace`` but waited until
``idle_since + grace``; where the two disagree by one ulp the wait ended at once, for ever, at a
fixed virtual time, and a parked alias's requests were never served)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

import calserve.engine.timeswitch as timeswitch
from calserve.engine.timeswitch import IDLE_GRACE, TimeSwitcher


@pytest.mark.parametrize("start", [0.001995, 0.005983, 0.556824, 0.25])
async def test_an_idle_hold_ends_after_its_grace(autojump_clock: Any, monkeypatch: pytest.MonkeyPatch,
                                                 start: float) -> None:
    min_res = 2.0
    grace = IDLE_GRACE * min_res
    autojump_clock.jump(start)
    waits: list[tuple[float, float]] = []
    move_on_at = trio.move_on_at

    def checked(deadline: float, *args: Any, **kw: Any) -> Any:
        waits.append((trio.current_time(), deadline))
        assert deadline > trio.current_time(), "a hold waited on a deadline already passed"
        return move_on_at(deadline, *args, **kw)

    monkeypatch.setattr(timeswitch.trio, "move_on_at", checked)
    control = SimpleNamespace(
        cfg=SimpleNamespace(switching=SimpleNamespace(min_residency_s=min_res)),
        unloader=SimpleNamespace(load_of=lambda gen: (0, 0)),  # resident, idle
        driver=SimpleNamespace(wait_progress=trio.sleep_forever),
    )
    ts = TimeSwitcher(control)
    ts.resident = lambda: object()  # type: ignore[method-assign]
    ts.resident_since = trio.current_time()
    with trio.fail_after(10 * min_res):
        await ts._hold_residency()
    assert trio.current_time() == start + grace  # one grace of idleness, then the hold ends
    assert len(waits) == 1
