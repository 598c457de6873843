"""StopMatcher: the Aho-Corasick matcher gives exactly the answers of the plain search it replaced,
and its per-token cost does not grow with the number or the length of the stop strings (hostile
input: the schema allows 16 stops of 256 characters, checked on every token of the stream)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.engine import detok
from calserve.engine.detok import StopMatcher


class _Reference:
    """The previous StopMatcher (a search per stop string and per held suffix length): the spec of
    the answers, not of the cost."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(stops))
        self._maxlen = max((len(s) for s in self._stops), default=0)
        self._buf = ""
        self.matched: str | None = None
        self._done = False

    def feed(self, text: str, *, check: bool = True) -> tuple[str, bool]:
        if self._done:
            return "", self.matched is not None
        if not self._stops:
            return text, False
        if not check:
            out, self._buf = self._buf + text, ""
            return out, False
        buf = self._buf + text
        best: tuple[int, int] | None = None
        for s in self._stops:
            i = buf.find(s)
            if i >= 0:
                key = (i + len(s), -len(s))
                if best is None or key < best:
                    best, self.matched = key, s
        if best is not None:
            end, neg_len = best
            self._done = True
            self._buf = ""
            return buf[: end + neg_len], True
        hold = 0
        for n in range(min(len(buf), self._maxlen - 1), 0, -1):
            if any(s.startswith(buf[-n:]) for s in self._stops):
                hold = n
                break
        self._buf = buf[len(buf) - hold:]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        self._done = True
        return "" if self.matched is not None else out


_alphabet = st.sampled_from(list("aab c\n数🎉"))
_stops = st.lists(st.text(_alphabet, min_size=1, max_size=6), max_size=5)
_feeds = st.lists(st.tuples(st.text(_alphabet, max_size=8), st.booleans()), max_size=25)


@settings(max_examples=400)
@given(_stops, _feeds)
def test_same_answers_as_the_plain_search(stops: list[str], feeds: list[tuple[str, bool]]) -> None:
    new, ref = StopMatcher(stops), _Reference(stops)
    for text, unchecked in feeds:
        check = not unchecked or len(text) % 3 != 0  # mostly checked, sometimes not
        assert new.feed(text, check=check) == ref.feed(text, check=check)
        assert new.matched == ref.matched
    assert new.flush() == ref.flush()


def _steps_per_char(stops: Sequence[str], pieces: Sequence[str]) -> float:
    """Python lines executed inside the matcher's module per character fed: a deterministic
    measure of its work (the C-level slicing it does is bounded by the held text)."""
    m = StopMatcher(stops)
    count = 0
    target = detok.__file__

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if frame.f_code.co_filename != target:
            return None
        if event == "line":
            count += 1
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        for p in pieces:
            m.feed(p)
    finally:
        sys.settrace(old)
    assert m.matched is None  # the worst case: never a match, so every token is checked
    return count / sum(len(p) for p in pieces)


# Hostile stops against a model that keeps producing "a": every stop shares a 240+ character
# prefix with the output, so text is held back all along and every character is a candidate end.
_HOSTILE = [("a" * (255 - i)) + chr(ord("b") + i) for i in range(16)]
# ... and against output that keeps breaking a long partial match (the held text collapses).
_BREAKING = ["x" * 255 + "y"] + ["x" * i + "q" for i in range(1, 16)]


def test_cost_per_character_does_not_grow_with_the_stops() -> None:
    plain = _steps_per_char(["\n\n"], ["Hello", " world", ",", " a", " test"] * 200)
    hostile = _steps_per_char(_HOSTILE, ["aaaa"] * 1000)
    breaking = _steps_per_char(_BREAKING, (["xxxx"] * 60 + ["z"]) * 20)
    one_long = _steps_per_char(["a" * 255 + "b"], ["aaaa"] * 1000)
    # A handful of lines per character (an automaton step, plus a per-feed constant spread over
    # the piece's characters), whatever the stops: 16 hostile ones cost what one does. (The plain
    # search it replaced ran up to 16 x 255 suffix tests per token here.)
    for v in (plain, hostile, breaking, one_long):
        assert v < 24, (plain, hostile, breaking, one_long)
    assert hostile <= 1.2 * one_long, (hostile, one_long)


def test_automaton_is_shared_between_requests_with_the_same_stops() -> None:
    a, b = StopMatcher(_HOSTILE), StopMatcher(list(_HOSTILE))
    assert a._auto is b._auto  # noqa: SLF001 - building 4k trie nodes once, not per request


def test_longest_among_stops_completing_at_the_same_place() -> None:
    m = StopMatcher(["bc", "abc", "c"])
    assert m.feed("xab") == ("x", False)
    assert m.feed("cd") == ("", True)  # "x" went out already
    assert m.matched == "abc"
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("abc") == ("a", True) and m.matched == "bc"  # "bc" completes first
