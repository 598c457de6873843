"""Device.completion_fd: the per-engine completion eventfd (spec §19 M1), and Job.result_nowait.

What matters to the engine: one count per completed job of that (chip, engine) whatever the status,
written only after the job reports done (drain -> check -> wait never misses a wake-up), and the fd is
the runtime's (stable across calls, closed with the device)."""

from __future__ import annotations

import os
import select

import numpy as np
import pytest

from calserve.runtime import Device, FaultKind, InvalidArgument, JobEngine, JobStatus, ProfileSpec

from .conftest import SMALL


def _drain(fd: int) -> int:
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


def _readable(fd: int, timeout_s: float) -> bool:
    r, _, _ = select.select([fd], [], [], timeout_s)
    return bool(r)


def test_fd_is_stable_per_engine_and_validated(next_device: Device) -> None:
    ping = next_device.completion_fd(JobEngine.PING)
    pong = next_device.completion_fd(JobEngine.PONG)
    assert ping is not None and pong is not None and ping != pong
    assert next_device.completion_fd(JobEngine.PING) == ping  # same fd every time
    other = next_device.completion_fd(JobEngine.PING, chip=1)
    assert other not in (ping, pong)
    assert not os.get_blocking(ping)
    assert not os.get_inheritable(ping)
    with pytest.raises(InvalidArgument, match="chip"):
        next_device.completion_fd(JobEngine.PING, chip=2)


def test_one_count_per_completion_any_status(device: Device, small_weights: dict) -> None:
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 64, 2))
    fd = device.completion_fd(JobEngine.PING)
    pong = device.completion_fd(JobEngine.PONG)
    assert fd is not None and pong is not None
    _drain(fd)
    s = cb.create_sequence()
    job = cb.submit_prefill(s, [1, 2, 3])
    assert _readable(fd, 10.0)
    assert job.done()  # done is visible once the fd is readable
    assert _drain(fd) == 1 and not _readable(fd, 0) and not _readable(pong, 0)
    r = job.result_nowait()
    assert r is not None and r.status is JobStatus.OK and job.wait(0) is r

    # INVALID (wrong position) counts too, on its own engine's fd.
    bad = cb.submit_decode([s], [1], [9], [True], engine=JobEngine.PONG)
    assert _readable(pong, 10.0) and _drain(pong) == 1
    r = bad.result_nowait()
    assert r is not None and r.status is JobStatus.INVALID

    # A hung job: not done, no count, result_nowait counts no timeout; the reset aborts it -> 1 count.
    device.inject_fault(FaultKind.TIMEOUT, JobEngine.PING, 1)
    hung = cb.submit_decode([s], [1], [3], [True])
    assert not _readable(fd, 0.05)
    assert hung.result_nowait() is None
    assert device.counters(JobEngine.PING).timeouts == 0
    device.reset()
    assert _readable(fd, 10.0) and _drain(fd) == 1
    r = hung.result_nowait()
    assert r is not None and r.status is JobStatus.ABORTED


def test_counts_add_up_over_many_jobs(device: Device, small_weights: dict) -> None:
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 64, 2))
    fd = device.completion_fd(JobEngine.PING)
    assert fd is not None
    _drain(fd)
    s = cb.create_sequence()
    jobs = [cb.submit_prefill(s, [1])]
    tok, total = 1, 0
    for pos in range(1, 20):
        jobs.append(cb.submit_decode([s], [tok], [pos], [True]))
        # Protocol as the engine uses it: drain, check, wait for readable.
        while (r := jobs[-2].result_nowait()) is None:
            assert _readable(fd, 10.0)
            total += _drain(fd)
        tok = int(np.argmax(r.logits[0]))
    for j in jobs:
        j.wait(10.0)
    # A job's count is written after the job is done (what wait() returns on): the last ones may
    # still be on their way here. A count that never comes fails after the 10 s wait.
    while total < len(jobs) and _readable(fd, 10.0):
        total += _drain(fd)
    assert total == len(jobs) == device.counters(JobEngine.PING).completed


def test_fd_closed_with_the_device(small_weights: dict) -> None:
    with Device.open("calrt-0.7.6", dram_bytes=1 << 30) as dev:
        fd = dev.completion_fd(JobEngine.PING)
        assert fd is not None
        os.fstat(fd)
    with pytest.raises(OSError):
        os.fstat(fd)


def test_int32_rows_are_passed_without_copy_and_still_checked(device: Device, small_weights: dict) -> None:
    """The submit hot path: int32 1-D contiguous inputs skip the conversion; the length check and
    the runtime's own checks (vocab range) still name the field."""
    from calserve.runtime.device import _i32

    row = np.array([1, 2, 3], np.int32)
    assert _i32("tokens", row) is row
    with pytest.raises(InvalidArgument, match="seq_ids: expected 1 entries"):
        _i32("seq_ids", row, 1)
    assert _i32("tokens", [1, 2]).dtype == np.int32  # other inputs are converted as before
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 64, 2))
    s = cb.create_sequence()
    with pytest.raises(InvalidArgument, match="tokens"):
        cb.submit_prefill(s, np.array([1, SMALL.vocab_size], np.int32))
    with pytest.raises(InvalidArgument, match="positions"):
        cb.submit_decode(np.array([s], np.int32), np.array([1], np.int32), np.array([1, 2], np.int32), [True])
    r = cb.submit_prefill(s, row[:2].copy()).wait(10.0)
    assert r.status is JobStatus.OK
