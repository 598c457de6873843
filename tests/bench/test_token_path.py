"""bench/token_path.py: the actor -> SSE path in-process, a token a message or a run a message."""

from __future__ import annotations

import pytest
import trio

from bench.token_path import STREAMS, _run, _tokenizer, main


@pytest.mark.parametrize(("inline", "group", "runs"), [(False, 1, False), (True, 8, False), (True, 8, True),
                                                      (False, 3, True)])
def test_every_stream_takes_every_token(inline: bool, group: int, runs: bool) -> None:
    """Whatever the inbox and however the tokens are sent (one ``Tokens`` each, or a stream's
    tokens between two reads as one ``TokenRun``), every stream writer takes every token."""
    dt, taken = trio.run(_run, _tokenizer(), 20, inline, group, "none", runs)
    assert taken == STREAMS * 20
    assert dt > 0


def test_main_prints_the_run_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--inbox", "inline", "--tokens-per-event", "4", "--run", "--steps", "16", "--reps", "1"]) == 0
    assert "as one TokenRun" in capsys.readouterr().out
