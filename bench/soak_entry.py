"""The soak's memory probe: ``bench.serve_entry`` plus a sampler thread inside the serving process.

``python -m bench.soak_entry --config FILE --port N`` serves exactly like :mod:`bench.serve_entry`
(same PID, same code path) and, when ``SOAK_PROBE=PATH`` is set, appends one JSON line per
``SOAK_PROBE_INTERVAL_S`` (default 1 s) to PATH, so RSS growth can be split into its owners:

- ``rss``: resident set (``/proc/self/statm``), what the soak reports;
- ``malloc_*``: glibc ``mallinfo2()`` — ``arena`` (brk heap), ``in_use`` (live small/medium chunks),
  ``free`` (free chunks kept in the arenas), ``mmap`` (live chunks of their own mapping: big C
  buffers such as the runtime's 1 MiB KV sequences, numpy arrays over 128 KiB);
- ``py_blocks``: ``sys.getallocatedblocks()`` (live pymalloc objects — a Python-object leak climbs
  here), ``gc_count``/``gc_collections`` (generation counters and collections so far),
  ``gc_frozen`` (objects ``gc.freeze()`` moved to the permanent generation).

Every ``SOAK_PROBE_DEEP_S`` seconds (0 = never, the default) it also writes a ``deep`` record:
the top object-type count deltas since the previous deep sample (``gc.get_objects()``), and —
with ``SOAK_GARBAGE=1``, a full collection under ``gc.DEBUG_SAVEALL`` whose
garbage is counted by type (what the raised threshold was keeping; this collects, so it changes the
policy under test), and when ``SOAK_TRACEMALLOC=1`` (slows the server ~2×, diagnosis only) — the top tracemalloc line
deltas. (The debugging trace's size is the config key ``server.trace_events``.)
``SOAK_GC`` picks the collector policy under test:

- ``serving`` (default): whatever calserve does (:func:`calserve.engine.backend.tune_gc_for_serving`);
- ``default``: CPython's thresholds, no ``gc.freeze()`` (the comparison run;
  ``runtime.gc_gen0_threshold: 0`` in the config the probe writes);
- ``gen0:N``: the serving policy with gen0 threshold N (``runtime.gc_gen0_threshold: N``);
- ``collect:S``: serving policy plus a full ``gc.collect()`` by the probe every S seconds (measures
  how much of the growth is unreachable cyclic garbage the raised threshold lets pile up).

Nothing here is imported by calserve; it exists only for ``bench.scenarios soak`` and the
``bench.soak_probe`` comparisons.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["mallinfo", "main"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc_mallinfo2() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _libc_mallinfo2()


def mallinfo() -> dict[str, int]:
    """glibc's allocator figures (empty when not glibc ≥ 2.33)."""
    if _MALLINFO2 is None:
        return {}
    m = _MALLINFO2()
    return {"malloc_arena": int(m.arena), "malloc_in_use": int(m.uordblks),
            "malloc_free": int(m.fordblks), "malloc_mmap": int(m.hblkhd),
            "malloc_mmap_chunks": int(m.hblks)}


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _type_counts() -> collections.Counter[str]:
    c: collections.Counter[str] = collections.Counter()
    for o in gc.get_objects():
        t = type(o)
        c[f"{t.__module__}.{t.__qualname__}"] += 1
    return c


def _cycle_examples(garbage: list[Any], n: int = 8) -> list[str]:
    """Short reprs of the garbage's non-container objects (frames, coroutines, exceptions, class
    instances), which usually name the cycle's owner."""
    out: list[str] = []
    for o in garbage:
        if isinstance(o, (tuple, list, dict, set, frozenset)) or type(o).__name__ in ("cell", "function"):
            continue
        try:
            r = repr(o)
        except Exception:  # noqa: BLE001 - diagnosis only
            r = f"<{type(o).__qualname__}>"
        out.append(r[:160])
        if len(out) >= n:
            break
    return out


class _GcTimer:
    """``gc.callbacks`` hook: count, total and max pause of the collections per generation (the
    cost a GC policy puts on the event loop, where every collection of this process runs)."""

    def __init__(self) -> None:
        self.n = [0, 0, 0]
        self.total_ms = [0.0, 0.0, 0.0]
        self.max_ms = [0.0, 0.0, 0.0]
        self.collected = [0, 0, 0]
        self.cpu_max_ms = [0.0, 0.0, 0.0]  # thread CPU time: the pause without other processes' share
        self._t0 = 0.0
        self._c0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            self._c0 = time.thread_time()
            return
        g = info["generation"]
        ms = (time.perf_counter() - self._t0) * 1e3
        self.cpu_max_ms[g] = max(self.cpu_max_ms[g], (time.thread_time() - self._c0) * 1e3)
        self.n[g] += 1
        self.total_ms[g] += ms
        self.max_ms[g] = max(self.max_ms[g], ms)
        self.collected[g] += info.get("collected", 0)

    def figures(self) -> dict[str, Any]:
        return {"gc_n": list(self.n), "gc_total_ms": [round(x, 2) for x in self.total_ms],
                "gc_max_ms": [round(x, 2) for x in self.max_ms],
                "gc_cpu_max_ms": [round(x, 2) for x in self.cpu_max_ms], "gc_freed": list(self.collected)}


GC_TIMER = _GcTimer()


class _Probe:
    """The sampler thread (daemon: it never holds the process open)."""

    def __init__(self, path: Path, interval: float, deep_s: float, collect_s: float,
                 garbage: bool = False) -> None:
        self.garbage = garbage
        self.path = path
        self.interval = interval
        self.deep_s = deep_s
        self.collect_s = collect_s
        self.t0 = time.monotonic()
        self.prev_types: collections.Counter[str] | None = None
        self.prev_snap: Any = None

    def run(self) -> None:
        next_deep = self.t0 + self.deep_s if self.deep_s else float("inf")
        next_collect = self.t0 + self.collect_s if self.collect_s else float("inf")
        with self.path.open("a") as f:
            while True:
                now = time.monotonic()
                rec: dict[str, Any] = {"t": round(now - self.t0, 3), "wall": round(time.time(), 3)}
                if now >= next_collect:
                    c0 = time.perf_counter()
                    rec["collected"] = gc.collect()
                    rec["collect_ms"] = round((time.perf_counter() - c0) * 1e3, 2)
                    next_collect = now + self.collect_s
                rec.update(self.sample())
                if now >= next_deep:
                    rec["deep"] = self.deep()
                    next_deep = time.monotonic() + self.deep_s
                f.write(json.dumps(rec) + "\n")
                f.flush()
                time.sleep(self.interval)

    def sample(self) -> dict[str, Any]:
        return {"rss": _rss(), **mallinfo(), "py_blocks": sys.getallocatedblocks(),
                "gc_count": list(gc.get_count()), "gc_threshold": list(gc.get_threshold()),
                "gc_collections": [s["collections"] for s in gc.get_stats()],
                "gc_frozen": gc.get_freeze_count(), **GC_TIMER.figures()}

    def deep(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        types = _type_counts()
        out["objects"] = sum(types.values())
        if self.prev_types is not None:
            d = types.copy()
            d.subtract(self.prev_types)
            out["type_delta_top"] = [(k, v) for k, v in d.most_common(15) if v > 0]
        self.prev_types = types
        if self.garbage:
            # What a full collection would free now, by type (DEBUG_SAVEALL keeps it for a look).
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                out["garbage_collected"] = gc.collect()
                g: collections.Counter[str] = collections.Counter(
                    f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
                out["garbage_top"] = g.most_common(20)
                out["garbage_examples"] = _cycle_examples(gc.garbage)
            finally:
                gc.garbage.clear()
                gc.set_debug(0)
                gc.collect()  # the saved cycles are garbage again: free them now, not next time
        import tracemalloc
        if tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)])
            out["traced_bytes"] = tracemalloc.get_traced_memory()[0]
            if self.prev_snap is not None:
                stats = snap.compare_to(self.prev_snap, "lineno")
                out["trace_delta_top"] = [(str(s.traceback[0]), s.size_diff, s.count_diff)
                                          for s in stats[:15] if s.size_diff > 0]
            self.prev_snap = snap
        return out


def _apply_gc_policy(policy: str) -> float:
    """The probe's periodic-collect interval of the collector policy under test (``default`` and
    ``gen0:N`` are the config key ``runtime.gc_gen0_threshold``, which bench.soak_probe writes)."""
    if policy == "default" or policy.startswith("gen0:"):
        return 0.0
    if policy.startswith("collect:"):
        return float(policy.split(":", 1)[1])
    if policy != "serving":
        raise SystemExit(f"SOAK_GC: unknown policy {policy!r} (serving, default, gen0:N, collect:S)")
    return 0.0


def main(argv: list[str] | None = None) -> int:
    collect_s = _apply_gc_policy(os.environ.get("SOAK_GC", "serving"))
    path = os.environ.get("SOAK_PROBE")
    if os.environ.get("SOAK_TRACEMALLOC") == "1":
        import tracemalloc
        tracemalloc.start(1)
    if path:
        gc.callbacks.append(GC_TIMER)
        probe = _Probe(Path(path), float(os.environ.get("SOAK_PROBE_INTERVAL_S", "1")),
                       float(os.environ.get("SOAK_PROBE_DEEP_S", "0")), collect_s,
                       garbage=os.environ.get("SOAK_GARBAGE") == "1")
        threading.Thread(target=probe.run, name="soak-probe", daemon=True).start()
    from bench.serve_entry import main as serve_main
    return serve_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
