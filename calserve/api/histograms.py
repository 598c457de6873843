"""One histogram update for ``n`` equal observations (the stream pump's per-batch ITL update).

``prometheus_client``'s ``Histogram.observe`` takes one value: the pump observed the same gap once
per token of a batch (a locked ``inc`` on the sum and one on a bucket, plus a linear bucket search,
per token). :func:`observe_many` does the same arithmetic once: the sum grows by ``n * amount``, the
bucket ``amount`` falls in by ``n`` — exactly the state ``n`` calls of ``observe(amount)`` leave. It
relies on the histogram child's ``_upper_bounds``/``_buckets``/``_sum`` (stable in
prometheus_client 0.x); without them it falls back to ``n`` plain observations.
"""

from __future__ import annotations

import bisect
from typing import Any

__all__ = ["observe_many", "ManyObserver", "counter_inc"]


def observe_many(hist: Any, amount: float, n: int) -> None:
    """``n`` times ``hist.observe(amount)`` (``hist``: a labelled Histogram child), in one update."""
    if n <= 0:
        return
    bounds = getattr(hist, "_upper_bounds", None)
    buckets = getattr(hist, "_buckets", None)
    total = getattr(hist, "_sum", None)
    if n == 1 or bounds is None or buckets is None or total is None or amount != amount:
        for _ in range(n):
            hist.observe(amount)
        return
    total.inc(amount * n)
    i = bisect.bisect_left(bounds, amount)  # the first bucket with amount <= bound
    if i < len(buckets):
        buckets[i].inc(n)


class ManyObserver:
    """:func:`observe_many` on one histogram child, its internals looked up once (the stream
    pump's per-batch call; one stream, one child). ``n`` = 1 takes the same direct update, which
    is what ``observe`` does for a finite amount without an exemplar: the sum grows by the amount,
    the first bucket whose bound is >= it by one."""

    __slots__ = ("_hist", "_bounds", "_buckets", "_sum", "_direct")

    def __init__(self, hist: Any) -> None:
        self._hist = hist
        self._bounds = getattr(hist, "_upper_bounds", None)
        self._buckets = getattr(hist, "_buckets", None)
        self._sum = getattr(hist, "_sum", None)
        self._direct = (self._bounds is not None and self._buckets is not None
                        and self._sum is not None)

    def observe(self, amount: float, n: int = 1) -> None:
        if n <= 0:
            return
        if not self._direct or amount != amount:
            observe_many(self._hist, amount, n)
            return
        self._sum.inc(amount * n if n != 1 else amount)  # type: ignore[union-attr]
        buckets = self._buckets
        i = bisect.bisect_left(self._bounds, amount)  # type: ignore[arg-type]
        if i < len(buckets):  # type: ignore[arg-type]
            buckets[i].inc(n)  # type: ignore[index]


def counter_inc(counter: Any) -> Any:
    """The counter child's increment for amounts >= 0: its value's own ``inc`` (what
    ``Counter.inc`` ends in, minus the checks), else ``counter.inc``."""
    value = getattr(counter, "_value", None)
    inc = getattr(value, "inc", None)
    return inc if inc is not None else counter.inc
