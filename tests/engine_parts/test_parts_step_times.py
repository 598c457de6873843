"""StepTimes keeps its window sorted as it goes (no sort per P99): the same P99s, published at the
same jobs, as sorting the last WINDOW times each time, for any sequence of times and keys."""

from __future__ import annotations

import collections
import math
import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from calserve.engine import step_times
from calserve.engine.step_times import P99_MIN_SAMPLES, WINDOW, StepTimes


def _reference(samples: list[tuple[int, float]]) -> list[float | None]:
    """What each add returns, recomputed from scratch: the window sorted at every republish."""
    windows: dict[int, collections.deque[float]] = {}
    fresh: dict[int, int] = collections.Counter()
    out: list[float | None] = []
    for key, t in samples:
        w = windows.setdefault(key, collections.deque(maxlen=WINDOW))
        w.append(t)
        fresh[key] += 1
        if fresh[key] >= step_times._RECOMPUTE and len(w) >= P99_MIN_SAMPLES:  # noqa: SLF001
            fresh[key] = 0
            s = sorted(w)
            out.append(s[min(len(s) - 1, max(0, math.ceil(0.99 * len(s)) - 1))])
        else:
            out.append(None)
    return out


# Few distinct values (repeats: bisecting equal times) and long runs (the window wraps several times).
_times = st.one_of(st.sampled_from([0.001, 0.002, 0.004, 0.004, 0.5]),
                   st.floats(min_value=0.0, max_value=10.0, allow_nan=False))


# Runs of one key and value, some long: a key's window wraps (WINDOW = 512) within one example.
_runs = st.lists(st.tuples(st.integers(0, 2), _times, st.one_of(st.integers(1, 40), st.integers(300, 700))),
                 min_size=0, max_size=12)


@settings(max_examples=80, deadline=None)
@given(_runs, st.randoms(use_true_random=False))
@example([(0, 0.004, 700), (1, 0.5, 30), (0, 0.001, 400), (0, 9.0, 20)], random.Random(1))
def test_sorted_window_gives_the_same_p99s(runs: list[tuple[int, float, int]], rnd: random.Random) -> None:
    samples = []
    for key, x, n in runs:  # a run's values jitter around x, so the window holds many distinct ones
        samples += [(key, x * (1.0 + rnd.random() / 8) if rnd.random() < 0.5 else x) for _ in range(n)]
    t = StepTimes(hang_factor=20.0, hang_min_s=1.0, max_wait_s=30.0)
    got = [t.add("decode", key, x) for key, x in samples]
    assert got == _reference(samples)
    for key in {k for k, _ in samples}:
        w = t._w[("decode", key)]  # noqa: SLF001 - the invariant itself
        assert w.ordered == sorted(w.times) and len(w.times) == min(WINDOW, sum(k == key for k, _ in samples))
        assert t.samples("decode", key) == len(w.times)
