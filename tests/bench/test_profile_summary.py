"""bench.profile_summary: self and inclusive shares of a py-spy collapsed-stack file, trio thread only
by default (py-spy counts threads parked in C waits as active)."""

from __future__ import annotations

from pathlib import Path

from bench.profile_summary import summarize


def test_shares_and_trio_filter(tmp_path: Path) -> None:
    p = tmp_path / "p.folded"
    p.write_text(
        "run (trio/_core/_run.py:1);unrolled_run (trio/_core/_run.py:2);pump (api/running.py:10) 3\n"
        "run (trio/_core/_run.py:1);unrolled_run (trio/_core/_run.py:2);pump (api/running.py:12);"
        "send (h11/x.py:5) 1\n"
        "_bootstrap (threading.py:1);_loop (engine/backend_waits.py:9) 6\n"
        "not a stack line\n")
    trio = summarize(p)
    assert trio["samples"] == [("total", 4.0)]
    assert dict(trio["self"]) == {"pump (api/running.py)": 0.75, "send (h11/x.py)": 0.25}
    assert dict(trio["inclusive"])["pump (api/running.py)"] == 1.0  # lines merged per function
    every = summarize(p, only=None)
    assert every["samples"] == [("total", 10.0)]
    assert dict(every["self"])["_loop (engine/backend_waits.py)"] == 0.6


def test_categories_first_match_wins(tmp_path: Path) -> None:
    from bench.profile_summary import categories

    p = tmp_path / "p.folded"
    p.write_text(
        "unrolled_run (trio/_core/_run.py:2);pump_stream (api/running.py:10) 2\n"
        "unrolled_run (trio/_core/_run.py:2);pump_stream (api/running.py:10);"
        "HTTPStream.app_send (protocol/http_stream.py:5) 1\n"
        "unrolled_run (trio/_core/_run.py:2);_wait_hot (engine/backend.py:1);"
        "_TokenStep._step_plain (engine/actor.py:3) 1\n"
        "_bootstrap (threading.py:1);_loop (engine/backend_waits.py:9) 6\n")
    c = categories(p)
    assert c["pump"] == 0.5 and c["send"] == 0.25 and c["actor"] == 0.25
    assert c["other"] == 0.0 and abs(sum(c.values()) - 1.0) < 1e-9
