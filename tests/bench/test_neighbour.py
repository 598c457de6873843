"""bench/neighbour.py: the busy hour M1 can run under (``--neighbour``)."""

from __future__ import annotations

import time

import pytest

from bench import procstat
from bench.neighbour import NeighbourSpec, noisy_neighbour, parse_spec


@pytest.mark.parametrize(("text", "spec"), [
    ("3:3", NeighbourSpec(3.0, 3.0, 1)),
    ("2.5:0x4", NeighbourSpec(2.5, 0.0, 4)),
    (" 10 : 5 x 2 ", NeighbourSpec(10.0, 5.0, 2)),
])
def test_spec_parses(text: str, spec: NeighbourSpec) -> None:
    assert parse_spec(text) == spec
    assert parse_spec(str(spec)) == spec


@pytest.mark.parametrize("text", ["", "3", "3:", "a:b", "0:3", "3:3x0", "3:3x65", "-1:3", "3:3x"])
def test_a_bad_spec_names_itself(text: str) -> None:
    with pytest.raises(ValueError, match="neighbour"):
        parse_spec(text)


def _cpu_s(pid: int) -> float:
    s = procstat.sample(pid)
    assert s is not None, f"neighbour process {pid} is gone"
    return s.cpu_s


def test_the_neighbour_takes_cpu_while_the_block_runs_and_is_reaped_after() -> None:
    with noisy_neighbour(NeighbourSpec(5.0, 1.0, 2)) as procs:
        assert len(procs) == 2
        deadline = time.monotonic() + 20.0  # real processes: wait until both have spun a while
        while min(_cpu_s(p.pid) for p in procs) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.poll() is None for p in procs)
        assert min(_cpu_s(p.pid) for p in procs) >= 0.05
    assert all(p.returncode is not None for p in procs)  # killed and waited for


def test_no_spec_no_process() -> None:
    with noisy_neighbour(None) as procs:
        assert procs == []
