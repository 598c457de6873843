"""bench/engine_path.py: the engine's per-token path in-process, with and without the pump's holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.engine_path import measure


@pytest.mark.parametrize("hold_ms", [0.0, 20.0])
def test_every_stream_gets_every_token(hold_ms: float, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Held or not, every token reaches its stream. A 20 ms hold after each read lets the tokens of
    several steps gather, as a served stream's pump does under load: a read then takes more than
    one token on average (at 8 streams over B8..B16 the null-compute device makes hundreds of steps
    a second)."""
    monkeypatch.setenv("CALSERVE_HOME", str(tmp_path))
    streams, tokens = 8, 80
    out = measure(streams, tokens, reps=1, hold_ms=hold_ms)
    assert out["tokens_received"] == streams * tokens
    assert out["us_per_token"] > 0
    assert out["tokens_per_read"] >= 1.0
    if hold_ms:
        assert out["tokens_per_read"] > 2.0
