"""bench/request_cost.py: server CPU a short streamed request, calserve and the floor app, both
started for real on 127.0.0.1 (a short load)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.request_cost import main


def test_both_sides_serve_short_streams_and_the_ratio_is_reported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--output", "2", "--duration", "0.6", "--warmup", "0.2", "--out",
                 str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "summary.json").read_text())
    for side in ("calserve", "floor"):
        s = doc[side]
        assert s["requests"] > 0 and s["outcomes"]["ok"] == s["requests"]
        assert s["us_per_request"] > 0
    assert doc["floor"]["events_per_request"] == pytest.approx(2.0)  # a token an event
    # calserve groups the tokens produced while its thread is busy into one event
    assert 1.0 <= doc["calserve"]["events_per_request"] <= 2.0
    assert doc["ratio_per_request"] == pytest.approx(
        doc["calserve"]["us_per_request"] / doc["floor"]["us_per_request"])
    assert "calserve / floor" in capsys.readouterr().out


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--output", "0"])
