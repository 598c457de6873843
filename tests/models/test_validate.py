"""Compatibility with the runtime's capabilities and the scheduler config (spec §15), introspection
(spec §11 step 8), and the capacity plan (spec §11 step 4)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from calserve.config import AdmissionConfig, decode_config
from calserve.errors import ConfigError, ValidationError
from calserve.models.capacity import plan_capacity
from calserve.models.manifest import Manifest
from calserve.models.package import open_package
from calserve.models.signing import TrustStore
from calserve.models.validate import (
    check_scheduler_config,
    compare_introspection,
    runnable_profiles,
)
from calserve.runtime.reference import weight_shapes
from calserve.runtime.types import RUNTIME_PROFILES

OLD, NEXT = RUNTIME_PROFILES["calrt-0.7.6"], RUNTIME_PROFILES["sim-next"]


@pytest.fixture(scope="module")
def manifest(demo_pkg: Path, dev_trust: TrustStore) -> Manifest:
    return open_package(demo_pkg, dev_trust, demo_pkg.parent).manifest


def _only(m: Manifest, batches: list[int]) -> Manifest:
    return msgspec.structs.replace(m, profiles=[p for p in m.profiles if p.compiled_batch in batches])


def test_runnable_profiles(manifest: Manifest) -> None:
    assert runnable_profiles(manifest, OLD) == {1: True, 4: False, 8: False, 16: False}
    assert runnable_profiles(manifest, NEXT) == {1: True, 4: True, 8: True, 16: True}


def test_package_without_runnable_profile_refused(manifest: Manifest) -> None:
    with pytest.raises(ValidationError, match="no profile .* runnable on runtime calrt-0.7.6"):
        runnable_profiles(_only(manifest, [8, 16]), OLD)
    assert runnable_profiles(_only(manifest, [8, 16]), NEXT) == {8: True, 16: True}


def test_b8_requested_against_b1_package_fails_startup(manifest: Manifest) -> None:
    cfg = decode_config({"scheduler": {"batch": {"profiles": [1, 8]}}, "runtime": {"profile": "sim-next"}})
    with pytest.raises(ConfigError, match=r"\$\.scheduler\.batch\.profiles: B8 requested .* only \['B1'\]"):
        check_scheduler_config(_only(manifest, [1]), cfg, NEXT)
    assert check_scheduler_config(manifest, cfg, NEXT) == [1, 8]


def test_profile_unsupported_by_runtime_fails_startup(manifest: Manifest) -> None:
    cfg = decode_config({"scheduler": {"batch": {"profiles": [4]}}})
    with pytest.raises(ConfigError, match="B4 cannot run on runtime calrt-0.7.6"):
        check_scheduler_config(manifest, cfg, OLD)


def test_instance_pool(manifest: Manifest) -> None:
    cfg = decode_config({"scheduler": {"batch": {"profiles": [1, 16], "instance_pool": 16}}})
    assert check_scheduler_config(manifest, cfg, NEXT) == [16]
    bad = decode_config({"scheduler": {"batch": {"profiles": [1], "instance_pool": 16}}})
    with pytest.raises(ConfigError, match="instance_pool"):
        check_scheduler_config(manifest, bad, NEXT)
    # Without multi-calbin residency, several profiles need an instance pool.
    caps = dataclasses.replace(NEXT, multi_calbin=False)
    both = decode_config({"scheduler": {"batch": {"profiles": [1, 16]}}})
    with pytest.raises(ConfigError, match="cannot co-reside"):
        check_scheduler_config(manifest, both, caps)


def _good_introspection(m: Manifest, b: int) -> dict[str, Any]:
    p = m.profile(b)
    return {
        "compiled_batch": b,
        "max_seq": p.max_seq,
        "max_sequences": p.max_sequences,
        "kv_dtype": p.kv_dtype,
        "valid_mask": True,
        "inactive_writes_kv": False,
        "kv_layout": msgspec.structs.asdict(p.kv_layout),
        "tensors": [(n, s, "fp32") for n, s in weight_shapes(m.model_config()).items()],
    }


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.update(compiled_batch=8), "compiled_batch"),
        (lambda d: d.update(max_seq=1024), "max_seq"),
        (lambda d: d.update(inactive_writes_kv=True), "inactive_writes_kv"),
        (lambda d: d["kv_layout"].update(head_dim=8), r"kv_layout\.head_dim"),
        (lambda d: d["tensors"].pop(), "tensor set differs"),
        (lambda d: d.pop("max_seq"), "did not report max_seq"),
    ],
)
def test_introspection_mismatch(
    manifest: Manifest, change: Callable[[dict[str, Any]], None], match: str
) -> None:
    info = _good_introspection(manifest, 4)
    compare_introspection(manifest, 4, info)  # the unchanged view passes
    change(info)
    with pytest.raises(ValidationError, match=match):
        compare_introspection(manifest, 4, info)


def test_capacity_plan(manifest: Manifest) -> None:
    p1 = manifest.profile(1)
    plan = plan_capacity(manifest, [1], 32 << 30, 0, AdmissionConfig())
    kv = p1.max_sequences * p1.max_seq * p1.kv_layout.bytes_per_token
    assert plan.fits and plan.reason == ""
    assert plan.profiles[0].kv_bytes == kv
    assert plan.total_bytes == manifest.capacity.dram_reservation_bytes[1]
    assert plan.total_bytes > manifest.capacity.parameter_bytes + kv  # pools are reserved too
    b = plan.budget()
    assert (b.max_sequences, b.max_kv_tokens) == (p1.max_sequences, p1.max_sequences * p1.max_seq)
    assert b.max_waiting_requests == AdmissionConfig().max_waiting_requests
    both = plan_capacity(manifest, [1, 16], 32 << 30, 0, AdmissionConfig(), max_inflight=2)
    assert both.total_bytes == sum(manifest.capacity.dram_reservation_bytes[x] for x in (1, 16))
    assert both.max_inflight_jobs == 2


def test_capacity_does_not_fit(manifest: Manifest) -> None:
    need = manifest.capacity.dram_reservation_bytes[1]
    tight = plan_capacity(manifest, [1], need, 1, AdmissionConfig())
    assert not tight.fits and "device DRAM" in tight.reason
    exact = plan_capacity(manifest, [1], need + 5, 5, AdmissionConfig())
    assert exact.fits and exact.dram_free_after == 0


def test_capacity_overrides(manifest: Manifest) -> None:
    small = plan_capacity(manifest, [1], 32 << 30, 0, AdmissionConfig(max_sequences=4, max_kv_tokens=100))
    assert small.fits and (small.max_sequences, small.max_kv_tokens) == (4, 100)
    big = plan_capacity(manifest, [1], 32 << 30, 0, AdmissionConfig(max_sequences=10_000))
    assert not big.fits and "max_sequences" in big.reason
