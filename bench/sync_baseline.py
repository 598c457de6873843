"""The synchronous baseline runner (issue 5 item 9, spec §19 M1, the batching note's engine loop).

One OS thread, batch = 1, no trio: requests arrive on a :class:`queue.Queue`; the engine thread
takes one, creates its KV sequence, prefills, decodes token by token until max tokens or EOS, frees
the sequence, and takes the next. It runs on the same runtime facade (``calserve.runtime.Calbin``)
as the async engine, so M1 ("async in-flight=1 behaves like the sync baseline, P50 <= 3% / P99 <= 5%
worse") compares scheduling overhead only (bench/m1_async_vs_sync.py).

The calbin must have ``compiled_batch == 1`` or more (only lane 0 is used; other lanes are invalid
and never write KV). Sampling goes through :func:`calserve.engine.sampler.sample_batch` with B = 1,
so seeded outputs equal the async engine's.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, final

import numpy as np

from calserve.engine.sampler import LaneSampling, resolve_seed, sample_batch
from calserve.engine.types import FinishReason, SamplingParams
from calserve.runtime.types import CalrtError, JobEngine, JobResult, JobStatus, ProfileSpec, WaitTimeout

__all__ = [
    "BaselineRequest",
    "BaselineRecord",
    "BaselineCalbin",
    "SyncBaseline",
    "run_baseline",
]


class _Job(Protocol):
    def wait(self, timeout_s: float) -> JobResult: ...


class BaselineCalbin(Protocol):
    """The part of ``calserve.runtime.Calbin`` the baseline uses (tests may pass a fake)."""

    spec: ProfileSpec

    def create_sequence(self) -> int: ...
    def free_sequence(self, seq_id: int) -> None: ...
    def committed_len(self, seq_id: int) -> int: ...
    def submit_prefill(self, seq_id: int, tokens: Sequence[int] | np.ndarray, engine: JobEngine = ...) -> _Job: ...
    def submit_decode(
        self,
        seq_ids: Sequence[int] | np.ndarray,
        tokens: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        valid: Sequence[bool] | np.ndarray,
        engine: JobEngine = ...,
    ) -> _Job: ...


@final
@dataclasses.dataclass(frozen=True)
class BaselineRequest:
    request_id: int
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = SamplingParams(temperature=0.0)
    arrival_s: float = 0.0  # offset from the run's start at which it is put on the queue


@final
@dataclasses.dataclass(frozen=True)
class BaselineRecord:
    """What happened to one request; all times are seconds from the run's start."""

    request_id: int
    tokens: tuple[int, ...]
    finish_reason: FinishReason
    arrival_s: float
    start_s: float  # taken off the queue by the engine thread
    token_times_s: tuple[float, ...]  # when each token was sampled (token 0 from the prefill)
    finish_s: float
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def inter_token_s(self) -> tuple[float, ...]:
        """Gaps between consecutive tokens (the per-token latency of spec §19 M1)."""
        t = self.token_times_s
        return tuple(b - a for a, b in zip(t, t[1:]))


_STOP = object()  # queue sentinel: no more requests


@final
class SyncBaseline:
    """The engine loop of the batching note, on one thread, one request at a time."""

    def __init__(
        self,
        calbin: BaselineCalbin,
        *,
        eos_token_ids: Sequence[int] = (),
        wait_timeout_s: float = 60.0,
        engine: JobEngine = JobEngine.PING,
        clock: Callable[[], float] = time.perf_counter,
        reset: Callable[[], None] | None = None,
    ) -> None:
        """``reset`` (e.g. ``device.reset``) is called after a device fault or a wait timeout so the
        next request finds a working device; without it a fault ends the current request only."""
        if calbin.spec.compiled_batch < 1:
            raise ValueError("calbin.spec.compiled_batch must be >= 1")
        self._cb = calbin
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._timeout = wait_timeout_s
        self._engine = engine
        self._clock = clock
        self._reset = reset
        self._t0 = clock()

    def _now(self) -> float:
        return self._clock() - self._t0

    def _wait_ok(self, job: _Job) -> JobResult:
        try:
            res = job.wait(self._timeout)
        except WaitTimeout:
            if self._reset is None:
                raise
            # Invariant: a submitted job is always drained: the reset aborts it, then it completes.
            self._reset()
            job.wait(self._timeout)
            raise CalrtError(f"job wait timed out after {self._timeout} s; device reset") from None
        if res.status != JobStatus.OK:
            if self._reset is not None and res.status in (JobStatus.CCU_FAULT, JobStatus.DMA_UNKNOWN):
                self._reset()
            raise CalrtError(f"job {res.job_id} ended {res.status.name}")
        return res

    def serve_one(self, req: BaselineRequest) -> BaselineRecord:
        """Prefill + decode loop for one request (the caller is the engine thread)."""
        start = self._now()
        sp = req.sampling
        seed = resolve_seed(sp.seed) if sp.temperature > 0 else None
        b = self._cb.spec.compiled_batch
        tokens: list[int] = []
        times: list[float] = []
        reason = FinishReason.LENGTH
        error: str | None = None
        seq = self._cb.create_sequence()
        try:
            res = self._wait_ok(self._cb.submit_prefill(seq, np.asarray(req.prompt_tokens), self._engine))
            logits = res.logits[:1]
            pos = len(req.prompt_tokens)
            seq_ids = np.full(b, -1, dtype=np.int64)
            toks = np.zeros(b, dtype=np.int64)
            positions = np.zeros(b, dtype=np.int64)
            valid = np.zeros(b, dtype=bool)
            seq_ids[0], valid[0] = seq, True
            while len(tokens) < sp.max_tokens:
                lane = LaneSampling.from_params(sp, step=len(tokens), seed=seed)
                tok = int(sample_batch(logits, [lane]).tokens[0])
                tokens.append(tok)
                times.append(self._now())
                if not sp.ignore_eos and len(tokens) > sp.min_tokens and (
                    tok in self._eos or tok in sp.stop_token_ids
                ):
                    reason = FinishReason.STOP
                    break
                if len(tokens) >= sp.max_tokens:
                    break
                toks[0], positions[0] = tok, pos
                res = self._wait_ok(self._cb.submit_decode(seq_ids, toks, positions, valid, self._engine))
                logits = res.logits[:1]
                pos += 1
        except CalrtError as exc:
            reason, error = FinishReason.ERROR, str(exc)
        finally:
            self._cb.free_sequence(seq)
        return BaselineRecord(
            request_id=req.request_id,
            tokens=tuple(tokens),
            finish_reason=reason,
            arrival_s=req.arrival_s,
            start_s=start,
            token_times_s=tuple(times),
            finish_s=self._now(),
            error=error,
        )

    def serve(self, inbox: queue.Queue[object]) -> list[BaselineRecord]:
        """Serve requests from ``inbox`` in arrival order until the stop sentinel (see :meth:`run`)."""
        out: list[BaselineRecord] = []
        while True:
            item = inbox.get()
            if item is _STOP:
                return out
            assert isinstance(item, BaselineRequest)
            out.append(self.serve_one(item))

    def run(self, requests: Sequence[BaselineRequest]) -> list[BaselineRecord]:
        """Feed ``requests`` onto a queue at their ``arrival_s`` (a feeder thread) and serve them on
        one engine thread; return the records in completion order. Times are from this call."""
        inbox: queue.Queue[object] = queue.Queue()
        ordered = sorted(requests, key=lambda r: r.arrival_s)
        records: list[BaselineRecord] = []
        failure: list[BaseException] = []
        self._t0 = self._clock()

        def feeder() -> None:
            for r in ordered:
                delay = r.arrival_s - self._now()
                if delay > 0:
                    time.sleep(delay)
                inbox.put(r)
            inbox.put(_STOP)

        def engine() -> None:
            try:
                records.extend(self.serve(inbox))
            except BaseException as exc:  # surfaced in the caller's thread below
                failure.append(exc)

        threads = [
            threading.Thread(target=feeder, name="baseline-feeder", daemon=True),
            threading.Thread(target=engine, name="baseline-engine", daemon=True),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failure:
            raise failure[0]
        return records


def run_baseline(
    calbin: BaselineCalbin,
    requests: Sequence[BaselineRequest],
    *,
    eos_token_ids: Sequence[int] = (),
    wait_timeout_s: float = 60.0,
    reset: Callable[[], None] | None = None,
) -> list[BaselineRecord]:
    """Convenience: ``SyncBaseline(calbin, ...).run(requests)``."""
    return SyncBaseline(calbin, eos_token_ids=eos_token_ids, wait_timeout_s=wait_timeout_s, reset=reset).run(
        requests
    )
