"""Linux ``/proc`` readings of a server process: CPU seconds, RSS, open file descriptors, threads.

Used for the per-token CPU microbenchmark and the soak's leak checks. CPU time is ``utime + stime``
of the process and all its threads (``/proc/PID/stat`` fields 14-15) — children are not included, so
pass the PID of the process that actually serves (hypercorn's worker, not its parent).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

__all__ = ["ProcSample", "sample", "children", "threads_cpu_s", "SIM_DEVICE_THREADS"]

#: Name prefix of the software CalRT's engine worker threads (the simulated NPU's compute): their CPU
#: is the device's, which a real accelerator would not take from the host.
SIM_DEVICE_THREADS = "calrt-sim-"

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclasses.dataclass(frozen=True)
class ProcSample:
    cpu_s: float  # utime + stime
    rss_bytes: int
    open_fds: int
    threads: int


def sample(pid: int) -> ProcSample | None:
    """One reading, or None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        statm = Path(f"/proc/{pid}/statm").read_text().split()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces; fields after the closing paren are fixed.
    rest = stat[stat.rindex(")") + 2 :].split()
    utime, stime, threads = int(rest[11]), int(rest[12]), int(rest[17])
    return ProcSample((utime + stime) / _TICK, int(statm[1]) * _PAGE, fds, threads)


def threads_cpu_s(pid: int, prefix: str) -> float:
    """CPU seconds (utime + stime) of the threads of ``pid`` whose name starts with ``prefix``."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name.startswith(prefix):
            rest = stat[stat.rindex(")") + 2 :].split()
            total += int(rest[11]) + int(rest[12])
    return total / _TICK


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (e.g. hypercorn's worker process)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out
