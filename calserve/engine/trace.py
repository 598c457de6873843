"""Timeline: the engine's bounded, timestamped trace ring of device jobs and request phases, and
its export as Chrome trace JSON (``chrome://tracing`` / https://ui.perfetto.dev open it).

Recorded (``server.trace_events`` entries at most, oldest dropped; one tuple each):

- a device job when it completes: engine (PING/PONG), kind (prefill/decode), compiled batch
  (profile), active lanes, job id, submit time, completion time, the time it ran on its engine
  (the runtime's ``device_us``), status (ok, a fault name, ``refused``);
- a request phase: ``queued`` (arrival), ``admitted``, ``first_token``, ``lost`` (a fault lost its
  KV: re-admitted), ``end``.

Times are the engine's trio clock (seconds); the export writes microseconds from the first entry.
In the export a job is a complete event (``ph: X``) on thread ``PING``/``PONG`` of process
``device`` spanning its run on the engine (``queue_us`` in its args says how long it waited from
submit), and a request is a row of async spans (``queued``, ``prefill``, ``decode``) on process
``requests``. :func:`overlap_fraction` (also used by the benches) measures how much of the device's
busy time both engines were running.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

__all__ = ["Timeline", "chrome_trace", "overlap_fraction", "JOB", "REQ"]

JOB: Final = "job"
REQ: Final = "req"

_PID_DEVICE = 1
_PID_REQUESTS = 2


class Timeline:
    def __init__(self, maxlen: int = 4096) -> None:
        self.events: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=maxlen)
        self.enabled = maxlen > 0

    def job(self, engine: str, kind: str, batch: int, lanes: int, job_id: int, submit: float,
            done: float, device_s: float, status: str) -> None:
        if self.enabled:
            self.events.append((JOB, engine, kind, batch, lanes, job_id, submit, done, device_s, status))

    def request(self, ts: float, phase: str, rid: int) -> None:
        if self.enabled:
            self.events.append((REQ, ts, phase, rid))

    def snapshot(self) -> list[tuple[Any, ...]]:
        return list(self.events)


def _job_span(e: Sequence[Any]) -> tuple[float, float]:
    """(start, end) of a job's run on its engine, in seconds."""
    submit, done, device_s = float(e[6]), float(e[7]), float(e[8])
    start = max(submit, done - device_s) if device_s > 0 else submit
    return start, done


def chrome_trace(events: Iterable[Sequence[Any]], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The Chrome trace JSON object (``traceEvents`` + ``displayTimeUnit``) of ``events``."""
    evs = list(events)
    t0 = min((float(e[6]) if e[0] == JOB else float(e[1]) for e in evs), default=0.0)

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    out: list[dict[str, Any]] = [
        {"ph": "M", "pid": _PID_DEVICE, "name": "process_name", "args": {"name": "device"}},
        {"ph": "M", "pid": _PID_REQUESTS, "name": "process_name", "args": {"name": "requests"}},
    ]
    tids: dict[str, int] = {}
    phases: dict[int, dict[str, float]] = collections.defaultdict(dict)
    for e in evs:
        if e[0] == JOB:
            _, engine, kind, batch, lanes, job_id, submit, done, _device, status = e
            tid = tids.get(engine)
            if tid is None:
                tid = tids[engine] = len(tids) + 1
                out.append({"ph": "M", "pid": _PID_DEVICE, "tid": tid, "name": "thread_name",
                            "args": {"name": engine}})
            start, end = _job_span(e)
            out.append({"ph": "X", "pid": _PID_DEVICE, "tid": tid, "cat": "job",
                        "name": f"{kind} B{batch}", "ts": us(start), "dur": round((end - start) * 1e6, 3),
                        "args": {"job_id": job_id, "engine": engine, "profile": batch,
                                 "lanes": lanes, "status": status,
                                 "queue_us": round((start - float(submit)) * 1e6, 3)}})
        else:
            _, ts, phase, rid = e
            p = phases[int(rid)]
            if phase == "lost":
                out.append({"ph": "n", "pid": _PID_REQUESTS, "cat": "request", "id": int(rid),
                            "name": "lost", "ts": us(float(ts))})
            p.setdefault(phase, float(ts))
    for rid, p in sorted(phases.items()):
        marks = [("queued", p.get("queued")), ("prefill", p.get("admitted")),
                 ("decode", p.get("first_token")), (None, p.get("end"))]
        known = [(name, t) for name, t in marks if t is not None]
        for (name, t), (_, t_next) in zip(known, known[1:]):
            if name is None:
                continue
            out.append({"ph": "b", "pid": _PID_REQUESTS, "cat": "request", "id": rid,
                        "name": name, "ts": us(t), "args": {"request_id": rid}})
            out.append({"ph": "e", "pid": _PID_REQUESTS, "cat": "request", "id": rid,
                        "name": name, "ts": us(t_next)})
    doc: dict[str, Any] = {"traceEvents": out, "displayTimeUnit": "ms"}
    if meta:
        doc["otherData"] = dict(meta)
    return doc


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap_fraction(trace: Mapping[str, Any]) -> dict[str, float]:
    """From a Chrome trace of :func:`chrome_trace`: ``overlap`` = the time both engines ran a job /
    the time at least one did (0: the engines serialise or one was idle; 1: full overlap), with
    ``busy_s`` (union) and ``both_s`` (intersection) and per-engine busy time."""
    by_engine: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "job":
            s = float(ev["ts"]) / 1e6
            by_engine[str(ev["args"]["engine"])].append((s, s + float(ev["dur"]) / 1e6))
    unions = {k: _union(v) for k, v in by_engine.items()}
    all_busy = _union([sp for v in unions.values() for sp in v])
    busy = _length(all_busy)
    both = 0.0
    if len(unions) >= 2:
        a, b = unions.get("PING", []), unions.get("PONG", [])
        both = _length(_intersect(a, b))
    res = {"overlap": both / busy if busy > 0 else 0.0, "busy_s": busy, "both_s": both}
    for k, v in unions.items():
        res[f"{k.lower()}_busy_s"] = _length(v)
    return res
