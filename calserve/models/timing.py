"""Named timing profiles for the software runtime (what a package's ``timing`` section holds).

The software CalRT makes a job take at least its modeled device time (``runtime.types.Timing``), so
benchmarks on a CPU mean something. A profile is picked at pack time (``calserve pack --timing NAME``)
or overridden per model in config (``models.<alias>.timing``).

``none``
    No modeled time: jobs take what the CPU takes. Logic tests and the demo default.
``qwen3-dual``
    In the spirit of the spec's reference (dual-chiplet Qwen3, ~17 GiB BF16 parameters): a decode
    step is bound by streaming the weights, ~40 ms at B1, growing slowly with B (weights are read once
    per step, KV/compute grow per lane): B4 44 ms, B8 48 ms, B16 56 ms. Prefill 30 ms + 0.35 ms/token.
``fast``
    A small model that stresses the serving layer: ~1 ms decode step at B1 (1.2/1.5/2 ms at B4/8/16),
    prefill 0.5 ms + 5 µs/token. Thousands of tokens/s per instance.
``sat-4k``
    Saturation benchmark: every profile's step is 4 ms, so B16 delivers 4,000 tokens/s device-bound
    (B1 250, B4 1,000, B8 2,000 tokens/s). Prefill 2 ms + 20 µs/token.

PING/PONG overlap is 0 (the two job engines serialise on one device) for every profile except ``fast``
(0.5), so ping/pong experiments show an effect on the small model only.
"""

from __future__ import annotations

from calserve.errors import ConfigError
from calserve.runtime.types import Timing

__all__ = ["TIMING_PROFILES", "timing_profile", "timing_names"]

TIMING_PROFILES: dict[str, Timing] = {
    "none": Timing(),
    "qwen3-dual": Timing(
        prefill_base_us=30_000.0,
        prefill_us_per_token=350.0,
        decode_step_us={1: 40_000.0, 4: 44_000.0, 8: 48_000.0, 16: 56_000.0},
        pingpong_overlap=0.0,
    ),
    "fast": Timing(
        prefill_base_us=500.0,
        prefill_us_per_token=5.0,
        decode_step_us={1: 1_000.0, 4: 1_200.0, 8: 1_500.0, 16: 2_000.0},
        pingpong_overlap=0.5,
    ),
    "sat-4k": Timing(
        prefill_base_us=2_000.0,
        prefill_us_per_token=20.0,
        decode_step_us={1: 4_000.0, 4: 4_000.0, 8: 4_000.0, 16: 4_000.0},
        pingpong_overlap=0.0,
    ),
}


def timing_names() -> list[str]:
    return sorted(TIMING_PROFILES)


def timing_profile(name: str) -> Timing:
    """The named profile; an unknown name is a ConfigError listing the known ones."""
    try:
        return TIMING_PROFILES[name]
    except KeyError:
        raise ConfigError(
            f"unknown timing profile {name!r} (known: {', '.join(timing_names())})"
        ) from None
