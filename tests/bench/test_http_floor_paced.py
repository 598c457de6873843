"""``bench.http_floor``'s device-paced variant: calserve's configuration on a timed device (below
saturation, its CPU per token is what its events and tokens cost, not its share of the stream
period: bench/README, session 45)."""

from __future__ import annotations

import copy

from bench.http_floor import (
    HOST_VARIANT,
    PACED_INTERVAL_MS,
    PACED_STEP_US,
    device_paced_config,
    server_config,
    variant_configs,
)
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


def test_the_variants_and_what_each_changes() -> None:
    """Every variant of the scenario, in order, and what it changes from the default configuration:
    the device-paced multi-step one is the device-paced one with ``scheduler.batch.multi_step``."""
    register_step_profiles(KNEE_STEPS_US)
    cfg = server_config()
    configs = variant_configs(cfg, multi_step=8)
    assert list(configs) == ["calserve", "calserve_ungrouped", "calserve_multi_step",
                             "calserve_multi_step_ungrouped", "calserve_device_paced",
                             "calserve_device_paced_multi_step", HOST_VARIANT]
    assert configs["calserve"] == ({}, {}, cfg)
    paced = configs["calserve_device_paced"][2]
    server, batch, both = configs["calserve_device_paced_multi_step"]
    assert server == {"stream_interval_ms": PACED_INTERVAL_MS} and batch == {"multi_step": 8}
    assert both["models"] == paced["models"] and both["server"] == paced["server"]
    assert both["scheduler"]["batch"] == {**paced["scheduler"]["batch"], "multi_step": 8}
    assert configs["calserve_multi_step_ungrouped"][0] == {"stream_busy_interval_ms": 0}
    # the host-driven one: the device-paced multi-step configuration, the host feeding tokens back
    hosted = configs[HOST_VARIANT][2]
    assert hosted["runtime"] == {**both["runtime"], "host_multi_step": True}
    assert {k: v for k, v in hosted.items() if k != "runtime"} == {k: v for k, v in both.items() if k != "runtime"}
    assert "host_multi_step" not in both["runtime"]
    for _, _, vcfg in configs.values():
        decode_config(vcfg)
    # no multi-step, no timed device: neither of their variants
    assert list(variant_configs(cfg, multi_step=1, device_paced=False)) == ["calserve", "calserve_ungrouped"]
    assert "calserve_interval_30ms" in variant_configs(cfg, stream_interval_ms=30)
