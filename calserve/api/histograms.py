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

__all__ = ["observe_many"]


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
