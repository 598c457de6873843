"""A noisy neighbour for a benchmark run: processes that take CPU in bursts, as other tenants of a
shared box do (issue 18 goal 4 asks for M1 on a busy hour; this makes one on demand).

``SPEC`` is ``BUSY_MS:IDLE_MS`` or ``BUSY_MS:IDLE_MSxN``: N processes (default
1), each spinning for about ``BUSY_MS`` (uniformly 0.5-1.5 of it), then sleeping for about
``IDLE_MS`` (the same spread), not pinned, until the ``with`` block ends. ``3:3`` keeps one CPU
about half busy in bursts of a few milliseconds: a decode step's length, so a burst lands on some
steps and not others, which is what a P99 sees of a neighbour.

    with noisy_neighbour(parse_spec("3:3x2")):
        ...
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["NeighbourSpec", "parse_spec", "noisy_neighbour"]

# Each neighbour also ends by itself (max_s), should the benchmark die without killing it.
_LOOP = """
import random, sys, time
busy, idle, seed, end = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, int(sys.argv[3]), float(sys.argv[4])
rnd = random.Random(seed)
end += time.monotonic()
while time.monotonic() < end:
    t = time.perf_counter() + busy * rnd.uniform(0.5, 1.5)
    while time.perf_counter() < t:
        pass
    time.sleep(idle * rnd.uniform(0.5, 1.5))
"""


@dataclass(frozen=True)
class NeighbourSpec:
    busy_ms: float
    idle_ms: float
    procs: int = 1

    def __str__(self) -> str:
        return f"{self.busy_ms:g}:{self.idle_ms:g}x{self.procs}"


_SPEC = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*:\s*(\d+(?:\.\d+)?)\s*(?:x\s*(\d+))?\s*$")


def parse_spec(text: str) -> NeighbourSpec:
    """``BUSY_MS:IDLE_MS[xN]`` (module docstring); ValueError naming the text otherwise."""
    m = _SPEC.match(text)
    if m is None:
        raise ValueError(f"neighbour {text!r}: expected BUSY_MS:IDLE_MS or BUSY_MS:IDLE_MSxN, e.g. 3:3x2")
    busy, idle, procs = float(m.group(1)), float(m.group(2)), int(m.group(3) or 1)
    if busy <= 0 or idle < 0 or not 1 <= procs <= 64:
        raise ValueError(f"neighbour {text!r}: BUSY_MS > 0, IDLE_MS >= 0 and 1 <= N <= 64")
    return NeighbourSpec(busy, idle, procs)


@contextlib.contextmanager
def noisy_neighbour(spec: NeighbourSpec | None, max_s: float = 3600.0) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The neighbour's processes while the block runs (none for ``spec`` None); killed and reaped
    on the way out, whatever happened."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if spec is not None:
            for i in range(spec.procs):
                procs.append(subprocess.Popen([sys.executable, "-c", _LOOP, str(spec.busy_ms),
                                               str(spec.idle_ms), str(i + 1), str(max_s)]))
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
