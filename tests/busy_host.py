"""A host kept busy for a test: every CPU this process may run on busy twice over, by spinning
subprocesses, for the ``with`` block (the runtime's threads then wait for a CPU to compute and to
wake up, as on a loaded server). Imported as ``from busy_host import busy_host`` (tests/ is on
sys.path: its conftest)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

# Each spinner also ends by itself, should the test process die without killing it.
_SPIN = "import time\nt = time.monotonic() + 120\nwhile time.monotonic() < t: pass\n"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as ``nproc`` counts)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextlib.contextmanager
def busy_host(per_cpu: int = 2, settle_s: float = 0.2) -> Iterator[None]:
    """``per_cpu`` spinners per usable CPU while the block runs (``settle_s``: they are running
    before it starts); killed and reaped on the way out, whatever happened."""
    hogs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(per_cpu * usable_cpus())]
    try:
        time.sleep(settle_s)
        yield
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()
