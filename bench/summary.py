"""Per-request records and the summary computed from them (pure; no I/O besides helpers to read/write).

Definitions follow vLLM's ``bench serve`` so numbers compare with the field:
- TTFT: request sent -> first content event. TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request.
  ITL: gaps between consecutive content events, pooled over requests. E2E: sent -> last byte.
- Throughput: completed requests (and their output tokens) / the run's duration (first send to last
  answer). Goodput (DistServe): completed requests meeting every given SLO / duration.
- Outcomes: ``ok`` (200, stream ended cleanly), ``rejected`` (429/503: the server said "not now"),
  ``failed`` (anything else, incl. an error event mid-stream), ``disconnected`` (the client hung up on
  purpose), ``timeout`` (cut by the run's hard deadline). Every sent request has exactly one outcome.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

__all__ = ["Record", "OUTCOMES", "latency_stats", "summarize", "write_records", "read_records",
           "service_over_time"]

OUTCOMES = ("ok", "rejected", "failed", "disconnected", "timeout")


class Record(msgspec.Struct, kw_only=True):
    index: int
    tenant: str
    outcome: str = "failed"
    status: int = 0  # HTTP status; 0 = no response
    error: str | None = None
    planned: float = 0.0  # planned send time, s from run start
    start: float = 0.0  # actual send time, s from run start
    ttft: float | None = None  # s (streaming only)
    e2e: float | None = None  # s
    # Arrival time of each content event, s from this request's start (rounded to 1 µs).
    token_times: list[float] = msgspec.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    # Bytes of the content events on the wire (``data: ...\n\n``), for event-size comparisons.
    content_bytes: int = 0

    @property
    def tpot(self) -> float | None:
        if self.outcome != "ok" or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def write_records(path: Path, records: Iterable[Record]) -> None:
    enc = msgspec.json.Encoder()
    with path.open("wb") as f:
        for r in records:
            f.write(enc.encode(r) + b"\n")


def read_records(path: Path) -> list[Record]:
    dec = msgspec.json.Decoder(Record)
    return [dec.decode(line) for line in path.read_bytes().splitlines() if line.strip()]


def latency_stats(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | int]:
    """mean/p50/p90/p99/min/max (in ms by default) and the count; NaN-free: empty -> count 0 only."""
    if not values:
        return {"count": 0}
    a = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "count": int(a.size),
        "mean": float(a.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "min": float(a.min()),
        "max": float(a.max()),
    }


def _tokens_per_event(r: Record) -> float:
    return r.output_tokens / len(r.token_times) if r.token_times and r.output_tokens else 1.0


def service_over_time(
    records: Sequence[Record], bin_s: float, duration: float
) -> dict[str, list[float]]:
    """Output tokens delivered per tenant per time bin (tokens/s), counting every delivered event,
    including those of requests that later failed or were disconnected (service is what arrived)."""
    nbins = max(1, math.ceil(duration / bin_s))
    out: dict[str, list[float]] = {}
    for r in records:
        row = out.setdefault(r.tenant, [0.0] * nbins)
        if not r.token_times:
            if r.outcome == "ok" and r.e2e is not None and r.output_tokens:  # non-streaming
                b = min(nbins - 1, int((r.start + r.e2e) / bin_s))
                row[b] += r.output_tokens / bin_s
            continue
        w = _tokens_per_event(r) / bin_s
        for t in r.token_times:
            b = min(nbins - 1, max(0, int((r.start + t) / bin_s)))
            row[b] += w
    return out


def summarize(
    records: Sequence[Record],
    *,
    duration: float | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    bin_s: float = 1.0,
    window: tuple[float, float] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary document (JSON-able). ``duration`` defaults to first send -> last answer.

    ``window`` (s from run start) adds the steady-state output throughput: every output token whose
    event arrived inside the window, over its length. Closed-loop saturation runs use it so the ramp-up
    and the drain tail (when fewer and fewer requests remain) do not dilute the figure."""
    ends = [r.start + (r.e2e or 0.0) for r in records]
    if duration is None:
        duration = (max(ends) - min(r.start for r in records)) if records else 0.0
    dur = max(duration, 1e-9)
    ok = [r for r in records if r.outcome == "ok"]
    outcomes = Counter(r.outcome for r in records)
    by_status = Counter(str(r.status) for r in records)
    errors = Counter((r.error or "")[:120] for r in records if r.error)
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    e2es = [r.e2e for r in ok if r.e2e is not None]

    def meets(r: Record) -> bool:
        if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > slo_ttft_ms):
            return False
        tp = r.tpot
        return not (slo_tpot_ms is not None and tp is not None and tp * 1000 > slo_tpot_ms)

    good = sum(1 for r in ok if meets(r))
    tenants: dict[str, Any] = {}
    for name in sorted({r.tenant for r in records}):
        rs = [r for r in records if r.tenant == name]
        rok = [r for r in rs if r.outcome == "ok"]
        delivered = sum(
            r.output_tokens if r.outcome == "ok" else _tokens_per_event(r) * len(r.token_times)
            for r in rs
        )
        tenants[name] = {
            "sent": len(rs),
            "outcomes": dict(Counter(r.outcome for r in rs)),
            "output_tokens_delivered": delivered,
            "output_throughput": delivered / dur,
            "ttft_ms": latency_stats([r.ttft for r in rok if r.ttft is not None]),
            "tpot_ms": latency_stats([t for t in (r.tpot for r in rok) if t is not None]),
        }
    total_delivered = sum(t["output_tokens_delivered"] for t in tenants.values()) or 1.0
    for t in tenants.values():
        t["share"] = t["output_tokens_delivered"] / total_delivered
    summary: dict[str, Any] = {
        "duration_s": duration,
        "sent": len(records),
        "outcomes": {k: outcomes.get(k, 0) for k in OUTCOMES},
        "by_status": dict(sorted(by_status.items())),
        "errors": dict(errors.most_common(10)),
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tok / dur,
        "total_token_throughput": (out_tok + in_tok) / dur,
        "output_tokens": out_tok,
        "prompt_tokens": in_tok,
        "ttft_ms": latency_stats(ttfts),
        "tpot_ms": latency_stats(tpots),
        "itl_ms": latency_stats(itls),
        "e2e_ms": latency_stats(e2es),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "goodput": good / dur,
        "good_requests": good,
        "tenants": tenants,
        "service_over_time": {"bin_s": bin_s,
                              "tokens_per_s": service_over_time(records, bin_s, duration)},
    }
    if window is not None:
        w0, w1 = window
        tok = 0.0
        for r in records:
            w = _tokens_per_event(r)
            tok += sum(w for t in r.token_times if w0 <= r.start + t < w1)
        # TPOT of the requests sent inside the window: steady state, without the ramp-up's
        # requests (which queue behind each other's prefills while the server fills up)
        steady_tpots = [t for r in records if w0 <= r.start < w1 and (t := r.tpot) is not None]
        summary["window"] = {"start_s": w0, "end_s": w1, "output_tokens": tok,
                             "output_throughput": tok / max(1e-9, w1 - w0),
                             "tpot_ms": latency_stats(steady_tpots)}
    if extra:
        summary.update(extra)
    return summary


def ratio_or_none(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b

