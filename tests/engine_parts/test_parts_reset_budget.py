"""ResetBudget: levels ok -> degraded -> failed over the 10-minute window, ageing out, and the
per-board file that survives a restart (written atomically, unreadable -> empty, logged)."""

from __future__ import annotations

import json
from pathlib import Path

from calserve.config import decode_config
from calserve.engine.reset_budget import WINDOW_S, BudgetLevel, ResetBudget, budget_path, open_budget
from calserve.engine.step_times import P99_MIN_SAMPLES, StepTimes


def test_levels_over_the_window() -> None:
    b = ResetBudget(2, 2)
    assert [b.record(t).value for t in (0.0, 1.0, 2.0, 3.0, 4.0)] == [
        "ok", "ok", "degraded", "degraded", "failed"]
    assert b.level(5.0) is BudgetLevel.FAILED
    assert b.next_change(5.0) == WINDOW_S  # the first reset ages out at t=600
    assert b.level(WINDOW_S + 1.5) is BudgetLevel.DEGRADED  # 0 and 1 aged out: 3 left
    assert b.count(WINDOW_S + 3.5) == 1 and b.level(WINDOW_S + 3.5) is BudgetLevel.OK
    strict = ResetBudget(1, 0)
    assert strict.record(0.0) is BudgetLevel.OK and strict.record(1.0) is BudgetLevel.FAILED


def test_persisted_per_board_survives_a_restart(tmp_path: Path) -> None:
    p0, p1 = budget_path(tmp_path, 0), budget_path(tmp_path, 1)
    b = ResetBudget(2, 2, p0, 0)
    for t in (100.0, 101.0, 102.0):
        b.record(t)
    doc = json.loads(p0.read_text())
    assert doc["device"] == 0 and doc["resets"] == [100.0, 101.0, 102.0]
    assert not list(tmp_path.glob("*.json.*"))  # no temp file left behind
    again = ResetBudget(2, 2, p0, 0)
    again.load(200.0)
    assert again.level(200.0) is BudgetLevel.DEGRADED  # a restart does not refill the budget
    other = ResetBudget(2, 2, p1, 1)
    other.load(200.0)
    assert other.count(200.0) == 0  # another board has its own budget
    late = ResetBudget(2, 2, p0, 0)
    late.load(100.0 + WINDOW_S + 5.0)
    assert late.count(100.0 + WINDOW_S + 5.0) == 0  # only the window's resets are loaded


def test_unreadable_file_starts_empty(tmp_path: Path) -> None:
    p = budget_path(tmp_path, 0)
    p.write_text("{not json")
    b = ResetBudget(2, 2, p)
    b.load(0.0)
    assert b.count(0.0) == 0
    b.record(1.0)
    assert json.loads(p.read_text())["resets"] == [1.0]


def test_open_budget_state_dir_and_device(tmp_path: Path) -> None:
    cfg = decode_config({"scheduler": {"recovery": {"state_dir": str(tmp_path),
                                                    "max_resets_per_10min": 3}}})
    b = open_budget(cfg, persist=False)  # a configured state dir always persists
    assert b.path == budget_path(tmp_path, 0) and b.max_resets == 3
    mem = open_budget(decode_config({}), persist=False)
    assert mem.path is None


def test_hang_timeout_from_model_then_observed_p99_bounded() -> None:
    t = StepTimes(hang_factor=20.0, hang_min_s=1.0, max_wait_s=30.0)
    assert t.timeout("decode", 16, 0.004) == 1.0  # 20 x 4 ms = 80 ms < the 1 s floor
    assert t.timeout("decode", 16, 0.1) == 2.0  # 20 x 100 ms
    assert t.timeout("decode", 16, 10.0) == 30.0  # never above wait_timeout_ms
    assert t.timeout("decode", 16, None) == 30.0  # nothing observed yet: the fixed bound
    for i in range(P99_MIN_SAMPLES):
        t.add("decode", 16, 0.2 if i == 0 else 0.1)
    assert t.p99("decode", 16) == 0.2
    assert t.timeout("decode", 16, None) == 4.0  # 20 x observed P99
    assert t.timeout("prefill", 16, None) == 30.0  # per profile and kind
