"""The least a Python engine can spend per token on this runtime: the floor under ``engine_path``.

``python -m bench.engine_floor [--steps 2000] [--batch 16]``

Issue 18 goal 1 asks for calserve's host work per token within 2x the HTTP stack's own cost at the
same tokens per event. Part of calserve's cost is not the engine's logic but the device
interaction every engine must do, in Python, per step: build the step's arrays, submit, wait for
the completion, sample, hand each lane's token on. This measures that alone, on the software
runtime with null compute (timing ``none``, the demo package's shapes), ``--batch`` lanes that
continue forever, greedy:

1. ``sync``: a plain loop — submit, ``Job.wait`` (the runtime's blocking wait), one numpy argmax for
   the batch;
2. ``trio``: the same loop as a trio task waiting on the engine's completion fd
   (:class:`~calserve.engine.backend_waits.CompletionFdWaiter`, as the engine does), each lane's
   token appended to its stream's list, and ``--batch`` consumer tasks each woken once per
   ``--group`` tokens (as grouped SSE streams are).

Prints µs of CPU per token: the process (the simulated device's threads included: null logits,
checksums, their spin before sleeping) and the Python thread alone (``time.thread_time``). Compare
the Python thread's figure with ``bench.engine_path`` (the whole engine, actor and stream writer)
and with ``http-floor``'s floor per token.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import trio
import trio.testing

__all__ = ["main", "run"]


def _open(batch: int, steps: int) -> tuple[Any, Any, list[int]]:
    from bench.scenario_lib import calserve_config
    from calserve.config import decode_config
    from calserve.models.source import load_sources
    from calserve.runtime import Device, ProfileSpec

    cfg = decode_config(calserve_config(profiles=[1, 4, 8, 16], timing="none", null_compute=True))
    src = next(iter(load_sources(cfg).values()))
    dev = Device.open("sim-next", null_compute=True)
    cb = dev.load_calbin(src.model_config, src.weights, ProfileSpec(batch, steps + 16, batch))
    seqs = [cb.create_sequence() for _ in range(batch)]
    for s in seqs:
        cb.submit_prefill(s, np.arange(300, 304, dtype=np.int32)).wait(10.0)
    return dev, cb, seqs


def _figures(t_proc: float, t_thread: float, t_wall: float, steps: int, batch: int) -> dict[str, float]:
    tokens = steps * batch
    return {"us_per_token_process": t_proc / tokens * 1e6,
            "us_per_token_python_thread": t_thread / tokens * 1e6,
            "us_per_step_wall": t_wall / steps * 1e6}


def _clocks() -> tuple[float, float, float]:
    return time.process_time(), time.thread_time(), time.perf_counter()


def _step_arrays(cb: Any, seqs: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The first decode step's sequence ids, tokens, positions and valid flags (every lane)."""
    b = len(seqs)
    return (np.array(seqs, np.int32), np.full(b, 300, np.int32),
            np.array([cb.committed_len(s) for s in seqs], np.int32), np.ones(b, np.uint8))


def _sync(cb: Any, seqs: list[int], steps: int) -> tuple[float, float, float]:
    sid, toks, pos, valid = _step_arrays(cb, seqs)
    p0, th0, w0 = _clocks()
    for _ in range(steps):
        r = cb.submit_decode(sid, toks, pos, valid).wait(10.0)
        toks = r.logits.argmax(axis=1).astype(np.int32)
        pos += 1
    p1, th1, w1 = _clocks()
    return p1 - p0, th1 - th0, w1 - w0


async def _trio(dev: Any, cb: Any, seqs: list[int], steps: int, group: int
                ) -> tuple[tuple[float, float, float], int, int]:
    from calserve.engine.backend_waits import CompletionFdWaiter
    from calserve.runtime.types import JobEngine

    fd = dev.completion_fd(JobEngine.PING)
    if fd is None:
        raise SystemExit("engine_floor: this runtime has no completion fd")
    waiter = CompletionFdWaiter(fd)
    sid, toks, pos, valid = _step_arrays(cb, seqs)
    b = len(seqs)
    bufs: list[list[int]] = [[] for _ in range(b)]
    parked: list[trio.lowlevel.Task | None] = [None] * b
    received = 0

    def _abort(_: Any) -> trio.lowlevel.Abort:
        return trio.lowlevel.Abort.SUCCEEDED

    async def consumer(k: int) -> None:
        nonlocal received
        while True:
            parked[k] = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(_abort)
            received += len(bufs[k])
            bufs[k].clear()

    async with trio.open_nursery() as nursery:
        for k in range(b):
            nursery.start_soon(consumer, k)
        await trio.testing.wait_all_tasks_blocked()
        p0, th0, w0 = _clocks()
        for _ in range(steps):
            job = cb.submit_decode(sid, toks, pos, valid, JobEngine.PING)
            r = await waiter.wait(job, 10.0)
            assert r is not None
            toks = r.logits.argmax(axis=1).astype(np.int32)
            pos += 1
            for k, t in enumerate(toks.tolist()):
                buf = bufs[k]
                buf.append(t)
                task = parked[k]
                if task is not None and len(buf) >= group:
                    parked[k] = None
                    trio.lowlevel.reschedule(task)
        p1, th1, w1 = _clocks()
        await trio.testing.wait_all_tasks_blocked()  # the last woken consumers take their tokens
        nursery.cancel_scope.cancel()
    return (p1 - p0, th1 - th0, w1 - w0), received, sum(map(len, bufs))


def run(steps: int = 2000, batch: int = 16, group: int = 16) -> dict[str, dict[str, float]]:
    """Both loops' figures (module docstring), each on its own freshly opened device; the trio
    loop's also counts the tokens its consumers took (``tokens_delivered``) and those left in the
    lists at the end, short of a group (``tokens_left``)."""
    out: dict[str, dict[str, float]] = {}
    dev, cb, seqs = _open(batch, steps)
    try:
        out["sync"] = _figures(*_sync(cb, seqs, steps), steps, batch)
    finally:
        dev.close()
    dev, cb, seqs = _open(batch, steps)
    try:
        t, delivered, left = trio.run(_trio, dev, cb, seqs, steps, group)
    finally:
        dev.close()
    out["trio"] = {**_figures(*t, steps, batch), "tokens_delivered": float(delivered),
                   "tokens_left": float(left)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16, help="lanes (a compiled batch of the demo package)")
    ap.add_argument("--group", type=int, default=16, help="trio loop: tokens per consumer wake-up")
    a = ap.parse_args(argv)
    from bench.server import BENCH_OUT

    os.environ.setdefault("CALSERVE_HOME", str(BENCH_OUT / ".home"))
    for name, f in run(a.steps, a.batch, a.group).items():
        print(f"engine_floor {name}: {f['us_per_token_process']:.2f} µs CPU per token (process), "
              f"{f['us_per_token_python_thread']:.2f} µs the Python thread; "
              f"{f['us_per_step_wall']:.0f} µs wall per step (B{a.batch}, null compute)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
