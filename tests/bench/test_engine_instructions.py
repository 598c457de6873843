"""bench/engine_instructions.py: the per-token path in instructions, from two callgrind runs.

The arithmetic and the parsing, with a fake runner and valgrind's and engine_path's own output
lines (the real runs take ~1.5 min under valgrind: bench/README, session 46)."""

from __future__ import annotations

import pytest

from bench.engine_instructions import (instructions_per_token, main, measure, parse_collected,
                                       parse_tokens_a_read)

# What the two tools print (valgrind on stderr, engine_path on stdout), as seen on this box
VALGRIND = """==7001== Callgrind, a call-graph generating cache profiler
==7001== Events    : Ir
==7001== Collected : 3776191635
==7001==
==7001== I   refs:      3,776,191,635
"""
ENGINE_PATH = ("engine_path: 1094.02 µs CPU per token (engine + actor + stream writer; 64 streams x 192 "
               "tokens, B1..B16, null compute, held 1000 ms a read: 15.8 tokens a read)\n")


def test_parses_what_the_tools_print() -> None:
    assert parse_collected(VALGRIND) == 3_776_191_635
    assert parse_collected("==1== Collected : 1,234,567") == 1_234_567
    assert parse_tokens_a_read(ENGINE_PATH) == pytest.approx(15.8)
    assert parse_tokens_a_read("engine_path: 23.61 µs CPU per token (..., null compute)") is None
    with pytest.raises(ValueError, match="Collected"):
        parse_collected("valgrind: command not found")


def test_the_start_up_cancels_out() -> None:
    """A fixed start-up cost plus a cost a token: the figure is the cost a token, whatever the
    start-up and whichever two counts are run."""
    start_up, per_token, streams = 3_000_000_000, 81_000, 64

    def run(tokens: int) -> tuple[int, float | None]:
        return start_up + per_token * tokens * streams, 17.0

    for n1, n2 in ((64, 192), (10, 11), (100, 400)):
        rows = measure(run, n1, n2, streams, repeats=2)
        assert len(rows) == 2
        assert all(r["instructions_per_token"] == per_token for r in rows)
        assert rows[0]["tokens_per_read"] == 17.0
        assert rows[0]["instructions"] == [start_up + per_token * n1 * streams,
                                           start_up + per_token * n2 * streams]


def test_runs_in_order_and_reports_the_longer_runs_reads() -> None:
    calls: list[int] = []

    def run(tokens: int) -> tuple[int, float | None]:
        calls.append(tokens)
        return 1000 * tokens, float(tokens)  # tokens a read: the run's own

    rows = measure(run, 8, 24, streams=1, repeats=3)
    assert calls == [8, 24] * 3
    assert [r["tokens_per_read"] for r in rows] == [24.0] * 3
    assert [r["instructions_per_token"] for r in rows] == [1000.0] * 3


@pytest.mark.parametrize("n1, n2, streams", [(64, 64, 64), (192, 64, 64), (64, 192, 0)])
def test_refuses_counts_that_give_no_difference(n1: int, n2: int, streams: int) -> None:
    with pytest.raises(ValueError, match="n2 > n1"):
        instructions_per_token(1, 2, n1, n2, streams)


def test_without_valgrind_it_says_so(monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("bench.engine_instructions.shutil.which", lambda name: None)
    assert main(["--repeats", "1"]) == 2
    assert "valgrind not found" in capsys.readouterr().err
