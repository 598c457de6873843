"""The server process benchmarks start: ``calserve serve`` plus the bench's extra timing profiles.

``python -m bench.serve_entry --config FILE --port N`` registers the knee-sweep timing profiles
(``bench-step-<µs>``: every compiled batch size takes that many µs per decode step, prefill scaled
like ``sat-4k``) in the model package's timing table, then runs calserve's own ``serve`` entry point
in this very process (no fork: the PID the bench samples from ``/proc`` is the one that serves).
If ``calserve.api.serve`` is not there, it serves ``create_app(config)`` with hypercorn's trio worker.
"""

from __future__ import annotations

import sys

__all__ = ["register_step_profiles", "main", "STEP_PREFIX"]

STEP_PREFIX = "bench-step-"


def register_step_profiles(steps_us: list[int]) -> list[str]:
    """Add ``bench-step-<us>`` timing profiles; returns their names."""
    from calserve.models.timing import TIMING_PROFILES
    from calserve.runtime.types import Timing

    names = []
    for us in steps_us:
        scale = us / 4000.0  # relative to sat-4k (4 ms step, prefill 2 ms + 20 µs/token)
        name = f"{STEP_PREFIX}{us}"
        TIMING_PROFILES[name] = Timing(
            prefill_base_us=2000.0 * scale,
            prefill_us_per_token=20.0 * scale,
            decode_step_us={1: float(us), 4: float(us), 8: float(us), 16: float(us)},
            pingpong_overlap=0.0,
        )
        names.append(name)
    return names


KNEE_STEPS_US = [16000, 8000, 4000, 2000, 1500, 1250, 1000, 500, 250]
# Registered too, not swept: fairness-backlogged's 32 ms step (a server as fast as VTC's A10G).
EXTRA_STEPS_US = [32000]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    register_step_profiles(KNEE_STEPS_US + EXTRA_STEPS_US)
    try:
        from calserve.api.serve import main as serve_main
    except ImportError:
        return _fallback(argv)
    return int(serve_main(argv) or 0)


def _fallback(argv: list[str]) -> int:
    import argparse

    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from calserve.api.app import create_app
    from calserve.config import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args(argv)
    app = create_app(load_config(a.config))
    cfg = Config()
    cfg.bind = [f"{a.host}:{a.port}"]
    cfg.accesslog = None
    trio.run(serve, app, cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
