"""The per-token shortcuts of the host path (issue 18) against the general code they stand for:
the actor's plain token step (a request without stop strings) against the general step, and the
stream's fast :func:`~calserve.engine.types.token_event` against ``TokenEvent(...)``."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from calserve.engine.actor import _TokenStep
from calserve.engine.state import Tokens
from calserve.engine.stream import StreamWriter
from calserve.engine.types import FinishReason, SamplingParams, TokenEvent, TokenLogprob, token_event

from tests.engine.helpers import CharTokenizer

_lp = st.builds(TokenLogprob, st.integers(0, 500), st.floats(-50, 0),
                st.lists(st.tuples(st.integers(0, 500), st.floats(-50, 0)), max_size=3).map(tuple))


@given(st.lists(st.integers(0, 10**6), max_size=20).map(tuple), st.text(max_size=30),
       st.none() | st.lists(_lp, max_size=4).map(tuple))
def test_token_event_is_the_same_object_as_the_dataclass(ids: tuple[int, ...], text: str,
                                                          lps: tuple[TokenLogprob, ...] | None
                                                          ) -> None:
    ref = TokenEvent(ids, text, lps)
    ev = token_event(ids, text, lps)
    assert type(ev) is TokenEvent and ev == ref and hash(ev) == hash(ref) and repr(ev) == repr(ref)
    assert dataclasses.astuple(ev) == dataclasses.astuple(ref)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.text = "x"  # type: ignore[misc]


def _seq(sp: SamplingParams) -> Any:
    return types.SimpleNamespace(req=types.SimpleNamespace(sampling=sp))


_msgs = st.lists(st.tuples(st.integers(0, 120), st.booleans(), st.booleans()), max_size=40)


@given(_msgs, st.integers(0, 41), st.integers(0, 40), st.booleans())
def test_plain_step_equals_the_general_step(msgs: list[tuple[int, bool, bool]], abandon_at: int,
                                            min_tokens: int, with_lp: bool) -> None:
    """Same writer contents, counts and requests to the actor task, token by token, whether the
    consumer stays or goes (``abandon_at``) mid-stream."""
    sp = SamplingParams(min_tokens=min_tokens, max_tokens=64)
    outs = []
    for plain in (True, False):
        w = StreamWriter()
        step = _TokenStep(_seq(sp), w, CharTokenizer())
        assert (step.on_tokens == step._step_plain) and step._stops is None
        run = step._step_plain if plain else step._step
        trace = []
        for i, (tok, hidden, first) in enumerate(msgs):
            if i == abandon_at:
                w._give_up()  # the consumer went away (aclose / cut)
            lp = TokenLogprob(tok, -1.0) if with_lp else None
            wanted = run(Tokens(tok, lp, first, hidden))
            trace.append((wanted, step.completion, step.stop_wanted, step.stopped))
            if wanted:
                step.stop_wanted = None  # what the actor task does once it told the engine
        st_ = w.statistics()
        outs.append((trace, list(w._ids), list(w._texts), w._lps, st_.tokens_put, st_.coalesced,
                     st_.abandoned, step.tail()))
    assert outs[0] == outs[1]
    trace = outs[0][0]
    if abandon_at < len(msgs) and any(not h for _, h, _ in msgs[abandon_at:]):
        assert any(t[2] is FinishReason.CANCELLED or t[0] for t in trace[abandon_at:])
