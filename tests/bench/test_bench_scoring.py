"""bench/scoring.py: scored and answered prompts through a real server, side by side."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.scoring import run


def test_scoring_and_answering_both_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CALSERVE_HOME", str(tmp_path / "home"))
    s = run(tmp_path / "out", True, prompt=12, requests=6, concurrency=3)
    for way in ("score", "answer", "score_teacher", "answer_teacher"):
        assert len(s[way]["prompt_tokens_per_s"]) == 2 and min(s[way]["prompt_tokens_per_s"]) > 0
        assert 0 < s[way]["latency_p50_s"] <= s[way]["latency_p99_s"]
    for r in ("score_over_answer", "score_teacher_over_answer", "score_over_score_teacher"):
        assert s[r] > 0
    assert (tmp_path / "out" / "summary.json").exists()
