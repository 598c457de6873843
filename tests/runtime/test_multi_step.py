"""Multi-step greedy decode (C3-style ``multi_step``, sim-next only): ``submit_decode(..., steps=N)``.

One job runs N greedy decode steps, each lane's argmax fed back on the device: its ``step_tokens``
must equal the tokens of N single-step jobs with the host's ``np.argmax`` fed back, its logits rows
bitwise the last of those steps', echo the last position; the sequence commits N tokens; a fault
acts as on any job; calrt-0.7.6 refuses it. The fake device (engine tests) must agree with the
runtime on the same contract.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from calserve.runtime import Calbin, Device, InvalidArgument, JobEngine, JobStatus, NotSupported, ProfileSpec
from calserve.runtime import FaultKind, verify_lanes
from calserve.runtime.reference import ModelConfig, random_weights
from calserve.testing.fake_device import FakeBackend

from .conftest import SMALL, SMALL_LLAMA


def _prefill(cb: Calbin, prompt: list[int]) -> tuple[int, int]:
    """A new sequence with ``prompt`` committed, and the argmax of its prefill's logits."""
    s = cb.create_sequence()
    r = cb.submit_prefill(s, prompt).wait(30)
    assert r.status is JobStatus.OK
    return s, int(np.argmax(r.logits[0]))


@pytest.mark.parametrize(("config", "batch", "steps"), [(SMALL, 4, 6), (SMALL_LLAMA, 1, 3), (SMALL, 4, 1 + 1)])
def test_steps_equal_single_steps(next_device: Device, config: ModelConfig, batch: int, steps: int) -> None:
    assert next_device.capabilities.multi_step
    cb = next_device.load_calbin(config, random_weights(config, seed=5), ProfileSpec(batch, 40, 8))
    prompts = [[3, 9, 27], [5, 1, 50, 7, 7], [60, 2]][: max(1, batch - 1)]
    lanes = len(prompts)
    multi = [_prefill(cb, p) for p in prompts]
    ref = [_prefill(cb, p) for p in prompts]
    pad = batch - lanes
    valid = [True] * lanes + [False] * pad
    pos = [len(p) for p in prompts] + [0] * pad
    toks = [t for _, t in multi] + [0] * pad
    for _round in range(2):
        job = cb.submit_decode([s for s, _ in multi] + [0] * pad, toks, pos, valid, JobEngine.PONG, steps=steps)
        r = job.wait(30)
        assert r.status is JobStatus.OK and r.step_tokens is not None
        assert r.step_tokens.shape == (batch, steps) and r.step_tokens.dtype == np.int32
        assert verify_lanes(r, r.job_id, range(lanes), [(s, p + steps - 1) for (s, _), p in zip(multi, pos)]) == []
        rtoks = [t for _, t in ref] + [0] * pad
        want = np.zeros((batch, steps), np.int32)
        for k in range(steps):
            rr = cb.submit_decode([s for s, _ in ref] + [0] * pad, rtoks, [p + k for p in pos], valid).wait(30)
            assert rr.status is JobStatus.OK and rr.step_tokens is None
            rtoks = [int(np.argmax(rr.logits[i])) for i in range(lanes)] + [0] * pad
            want[:lanes, k] = rtoks[:lanes]
        assert np.array_equal(r.step_tokens, want)
        assert np.array_equal(r.logits[:lanes], rr.logits[:lanes])  # bitwise: the last step's rows
        assert not r.logits[lanes:].any()
        for (s, _), p in zip(multi, pos):
            assert cb.committed_len(s) == p + steps
        toks = r.step_tokens[:, -1].tolist()
        ref = [(s, t) for (s, _), t in zip(ref, rtoks)]
        pos = [p + steps if v else 0 for p, v in zip(pos, valid)]


def test_refusals_and_faults(next_device: Device, small_weights: dict) -> None:
    cb = next_device.load_calbin(SMALL, small_weights, ProfileSpec(1, 16, 4))
    s, t = _prefill(cb, [1, 2, 3])
    with pytest.raises(InvalidArgument, match="steps"):
        cb.submit_decode([s], [t], [3], [True], steps=0)
    with pytest.raises(InvalidArgument, match="exceed max_seq"):
        cb.submit_decode([s], [t], [3], [True], steps=14)
    assert cb.committed_len(s) == 3
    # a CCU fault: every step token zero, the sequence's KV unknown
    next_device.inject_fault(FaultKind.CCU_FAULT, engine=JobEngine.PING, nth=1)
    r = cb.submit_decode([s], [t], [3], [True], steps=5).wait(30)
    assert r.status is JobStatus.CCU_FAULT and r.step_tokens is not None and not r.step_tokens.any()
    assert not cb.sequence_valid(s)
    next_device.reset()


def test_not_on_calrt_076(device: Device, small_weights: dict) -> None:
    assert not device.capabilities.multi_step
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 16, 4))
    s, t = _prefill(cb, [1, 2, 3])
    with pytest.raises(NotSupported, match="multi_step"):
        cb.submit_decode([s], [t], [3], [True], steps=2)
    assert cb.submit_decode([s], [t], [3], [True], steps=1).wait(30).status is JobStatus.OK


def test_fake_device_agrees_with_its_single_steps() -> None:
    """The fake device's multi-step job: the tokens its own single-step jobs give with the argmax
    fed back, N committed, the last step's echo; refusals as the runtime's."""

    async def main() -> None:
        dev = FakeBackend("sim-next")
        cb = await dev.load_calbin(SMALL, {}, ProfileSpec(2, 20, 8))
        a, b = await cb.create_sequence(), await cb.create_sequence()
        for s in (a, b):
            t = await cb.submit_prefill(s, np.array([4, 5], np.int32), JobEngine.PING)
            assert (await cb.wait(t, 10)).status is JobStatus.OK
        ids, valid = np.array([a, b]), np.array([1, 1], np.uint8)
        t = await cb.submit_decode(ids, np.array([7, 8]), np.array([2, 2]), valid, JobEngine.PING, steps=4)
        r = await cb.wait(t, 10)
        assert r is not None and r.status is JobStatus.OK and r.step_tokens is not None
        assert r.echo[:, 2].tolist() == [5, 5] and await cb.committed_len(a) == 6
        # the same tokens one step at a time on two fresh sequences
        c, d = await cb.create_sequence(), await cb.create_sequence()
        for s in (c, d):
            t = await cb.submit_prefill(s, np.array([4, 5], np.int32), JobEngine.PING)
            await cb.wait(t, 10)
        toks = np.array([7, 8])
        got = []
        for k in range(4):
            t = await cb.submit_decode(np.array([c, d]), toks, np.array([2 + k] * 2), valid, JobEngine.PONG)
            rr = await cb.wait(t, 10)
            assert rr is not None and rr.status is JobStatus.OK
            toks = rr.logits.argmax(axis=1)
            got.append(toks.tolist())
        assert r.step_tokens.T.tolist() == got
        assert np.array_equal(r.logits, rr.logits)
        with pytest.raises(InvalidArgument, match="exceed max_seq"):
            await cb.submit_decode(ids, np.array([7, 8]), np.array([6, 6]), valid, JobEngine.PING, steps=15)
        old = await FakeBackend("calrt-0.7.6").load_calbin(SMALL, {}, ProfileSpec(1, 20, 8))
        with pytest.raises(NotSupported):
            await old.submit_decode(np.array([1]), np.array([1]), np.array([0]), np.array([1]),
                                    JobEngine.PING, steps=2)

    trio.run(main)


def test_lane_steps(next_device: Device, small_weights: dict) -> None:
    """Each lane its own step count: lane i's tokens, last row, echo and commit are those of its own
    ``lane_steps[i]`` single steps; zeros after them."""
    cb = next_device.load_calbin(SMALL, small_weights, ProfileSpec(4, 40, 8))
    prompts = [[3, 9, 27], [5, 1, 50, 7], [60, 2]]
    multi = [_prefill(cb, p) for p in prompts]
    ref = [_prefill(cb, p) for p in prompts]
    ls = [5, 1, 3]
    pos = [len(p) for p in prompts]
    r = cb.submit_decode([s for s, _ in multi] + [0], [t for _, t in multi] + [0], pos + [0],
                         [True] * 3 + [False], steps=5, lane_steps=ls + [1]).wait(30)
    assert r.status is JobStatus.OK and r.step_tokens is not None
    for i, ((s, t), (rs, rt)) in enumerate(zip(multi, ref)):
        toks = []
        for k in range(ls[i]):
            rr = cb.submit_decode([rs, 0, 0, 0], [rt, 0, 0, 0], [pos[i] + k, 0, 0, 0],
                                  [True, False, False, False]).wait(30)
            rt = int(np.argmax(rr.logits[0]))
            toks.append(rt)
        assert r.step_tokens[i].tolist() == toks + [0] * (5 - ls[i])
        assert np.array_equal(r.logits[i], rr.logits[0])
        assert r.echo[i].tolist() == [r.job_id, s, pos[i] + ls[i] - 1]
        assert cb.committed_len(s) == pos[i] + ls[i]
    with pytest.raises(InvalidArgument, match="lane_steps"):
        cb.submit_decode([multi[0][0], 0, 0, 0], [1, 0, 0, 0], [pos[0] + 5, 0, 0, 0], [True, False, False, False],
                         steps=2, lane_steps=[3, 1, 1, 1])
