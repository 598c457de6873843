"""The synchronous baseline runner (issue 5 item 9): one thread, B=1, same facade as the engine.

Checked against the numpy reference through a minimal in-test facade (always) and through the real
software runtime when the extension is built.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from bench.sync_baseline import BaselineRequest, SyncBaseline, run_baseline
from calserve.engine.sampler import LaneSampling, sample_batch
from calserve.engine.types import FinishReason, SamplingParams
from calserve.runtime.reference import ModelConfig, ReferenceModel, greedy_generate, random_weights
from calserve.runtime.types import JobEngine, JobResult, JobStatus, ProfileSpec

CFG = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
)
WEIGHTS = random_weights(CFG, seed=3)
PROMPTS = [(1, 2, 3), (7, 8, 9, 10, 11), (42,), (5, 60, 61, 62)]


@dataclasses.dataclass
class _FakeJob:
    result: JobResult

    def wait(self, timeout_s: float) -> JobResult:
        return self.result


class FakeCalbin:
    """The KvManager + job part of the Calbin contract over ReferenceModel, synchronous."""

    def __init__(self, batch: int = 1) -> None:
        self.spec = ProfileSpec(compiled_batch=batch, max_seq=128, max_sequences=4)
        self.seqs: dict[int, ReferenceModel] = {}
        self.next_id = 0
        self.jobs = 0
        self.fail_job: int | None = None  # 1-based job number that ends CCU_FAULT
        self.calls: list[str] = []

    def create_sequence(self) -> int:
        sid = self.next_id
        self.next_id += 1
        self.seqs[sid] = ReferenceModel(CFG, WEIGHTS)
        return sid

    def free_sequence(self, seq_id: int) -> None:
        del self.seqs[seq_id]

    def committed_len(self, seq_id: int) -> int:
        return self.seqs[seq_id].length

    def _result(self, logits: np.ndarray) -> _FakeJob:
        self.jobs += 1
        status = JobStatus.CCU_FAULT if self.jobs == self.fail_job else JobStatus.OK
        b = logits.shape[0]
        return _FakeJob(
            JobResult(self.jobs, JobEngine.PING, status, logits, np.zeros((b, 3), np.int64), np.zeros(b, np.uint64), 0.0)
        )

    def submit_prefill(self, seq_id: int, tokens: Sequence[int] | np.ndarray, engine: JobEngine = JobEngine.PING) -> _FakeJob:
        self.calls.append("prefill")
        return self._result(self.seqs[seq_id].forward(list(np.asarray(tokens)))[-1:])

    def submit_decode(self, seq_ids, tokens, positions, valid, engine: JobEngine = JobEngine.PING) -> _FakeJob:  # type: ignore[no-untyped-def]
        self.calls.append("decode")
        b = self.spec.compiled_batch
        assert len(seq_ids) == len(tokens) == len(positions) == len(valid) == b
        out = np.zeros((b, CFG.vocab_size), np.float32)
        for lane in range(b):
            if valid[lane]:
                m = self.seqs[int(seq_ids[lane])]
                assert int(positions[lane]) == m.length, "position must equal committed_len"
                out[lane] = m.forward([int(tokens[lane])])[-1]
        return self._result(out)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_equals_reference_and_records_are_sane(batch: int) -> None:
    cb = FakeCalbin(batch)
    reqs = [BaselineRequest(i, p, _greedy(6 + i), arrival_s=0.002 * i) for i, p in enumerate(PROMPTS)]
    recs = SyncBaseline(cb).run(reqs)
    assert [r.request_id for r in recs] == [0, 1, 2, 3]  # one at a time, arrival order
    for r, q in zip(recs, reqs):
        assert list(r.tokens) == greedy_generate(CFG, WEIGHTS, list(q.prompt_tokens), q.sampling.max_tokens)
        assert r.finish_reason is FinishReason.LENGTH and r.error is None
        assert r.arrival_s <= r.start_s <= r.token_times_s[0] <= r.finish_s
        assert list(r.token_times_s) == sorted(r.token_times_s)
        assert len(r.inter_token_s) == len(r.tokens) - 1
        assert r.ttft_s is not None and r.ttft_s >= 0 and r.e2e_s >= r.ttft_s
    # Batch 1 means strictly serial: each request starts after the previous one finished.
    assert all(a.finish_s <= b.start_s for a, b in zip(recs, recs[1:]))
    assert cb.seqs == {}  # every sequence freed
    # max_tokens=n costs one prefill and n-1 decodes.
    assert cb.calls.count("prefill") == 4 and cb.calls.count("decode") == sum(5 + i for i in range(4))


def test_eos_stops_and_min_tokens_and_ignore_eos() -> None:
    prompt = list(PROMPTS[1])
    ref = greedy_generate(CFG, WEIGHTS, prompt, 8)
    eos = ref[2]
    first = ref.index(eos)
    recs = run_baseline(
        FakeCalbin(),
        [
            BaselineRequest(0, tuple(prompt), _greedy(8)),
            BaselineRequest(1, tuple(prompt), dataclasses.replace(_greedy(8), ignore_eos=True)),
            BaselineRequest(2, tuple(prompt), dataclasses.replace(_greedy(8), min_tokens=first + 1)),
        ],
        eos_token_ids=[eos],
    )
    assert list(recs[0].tokens) == ref[: first + 1] and recs[0].finish_reason is FinishReason.STOP
    assert list(recs[1].tokens) == ref and recs[1].finish_reason is FinishReason.LENGTH
    later = [i for i, t in enumerate(ref) if t == eos and i > first]
    want = ref[: later[0] + 1] if later else ref
    assert list(recs[2].tokens) == want


def test_seeded_sampling_equals_sample_batch_with_b1() -> None:
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=1234, max_tokens=7)
    prompt = [3, 1, 4, 1, 5]
    recs = run_baseline(FakeCalbin(), [BaselineRequest(0, tuple(prompt), sp), BaselineRequest(1, tuple(prompt), sp)])
    m = ReferenceModel(CFG, WEIGHTS)
    logits = m.forward(prompt)[-1:]
    want: list[int] = []
    for step in range(sp.max_tokens):
        t = int(sample_batch(logits, [LaneSampling.from_params(sp, step=step)]).tokens[0])
        want.append(t)
        logits = m.forward([t])[-1:]
    assert list(recs[0].tokens) == want == list(recs[1].tokens)


def test_device_fault_ends_that_request_with_an_error_and_the_next_succeeds() -> None:
    cb = FakeCalbin()
    cb.fail_job = 3  # the second decode of request 0
    resets: list[int] = []
    recs = run_baseline(
        cb,
        [BaselineRequest(0, PROMPTS[0], _greedy(5)), BaselineRequest(1, PROMPTS[1], _greedy(5))],
        reset=lambda: resets.append(cb.jobs),
    )
    assert resets == [3]  # the device is reset right after the faulted job
    assert recs[0].finish_reason is FinishReason.ERROR and "CCU_FAULT" in (recs[0].error or "")
    assert len(recs[0].tokens) == 2
    assert list(recs[1].tokens) == greedy_generate(CFG, WEIGHTS, list(PROMPTS[1]), 5)
    assert cb.seqs == {}


# ------------------------------------------------------------------------------- real runtime
_HAVE_RUNTIME = importlib.util.find_spec("calserve._calrt") is not None


@pytest.fixture
def real_calbin() -> Iterator[object]:
    from calserve.runtime import Device

    dev = Device.open("calrt-0.7.6", dram_bytes=256 << 20)
    try:
        yield dev.load_calbin(CFG, WEIGHTS, ProfileSpec(compiled_batch=1, max_seq=64, max_sequences=4))
    finally:
        dev.close()


@pytest.mark.skipif(not _HAVE_RUNTIME, reason="calserve._calrt is not built (pip install -e .)")
def test_real_runtime_greedy_equals_reference(real_calbin: object) -> None:
    reqs = [BaselineRequest(i, p, _greedy(10), arrival_s=0.001 * i) for i, p in enumerate(PROMPTS)]
    recs = SyncBaseline(real_calbin, wait_timeout_s=30.0).run(reqs)  # type: ignore[arg-type]
    for r, q in zip(recs, reqs):
        assert r.error is None
        assert list(r.tokens) == greedy_generate(CFG, WEIGHTS, list(q.prompt_tokens), 10)
