"""Micro-benchmark of the engine's per-token path inside one process, without HTTP.

``python -m bench.engine_path [--streams 64] [--tokens 256] [--reps 3]``

The real engine (:meth:`calserve.engine.engine.Engine.open`) over the software runtime with null
compute and timing ``none`` (the device costs ~nothing), the demo package, profiles B1..B16 with
PING/PONG, as the ``http-floor`` scenario's server: ``--streams`` greedy requests of ``--tokens``
tokens each submitted at once, each consumed through its handle's ``receive_many`` (what the HTTP
pump reads). Prints process CPU µs per token over the whole run (start-up excluded; min over
``--reps``): scheduler, planner, executor, step bookkeeping, sampling, actor, detokenizer and stream
writer — everything of the per-token path but the HTTP layer (``bench.token_path`` has the actor
→ SSE part alone).

On a shared 2-core box CPU times are noisy; instruction counts are not. Under valgrind the
difference between two token counts is the instructions per token::

    for n in 64 128; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python -m bench.engine_path --tokens $n --reps 1 2>&1 | grep Collected; done
    # (Ir(128) - Ir(64)) / (64 * streams) = instructions per token
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import trio

__all__ = ["main"]


async def _run(streams: int, tokens: int, reps: int) -> float:
    from bench.scenario_lib import calserve_config
    from calserve.config import decode_config
    from calserve.engine.engine import Engine
    from calserve.engine.types import FinishEvent, GenerateRequest, SamplingParams

    cfg = decode_config(calserve_config(profiles=[1, 4, 8, 16], timing="none", null_compute=True))
    best = float("inf")
    async with Engine.open(cfg) as eng:
        for _ in range(reps):
            done = 0

            async def one(i: int) -> None:
                nonlocal done
                h = await eng.submit(GenerateRequest(
                    (300 + i % 50, 301, 302, 303), SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                                  temperature=0.0)))
                n = 0
                while True:
                    batch = await h.receive_many()
                    if not batch:
                        break
                    n += sum(len(getattr(ev, "token_ids", ())) for ev in batch)
                    if isinstance(batch[-1], FinishEvent):
                        break
                done += n

            t0 = time.process_time()
            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(one, i)
            dt = time.process_time() - t0
            best = min(best, dt / max(1, done) * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    from bench.server import BENCH_OUT

    os.environ.setdefault("CALSERVE_HOME", str(BENCH_OUT / ".home"))
    us: Any = trio.run(_run, a.streams, a.tokens, a.reps)
    print(f"{Path(__file__).stem}: {us:.2f} µs CPU per token (engine + actor + stream writer; "
          f"{a.streams} streams x {a.tokens} tokens, B1..B16, null compute)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
