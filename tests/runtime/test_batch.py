"""Batch invariance (sim-next): per-lane logits at B4/B8/B16 are bitwise equal to running the sequence
alone at B1; inactive lanes never write KV; interleaving; RemoveTokensAtEnd."""

from __future__ import annotations

import numpy as np
import pytest

from calserve.runtime import Calbin, Device, JobStatus, ProfileSpec
from calserve.runtime.reference import greedy_generate

from calserve.runtime.reference import ModelConfig, random_weights

from .conftest import (SMALL, SMALL_GEMMA2, SMALL_GEMMA3, SMALL_LLAMA, SMALL_LLAMA31, SMALL_LLAMA_SW,
                       SMALL_LLAMA_SW2, SMALL_QWEN2)


def _prefill(cb: Calbin, seq: int, prompt: list[int]) -> int:
    r = cb.submit_prefill(seq, prompt).wait(30)
    assert r.status is JobStatus.OK
    return int(np.argmax(r.logits[0]))


def _alone(cb1: Calbin, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Logits rows of `steps` greedy decode steps of one sequence on the B1 calbin."""
    seq = cb1.create_sequence()
    tok = _prefill(cb1, seq, prompt)
    rows = []
    for _ in range(steps):
        r = cb1.submit_decode([seq], [tok], [cb1.committed_len(seq)], [True]).wait(30)
        rows.append(r.logits[0].copy())
        tok = int(np.argmax(r.logits[0]))
    cb1.free_sequence(seq)
    return rows


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("batch", [4, 8, 16])
def test_batch_lanes_bitwise_equal_b1(next_device: Device, small_weights: dict, batch: int,
                                      kv_dtype: str) -> None:
    _check_lanes_equal_b1(next_device, SMALL, small_weights, batch, kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [SMALL_LLAMA, SMALL_QWEN2, SMALL_LLAMA31, SMALL_GEMMA3, SMALL_GEMMA2,
                                 SMALL_LLAMA_SW, SMALL_LLAMA_SW2],
                         ids=["llama", "qwen2", "llama31", "gemma3", "gemma2", "llama-sliding",
                              "llama-sliding-pattern2"])
def test_llama_batch_lanes_bitwise_equal_b1(next_device: Device, kv_dtype: str, cfg: ModelConfig) -> None:
    """The Llama path (no q/k norm, its RoPE base), Qwen2's (its q/k/v biases), Gemma 3's (its norms,
    GELU and sliding layers), Gemma 2's (its attention and final logit soft-capping) and sliding
    windows in Llama keep the same B1 vs B16 bitwise invariance
    (the lanes' prompts, 3 to 33 tokens, end inside and past the windows of 6 and 8)."""
    _check_lanes_equal_b1(next_device, cfg, random_weights(cfg, seed=11), 16, kv_dtype)


def _check_lanes_equal_b1(next_device: Device, cfg: ModelConfig, weights: dict, batch: int,
                          kv_dtype: str) -> None:
    steps = 6
    rng = np.random.default_rng(batch)
    cb1 = next_device.load_calbin(cfg, weights, ProfileSpec(1, 64, 2, kv_dtype=kv_dtype))
    cbb = next_device.load_calbin(cfg, weights,
                                  ProfileSpec(batch, 64, batch + 1, kv_dtype=kv_dtype))
    # Active lanes: every other lane plus lane 1 (so inactive lanes sit between active ones).
    active = sorted({*range(0, batch, 2), 1})
    prompts = {lane: [int(t) for t in rng.integers(0, cfg.vocab_size, 3 + 2 * lane)] for lane in active}
    expect = {lane: _alone(cb1, prompts[lane], steps) for lane in active}

    seqs = {lane: cbb.create_sequence() for lane in active}
    toks = {lane: _prefill(cbb, seqs[lane], prompts[lane]) for lane in active}
    # An idle sequence with committed KV that inactive lanes point at: its bytes must not change.
    idle = cbb.create_sequence()
    _prefill(cbb, idle, [5, 6, 7])
    idle_kv = cbb.read_kv(idle).copy()
    active_kv_before = {lane: cbb.read_kv(seqs[lane]).copy() for lane in active}
    for step in range(steps):
        seq_ids = [seqs.get(lane, idle) for lane in range(batch)]
        tokens = [toks.get(lane, 11) for lane in range(batch)]
        positions = [cbb.committed_len(seqs[lane]) if lane in seqs else 3 for lane in range(batch)]
        valid = [lane in seqs for lane in range(batch)]
        r = cbb.submit_decode(seq_ids, tokens, positions, valid).wait(30)
        assert r.status is JobStatus.OK
        for lane in range(batch):
            if lane in seqs:
                assert np.array_equal(r.logits[lane], expect[lane][step]), (lane, step)
                assert r.echo[lane].tolist() == [r.job_id, seqs[lane], positions[lane]]
                toks[lane] = int(np.argmax(r.logits[lane]))
            else:
                assert not r.logits[lane].any()
                assert r.echo[lane].tolist() == [r.job_id, -1, -1]
                assert int(r.checksum[lane]) == 0
    assert np.array_equal(cbb.read_kv(idle), idle_kv)
    assert cbb.committed_len(idle) == 3
    for lane in active:  # active lanes wrote exactly positions [len, len+steps)
        kv = cbb.read_kv(seqs[lane])
        n = len(prompts[lane])
        assert np.array_equal(kv[:, :, :, :n], active_kv_before[lane][:, :, :, :n])
        assert kv[:, :, :, n : n + steps].any()
        assert not kv[:, :, :, n + steps :].any()


@pytest.mark.parametrize("null_compute", [False, True])
def test_inactive_rows_are_zeros_in_a_reused_buffer(small_weights: dict, null_compute: bool) -> None:
    """A job's logits buffer is not cleared when it is created (the submitting thread would clear
    lanes x vocab floats a job): execution writes the valid lanes' rows and zeroes the others. So a
    job with inactive lanes, created right after a full batch's job was released (the allocator
    hands its buffer back), still returns all-zero rows and checksum 0 for them, computed or not."""
    with Device.open("sim-next", dram_bytes=1 << 30, null_compute=null_compute) as dev:
        cb = dev.load_calbin(SMALL, small_weights, ProfileSpec(16, 64, 16))
        seqs = [cb.create_sequence() for _ in range(16)]
        toks = [_prefill(cb, s, [1 + lane, 2, 3]) for lane, s in enumerate(seqs)]
        for round_ in range(3):
            full = cb.submit_decode(seqs, toks, [cb.committed_len(s) for s in seqs], [True] * 16).wait(30)
            assert full.status is JobStatus.OK
            assert all(full.logits[lane].any() for lane in range(16))
            toks = full.logits.argmax(axis=1).tolist()
            del full  # the job released: its buffer goes back to the allocator
            valid = [(lane + round_) % 3 == 0 for lane in range(16)]
            r = cb.submit_decode(seqs, toks, [cb.committed_len(s) for s in seqs], valid).wait(30)
            assert r.status is JobStatus.OK
            for lane in range(16):
                if valid[lane]:
                    assert r.logits[lane].any() and int(r.checksum[lane]) != 0
                    toks[lane] = int(np.argmax(r.logits[lane]))
                else:
                    assert not r.logits[lane].any(), (round_, lane)
                    assert int(r.checksum[lane]) == 0
            del r


def test_two_sequences_interleaved_match_alone(device: Device, small_weights: dict) -> None:
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 64, 2))
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3]]
    alone = [greedy_generate(SMALL, small_weights, p, 12) for p in prompts]
    seqs = [cb.create_sequence() for _ in prompts]
    toks = [[_prefill(cb, s, p)] for s, p in zip(seqs, prompts)]
    for _ in range(11):
        for i, s in enumerate(seqs):
            r = cb.submit_decode([s], [toks[i][-1]], [cb.committed_len(s)], [True]).wait(30)
            toks[i].append(int(np.argmax(r.logits[0])))
    assert toks == alone


@pytest.mark.parametrize("cut_at", [15, 16, 17])
def test_remove_tokens_at_end_then_redecode(device: Device, small_weights: dict, cut_at: int) -> None:
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 64, 1))
    seq = cb.create_sequence()
    prompt = [3, 1, 4, 1, 5]
    toks = [_prefill(cb, seq, prompt)]
    rows = []
    while cb.committed_len(seq) < 24:
        r = cb.submit_decode([seq], [toks[-1]], [cb.committed_len(seq)], [True]).wait(30)
        rows.append(r.logits[0].copy())
        toks.append(int(np.argmax(r.logits[0])))
    # toks[i] is fed at position len(prompt) + i; rewind so committed_len == cut_at.
    cb.remove_tokens_at_end(seq, cb.committed_len(seq) - cut_at)
    assert cb.committed_len(seq) == cut_at
    i = cut_at - len(prompt)
    tok = toks[i]
    for j in range(i, len(rows)):
        r = cb.submit_decode([seq], [tok], [cb.committed_len(seq)], [True]).wait(30)
        assert np.array_equal(r.logits[0], rows[j])
        tok = int(np.argmax(r.logits[0]))
        assert tok == toks[j + 1]


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "gemma3", "gemma2", "llama-sliding"])
def test_decode_steps_equal_one_prefill_of_the_same_tokens(next_device: Device, small_weights: dict,
                                                           arch: str, kv_dtype: str) -> None:
    """A decode step's RoPE and KV write run inside its attention tasks (each decode row is its own
    sequence); a prefill's run for all rows before its attention. Both must give the same bits: the
    logits after decoding t_1..t_k one step at a time (B16, several lanes at once) equal those of one
    prefill of prompt + t_1..t_k, and so does the KV the steps wrote."""
    cfg = {"qwen3": SMALL, "llama": SMALL_LLAMA, "qwen2": SMALL_QWEN2, "gemma3": SMALL_GEMMA3,
           "gemma2": SMALL_GEMMA2, "llama-sliding": SMALL_LLAMA_SW2}[arch]
    w = small_weights if arch == "qwen3" else random_weights(cfg, seed=11)
    rng = np.random.default_rng(5)
    cb = next_device.load_calbin(cfg, w, ProfileSpec(16, 64, 32, kv_dtype=kv_dtype))
    lanes = 5
    seqs = [cb.create_sequence() for _ in range(lanes)]
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, 4 + 3 * i)] for i in range(lanes)]
    toks = [_prefill(cb, s, p) for s, p in zip(seqs, prompts)]
    idle = cb.create_sequence()  # what the 11 inactive lanes name (they compute nothing)
    _prefill(cb, idle, [5, 6, 7])
    pad = 16 - lanes
    fed: list[list[int]] = [[] for _ in range(lanes)]
    last = None
    for _ in range(6):
        r = cb.submit_decode(seqs + [idle] * pad, toks + [11] * pad,
                             [cb.committed_len(s) for s in seqs] + [3] * pad,
                             [True] * lanes + [False] * pad).wait(30)
        assert r.status is JobStatus.OK
        for i in range(lanes):
            fed[i].append(toks[i])
        last = r.logits[:lanes].copy()
        toks = [int(np.argmax(row)) for row in r.logits[:lanes]]
    assert last is not None
    for i in range(lanes):
        one = cb.create_sequence()
        r = cb.submit_prefill(one, prompts[i] + fed[i]).wait(30)
        assert r.status is JobStatus.OK
        assert np.array_equal(r.logits[0], last[i]), i
        assert np.array_equal(cb.read_kv(one), cb.read_kv(seqs[i])), i
        cb.free_sequence(one)
