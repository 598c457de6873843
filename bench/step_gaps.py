"""Where a decode step's wall time goes with one job in flight: host turnaround, device, wake-ups.

``python -m bench.step_gaps [--streams 8] [--tokens 200] [--config default|sim-next] [--reps 2]``

The real engine over the software runtime with real compute (the demo package, timing ``none``),
``--streams`` greedy requests of ``--tokens`` tokens after a 100-token prompt, submitted at once.
``default`` is the shipped configuration (calrt-0.7.6: B1, one job in flight), ``sim-next`` B1..B16
with PING/PONG. For every job (the decode steps, and each request's prefill) it records, from the
engine's side (``perf_counter``):

- ``submit``: the runtime's submit call of a decode job (creating it and handing it to the engine);
- ``after``: the work the executor does right after a submit (the previous step's bookkeeping and
  token delivery), while the device computes;
- ``waiting``: from the end of that work to the completion's wake-up of the executor: the device's
  remaining compute plus the wake-ups (the engine thread's on submit, the executor's on completion);
- ``device``: the job's own compute (``device_us``, the runtime's clock);
- ``turnaround``: from a completion's wake-up to the next submit's return (the host's critical
  path with one job in flight: verify, sample, pick and build the next job, submit).

Prints tokens/s and process CPU per token (best of ``--reps``) and the medians and means of the
per-job figures. ``waiting - max(0, device - after)`` is what the wake-ups cost. A diagnostic: it
wraps the runtime backend's private hot-path method and moves with the code.
``CALRT_SIM_ENGINE_SPIN_US=0`` turns the software engine's poll for its next job off (ext/README.md),
``--completion-poll-us 0`` the executor's poll before it parks on the completion fd
(``runtime.completion_poll_us``), for a before/after in one build.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import trio

__all__ = ["main"]

PROMPT = 100


class _Recorder:
    """Wraps the backend's submit + first wait of a decode job (``_RuntimeCalbin._wait_hot``, which
    runs the after-submit work first) and the runtime's submit call."""

    def __init__(self) -> None:
        self.jobs: list[tuple[float, float, float, float]] = []  # submitted, after done, woken, device
        self.submits: list[float] = []

    def install(self) -> None:
        import calserve.engine.backend as backend
        import calserve.runtime.device as device

        rec = self
        wait_hot = backend._RuntimeCalbin._wait_hot
        submit = device.Calbin.submit_decode

        async def timed_wait_hot(self: Any, job: Any, engine: Any, timeout_s: float, after: Any) -> Any:
            t_sub = time.perf_counter()
            t_after = t_sub

            def timed_after() -> None:
                nonlocal t_after
                if after is not None:
                    after()
                t_after = time.perf_counter()

            out = await wait_hot(self, job, engine, timeout_s, timed_after)
            r = out[1]
            rec.jobs.append((t_sub, t_after, time.perf_counter(), r.device_us * 1e-6 if r is not None else 0.0))
            return out

        def timed_submit(self: Any, *args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return submit(self, *args, **kw)
            finally:
                rec.submits.append(time.perf_counter() - t0)

        backend._RuntimeCalbin._wait_hot = timed_wait_hot  # type: ignore[method-assign,assignment]
        device.Calbin.submit_decode = timed_submit  # type: ignore[method-assign]

    def clear(self) -> None:
        self.jobs.clear()
        self.submits.clear()

    def figures(self) -> dict[str, list[float]]:
        js = self.jobs
        return {
            "submit": self.submits,
            "after": [a - s for s, a, _, _ in js],
            "waiting": [w - a for _, a, w, _ in js],
            "device": [d for *_, d in js],
            "turnaround": [js[i + 1][0] - js[i][2] for i in range(len(js) - 1)],
        }


async def _run(streams: int, tokens: int, config: str, reps: int, rec: _Recorder, poll_us: int | None
               ) -> tuple[float, float, dict[str, list[float]]]:
    from bench.scenario_lib import calserve_config
    from calserve.config import decode_config
    from calserve.engine.engine import Engine
    from calserve.engine.types import FinishEvent, GenerateRequest, SamplingParams

    raw: dict[str, Any] = ({"models": {"qwen3": {"timing": "none"}}} if config == "default"
                           else calserve_config(profiles=[1, 4, 8, 16], timing="none"))
    if poll_us is not None:
        raw.setdefault("runtime", {})["completion_poll_us"] = poll_us
    cfg = decode_config(raw)
    best: tuple[float, float, dict[str, list[float]]] = (0.0, 0.0, {})
    async with Engine.open(cfg) as eng:

        async def one(i: int, n: int) -> None:
            h = await eng.submit(GenerateRequest(
                tuple(300 + (i + k) % 200 for k in range(PROMPT)),
                SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)))
            while True:
                batch = await h.receive_many()
                if not batch or isinstance(batch[-1], FinishEvent):
                    break

        async with trio.open_nursery() as nursery:  # warm-up
            for i in range(streams):
                nursery.start_soon(one, i, 8)
        for _ in range(reps):
            rec.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(one, i, tokens)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            n = streams * tokens
            if n / wall > best[0]:
                best = (n / wall, cpu / n, rec.figures())
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_gaps", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--config", choices=("default", "sim-next"), default="default")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--completion-poll-us", type=int, default=None,
                    help="runtime.completion_poll_us (default: the configuration's)")
    a = ap.parse_args(argv)
    from bench.server import BENCH_OUT

    os.environ.setdefault("CALSERVE_HOME", str(BENCH_OUT / ".home"))
    rec = _Recorder()
    rec.install()
    tok_s, cpu, fig = trio.run(_run, a.streams, a.tokens, a.config, a.reps, rec, a.completion_poll_us)
    poll = os.environ.get("CALRT_SIM_ENGINE_SPIN_US") or "default"
    fd_poll = "default" if a.completion_poll_us is None else a.completion_poll_us
    print(f"{Path(__file__).stem}: {a.config}, {a.streams} streams x {a.tokens} tokens: {tok_s:.0f} tok/s, "
          f"{cpu * 1e6:.0f} us CPU per token (engine poll cap: {poll}; completion poll: {fd_poll})")
    for name, xs in fig.items():
        if xs:
            print(f"  {name:>10}: median {statistics.median(xs) * 1e6:6.1f} us, mean "
                  f"{statistics.mean(xs) * 1e6:6.1f} us ({len(xs)} jobs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
