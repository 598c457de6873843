"""ResetBudget: what spending ``recovery.max_resets_per_10min`` means, kept per board across restarts.

The spec's budget (§15 ``max_resets_per_10min: 2``) exists to stop reset loops, not to turn three
quick faults into an outage. Counting the resets of the last 10 minutes, this one included:

- up to ``max_resets_per_10min``: **ok** — recover and serve as before;
- up to ``max_resets_per_10min + degraded_resets_per_10min``: **degraded** — recover, then serve
  with one job engine (PING/PONG off), the smallest decode profile (B1 where loaded: a fault costs
  one lane's KV) and slower admission (no new request is admitted for
  ``degraded_admit_cooldown_ms`` after each reset; queued ones wait, nobody is refused); degraded
  ends by itself once resets age out of the window;
- beyond: **failed** — the generation goes Failed (``/ready`` 503, its requests end with 503
  ``model_unavailable`` + Retry-After) and, with ``recovery.exit_on_failed``, the process exits 1 so
  its supervisor restarts it.

The reset times are wall-clock and persisted per board (``runtime.device``) in a small JSON file
(``<state dir>/reset-budget-device<N>.json``, written atomically: temp file + fsync + rename), so a
supervisor's restart does not refill the budget: a process restarted after Failed starts with the
resets of the window already counted (degraded), and its next fault inside the window fails it at
once — a crash loop is bounded by the window, not by the restart rate.

Pure apart from the file: the caller passes the wall-clock time.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from calserve.config import CalserveConfig, calserve_home

__all__ = ["BudgetLevel", "ResetBudget", "WINDOW_S", "budget_path", "open_budget"]

log = logging.getLogger("calserve.engine.recovery")

WINDOW_S = 600.0


class BudgetLevel(enum.Enum):
    OK = "ok"
    DEGRADED = "degraded"
    FAILED = "failed"


def budget_path(state_dir: Path, device: int) -> Path:
    return state_dir / f"reset-budget-device{device}.json"


class ResetBudget:
    def __init__(self, max_resets: int, degraded_resets: int, path: Path | None = None,
                 device: int = 0, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock  # wall clock (the persisted times survive a restart)
        self.max_resets = max_resets
        self.degraded_resets = degraded_resets
        self.path = path
        self.device = device
        self.resets: list[float] = []  # wall-clock times, ascending

    # ------------------------------------------------------------------------------ decisions
    def _trim(self, now: float) -> None:
        cut = now - WINDOW_S
        if self.resets and self.resets[0] <= cut:
            self.resets = [t for t in self.resets if t > cut]

    def count(self, now: float) -> int:
        self._trim(now)
        return len(self.resets)

    def level_of(self, n: int) -> BudgetLevel:
        if n <= self.max_resets:
            return BudgetLevel.OK
        if n <= self.max_resets + self.degraded_resets:
            return BudgetLevel.DEGRADED
        return BudgetLevel.FAILED

    def level(self, now: float) -> BudgetLevel:
        """The level with the resets of the window so far (between faults)."""
        return self.level_of(self.count(now))

    def record(self, now: float) -> BudgetLevel:
        """A reset happens now: count it (persisted) and return the level including it."""
        self._trim(now)
        self.resets.append(now)
        self.save()
        return self.level_of(len(self.resets))

    def next_change(self, now: float) -> float:
        """The wall-clock time the oldest reset of the window ages out (inf: none)."""
        self._trim(now)
        return self.resets[0] + WINDOW_S if self.resets else float("inf")

    # ------------------------------------------------------------------------------ persistence
    def load(self, now: float) -> None:
        """Read the board's resets of the window (a missing or unreadable file: none; logged)."""
        if self.path is None:
            return
        try:
            data = json.loads(self.path.read_text())
            times = sorted(float(t) for t in data["resets"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("reset budget file %s unreadable (%s): starting with an empty budget",
                        self.path, e)
            return
        self.resets = [t for t in times if now - WINDOW_S < t <= now + 1.0]
        if self.resets:
            log.warning("reset budget of device %d: %d reset(s) in the last 10 min (from %s)",
                        self.device, len(self.resets), self.path)

    def save(self) -> None:
        if self.path is None:
            return
        body = json.dumps({"device": self.device, "window_s": WINDOW_S, "resets": self.resets})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(body)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:  # the budget still holds in memory; a restart would refill it
            log.error("cannot persist the reset budget to %s: %s", self.path, e)



def board_index(cfg: CalserveConfig) -> int:
    """The board this process drives (``runtime.device``)."""
    return cfg.runtime.device


def open_budget(cfg: CalserveConfig, persist: bool) -> ResetBudget:
    """The reset budget of this process' board, loaded from its file: kept in
    ``recovery.state_dir`` (None: ``CALSERVE_HOME/state`` when ``persist`` — the server's engine —
    else in memory only)."""
    rc = cfg.scheduler.recovery
    device = board_index(cfg)
    state_dir = Path(rc.state_dir).expanduser() if rc.state_dir else (
        calserve_home() / "state" if persist else None)
    b = ResetBudget(rc.max_resets_per_10min, rc.degraded_resets_per_10min,
                    budget_path(state_dir, device) if state_dir is not None else None, device)
    b.load(b.clock())
    return b
