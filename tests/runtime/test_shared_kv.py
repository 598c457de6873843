"""Shared KV across the batch-profile calbins of one model (C3 ``shared_kv``, sim-next only; spec §8).

A sequence moved between the B1 and B16 calbins of one KV group must produce exactly the logits it
would have produced at B1 throughout; DRAM is charged for weights + KV once; members are released in any
order; reset/DMA_UNKNOWN and the in-use rules act on the whole group; calrt-0.7.6 refuses it.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    Timing,
)
from calserve.runtime.reference import random_weights

from .conftest import SMALL

MAX_SEQ, SEQS = 48, 17


def _spec(batch: int, kv_dtype: str = "fp32", **kw: object) -> ProfileSpec:
    return dataclasses.replace(ProfileSpec(batch, MAX_SEQ, SEQS, kv_dtype=kv_dtype), **kw)


def _decode(cb: Calbin, lanes: dict[int, tuple[int, int]], idle: int) -> np.ndarray:
    """One decode step on ``cb`` with ``lanes`` = {lane: (seq, token)}; other lanes inactive (pointing at
    ``idle``). Returns the logits [B, vocab]."""
    b = cb.spec.compiled_batch
    seq_ids = [lanes[ln][0] if ln in lanes else idle for ln in range(b)]
    toks = [lanes[ln][1] if ln in lanes else 3 for ln in range(b)]
    pos = [cb.committed_len(lanes[ln][0]) if ln in lanes else 0 for ln in range(b)]
    r = cb.submit_decode(seq_ids, toks, pos, [ln in lanes for ln in range(b)]).wait(30)
    assert r.status is JobStatus.OK
    for ln in range(b):
        if ln in lanes:
            assert r.echo[ln].tolist() == [r.job_id, lanes[ln][0], pos[ln]]
        else:
            assert not r.logits[ln].any()
    return r.logits.copy()


def _b1_rows(cb1: Calbin, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Reference: prefill + greedy decode of one sequence at B1 only (logits row per step)."""
    seq = cb1.create_sequence()
    r = cb1.submit_prefill(seq, prompt).wait(30)
    rows = [r.logits[0].copy()]
    for _ in range(steps):
        rows.append(_decode(cb1, {0: (seq, int(np.argmax(rows[-1])))}, seq)[0])
    cb1.free_sequence(seq)
    return rows


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_b1_b16_b1_bitwise_equals_b1_throughout(next_device: Device, small_weights: dict,
                                                kv_dtype: str) -> None:
    cb1 = next_device.load_calbin(SMALL, small_weights, _spec(1, kv_dtype))
    cb16 = next_device.load_calbin(SMALL, small_weights, _spec(16, kv_dtype), kv_owner=cb1)
    assert cb16.kv_group == cb1.kv_group and cb16.kv_owner is cb1
    assert cb1.kv_group_members() == [cb1, cb16]
    prompt, other_prompt = [5, 17, 2, 99, 40], [8, 8, 1]
    expect = _b1_rows(cb1, prompt, 9)
    other_expect = _b1_rows(cb1, other_prompt, 3)

    seq = cb1.create_sequence()  # created through B1 ...
    r = cb1.submit_prefill(seq, prompt).wait(30)
    rows = [r.logits[0].copy()]
    other = cb16.create_sequence()  # ... and a batch-mate created through B16: one id space
    assert other != seq
    o_rows = [cb16.submit_prefill(other, other_prompt).wait(30).logits[0].copy()]
    idle = cb16.create_sequence()
    for _ in range(3):  # B1
        rows.append(_decode(cb1, {0: (seq, int(np.argmax(rows[-1])))}, idle)[0])
    assert cb16.committed_len(seq) == len(prompt) + 3  # the B16 member sees B1's commits
    for step in range(3):  # B16: lane 9 = seq, lane 2 = batch-mate (active 2 steps), rest inactive
        lanes = {9: (seq, int(np.argmax(rows[-1])))}
        if step < 2:
            lanes[2] = (other, int(np.argmax(o_rows[-1])))
        logits = _decode(cb16, lanes, idle)
        rows.append(logits[9])
        if step < 2:
            o_rows.append(logits[2])
    for _ in range(3):  # back to B1
        rows.append(_decode(cb1, {0: (seq, int(np.argmax(rows[-1])))}, idle)[0])
    o_rows.append(_decode(cb1, {0: (other, int(np.argmax(o_rows[-1])))}, idle)[0])
    for i, (got, want) in enumerate(zip(rows, expect, strict=True)):
        assert np.array_equal(got, want), f"step {i}"
    for i, (got, want) in enumerate(zip(o_rows, other_expect, strict=True)):
        assert np.array_equal(got, want), f"batch-mate step {i}"
    assert cb1.committed_len(idle) == 0 and not cb16.read_kv(idle).any()  # inactive lanes wrote nothing
    assert np.array_equal(cb1.read_kv(seq), cb16.read_kv(seq))


@settings(max_examples=12)
@given(schedule=st.lists(st.tuples(st.sampled_from([1, 4, 16]), st.integers(0, 15)), min_size=1,
                         max_size=7))
def test_any_profile_schedule_equals_b1(schedule: list[tuple[int, int]]) -> None:
    """Property: whatever profile (and lane) each decode step of a sequence uses, its logits equal B1's."""
    w = random_weights(SMALL, seed=11)
    with Device.open("sim-next", dram_bytes=1 << 30) as dev:
        cbs = {1: dev.load_calbin(SMALL, w, _spec(1))}
        for b in (4, 16):
            cbs[b] = dev.load_calbin(SMALL, w, _spec(b), kv_owner=cbs[1 if b == 4 else 4])
        assert len({c.kv_group for c in cbs.values()}) == 1
        expect = _b1_rows(cbs[1], [7, 3, 60], len(schedule))
        seq = cbs[16].create_sequence()
        rows = [cbs[4].submit_prefill(seq, [7, 3, 60]).wait(30).logits[0].copy()]
        for b, lane in schedule:
            ln = lane % b
            rows.append(_decode(cbs[b], {ln: (seq, int(np.argmax(rows[-1])))}, seq)[ln])
        for got, want in zip(rows, expect, strict=True):
            assert np.array_equal(got, want)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_dram_charged_once_and_released_in_any_order(next_device: Device, small_weights: dict,
                                                     order: tuple[int, ...]) -> None:
    base = next_device.dram(0)[1]
    cb1 = next_device.load_calbin(SMALL, small_weights, _spec(1))
    alone = cb1.introspect()
    assert next_device.dram(0)[1] - base == alone["dram_bytes"]
    shared = alone["shared_dram_bytes"]
    assert 0 < shared < alone["dram_bytes"]  # weights + KV; the rest is B1's own scratch
    members = [cb1]
    own = {cb1.calbin_id: alone["dram_bytes"] - shared}  # B1's own pools (activation scratch)
    for b in (4, 16):
        before = next_device.dram(0)[1]
        m = next_device.load_calbin(SMALL, small_weights, _spec(b), kv_owner=members[-1])
        info = m.introspect()
        # only its own pools: a standalone B-profile would have cost shared + those pools
        assert next_device.dram(0)[1] - before == info["dram_bytes"]
        assert info["shared_dram_bytes"] == shared and info["dram_bytes"] < shared
        own[m.calbin_id] = info["dram_bytes"]
        members.append(m)
    assert own[members[1].calbin_id] < own[members[2].calbin_id]  # B16 scratch > B4 scratch
    assert [m.introspect()["kv_group_size"] for m in members] == [3, 3, 3]
    assert next_device.dram(0)[1] - base == shared + sum(own.values())

    seq = members[1].create_sequence()
    members[2].submit_prefill(seq, [1, 2, 3]).wait(30)
    alive = list(members)
    for i in order:
        gone = members[i]
        gone.release()
        alive.remove(gone)
        assert gone.kv_group_members() == [] and gone.released
        if alive:  # the group's KV and weights stay charged and usable until the last member goes
            assert next_device.dram(0)[1] - base == shared + sum(own[m.calbin_id] for m in alive)
            assert alive[0].kv_group_members() == alive
            assert alive[0].introspect()["kv_group_size"] == len(alive)
            assert alive[0].committed_len(seq) == 3 + (len(members) - len(alive) - 1)
            tok = alive[0].committed_len(seq)
            _decode(alive[0], {0: (seq, tok)}, seq)
    assert next_device.dram(0)[1] == base


def test_standalone_calbin_is_a_group_of_one(next_device: Device, small_weights: dict) -> None:
    a = next_device.load_calbin(SMALL, small_weights, _spec(1))
    b = next_device.load_calbin(SMALL, small_weights, _spec(4))
    assert a.kv_group != b.kv_group and a.kv_owner is None
    assert a.kv_group_members() == [a] and a.introspect()["kv_group_size"] == 1
    sa, sb = a.create_sequence(), b.create_sequence()
    assert sa == sb == 0  # separate KvManagers: ids overlap, sequences do not
    a.submit_prefill(sa, [1, 2]).wait(30)
    assert b.committed_len(sb) == 0


def test_refused_on_calrt_0_7_6(device: Device, small_weights: dict) -> None:
    assert not device.capabilities.shared_kv
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, MAX_SEQ, SEQS))
    used = device.dram(0)[1]
    with pytest.raises(NotSupported, match="kv_owner"):
        device.load_calbin(SMALL, small_weights, ProfileSpec(1, MAX_SEQ, SEQS), kv_owner=cb)
    assert device.dram(0)[1] == used and device.calbins() == [cb]


def test_capability_flag_on_sim_next(next_device: Device) -> None:
    assert next_device.capabilities.shared_kv


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"config": dataclasses.replace(SMALL, rms_norm_eps=1e-5)}, "model.rms_norm_eps differs"),
        ({"config": dataclasses.replace(SMALL, rope_theta=5e4)}, "model.rope_theta differs"),
        ({"weights": "copy"}, "tensor 'model.embed_tokens.weight' is not the owner's buffer"),
        ({"weights": "copy_one"}, "tensor 'model.layers.1.mlp.up_proj.weight' is not the owner's"),
        ({"spec": _spec(4, max_seq=MAX_SEQ + 1)}, "profile.max_seq differs"),
        ({"spec": _spec(4, max_sequences=SEQS - 1)}, "profile.max_sequences differs"),
        ({"spec": _spec(4, kv_dtype="bf16")}, "profile.kv_dtype differs"),
        ({"chip": 1}, "chip"),
    ],
)
def test_mismatch_refused_naming_what_differs(next_device: Device, small_weights: dict,
                                              change: dict, match: str) -> None:
    owner = next_device.load_calbin(SMALL, small_weights, _spec(1))
    used = [next_device.dram(c)[1] for c in range(2)]
    weights = small_weights
    if change.get("weights") == "copy":
        weights = {k: v.copy() for k, v in small_weights.items()}
    elif change.get("weights") == "copy_one":
        weights = dict(small_weights)
        key = "model.layers.1.mlp.up_proj.weight"
        weights[key] = weights[key].copy()
    with pytest.raises(InvalidArgument, match=match):
        next_device.load_calbin(change.get("config", SMALL), weights, change.get("spec", _spec(4)),
                                chip=change.get("chip", 0), kv_owner=owner)
    assert [next_device.dram(c)[1] for c in range(2)] == used
    assert next_device.calbins() == [owner] and owner.kv_group_members() == [owner]


def test_released_owner_refused(next_device: Device, small_weights: dict) -> None:
    owner = next_device.load_calbin(SMALL, small_weights, _spec(1))
    owner.release()
    with pytest.raises(InvalidArgument, match="kv_owner"):
        next_device.load_calbin(SMALL, small_weights, _spec(4), kv_owner=owner)


def test_reset_invalidates_the_group_and_aborts_member_jobs(next_device: Device,
                                                             small_weights: dict) -> None:
    cb1 = next_device.load_calbin(SMALL, small_weights, _spec(1))
    cb16 = next_device.load_calbin(SMALL, small_weights, _spec(16), kv_owner=cb1)
    s1, s2 = cb1.create_sequence(), cb16.create_sequence()
    cb1.submit_prefill(s1, [1, 2, 3]).wait(30)
    cb16.submit_prefill(s2, [4, 5]).wait(30)
    next_device.inject_fault(FaultKind.TIMEOUT, JobEngine.PONG, nth=1)
    hung = cb16.submit_decode([s2] + [s1] * 15, [1] * 16, [2] + [0] * 15, [True] + [False] * 15,
                              engine=JobEngine.PONG)
    with pytest.raises(InvalidArgument, match="in flight"):  # in use by a member's job: group-wide
        cb1.free_sequence(s2)
    with pytest.raises(InvalidArgument, match="in flight"):
        cb16.release()
    next_device.reset(0)
    assert hung.wait(30).status is JobStatus.ABORTED
    for cb in (cb1, cb16):
        assert not cb.sequence_valid(s1) and not cb.sequence_valid(s2)
        with pytest.raises(InvalidArgument, match="invalidated"):
            cb.committed_len(s1)
    cb16.free_sequence(s1)  # freed through the other member
    cb1.free_sequence(s2)
    s = cb16.create_sequence()
    assert cb1.submit_prefill(s, [9]).wait(30).status is JobStatus.OK and cb16.committed_len(s) == 1


def test_running_job_on_one_member_makes_the_sequence_invalid_for_another(
        next_device: Device, small_weights: dict) -> None:
    slow = Timing(prefill_base_us=200_000.0)  # the B1 prefill runs for 200 ms of modeled time
    cb1 = next_device.load_calbin(SMALL, small_weights, _spec(1), timing=slow)
    cb4 = next_device.load_calbin(SMALL, small_weights, _spec(4), kv_owner=cb1)
    seq = cb1.create_sequence()
    pre = cb1.submit_prefill(seq, [1, 2, 3], engine=JobEngine.PING)
    # Position 3 is only right after the prefill committed: before that the B4 job is INVALID whether
    # the prefill is still queued (position != committed_len) or running (sequence busy).
    dec = cb4.submit_decode([seq] * 4, [7] * 4, [3] * 4, [True, False, False, False], engine=JobEngine.PONG)
    r = dec.wait(30)
    assert r.status is JobStatus.INVALID and not r.logits.any()
    assert pre.wait(30).status is JobStatus.OK
    assert cb4.committed_len(seq) == 3 and not cb4.read_kv(seq)[:, :, :, 3:].any()
    again = cb4.submit_decode([seq] * 4, [7] * 4, [3] * 4, [True, False, False, False]).wait(30)
    assert again.status is JobStatus.OK and cb1.committed_len(seq) == 4


def test_dma_unknown_reconfigure_every_member(next_device: Device, small_weights: dict) -> None:
    cb1 = next_device.load_calbin(SMALL, small_weights, _spec(1))
    cb4 = next_device.load_calbin(SMALL, small_weights, _spec(4), kv_owner=cb1)
    used = next_device.dram(0)[1]
    seq = cb1.create_sequence()
    next_device.inject_fault(FaultKind.DMA_UNKNOWN, JobEngine.PING, nth=1)
    assert cb4.submit_prefill(seq, [1, 2]).wait(30).status is JobStatus.DMA_UNKNOWN
    next_device.reset(0)
    assert cb1.needs_reconfigure and cb4.needs_reconfigure
    cb1.free_sequence(seq)
    for cb in (cb1, cb4):
        with pytest.raises(DeviceFaulted, match="reconfigure"):
            cb.create_sequence()
    cb1.reconfigure()
    seq = cb1.create_sequence()
    assert cb1.submit_prefill(seq, [1, 2]).wait(30).status is JobStatus.OK
    with pytest.raises(DeviceFaulted, match="reconfigure"):  # each member is reconfigured itself
        cb4.submit_decode([seq] * 4, [1] * 4, [2] * 4, [True, False, False, False])
    cb4.reconfigure()
    r = cb4.submit_decode([seq] * 4, [1] * 4, [2] * 4, [True, False, False, False]).wait(30)
    assert r.status is JobStatus.OK and cb1.committed_len(seq) == 3
    assert next_device.dram(0)[1] == used and cb1.kv_group == cb4.kv_group


def test_owner_released_while_member_job_in_flight(next_device: Device, small_weights: dict) -> None:
    base = next_device.dram(0)[1]
    cb1 = next_device.load_calbin(SMALL, small_weights, _spec(1))
    cb4 = next_device.load_calbin(SMALL, small_weights, _spec(4), kv_owner=cb1)
    seq = cb4.create_sequence()
    next_device.inject_fault(FaultKind.TIMEOUT, JobEngine.PING, nth=1)
    job = cb4.submit_prefill(seq, [3, 4])
    cb1.release()  # no job in flight on the owner itself: allowed, the group lives on
    assert cb4.kv_group_members() == [cb4]
    next_device.reset(0)
    assert job.wait(30).status is JobStatus.ABORTED
    cb4.free_sequence(seq)
    seq = cb4.create_sequence()
    assert cb4.submit_prefill(seq, [3, 4]).wait(30).status is JobStatus.OK
    cb4.release()
    assert next_device.dram(0)[1] == base
