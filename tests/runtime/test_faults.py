"""Every injected fault's status, counters and KV-unknown marking; reset recovery; timing; busy."""

from __future__ import annotations

import time

import numpy as np
import pytest

from calserve.runtime import (
    Calbin,
    Device,
    DeviceBusy,
    DeviceFaulted,
    FaultKind,
    InvalidArgument,
    JobEngine,
    JobStatus,
    ProfileSpec,
    Timing,
    WaitTimeout,
    corrupted_lanes,
)

from .conftest import SMALL

PING, PONG = JobEngine.PING, JobEngine.PONG


def _setup(dev: Device, w: dict, batch: int = 1, timing: Timing | None = None) -> tuple[Calbin, int, int]:
    cb = dev.load_calbin(SMALL, w, ProfileSpec(batch, 64, 4), timing=timing)
    a, b = cb.create_sequence(), cb.create_sequence()
    for s in (a, b):
        assert cb.submit_prefill(s, [1, 2, 3]).wait(30).status is JobStatus.OK
    return cb, a, b


def test_timeout_fault_hangs_until_reset(device: Device, small_weights: dict) -> None:
    cb, a, b = _setup(device, small_weights)
    device.inject_fault(FaultKind.TIMEOUT, PONG, nth=1)
    job = cb.submit_decode([a], [4], [3], [True], engine=PONG)
    with pytest.raises(WaitTimeout):
        job.wait(0.05)
    assert not job.done()
    c = device.counters(PONG)
    assert (c.timeouts, c.inflight) == (1, 1)
    with pytest.raises(InvalidArgument):  # jobs in flight keep the calbin
        cb.release()
    # The other engine still works meanwhile.
    assert cb.submit_decode([b], [4], [3], [True], engine=PING).wait(30).status is JobStatus.OK
    device.reset()
    r = job.wait(5)
    assert r.status is JobStatus.ABORTED and not r.logits.any()
    c = device.counters(PONG)
    assert (c.failed, c.inflight) == (1, 0)
    assert not cb.sequence_valid(a) and not cb.sequence_valid(b)  # reset invalidates every sequence
    with pytest.raises(InvalidArgument):
        cb.committed_len(a)
    # Recovery: free the invalid sequences and run again, weights still configured.
    cb.free_sequence(a)
    cb.free_sequence(b)
    s = cb.create_sequence()
    assert cb.submit_prefill(s, [1, 2, 3]).wait(30).status is JobStatus.OK


def test_ccu_fault_marks_job_kv_unknown_and_needs_reset(device: Device, small_weights: dict) -> None:
    cb, a, b = _setup(device, small_weights)
    device.inject_fault(FaultKind.CCU_FAULT, PING, nth=2)
    assert cb.submit_decode([b], [4], [3], [True]).wait(30).status is JobStatus.OK
    r = cb.submit_decode([a], [4], [3], [True]).wait(30)
    assert r.status is JobStatus.CCU_FAULT
    assert not cb.sequence_valid(a)  # the job's KV is unknown
    assert cb.sequence_valid(b) and cb.committed_len(b) == 4  # others untouched until the reset
    assert device.faulted()
    with pytest.raises(DeviceFaulted):
        cb.submit_decode([b], [4], [4], [True])
    c = device.counters(PING)
    assert (c.submitted, c.completed, c.failed) == (4, 3, 1)
    device.reset()
    assert not device.faulted() and not device.needs_reconfigure
    cb.free_sequence(a)
    cb.free_sequence(b)
    s = cb.create_sequence()
    assert cb.submit_prefill(s, [7]).wait(30).status is JobStatus.OK


def test_dma_unknown_requires_reset_and_reconfigure(device: Device, small_weights: dict) -> None:
    cb, a, _ = _setup(device, small_weights)
    used = device.dram()[1]
    device.inject_fault(FaultKind.DMA_UNKNOWN, PONG, nth=1)
    r = cb.submit_decode([a], [4], [3], [True], engine=PONG).wait(30)
    assert r.status is JobStatus.DMA_UNKNOWN
    assert device.faulted() and device.needs_reconfigure
    device.reset()
    assert device.needs_reconfigure and cb.needs_reconfigure
    with pytest.raises(DeviceFaulted):
        cb.submit_prefill(a, [1])
    cb.reconfigure()
    assert not device.needs_reconfigure
    assert device.dram()[1] == used
    cb.free_sequence(a)
    s = cb.create_sequence()
    assert cb.submit_prefill(s, [1, 2]).wait(30).status is JobStatus.OK


def test_busy_fault_and_full_queue(device: Device, small_weights: dict) -> None:
    cb, a, b = _setup(device, small_weights)
    device.inject_fault(FaultKind.DEVICE_BUSY, PING, nth=1)
    with pytest.raises(DeviceBusy):
        cb.submit_decode([a], [4], [3], [True])
    assert device.counters(PING).busy == 1
    # Queue depth 2: a hung job + one waiting fill the engine; the third submit is refused.
    device.inject_fault(FaultKind.TIMEOUT, PING, nth=1)
    j1 = cb.submit_decode([a], [4], [3], [True])
    j2 = cb.submit_decode([b], [4], [3], [True])
    with pytest.raises(DeviceBusy):
        cb.submit_prefill(cb.create_sequence(), [1])
    assert device.counters(PING).busy == 2 and device.counters(PING).inflight == 2
    device.reset()
    assert j1.wait(5).status is JobStatus.ABORTED
    assert j2.wait(5).status is JobStatus.ABORTED


def test_crosstalk_is_detected_by_checksum(next_device: Device, small_weights: dict) -> None:
    cb, a, b = _setup(next_device, small_weights, batch=4)
    next_device.inject_fault(FaultKind.CROSSTALK, PING, nth=1, lane=1)
    r = cb.submit_decode([a, b, 0, 0], [4, 5, 0, 0], [3, 3, 0, 0], [True, True, False, False]).wait(30)
    assert r.status is JobStatus.OK
    assert corrupted_lanes(r) == [1]
    r = cb.submit_decode([a, b, 0, 0], [4, 5, 0, 0], [4, 4, 0, 0], [True, True, False, False]).wait(30)
    assert corrupted_lanes(r) == []


def test_invalid_at_execution_writes_nothing(device: Device, small_weights: dict) -> None:
    cb, a, _ = _setup(device, small_weights)
    kv = cb.read_kv(a).copy()
    r = cb.submit_decode([a], [4], [7], [True]).wait(30)  # position != committed_len
    assert r.status is JobStatus.INVALID
    assert cb.committed_len(a) == 3 and np.array_equal(cb.read_kv(a), kv)


def test_timing_model_and_pingpong_overlap(device: Device, small_weights: dict) -> None:
    t = Timing(prefill_base_us=1000, prefill_us_per_token=100, decode_step_us={1: 20_000},
               pingpong_overlap=0.0)
    cb, a, b = _setup(device, small_weights, timing=t)
    r = cb.submit_prefill(cb.create_sequence(), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).wait(30)
    assert r.device_us >= 2000
    t0 = time.monotonic()
    ja = cb.submit_decode([a], [4], [3], [True], engine=PING)
    jb = cb.submit_decode([b], [4], [3], [True], engine=PONG)
    ra, rb = ja.wait(30), jb.wait(30)
    # overlap 0: the two engines serialise on the chip -> ~2 steps of wall time.
    assert time.monotonic() - t0 >= 0.039
    # each job's device time is its own step: the wait for the other engine's share is not in it
    # (two engines' spans overlap only as much as pingpong_overlap lets them; the trace shows it)
    assert min(ra.device_us, rb.device_us) >= 20_000
