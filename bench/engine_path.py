"""Micro-benchmark of the engine's per-token path inside one process, without HTTP.

``python -m bench.engine_path [--streams 64] [--tokens 256] [--reps 3] [--hold-ms 0] [--multi-step 1]``

The real engine (:meth:`calserve.engine.engine.Engine.open`) over the software runtime with null
compute and timing ``none`` (the device costs ~nothing), the demo package, profiles B1..B16 with
PING/PONG, configured as the ``http-floor`` scenario's server (``http_floor.server_config``: no
running cap, so no time-slicing): ``--streams`` greedy requests of ``--tokens``
tokens each submitted at once, each consumed through its handle's ``receive_many`` (what the HTTP
pump reads). Prints process CPU µs per token over the whole run (start-up excluded; min over
``--reps``): scheduler, planner, executor, step bookkeeping, sampling, actor, detokenizer and stream
writer — everything of the per-token path but the HTTP layer (``bench.token_path`` has the actor
→ SSE part alone).

``--hold-ms H`` (H > 0): each consumer, after a read that got tokens, waits H ms before its next
read, through the same :class:`~calserve.api.pacing.HoldTimer` the HTTP pump holds with — the
grouping the served streams have under load (``server.stream_busy_interval_ms``), so a stream's
task wakes once per event instead of once per token; it prints the tokens per read too. Without
it every token wakes its consumer, which the HTTP path under load never does.

On a shared 2-core box CPU times are noisy; instruction counts are not. Under valgrind the
difference between two token counts is the instructions per token::

    for n in 64 128; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python -m bench.engine_path --tokens $n --reps 1 2>&1 | grep Collected; done
    # (Ir(128) - Ir(64)) / (64 * streams) = instructions per token

:mod:`bench.engine_instructions` runs that recipe, held as a served stream is (``--hold-ms 1000``
under valgrind's ~50x slowdown: reads of about as many tokens as ``--hold-ms 20`` natively), and
prints the figure with the tokens a read beside it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import trio

__all__ = ["main", "measure"]


async def _run(streams: int, tokens: int, reps: int, hold_ms: float = 0.0, multi_step: int = 1
               ) -> tuple[float, float, int]:
    """(the best rep's process CPU µs a token, tokens a read of the last rep, tokens the streams
    of the last rep received in all)."""
    from bench.http_floor import server_config, with_batch
    from calserve.api.pacing import HoldTimer
    from calserve.config import decode_config
    from calserve.engine.engine import Engine
    from calserve.engine.types import FinishEvent, GenerateRequest, SamplingParams

    raw = server_config()
    if multi_step > 1:
        raw = with_batch(raw, {"multi_step": multi_step})
    cfg = decode_config(raw)
    best = float("inf")
    timer = HoldTimer(cfg.server.stream_hold_coalesce_ms / 1000.0)  # as the app's (api/app.py)
    hold_s = hold_ms / 1000.0
    async with Engine.open(cfg) as eng, trio.open_nursery() as outer:
        if hold_s:
            await outer.start(timer.run)
        for _ in range(reps):
            done = 0
            reads = 0

            async def one(i: int) -> None:
                nonlocal done, reads
                h = await eng.submit(GenerateRequest(
                    (300 + i % 50, 301, 302, 303), SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                                  temperature=0.0)))
                n = 0
                written = getattr(h, "report_written", lambda: None)
                while True:
                    batch = await h.receive_many()
                    if not batch:
                        break
                    got = sum(len(getattr(ev, "token_ids", ())) for ev in batch)
                    n += got
                    reads += got > 0
                    if isinstance(batch[-1], FinishEvent):
                        break
                    if hold_s and got:
                        written()  # what the pump reports once its write completed
                        await timer.hold_until(trio.current_time() + hold_s)
                done += n

            t0 = time.process_time()
            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(one, i)
            dt = time.process_time() - t0
            best = min(best, dt / max(1, done) * 1e6)
        timer.stop()
    return best, done / max(1, reads), done


def measure(streams: int, tokens: int, reps: int = 1, hold_ms: float = 0.0) -> dict[str, float]:
    """One run of the benchmark (its own trio run): ``us_per_token`` (best rep, process CPU),
    ``tokens_per_read`` and ``tokens_received`` (the last rep's)."""
    us, per_read, got = trio.run(_run, streams, tokens, reps, hold_ms)
    return {"us_per_token": us, "tokens_per_read": per_read, "tokens_received": float(got)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hold-ms", type=float, default=0.0,
                    help="each consumer waits this long after a read (the HTTP pump's grouping)")
    ap.add_argument("--multi-step", type=int, default=1,
                    help="scheduler.batch.multi_step (greedy device steps a decode job)")
    a = ap.parse_args(argv)
    from bench.server import BENCH_OUT

    os.environ.setdefault("CALSERVE_HOME", str(BENCH_OUT / ".home"))
    us, per_read, _ = trio.run(_run, a.streams, a.tokens, a.reps, a.hold_ms, a.multi_step)
    held = f", held {a.hold_ms:g} ms a read: {per_read:.1f} tokens a read" if a.hold_ms else ""
    held += f", multi_step {a.multi_step}" if a.multi_step > 1 else ""
    print(f"{Path(__file__).stem}: {us:.2f} µs CPU per token (engine + actor + stream writer; "
          f"{a.streams} streams x {a.tokens} tokens, B1..B16, null compute{held})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
