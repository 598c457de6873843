"""A synchronous numpy stand-in of the runtime facade (``calserve.runtime.Device``), just enough to
exercise device-check's logic while the C runtime is not built. Computes with ReferenceModel."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from calserve.runtime.reference import ModelConfig, ReferenceModel, weight_shapes
from calserve.runtime.types import (
    RUNTIME_PROFILES,
    FaultKind,
    InvalidArgument,
    JobEngine,
    JobResult,
    JobStatus,
    NotSupported,
    OutOfSequences,
    ProfileSpec,
    Timing,
    WaitTimeout,
)


class FakeJob:
    def __init__(self, result: JobResult, hung: bool) -> None:
        self.result, self.hung = result, hung

    def wait(self, timeout_s: float) -> JobResult:
        if self.hung:
            raise WaitTimeout("fake timeout")
        return self.result


class FakeCalbin:
    def __init__(self, dev: FakeDevice, config: ModelConfig, weights: Mapping[str, np.ndarray], spec: ProfileSpec) -> None:
        self.dev, self.config, self.spec, self.chip = dev, config, spec, 0
        self.weights = weights
        self.seqs: dict[int, ReferenceModel | None] = {}
        self.bytes = sum(int(v.size) * 4 for v in weights.values()) + spec.max_sequences * spec.max_seq * config.kv_bytes_per_token_fp32
        self.job_id = 0

    def introspect(self) -> dict[str, Any]:
        s = self.spec
        return {
            "model": self.config.to_dict(), "compiled_batch": s.compiled_batch, "max_seq": s.max_seq,
            "max_sequences": s.max_sequences, "kv_dtype": s.kv_dtype, "valid_mask": s.valid_mask,
            "inactive_logits": s.inactive_logits, "inactive_writes_kv": s.inactive_writes_kv,
            "exact_submodel": s.exact_submodel,
            "kv_layout": {"dtype": "float32" if s.kv_dtype == "fp32" else "bfloat16", "bytes_per_token": self.config.kv_bytes_per_token_fp32},
            "tensors": [(n, sh, "float32") for n, sh in weight_shapes(self.config).items()],
        }

    def release(self) -> None:
        if self in self.dev.calbins:
            self.dev.calbins.remove(self)
            self.dev.used -= self.bytes

    def create_sequence(self) -> int:
        for i in range(self.spec.max_sequences):
            if i not in self.seqs:
                self.seqs[i] = ReferenceModel(self.config, self.weights, self.spec.kv_dtype)
                return i
        raise OutOfSequences("full")

    def free_sequence(self, sid: int) -> None:
        if sid not in self.seqs:
            raise InvalidArgument(f"seq {sid} not allocated")
        del self.seqs[sid]

    def _seq(self, sid: int) -> ReferenceModel:
        m = self.seqs.get(sid)
        if m is None:
            raise InvalidArgument(f"seq {sid} invalid")
        return m

    def committed_len(self, sid: int) -> int:
        return self._seq(sid).length

    def sequence_valid(self, sid: int) -> bool:
        return self.seqs.get(sid) is not None

    def read_kv(self, sid: int) -> np.ndarray:
        m = self._seq(sid)
        return np.stack([np.stack([k, v]) for k, v in zip(m.k_cache, m.v_cache)])

    def _job(self, logits: np.ndarray, echo: list[tuple[int, int, int]], engine: JobEngine) -> FakeJob:
        self.job_id += 1
        fault = self.dev.take_fault(engine)
        status = JobStatus.OK
        if fault == FaultKind.CCU_FAULT:
            status = JobStatus.CCU_FAULT
        res = JobResult(self.job_id, engine, status, logits, np.array(echo, np.int64), np.zeros(len(echo), np.uint64), 0.0)
        job = FakeJob(res, hung=fault == FaultKind.TIMEOUT)
        self.dev.jobs.append(job)
        return job

    def submit_prefill(self, sid: int, tokens: Sequence[int], engine: JobEngine = JobEngine.PING) -> FakeJob:
        m = self._seq(sid)
        logits = m.forward(list(tokens))[-1:]
        return self._job(logits, [(self.job_id + 1, sid, m.length - 1)], engine)

    def submit_decode(self, seq_ids: Sequence[int], tokens: Sequence[int], positions: Sequence[int], valid: Sequence[bool], engine: JobEngine = JobEngine.PING) -> FakeJob:
        out = np.zeros((self.spec.compiled_batch, self.config.vocab_size), np.float32)
        echo = []
        for i, (s, t, p, v) in enumerate(zip(seq_ids, tokens, positions, valid)):
            if v:
                m = self._seq(s)
                assert m.length == p
                out[i] = m.forward([t])[-1]
                echo.append((self.job_id + 1, s, p))
            else:
                echo.append((self.job_id + 1, -1, -1))
        return self._job(out, echo, engine)


class FakeDevice:
    capacity = 32 << 30

    def __init__(self, profile: str) -> None:
        self.capabilities = RUNTIME_PROFILES[profile]
        self.calbins: list[FakeCalbin] = []
        self.used = 0
        self.faults: dict[JobEngine, list[tuple[FaultKind, int]]] = {}
        self.jobs: list[FakeJob] = []

    @classmethod
    def open(cls, profile: str = "calrt-0.7.6", **_: Any) -> FakeDevice:
        return cls(profile)

    def __enter__(self) -> FakeDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        for cb in list(self.calbins):
            cb.release()

    def dram(self, chip: int = 0) -> tuple[int, int]:
        return self.capacity, self.used

    def load_calbin(self, config: ModelConfig, weights: Mapping[str, np.ndarray], spec: ProfileSpec, timing: Timing | None = None, chip: int = 0) -> FakeCalbin:
        if spec.compiled_batch > 1 and not self.capabilities.batch_profiles:
            raise NotSupported("batch profiles")
        cb = FakeCalbin(self, config, weights, spec)
        self.calbins.append(cb)
        self.used += cb.bytes
        return cb

    def inject_fault(self, kind: FaultKind, engine: JobEngine, nth: int, lane: int = 0) -> None:
        self.faults.setdefault(engine, []).append((kind, nth))

    def take_fault(self, engine: JobEngine) -> FaultKind | None:
        pend = self.faults.get(engine, [])
        for i, (kind, nth) in enumerate(pend):
            if nth == 1:
                del pend[i]
                return kind
            pend[i] = (kind, nth - 1)
        return None

    def reset(self, chip: int | None = None) -> None:
        for job in self.jobs:
            if job.hung:
                job.hung = False
                job.result.status = JobStatus.ABORTED
        for cb in self.calbins:
            for sid in cb.seqs:
                cb.seqs[sid] = None
