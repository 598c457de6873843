"""Multi-step greedy decode driven by the host: ``submit_decode(..., steps=N, host=True)``.

N one-step device jobs back to back, each lane's argmax fed back by the binding in C
(``ext/host_steps.c``; its C tests run it under ASan and TSan). Through the Python API: the same
result as the device's own multi-step job (sim-next) and as N single steps (calrt-0.7.6 too, which
has no multi-step of its own), one device job a step, ``done`` driving a run without ``wait``, a
timed-out wait then a reset, and the refusals.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from calserve.runtime import Calbin, Device, InvalidArgument, JobEngine, JobStatus, NotSupported, ProfileSpec, Timing
from calserve.runtime import WaitTimeout, verify_lanes
from calserve.runtime.reference import ModelConfig, random_weights

from .conftest import SMALL, SMALL_LLAMA


def _prefill(cb: Calbin, prompt: list[int]) -> tuple[int, int]:
    s = cb.create_sequence()
    r = cb.submit_prefill(s, prompt).wait(30)
    assert r.status is JobStatus.OK
    return s, int(np.argmax(r.logits[0]))


def _submitted(dev: Device) -> int:
    return sum(dev.counters(e).submitted for e in JobEngine)


@pytest.mark.parametrize(("config", "batch", "steps", "lane_steps"),
                         [(SMALL, 4, 6, None), (SMALL_LLAMA, 1, 3, None), (SMALL, 4, 5, [5, 1, 3, 1])])
def test_host_run_equals_the_device_multi_step(next_device: Device, config: ModelConfig, batch: int,
                                               steps: int, lane_steps: list[int] | None) -> None:
    cb = next_device.load_calbin(config, random_weights(config, seed=7), ProfileSpec(batch, 40, 12))
    prompts = [[3, 9, 27], [5, 1, 50, 7, 7], [60, 2]][: max(1, batch - 1)]
    lanes = len(prompts)
    pad = batch - lanes
    valid = [True] * lanes + [False] * pad
    pos = [len(p) for p in prompts] + [0] * pad
    host = [_prefill(cb, p) for p in prompts]
    dev = [_prefill(cb, p) for p in prompts]
    for _round in range(2):
        before = _submitted(next_device)
        job = cb.submit_decode([s for s, _ in host] + [0] * pad, [t for _, t in host] + [0] * pad, pos, valid,
                               JobEngine.PONG, steps=steps, lane_steps=lane_steps, host=True)
        r = job.wait(30)
        most = max((lane_steps or [steps] * batch)[i] for i in range(lanes))
        assert job.submitted() == most == _submitted(next_device) - before  # one device job a step
        d = cb.submit_decode([s for s, _ in dev] + [0] * pad, [t for _, t in dev] + [0] * pad, pos, valid,
                             JobEngine.PING, steps=steps, lane_steps=lane_steps).wait(30)
        assert r.status is d.status is JobStatus.OK
        assert r.step_tokens is not None and d.step_tokens is not None
        assert np.array_equal(r.step_tokens, d.step_tokens)
        assert np.array_equal(r.logits, d.logits) and np.array_equal(r.checksum, d.checksum)
        assert np.array_equal(r.echo[:, 2], d.echo[:, 2]) and (r.echo[:, 0] == r.job_id).all()
        n = lane_steps or [steps] * batch
        assert verify_lanes(r, r.job_id, range(lanes), [(s, p + n[i] - 1) for i, ((s, _), p) in
                                                        enumerate(zip(host, pos))]) == []
        for i, ((s, _), (ds, _)) in enumerate(zip(host, dev)):
            assert cb.committed_len(s) == cb.committed_len(ds) == pos[i] + n[i]
        host = [(s, int(r.step_tokens[i, n[i] - 1])) for i, (s, _) in enumerate(host)]
        dev = [(s, int(d.step_tokens[i, n[i] - 1])) for i, (s, _) in enumerate(dev)]
        pos = [p + n[i] if v else 0 for i, (p, v) in enumerate(zip(pos, valid))]


def test_host_run_on_calrt_076_equals_single_steps(device: Device, small_weights: dict) -> None:
    assert not device.capabilities.multi_step
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 40, 4))
    (s, t), (rs, rt) = _prefill(cb, [1, 2, 3]), _prefill(cb, [1, 2, 3])
    r = cb.submit_decode([s], [t], [3], [True], steps=7, host=True).wait(30)
    assert r.status is JobStatus.OK and r.step_tokens is not None
    want = []
    for k in range(7):
        rr = cb.submit_decode([rs], [rt], [3 + k], [True]).wait(30)
        rt = int(np.argmax(rr.logits[0]))
        want.append(rt)
    assert r.step_tokens[0].tolist() == want
    assert np.array_equal(r.logits, rr.logits) and r.echo[0].tolist() == [r.job_id, s, 9]
    assert cb.committed_len(s) == 10
    with pytest.raises(InvalidArgument, match="lane_steps"):
        cb.submit_decode([s], [t], [10], [True], steps=2, lane_steps=[3], host=True)
    with pytest.raises(InvalidArgument, match="steps"):
        cb.submit_decode([s], [t], [10], [True], steps=65, host=True)


def test_done_drives_a_run_alone(device: Device, small_weights: dict) -> None:
    """Nobody waits: polling ``done`` advances the run step by step to its end (what the engine's
    completion paths may do with any job)."""
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 40, 4))
    (s, t), (rs, rt) = _prefill(cb, [4, 5]), _prefill(cb, [4, 5])
    job = cb.submit_decode([s], [t], [2], [True], steps=5, host=True)
    for _ in range(100_000):
        if job.done():
            break
        time.sleep(1e-4)
    assert job.done() and job.submitted() == 5
    r = job.wait(0)
    ref = cb.submit_decode([rs], [rt], [2], [True], steps=5, host=True).wait(30)
    assert r.step_tokens is not None and ref.step_tokens is not None
    assert np.array_equal(r.step_tokens, ref.step_tokens)


def test_timed_out_wait_then_reset(device: Device, small_weights: dict) -> None:
    """A wait that times out leaves the run in flight (WaitTimeout, counted); a reset aborts its step
    in flight, and the run ends ABORTED with no tokens, having submitted no further step."""
    cb = device.load_calbin(SMALL, small_weights, ProfileSpec(1, 40, 4), Timing(decode_step_us={1: 20_000.0}))
    s, t = _prefill(cb, [1, 2])
    job = cb.submit_decode([s], [t], [2], [True], steps=6, host=True)
    with pytest.raises(WaitTimeout):
        job.wait(0.005)
    device.reset()
    r = job.wait(30)
    assert r.status is JobStatus.ABORTED and r.step_tokens is not None and not r.step_tokens.any()
    assert job.submitted() < 6


def test_stop_ends_a_run_with_its_step_in_flight(next_device: Device, small_weights: dict) -> None:
    """``Job.stop``: the run's lanes end with the step in flight, each having run the least of its
    own steps and the steps run; the result is what a run of that many steps gives (tokens
    ``[lanes, steps run]``, last rows, echo, KV). Nobody drives the run between the stop and the
    wait here, so the steps run are the steps submitted at the stop. A device job: no effect."""
    # a timed step (2 ms): each done() below advances the run by one step at most
    cb = next_device.load_calbin(SMALL, small_weights, ProfileSpec(4, 40, 12), Timing(decode_step_us={4: 2000.0}))
    prompts = [[3, 9, 27], [5, 1, 50, 7, 7], [60, 2]]
    pos = [len(p) for p in prompts] + [0]
    valid = [True, True, True, False]
    lane_steps = [8, 2, 7, 1]
    host = [_prefill(cb, p) for p in prompts]
    ref = [_prefill(cb, p) for p in prompts]
    job = cb.submit_decode([s for s, _ in host] + [0], [t for _, t in host] + [0], pos, valid,
                           steps=8, lane_steps=lane_steps, host=True)
    for _ in range(100_000):  # polled up to its third step (done() advances it without blocking)
        if job.submitted() >= 3 or job.done():
            break
        time.sleep(1e-4)
    assert job.stop() is True
    m = job.submitted()
    r = job.wait(30)
    assert r.status is JobStatus.OK and job.submitted() == m and 3 <= m < 8
    assert r.step_tokens is not None and r.step_tokens.shape == (4, m)
    cut = [min(n, m) for n in lane_steps[:3]]
    want = cb.submit_decode([s for s, _ in ref] + [0], [t for _, t in ref] + [0], pos, valid,
                            steps=m, lane_steps=cut + [1], host=True).wait(30)
    assert want.step_tokens is not None and np.array_equal(r.step_tokens, want.step_tokens)
    assert np.array_equal(r.logits[:3], want.logits[:3]) and np.array_equal(r.checksum, want.checksum)
    assert r.echo[:3, 2].tolist() == [p + n - 1 for p, n in zip(pos, cut)]
    assert [cb.committed_len(s) for s, _ in host] == [p + n for p, n in zip(pos, cut)]
    assert verify_lanes(r, r.job_id, range(3), [(s, p + n - 1) for (s, _), p, n in zip(host, pos, cut)]) == []
    last = [int(r.step_tokens[i, n - 1]) for i, n in enumerate(cut)]
    one = cb.submit_decode([s for s, _ in host] + [0], last + [0],
                           [p + n for p, n in zip(pos, cut)] + [0], valid)
    assert one.stop() is False and one.wait(30).status is JobStatus.OK


def test_lanes_end_on_their_end_tokens(next_device: Device, small_weights: dict) -> None:
    """``ends``: a lane whose argmax is one of its end tokens (from its ``end_from`` step on) ends
    with that step: its steps, KV, last row and echo are a run of that many steps', and the run
    ends once no lane runs (``step_tokens`` ``[lanes, steps run]``, one device job a step). The
    result's ``lane_steps`` says each lane's steps run; None when no lane ran short."""
    cb = next_device.load_calbin(SMALL, small_weights, ProfileSpec(4, 48, 24))
    prompts = [[3, 9, 27], [5, 1, 50, 7, 7], [60, 2]]
    pos = [len(p) for p in prompts] + [0]
    valid = [True, True, True, False]
    full = [_prefill(cb, p) for p in prompts]  # the reference: 8 greedy steps each
    want = cb.submit_decode([s for s, _ in full] + [0], [t for _, t in full] + [0], pos, valid,
                            steps=8, host=True).wait(30)
    assert want.step_tokens is not None
    w = want.step_tokens[:3].tolist()
    # lane 0 ends on its step-1 token; lane 1's end token counts from step 4 on; lane 2: none.
    # Case 2: lane 2 ends on its step-2 token and lane 1 at its own lane_steps (3): the run stops
    # after the last of them.
    for case in (1, 2):
        ids = [[w[0][1], 10_000], [w[1][4]] if case == 1 else [], [w[2][2]] if case == 2 else [], [w[0][0]]]
        frm = [0, 4 if case == 1 else 0, 0, 0]
        lane_steps = [8, 8 if case == 1 else 3, 8, 1]
        per = []
        for i in range(3):
            n = lane_steps[i]
            for k in range(frm[i], n):
                if w[i][k] in ids[i]:
                    n = k + 1
                    break
            per.append(n)
        most = max(per)
        assert per[0] <= 2 and (most == 8 if case == 1 else most < 8)
        off = np.cumsum([0] + [len(x) for x in ids]).astype(np.int32)
        host = [_prefill(cb, p) for p in prompts]
        ref = [_prefill(cb, p) for p in prompts]
        before = _submitted(next_device)
        job = cb.submit_decode([s for s, _ in host] + [0], [t for _, t in host] + [0], pos, valid, steps=8,
                               lane_steps=lane_steps, host=True,
                               ends=(off, np.array([t for x in ids for t in x], np.int32),
                                     np.array(frm, np.int32)))
        r = job.wait(30)
        assert r.status is JobStatus.OK and job.submitted() == most == _submitted(next_device) - before
        assert r.lane_steps is not None and r.lane_steps[:3].tolist() == per and r.lane_steps[3] == 0
        assert r.step_tokens is not None and r.step_tokens.shape == (4, most)
        assert [r.step_tokens[i, :n].tolist() for i, n in enumerate(per)] == [w[i][:n] for i, n in enumerate(per)]
        assert all(not r.step_tokens[i, n:].any() for i, n in enumerate(per))
        assert [cb.committed_len(s) for s, _ in host] == [p + n for p, n in zip(pos, per)]
        assert verify_lanes(r, r.job_id, range(3), [(s, p + n - 1) for (s, _), p, n in zip(host, pos, per)]) == []
        solo = cb.submit_decode([s for s, _ in ref] + [0], [t for _, t in ref] + [0], pos, valid, steps=most,
                                lane_steps=per + [1], host=True).wait(30)
        assert np.array_equal(r.logits[:3], solo.logits[:3]) and np.array_equal(r.checksum, solo.checksum)
    # none drawn: nothing short
    s, t = _prefill(cb, prompts[0])
    r = cb.submit_decode([s, 0, 0, 0], [t, 0, 0, 0], [3, 0, 0, 0], [True, False, False, False], steps=4,
                         host=True, ends=(np.array([0, 1, 1, 1, 1], np.int32), np.array([-5], np.int32), None)
                         ).wait(30)
    assert r.lane_steps is None and r.step_tokens is not None and r.step_tokens.shape == (4, 4)
    # refusals: ends on a device job; offsets that are not offsets
    with pytest.raises(NotSupported, match="ends"):
        cb.submit_decode([s, 0, 0, 0], [t, 0, 0, 0], [7, 0, 0, 0], [True, False, False, False], steps=2,
                         ends=(np.zeros(5, np.int32), np.zeros(0, np.int32), None))
    with pytest.raises(ValueError, match="end_off"):
        cb.submit_decode([s, 0, 0, 0], [t, 0, 0, 0], [7, 0, 0, 0], [True, False, False, False], steps=2,
                         host=True, ends=(np.array([0, 2, 1, 1, 1], np.int32), np.zeros(2, np.int32), None))
    with pytest.raises(ValueError, match="end_off"):
        cb.submit_decode([s, 0, 0, 0], [t, 0, 0, 0], [7, 0, 0, 0], [True, False, False, False], steps=2,
                         host=True, ends=(np.array([0, 1, 1, 1, 3], np.int32), np.zeros(2, np.int32), None))
