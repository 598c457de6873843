"""Device lifecycle, capabilities, DRAM accounting, introspection, NotSupported ops, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from calserve.runtime import (
    RUNTIME_PROFILES,
    Device,
    DeviceAlreadyOpen,
    InvalidArgument,
    JobStatus,
    NotSupported,
    OutOfDeviceMemory,
    OutOfSequences,
    ProfileSpec,
)
from calserve.runtime.reference import weight_shapes

from .conftest import SMALL


def test_second_open_fails_until_close() -> None:
    d = Device.open()
    try:
        with pytest.raises(DeviceAlreadyOpen, match="already open"):
            Device.open("sim-next")
    finally:
        d.close()
    Device.open("sim-next").close()


def test_unknown_profile_named() -> None:
    with pytest.raises(InvalidArgument, match="profile"):
        Device.open("calrt-9")


def test_capability_flags_0_7_6(device: Device, small_weights: dict) -> None:
    assert device.capabilities == RUNTIME_PROFILES["calrt-0.7.6"] and device.chips == 1
    with pytest.raises(NotSupported, match="batch profiles"):
        device.load_calbin(SMALL, small_weights, ProfileSpec(4, 32, 4))
    with pytest.raises(NotSupported, match="chip-scoped"):
        device.load_calbin(SMALL, small_weights, ProfileSpec(1, 32, 4), chip=1)
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 32, 4))
    with pytest.raises(NotSupported, match="multi-calbin"):
        device.load_calbin(SMALL, small_weights, ProfileSpec(1, 16, 2))
    cb.release()  # then the second profile can be configured (a switch, not residency)
    device.load_calbin(SMALL, small_weights, ProfileSpec(1, 16, 2)).release()


def test_chip_scoped_configure_on_sim_next(next_device: Device, small_weights: dict) -> None:
    assert next_device.chips == 2 and next_device.capabilities.chip_scoped
    c0 = next_device.load_calbin(SMALL, small_weights, ProfileSpec(1, 32, 2), chip=0)
    c1 = next_device.load_calbin(SMALL, small_weights, ProfileSpec(4, 32, 4), chip=1)
    assert next_device.dram(0)[1] == c0.introspect()["dram_bytes"]
    assert next_device.dram(1)[1] == c1.introspect()["dram_bytes"]
    s0, s1 = c0.create_sequence(), c1.create_sequence()
    assert c0.submit_prefill(s0, [1, 2]).wait(30).status is JobStatus.OK
    assert c1.submit_prefill(s1, [1, 2]).wait(30).status is JobStatus.OK
    next_device.reset(chip=1)  # own reset domain: chip 0 keeps its KV
    assert c0.sequence_valid(s0) and not c1.sequence_valid(s1)
    assert c0.committed_len(s0) == 2


def test_dram_accounting_returns_to_baseline(next_device: Device, small_weights: dict) -> None:
    cap, base = next_device.dram()
    assert base == 0
    for i in range(5):
        cbs = [next_device.load_calbin(SMALL, small_weights, ProfileSpec(b, 32 + i, 3)) for b in (1, 4)]
        used = next_device.dram()[1]
        assert used == sum(c.introspect()["dram_bytes"] for c in cbs)
        for c in cbs:
            s = c.create_sequence()
            assert c.submit_prefill(s, [1, 2, 3]).wait(30).status is JobStatus.OK
            c.release()
        assert next_device.dram() == (cap, base)


def test_dram_reservation_that_does_not_fit_is_refused(small_weights: dict) -> None:
    with Device.open(dram_bytes=200_000) as dev:
        with pytest.raises(OutOfDeviceMemory, match="does not fit"):
            dev.load_calbin(SMALL, small_weights, ProfileSpec(1, 4096, 8))
        assert dev.dram()[1] == 0


def test_introspection_matches_manifest_view(device: Device, small_weights: dict) -> None:
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 32, 3, kv_dtype="bf16"))
    info = cb.introspect()
    assert [(n, s) for n, s, _ in info["tensors"]] == list(weight_shapes(SMALL).items())
    assert {d for _, _, d in info["tensors"]} == {"float32"}
    assert info["compiled_batch"] == 1 and info["max_seq"] == 32 and info["kv_dtype"] == "bf16"
    assert info["kv_layout"]["shape_per_sequence"] == (2, 2, 2, 32, 12)
    assert info["kv_layout"]["bytes_per_token"] == SMALL.kv_bytes_per_token_fp32 // 2
    assert info["valid_mask"] is True and info["inactive_writes_kv"] is False
    assert info["model"]["head_dim"] == 12


def test_kv_manager_ops_and_not_supported(device: Device, small_weights: dict) -> None:
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 32, 2))
    assert cb.can_allocate(2) and not cb.can_allocate(3)
    a, b = cb.create_sequence(), cb.create_sequence()
    with pytest.raises(OutOfSequences):
        cb.create_sequence()
    for op in (lambda: cb.copy_prefix(a, b, 1), lambda: cb.keep_one(a), lambda: cb.position_add(a, 1),
               lambda: cb.position_div(a, 2), lambda: cb.save_session(a), lambda: cb.load_session(a, b"")):
        with pytest.raises(NotSupported, match="not supported"):
            op()
    assert cb.submit_prefill(a, list(range(10))).wait(30).status is JobStatus.OK
    before = cb.read_kv(a).copy()
    cb.do_shift(a, 4)  # C1: drop the first 4 tokens, the rest move to the front
    assert cb.committed_len(a) == 6
    assert np.array_equal(cb.read_kv(a)[:, :, :, :6], before[:, :, :, 4:10])
    with pytest.raises(InvalidArgument, match="committed_len"):
        cb.remove_tokens_at_end(a, 7)
    cb.free_sequence(a)
    assert cb.can_allocate(1)


def test_bad_input_names_the_field(device: Device, small_weights: dict) -> None:
    bad = dict(small_weights)
    bad["model.norm.weight"] = np.zeros(3, np.float32)
    with pytest.raises(InvalidArgument, match="model.norm.weight"):
        device.load_calbin(SMALL, bad, ProfileSpec(1, 32, 2))
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 32, 2))
    s = cb.create_sequence()
    with pytest.raises(InvalidArgument, match=r"tokens\[1\]"):
        cb.submit_prefill(s, [1, 999])
    with pytest.raises(InvalidArgument, match="tokens"):
        cb.submit_prefill(s, [])
    with pytest.raises(InvalidArgument, match="compiled_batch"):
        cb.submit_decode([s, s], [1, 1], [0, 0], [True, True])
    with pytest.raises(InvalidArgument, match="seq_ids"):
        cb.submit_decode([1], [1], [0], [True])  # not allocated


def test_null_compute_is_deterministic_and_needs_no_weights() -> None:
    with Device.open("sim-next", null_compute=True) as dev:
        cb = dev.load_calbin(SMALL, {}, ProfileSpec(4, 32, 4))
        a, b = cb.create_sequence(), cb.create_sequence()
        ra = cb.submit_prefill(a, [1, 2, 3]).wait(30)
        rb = cb.submit_prefill(b, [1, 2, 3]).wait(30)
        assert np.array_equal(ra.logits, rb.logits) and ra.logits.any()
        r = cb.submit_decode([a, b, 0, 0], [5, 6, 0, 0], [3, 3, 0, 0], [1, 1, 0, 0]).wait(30)
        assert r.status is JobStatus.OK and cb.committed_len(a) == 4
        with pytest.raises(NotSupported):
            cb.read_kv(a)


def test_freed_sequence_is_scrubbed_before_reuse(device: Device, small_weights: dict) -> None:
    """A free scrubs every position ever written (committed, dropped by RemoveTokensAtEnd, or past
    the committed length by a job), and only those: the next owner of the slot reads zeros."""
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 32, 1))
    a = cb.create_sequence()
    assert cb.submit_prefill(a, list(range(12))).wait(30).status is JobStatus.OK
    cb.remove_tokens_at_end(a, 5)  # positions 7..11 stay written but uncommitted
    kv = cb.read_kv(a)
    assert np.count_nonzero(kv[:, :, :, 7:12]) and not np.count_nonzero(kv[:, :, :, 12:])
    cb.free_sequence(a)
    b = cb.create_sequence()  # the only slot: the same buffer
    assert b == a and not np.count_nonzero(cb.read_kv(b))
    assert cb.submit_prefill(b, [3, 4]).wait(30).status is JobStatus.OK
    assert np.count_nonzero(cb.read_kv(b)[:, :, :, :2]) and not np.count_nonzero(cb.read_kv(b)[:, :, :, 2:])
