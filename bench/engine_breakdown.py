"""Where the engine's time per decode step goes: ``bench.engine_path``'s workload with its stages timed.

``python -m bench.engine_breakdown [--streams 64] [--tokens 256] [--hold-ms 0]``

The same run as :mod:`bench.engine_path` (the real engine over the software runtime with null compute
and timing ``none``, the demo package, profiles B1..B16 with PING/PONG, ``--streams`` greedy
requests of ``--tokens`` tokens submitted at once, each read through ``receive_many``), with a
timing wrapper around each synchronous stage of the decode step below: wall time inside the stage
(``perf_counter_ns``), minus the wrappers' own cost (calibrated on a no-op, subtracted for the
stage's own call and for every wrapped call nested inside it). Inclusive figures: a stage's time
contains the stages it calls (``EngineCore._pass`` contains ``Planner.dispatch``, which contains
``JobBuilder.decode_batch``; ``StepHandler.complete`` contains ``_ok_decode``).

Prints per stage its calls per decode job, µs per job and µs per token, beside the run's whole
process CPU per token (as ``engine_path`` prints it: the wrappers add to that figure, the table says
by how much). What it answers that ``engine_path`` does not: how much of a token's cost is paid once
per step (planning, sampling, the submit, the completion's bookkeeping) and how much per token (the
per-lane loop, the actor / detokenizer / stream writer chain). A diagnostic: stage names are the
engine's private ones and move with the code.
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["main"]

# (module, attribute path, label): the stages timed. A module-level function is patched in the
# modules that call it (``from x import f`` binds the name there).
STAGES: list[tuple[str, str, str]] = [
    ("calserve.engine.core", "EngineCore.fast_decode", "core.fast_decode (continue or rotate? + sample)"),
    ("calserve.engine.core", "EngineCore.finish_fast", "core.finish_fast (fast step's bookkeeping)"),
    ("calserve.engine.core", "EngineCore.on_completion", "core.on_completion (general path)"),
    ("calserve.engine.core", "EngineCore._pass", "core._pass (admit, expire, plan)"),
    ("calserve.engine.rotation", "Rotation.may", "rotation.may (nothing else for the pass?)"),
    ("calserve.engine.rotation", "Rotation.next", "rotation.next (pick, replay, commit)"),
    ("calserve.engine.planner", "Planner.rotation_pick", "planner.rotation_pick"),
    ("calserve.engine.planner", "single_tenant_lanes", "batch_fast.single_tenant_lanes (planner)"),
    ("calserve.engine.core", "_housekeeping", "core._housekeeping (slicer, expiry, admission)"),
    ("calserve.engine.planner", "Planner.commit_rotation", "planner.commit_rotation"),
    ("calserve.engine.batches", "JobBuilder.picked_batch", "builder.picked_batch (the job)"),
    ("calserve.engine.planner", "Planner.dispatch", "planner.dispatch"),
    ("calserve.engine.batches", "JobBuilder.decode_batch", "builder.decode_batch (pick + build)"),
    ("calserve.engine.batches", "JobBuilder.continuation", "builder.continuation"),
    ("calserve.engine.steps", "StepHandler.complete", "steps.complete (verify, sample, lanes)"),
    ("calserve.engine.steps", "StepHandler._ok_decode", "steps._ok_decode (per-lane loop)"),
    ("calserve.engine.steps", "StepHandler.flush", "steps.flush (actor, detok, stream per token)"),
    ("calserve.engine.steps", "sample", "completion.sample (via steps)"),
    ("calserve.engine.core", "sample", "completion.sample (via core)"),
    ("calserve.runtime.device", "Calbin.submit_decode", "runtime submit_decode"),
    ("calserve.runtime.device", "Job.result_nowait", "runtime result_nowait"),
    ("calserve.engine.fault_watch", "FaultWatch.observe", "fault_watch.observe"),
]


class _Timer:
    def __init__(self) -> None:
        self.ns: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.nested: collections.Counter[str] = collections.Counter()
        self.depth_calls = 0  # wrapped calls so far (to count the ones nested in a call)
        self.overhead_ns = 0.0

    def wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        pc = time.perf_counter_ns
        ns, calls, nested = self.ns, self.calls, self.nested

        def timed(*args: Any, **kw: Any) -> Any:
            before = self.depth_calls
            self.depth_calls = before + 1
            t0 = pc()
            try:
                return fn(*args, **kw)
            finally:
                ns[label] += pc() - t0
                calls[label] += 1
                nested[label] += self.depth_calls - before - 1

        return timed

    def calibrate(self) -> None:
        probe = self.wrap(lambda: None, "_probe")
        n = 200_000
        t0 = time.perf_counter_ns()
        for _ in range(n):
            probe()
        loop = time.perf_counter_ns()
        for _ in range(n):
            pass
        bare = time.perf_counter_ns() - loop
        # the wrapper's cost as the caller of a wrapped stage sees it (the time outside fn)
        self.overhead_ns = max(0.0, (loop - t0 - bare) / n)
        for c in (self.ns, self.calls, self.nested):
            c.pop("_probe", None)
        self.depth_calls = 0


def _install(timer: _Timer) -> None:
    import importlib

    for mod_name, path, label in STAGES:
        mod = importlib.import_module(mod_name)
        owner: Any = mod
        parts = path.split(".")
        for p in parts[:-1]:
            owner = getattr(owner, p)
        setattr(owner, parts[-1], timer.wrap(getattr(owner, parts[-1]), label))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_breakdown", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hold-ms", type=float, default=0.0,
                    help="each consumer waits this long after a read (engine_path --hold-ms)")
    a = ap.parse_args(argv)
    from bench.engine_path import measure
    from bench.server import BENCH_OUT

    os.environ.setdefault("CALSERVE_HOME", str(BENCH_OUT / ".home"))
    plain = measure(a.streams, a.tokens, 1, a.hold_ms)["us_per_token"]  # unwrapped (and a warm-up)
    timer = _Timer()
    timer.calibrate()
    _install(timer)
    wrapped = measure(a.streams, a.tokens, 1, a.hold_ms)
    us, per_read = wrapped["us_per_token"], wrapped["tokens_per_read"]
    tokens = a.streams * a.tokens
    steps = timer.calls["runtime submit_decode"] or 1
    print(f"{Path(__file__).stem}: {a.streams} streams x {a.tokens} tokens, {steps} decode jobs "
          f"({tokens / steps:.1f} tokens a job); process CPU {plain:.2f} µs a token unwrapped, "
          f"{us:.2f} wrapped ({timer.overhead_ns:.0f} ns a wrapped call, subtracted below)"
          + (f"; held {a.hold_ms:g} ms a read, {per_read:.1f} tokens a read" if a.hold_ms else ""))
    print(f"{'stage (inclusive)':48s} {'calls/job':>9s} {'µs/job':>8s} {'µs/token':>9s}")
    rows = []
    for _, _, label in STAGES:
        n = timer.calls[label]
        if not n:
            continue
        ns = timer.ns[label] - timer.overhead_ns * (n + timer.nested[label])
        rows.append((label, n / steps, ns / steps / 1e3, ns / tokens / 1e3))
    for label, per_job, us_job, us_tok in rows:
        print(f"{label:48s} {per_job:9.2f} {us_job:8.1f} {us_tok:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
