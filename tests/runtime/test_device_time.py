"""A job's ``device_us`` is the device's clock, not the host's: on the software runtime a timed job
reports its modeled span, whatever the host did meanwhile; only a computation that needs more CPU
than the span stretches it.

Why it matters: the engine's PING/PONG guard (spec §14) turns the second engine off when the P99 of
``device_us`` exceeds 3x the modeled step. When the software runtime counted the wake-up of its
worker thread after the timed wait (and the time its computation waited for a CPU), a serving host
busy enough to wake it late read as a slow device: at the 1 ms B16 step the guard fired within a
second of load, and with one job in flight the device idled ~20 % of the time while the host turned
each job around (bench/README.md, "The device's clock and the PING/PONG guard")."""

from __future__ import annotations

import time

import pytest
from busy_host import busy_host  # tests/busy_host.py (tests/ is on sys.path: its conftest)

from calserve.runtime import Calbin, Device, JobEngine, JobStatus, ProfileSpec, Timing
from calserve.runtime.reference import ModelConfig, random_weights

from .conftest import SMALL

STEP_US = 2000.0

# Large enough that a decode step's computation takes a measurable CPU time (~0.1-1 ms).
WIDE = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   tie_word_embeddings=False)


def _sequence(cb: Calbin, tokens: tuple[int, ...] = (1, 2, 3)) -> int:
    s = cb.create_sequence()
    assert cb.submit_prefill(s, list(tokens)).wait(30).status is JobStatus.OK
    return s


def _steps(cb: Calbin, seq: int, n: int,
           engine: JobEngine = JobEngine.PING) -> list[tuple[float, float]]:
    """``n`` decode steps of ``seq`` one after the other: (device_us, host round trip µs) each."""
    out = []
    pos = cb.committed_len(seq)
    for i in range(n):
        t0 = time.perf_counter()
        r = cb.submit_decode([seq], [5 + i], [pos + i], [True], engine=engine).wait(30)
        wall = (time.perf_counter() - t0) * 1e6
        assert r.status is JobStatus.OK
        out.append((r.device_us, wall))
    return out


def test_a_timed_step_reports_its_modeled_span(device: Device, small_weights: dict) -> None:
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 64, 4),
                            timing=Timing(decode_step_us={1: STEP_US}))
    for dev_us, wall in _steps(cb, _sequence(cb), 6):
        # exactly the span: the worker's wake-up after its timed wait (always some µs) is not in it
        assert dev_us == pytest.approx(STEP_US, abs=0.01)
        assert wall >= dev_us


def test_a_busy_host_is_not_device_time(device: Device, small_weights: dict) -> None:
    """Every CPU of the host busy twice over (the runtime's worker thread may then wait for a CPU
    to compute and to complete): the device's clock still reads the modeled step."""
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 64, 4),
                            timing=Timing(decode_step_us={1: STEP_US}))
    seq = _sequence(cb)
    with busy_host():
        steps = _steps(cb, seq, 20)
    assert all(d == pytest.approx(STEP_US, abs=0.01) for d, _ in steps), steps
    assert all(w >= d for d, w in steps)


def test_a_computation_longer_than_its_step_stretches_it(device: Device) -> None:
    """A modeled step shorter than the computation: the device time is the computation's (its CPU
    time on the worker thread), longer than the span, never longer than the host's round trip."""
    w = random_weights(WIDE, seed=3)
    cb = device.load_calbin(WIDE, w, ProfileSpec(1, 64, 4), timing=Timing(decode_step_us={1: 1.0}))
    for dev_us, wall in _steps(cb, _sequence(cb), 4):
        assert 1.0 < dev_us <= wall


def test_untimed_jobs_report_their_computation(device: Device) -> None:
    """Timing none: the host is the device, the computation's wall time is the device time."""
    w = random_weights(WIDE, seed=3)
    cb = device.load_calbin(WIDE, w, ProfileSpec(1, 64, 4))
    for dev_us, wall in _steps(cb, _sequence(cb), 4):
        assert 0.0 < dev_us <= wall

