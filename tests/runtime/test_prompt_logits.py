"""Prompt logits (C3-style ``prompt_logits``, sim-next only): ``submit_prefill(..., all_logits=True)``.

One prefill job returns the logits of every prompt position: row ``i`` must be bitwise the row of an
ordinary prefill of ``prompt[:i + 1]``, echo ``(job_id, seq_id, committed_len + i)``, checksum of the
row; the sequence commits all ``n`` tokens once and decodes on exactly as after an ordinary prefill;
faults act as on an ordinary prefill; calrt-0.7.6 refuses it.
"""

from __future__ import annotations

import numpy as np
import pytest

from calserve.runtime import (
    Calbin,
    Device,
    DeviceFaulted,
    FaultKind,
    InvalidArgument,
    JobEngine,
    JobStatus,
    NotSupported,
    ProfileSpec,
    corrupted_lanes,
    verify_lanes,
)
from calserve.runtime.binding import call
from calserve.runtime.reference import ModelConfig, random_weights

from .conftest import SMALL, SMALL_GEMMA2

PROMPT = [5, 17, 2, 99, 40, 17, 8]


def _prefilled(cb: Calbin, head: list[int]) -> int:
    """A new sequence with ``head`` committed (nothing when empty)."""
    s = cb.create_sequence()
    if head:
        assert cb.submit_prefill(s, head).wait(30).status is JobStatus.OK
    return s


def _decode_row(cb: Calbin, seq: int, token: int) -> np.ndarray:
    b = cb.spec.compiled_batch
    pos = cb.committed_len(seq)
    r = cb.submit_decode([seq] * b, [token] + [0] * (b - 1), [pos] + [0] * (b - 1),
                         [True] + [False] * (b - 1)).wait(30)
    assert r.status is JobStatus.OK and r.echo[0].tolist() == [r.job_id, seq, pos]
    return r.logits[0].copy()


@pytest.mark.parametrize(
    ("config", "batch", "kv_dtype", "head"),
    [(SMALL, 1, "fp32", []), (SMALL, 1, "bf16", [3, 1, 4]), (SMALL, 4, "fp32", [9]),
     (SMALL_GEMMA2, 1, "fp32", [2, 2])],  # Gemma 2: sliding layers and soft-capped logits per row
)
def test_rows_bitwise_equal_ordinary_prefills(next_device: Device, config: ModelConfig, batch: int,
                                               kv_dtype: str, head: list[int]) -> None:
    cb = next_device.load_calbin(config, random_weights(config, seed=11),
                                 ProfileSpec(batch, 48, 4, kv_dtype=kv_dtype))
    n, c0 = len(PROMPT), len(head)
    seq = _prefilled(cb, head)
    job = cb.submit_prefill(seq, PROMPT, all_logits=True, engine=JobEngine.PONG)
    r = job.wait(30)
    assert r.status is JobStatus.OK
    assert r.logits.shape == (n, config.vocab_size) and r.logits.dtype == np.float32
    assert r.echo.tolist() == [[r.job_id, seq, c0 + i] for i in range(n)]
    assert verify_lanes(r, r.job_id, range(n), [(seq, c0 + i) for i in range(n)]) == []
    assert corrupted_lanes(r) == []
    assert cb.committed_len(seq) == c0 + n
    for i in range(n):  # row i == the one row of an ordinary prefill of PROMPT[:i + 1]
        other = _prefilled(cb, head)
        ro = cb.submit_prefill(other, PROMPT[: i + 1]).wait(30)
        assert ro.status is JobStatus.OK and ro.logits.shape == (1, config.vocab_size)
        assert ro.echo[0].tolist() == [ro.job_id, other, c0 + i]
        assert np.array_equal(r.logits[i], ro.logits[0]), f"row {i}"
        cb.free_sequence(other)
    # A decode step after it equals the one after an ordinary prefill of the same tokens (same KV).
    ref = _prefilled(cb, head)
    rr = cb.submit_prefill(ref, PROMPT).wait(30)
    assert np.array_equal(rr.logits[0], r.logits[-1])
    assert np.array_equal(cb.read_kv(seq), cb.read_kv(ref))
    tok = int(np.argmax(r.logits[-1]))
    assert np.array_equal(_decode_row(cb, seq, tok), _decode_row(cb, ref, tok))
    assert cb.committed_len(seq) == cb.committed_len(ref) == c0 + n + 1


def test_single_token_and_null_compute() -> None:
    with Device.open("sim-next", dram_bytes=1 << 30, null_compute=True) as dev:
        assert dev.capabilities.prompt_logits
        cb = dev.load_calbin(SMALL, {}, ProfileSpec(1, 32, 3))
        seq = _prefilled(cb, [4, 4])
        r = cb.submit_prefill(seq, PROMPT, all_logits=True).wait(30)
        assert r.status is JobStatus.OK and r.logits.shape == (len(PROMPT), SMALL.vocab_size)
        assert r.echo[:, 2].tolist() == [2 + i for i in range(len(PROMPT))]
        for i in range(len(PROMPT)):  # pseudo-logits of (PROMPT[i], 2 + i): the ordinary prefill's row
            other = _prefilled(cb, [4, 4])
            ro = cb.submit_prefill(other, PROMPT[: i + 1]).wait(30)
            assert np.array_equal(r.logits[i], ro.logits[0])
            cb.free_sequence(other)
        one = cb.submit_prefill(seq, [7], all_logits=True).wait(30)  # one token: one row
        assert one.logits.shape == (1, SMALL.vocab_size) and one.echo.tolist() == [[one.job_id, seq, 9]]


def test_validation_as_ordinary_prefill(next_device: Device, small_weights: dict) -> None:
    cb = next_device.load_calbin(SMALL, small_weights, ProfileSpec(1, 16, 2))
    seq = cb.create_sequence()
    with pytest.raises(InvalidArgument, match="at least one"):
        cb.submit_prefill(seq, [], all_logits=True)
    with pytest.raises(InvalidArgument, match="vocab_size"):
        cb.submit_prefill(seq, [1, SMALL.vocab_size], all_logits=True)
    with pytest.raises(InvalidArgument, match="max_seq"):
        cb.submit_prefill(seq, [1] * 17, all_logits=True)
    assert cb.submit_prefill(seq, [1] * 10, all_logits=True).wait(30).status is JobStatus.OK
    r = cb.submit_prefill(seq, [1] * 7, all_logits=True).wait(30)  # 10 + 7 > max_seq at execution
    assert r.status is JobStatus.INVALID and cb.committed_len(seq) == 10
    cb.free_sequence(seq)  # not held by any job (each counts its sequence once)


def test_ccu_fault_leaves_sequence_unknown_as_ordinary_prefill(next_device: Device, small_weights: dict) -> None:
    cb = next_device.load_calbin(SMALL, small_weights, ProfileSpec(1, 48, 4))
    outcomes = []
    for all_logits in (False, True):
        a, b = _prefilled(cb, [1, 2, 3]), _prefilled(cb, [1, 2, 3])
        next_device.inject_fault(FaultKind.CCU_FAULT, JobEngine.PING, nth=1)
        r = cb.submit_prefill(a, PROMPT, all_logits=all_logits).wait(30)
        assert r.status is JobStatus.CCU_FAULT
        assert r.logits.shape[0] == (len(PROMPT) if all_logits else 1)
        assert not r.logits.any() and not r.checksum.any()
        assert r.echo[:, :2].tolist() == [[r.job_id, a]] * r.logits.shape[0]
        outcomes.append((cb.sequence_valid(a), cb.sequence_valid(b), cb.committed_len(b),
                         next_device.faulted(), next_device.needs_reconfigure))
        with pytest.raises(InvalidArgument):
            cb.committed_len(a)
        with pytest.raises(DeviceFaulted):
            cb.submit_prefill(b, [4], all_logits=True)
        next_device.reset()
        cb.free_sequence(a)
        cb.free_sequence(b)
    assert outcomes[0] == outcomes[1] == (False, True, 3, True, False)
    s = cb.create_sequence()
    assert cb.submit_prefill(s, PROMPT, all_logits=True).wait(30).status is JobStatus.OK


def test_crosstalk_on_one_row_is_detected(next_device: Device, small_weights: dict) -> None:
    cb = next_device.load_calbin(SMALL, small_weights, ProfileSpec(1, 48, 2))
    seq = cb.create_sequence()
    next_device.inject_fault(FaultKind.CROSSTALK, JobEngine.PING, nth=1, lane=4)
    r = cb.submit_prefill(seq, PROMPT, all_logits=True).wait(30)
    assert r.status is JobStatus.OK
    assert corrupted_lanes(r) == [4]
    assert verify_lanes(r, r.job_id, range(len(PROMPT)), [(seq, i) for i in range(len(PROMPT))]) == [4]


def test_capability_flags(device: Device, small_weights: dict) -> None:
    assert not device.capabilities.prompt_logits
    assert device.capabilities.name == "calrt-0.7.6"
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 48, 2))
    seq = cb.create_sequence()
    with pytest.raises(NotSupported, match="prompt logits"):
        cb.submit_prefill(seq, PROMPT, all_logits=True)
    with pytest.raises(NotSupported, match="prompt logits"):  # the runtime refuses it too
        call(cb._h.submit_prefill_all, seq, np.asarray(PROMPT, dtype=np.int32), 0)
    assert cb.committed_len(seq) == 0
    assert cb.submit_prefill(seq, PROMPT).wait(30).logits.shape == (1, SMALL.vocab_size)


def test_capability_flag_on_sim_next(next_device: Device) -> None:
    assert next_device.capabilities.prompt_logits
    assert next_device._h.capabilities()["prompt_logits"]
