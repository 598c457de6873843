"""``bench.http_floor``'s device-paced variant: calserve's configuration on a timed device (below
saturation, its CPU per token is what its events and tokens cost, not its share of the stream
period: bench/README, session 45)."""

from __future__ import annotations

import copy

from bench.http_floor import PACED_STEP_US, device_paced_config, server_config
from bench.serve_entry import KNEE_STEPS_US, STEP_PREFIX, register_step_profiles
from calserve.config import decode_config
from calserve.models.timing import timing_profile


def test_only_the_timing_changes() -> None:
    cfg = server_config()
    before = copy.deepcopy(cfg)
    paced = device_paced_config(cfg)
    assert cfg == before  # a copy: the other variants keep timing "none"
    assert [m["timing"] for m in paced["models"].values()] == [f"{STEP_PREFIX}{PACED_STEP_US}"]
    assert paced["runtime"] == cfg["runtime"]  # still null compute: the step is a wait
    assert paced["runtime"]["null_compute"] is True
    assert paced["scheduler"] == cfg["scheduler"]
    assert {k: v for k, v in paced["models"]["qwen3"].items() if k != "timing"} == \
        {k: v for k, v in cfg["models"]["qwen3"].items() if k != "timing"}


def test_the_benchmark_server_knows_the_timing() -> None:
    """The step is one the benchmark server registers (bench/serve_entry.py), its B16 decode step
    taking PACED_STEP_US, and the document is a valid configuration."""
    assert PACED_STEP_US in KNEE_STEPS_US
    register_step_profiles(KNEE_STEPS_US)
    prof = timing_profile(f"{STEP_PREFIX}{PACED_STEP_US}")
    assert prof.decode_step_us[16] == PACED_STEP_US
    decode_config(device_paced_config(server_config()))
