"""A trio-native fake CalRT device for fake-clock tests (spec §17.3 "mock Wait with random delays").

It honours the facade contract of :mod:`calserve.runtime.types` as the engine sees it through
:class:`calserve.engine.backend.DeviceBackend`: KV sequences with a committed length that grows only
when a job ends OK, one queue per job engine (``DeviceBusy`` beyond ``queue_depth``), jobs that take
a seeded jittered time (so completions interleave differently from submissions), deterministic fault
injection on the Nth job, and reset semantics (in-flight jobs end ABORTED, every sequence invalid,
``DMA_UNKNOWN`` requires a reconfigure).

Logits are cheap and deterministic: a function of the sequence's whole token history (a rolling
hash seeds a generator), so a request's output does not depend on its batch-mates or its lane, which
is exactly the property the real runtime guarantees and the tests check.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import trio

from calserve.engine.backend import BackendCalbin, JobTicket, row_checksums
from calserve.runtime.reference import ModelConfig
from calserve.runtime.types import (
    RUNTIME_PROFILES,
    DeviceBusy,
    DeviceFaulted,
    EngineCounters,
    FaultKind,
    InvalidArgument,
    JobEngine,
    JobResult,
    JobStatus,
    NotSupported,
    OutOfSequences,
    ProfileSpec,
    RunEnds,
    RuntimeCapabilities,
    Timing,
)

__all__ = ["FakeBackend", "FakeCalbin", "fake_logits"]

_MASK = (1 << 64) - 1


def _mix(h: int, token: int) -> int:
    h = (h ^ (token + 0x9E3779B97F4A7C15)) & _MASK
    h = (h * 0xBF58476D1CE4E5B9) & _MASK
    return (h ^ (h >> 31)) & _MASK


def fake_logits(history_hash: int, vocab: int) -> np.ndarray:
    """The fake model: logits for the next token given the hash of the whole sequence so far."""
    return np.random.default_rng(history_hash).standard_normal(vocab).astype(np.float32) * 4.0


def _greedy_run(h: int, tok: int, n: int, vocab: int, end_ids: frozenset[int] = frozenset(),
                end_from: int = 0) -> Iterator[tuple[int, np.ndarray, int]]:
    """A lane's greedy steps from history hash ``h`` with input ``tok``: (hash, logits, argmax)
    a step, each argmax the next input; ``n`` steps, or fewer when one draws an end token from
    step ``end_from`` on (a host-driven run's lane, ``submit_decode(ends=...)``), that step its
    last."""
    for k in range(n):
        h = _mix(h, tok)
        logits = fake_logits(h, vocab)
        tok = int(np.argmax(logits))
        yield h, logits, tok
        if k >= end_from and tok in end_ids:
            return


def history_hash(tokens: Sequence[int]) -> int:
    h = 0
    for t in tokens:
        h = _mix(h, int(t))
    return h


@dataclasses.dataclass
class _Seq:
    length: int = 0
    hash: int = 0
    valid: bool = True


@dataclasses.dataclass
class _Job:
    job_id: int
    engine: JobEngine
    calbin: FakeCalbin
    kind: str  # "prefill" | "prefill_all" (every position's logits, lane i = position i) | "decode"
    seq_ids: np.ndarray
    new_tokens: list[list[int]]  # per lane (empty for invalid lanes)
    positions: np.ndarray
    valid: np.ndarray
    submitted_at: float
    complete_at: float  # math.inf: never, until a reset
    fault: FaultKind | None
    fault_lane: int
    epoch: int  # device reset epoch at submit
    result: JobResult | None = None
    steps: int = 1  # a decode's greedy steps (multi_step): each lane's argmax fed back
    lane_steps: list[int] | None = None  # each lane's own steps (None: all ``steps``)
    started_at: float = 0.0  # when the device began it (a multi-step decode's steps follow)
    ran: int | None = None  # a host-driven run stopped early (stop_steps): the steps it ran
    # a host-driven run's lanes' end tokens (submit_decode(ends=...)): per lane (ids, from step)
    ends: list[tuple[frozenset[int], int]] | None = None
    stopped: bool = False  # stop_steps cut it (once)


@dataclasses.dataclass(eq=False)
class _KvGroup:
    """One KvManager shared by the member calbins of a KV group (sim-next ``shared_kv``).

    Invariant: ``members`` counts the group's unreleased calbins; the sequences go with the last."""

    weights: Any
    seqs: dict[int, _Seq] = dataclasses.field(default_factory=dict)
    next_seq: int = 1
    members: int = 0


class FakeCalbin(BackendCalbin):
    """Subclasses the protocol explicitly to inherit its submit-then-wait defaults."""

    def __init__(
        self, dev: FakeBackend, config: ModelConfig, spec: ProfileSpec, timing: Timing,
        group: _KvGroup | None = None,
    ) -> None:
        self._dev = dev
        self.config = config
        self.spec = spec
        self.timing = timing
        self.group = group if group is not None else _KvGroup(None)
        self.group.members += 1
        self._seqs: dict[int, _Seq] = self.group.seqs  # the very dict of the group
        self.released = False
        self.leaked_at_release = 0
        self.reconfigures = 0

    def introspect(self) -> dict[str, Any]:
        return {
            "compiled_batch": self.spec.compiled_batch,
            "max_seq": self.spec.max_seq,
            "max_sequences": self.spec.max_sequences,
            "kv_dtype": self.spec.kv_dtype,
            "valid_mask": self.spec.valid_mask,
        }

    # KvManager ------------------------------------------------------------------------------------
    def live_sequences(self) -> int:
        return len(self._seqs)

    async def create_sequence(self) -> int:
        await trio.lowlevel.checkpoint()
        if len(self._seqs) >= self.spec.max_sequences:
            raise OutOfSequences("no free KV sequence")
        sid = self.group.next_seq
        self.group.next_seq += 1
        self._seqs[sid] = _Seq()
        return sid

    @property
    def frees_inline(self) -> bool:  # type: ignore[override]
        return self._dev.frees_inline

    async def free_sequences(self, seq_ids: Sequence[int]) -> None:
        await trio.lowlevel.checkpoint()
        self.free_sequences_now(seq_ids)

    def free_sequences_now(self, seq_ids: Sequence[int]) -> None:
        for s in seq_ids:
            self._seqs.pop(int(s), None)

    async def committed_len(self, seq_id: int) -> int:
        await trio.lowlevel.checkpoint()
        return self._seqs[seq_id].length

    # Jobs -----------------------------------------------------------------------------------------
    def _prefill_args(self, seq_id: int, tokens: np.ndarray, engine: JobEngine,
                      all_logits: bool = False) -> tuple[Any, ...]:
        toks = [int(t) for t in np.asarray(tokens).reshape(-1)]
        seq = self._seqs.get(seq_id)
        pos = (seq.length if seq is not None else 0) + len(toks) - 1  # echo: last position
        dur = self.timing.prefill_base_us + self.timing.prefill_us_per_token * len(toks)
        if all_logits:  # lane i: the logits after toks[:i + 1] (runtime: submit_prefill_all)
            if not self._dev.capabilities.prompt_logits:
                raise NotSupported("all_logits: this runtime profile has no prompt logits")
            first = pos - len(toks) + 1
            return (self, "prefill_all", np.full(len(toks), seq_id),
                    [toks] + [[] for _ in toks[1:]], np.arange(first, pos + 1),
                    np.ones(len(toks), np.int64), engine, dur * 1e-6)
        return (self, "prefill", np.array([seq_id]), [toks], np.array([pos]), np.array([1]), engine,
                dur * 1e-6)

    def _decode_args(self, seq_ids: np.ndarray, tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray,
                     engine: JobEngine, steps: int = 1, lane_steps: np.ndarray | None = None,
                     ends: RunEnds | None = None) -> tuple[Any, ...]:
        B = self.spec.compiled_batch
        if not (len(seq_ids) == len(tokens) == len(positions) == len(valid) == B):
            raise InvalidArgument(f"decode arrays must have length compiled_batch={B}")
        if steps != 1:
            if not self._dev.capabilities.multi_step:
                raise NotSupported("steps: multi-step decode needs the multi_step capability")
            if not 1 <= steps <= 64:
                raise InvalidArgument(f"steps: {steps} not in [1, 64]")
            for i in range(B):
                n = steps if lane_steps is None else int(lane_steps[i])
                if valid[i] and not 1 <= n <= steps:
                    raise InvalidArgument(f"lane_steps[{i}]: {n} not in [1, steps={steps}]")
                if valid[i] and int(positions[i]) + n > self.spec.max_seq:
                    raise InvalidArgument(f"positions[{i}]: {int(positions[i])} + {n} steps exceed "
                                          f"max_seq={self.spec.max_seq}")
        new = [[int(tokens[i])] if valid[i] else [] for i in range(B)]
        dur = self.timing.decode_step_us.get(B, 1000.0) * steps
        lane_ends: list[tuple[frozenset[int], int]] | None = None
        if ends is not None and steps > 1:
            if not self._dev.capabilities.host_multi_step:  # as the runtime's Calbin.submit_decode
                raise NotSupported("ends: only a host-driven multi-step decode ends lanes on their tokens")
            off, ids, frm = ends  # as the binding's hs_start_ends takes them
            if len(off) != B + 1 or off[0] != 0 or any(off[i + 1] < off[i] for i in range(B)):
                raise InvalidArgument("end_off: compiled_batch + 1 non-decreasing offsets from 0")
            lane_ends = [(frozenset(int(t) for t in ids[off[i]:off[i + 1]]), 0 if frm is None else int(frm[i]))
                         for i in range(B)]
        return (self, "decode", np.asarray(seq_ids), new, np.asarray(positions), np.asarray(valid), engine,
                dur * 1e-6, steps, None if lane_steps is None else [int(n) for n in lane_steps], lane_ends)

    async def submit_prefill(self, seq_id: int, tokens: np.ndarray, engine: JobEngine,
                             all_logits: bool = False) -> JobTicket:
        return await self._dev._submit(*self._prefill_args(seq_id, tokens, engine, all_logits))

    async def submit_prefill_wait(
        self, seq_id: int, tokens: np.ndarray, engine: JobEngine, timeout_s: float,
        after_submit: Callable[[], None] | None = None, all_logits: bool = False,
    ) -> tuple[JobTicket, JobResult | None]:
        return await self._submit_now_wait(self._prefill_args(seq_id, tokens, engine, all_logits),
                                           timeout_s, after_submit)

    async def submit_decode_wait(
        self, seq_ids: np.ndarray, tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray,
        engine: JobEngine, timeout_s: float, after_submit: Callable[[], None] | None = None,
        steps: int = 1, lane_steps: np.ndarray | None = None, ends: RunEnds | None = None,
    ) -> tuple[JobTicket, JobResult | None]:
        return await self._submit_now_wait(
            self._decode_args(seq_ids, tokens, positions, valid, engine, steps, lane_steps, ends), timeout_s,
            after_submit)

    async def _submit_now_wait(self, args: tuple[Any, ...], timeout_s: float,
                               after_submit: Callable[[], None] | None) -> tuple[JobTicket, JobResult | None]:
        """Like the runtime's hot path: queue without a checkpoint, the caller's ``after_submit``,
        then the wait."""
        t = self._dev._submit_now(*args)
        if after_submit is not None:
            after_submit()
        return t, await self.wait(t, timeout_s)

    async def submit_decode(
        self,
        seq_ids: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        valid: np.ndarray,
        engine: JobEngine,
        steps: int = 1,
        lane_steps: np.ndarray | None = None,
        ends: RunEnds | None = None,
    ) -> JobTicket:
        return await self._dev._submit(*self._decode_args(seq_ids, tokens, positions, valid, engine, steps,
                                                          lane_steps, ends))

    async def wait(self, ticket: JobTicket, timeout_s: float) -> JobResult | None:
        return await self._dev._wait(ticket.native, timeout_s)

    def stop_steps(self, engine: JobEngine) -> None:
        """As the runtime's host-driven runs (capability ``host_multi_step``): the multi-step decode
        in flight on ``engine`` ends with its step in flight (each lane the least of its steps and
        the steps run). Nothing else can be cut short."""
        if self._dev.capabilities.host_multi_step:
            self._dev._stop_steps(engine)


    async def reconfigure(self) -> None:
        await trio.lowlevel.checkpoint()
        self.reconfigures += 1
        self._dev._reconfigured()

    async def release(self) -> None:
        await trio.lowlevel.checkpoint()
        if any(j.calbin is self for j in self._dev._inflight.values()):
            raise InvalidArgument("calbin has jobs in flight")
        self.group.members -= 1
        if self.group.members == 0:  # the group's KV is freed with its last member
            self.leaked_at_release = len(self._seqs)
            self._seqs.clear()
        self.released = True
        self._dev._calbins.remove(self)

    def checksum_ok(self, result: JobResult, lanes: Sequence[int]) -> list[bool]:
        idx = list(lanes)
        ok: list[bool] = (row_checksums(result.logits[idx]) == result.checksum[idx]).tolist()
        return ok

    # Completion -----------------------------------------------------------------------------------
    def _finish(self, job: _Job, aborted: bool) -> JobResult:
        B = len(job.seq_ids)
        V = self.config.vocab_size
        logits = np.zeros((B, V), np.float32)
        echo = np.full((B, 3), -1, np.int64)
        echo[:, 0] = job.job_id
        status = JobStatus.ABORTED if aborted else JobStatus.OK
        if not aborted and job.fault in (FaultKind.CCU_FAULT, FaultKind.DMA_UNKNOWN):
            status = JobStatus.CCU_FAULT if job.fault is FaultKind.CCU_FAULT else JobStatus.DMA_UNKNOWN
        if job.kind == "prefill_all":  # one sequence, a lane per position
            return self._finish_all(job, status, logits, echo)
        if job.steps > 1:
            return self._finish_steps(job, status, logits, echo)
        if status is JobStatus.OK:
            for lane in range(B):
                if not job.valid[lane]:
                    continue
                seq = self._seqs.get(int(job.seq_ids[lane]))
                start = int(job.positions[lane]) - len(job.new_tokens[lane]) + 1
                if seq is None or not seq.valid or seq.length != start:
                    status = JobStatus.INVALID
                    break
        if status is JobStatus.OK:
            for lane in range(B):
                if not job.valid[lane]:
                    continue
                seq = self._seqs[int(job.seq_ids[lane])]
                h = seq.hash
                for t in job.new_tokens[lane]:
                    h = _mix(h, t)
                logits[lane] = fake_logits(h, V)
                echo[lane, 1] = job.seq_ids[lane]
                echo[lane, 2] = job.positions[lane]
                seq.hash = h
                seq.length += len(job.new_tokens[lane])
        elif status in (JobStatus.CCU_FAULT, JobStatus.DMA_UNKNOWN):
            for lane in range(B):
                seq = self._seqs.get(int(job.seq_ids[lane]))
                if seq is not None and job.valid[lane]:
                    seq.valid = False
        return _result(job, status, logits, echo)

    def _steps_with_ends(self, seq_ids: np.ndarray, new_tokens: list[list[int]], valid: np.ndarray, steps: int,
                         lane_steps: list[int] | None, ends: list[tuple[frozenset[int], int]]) -> int:
        """The steps a host-driven run with end tokens runs, from its sequences as they are now
        (``_finish_steps`` gives its outputs; the engine never changes a sequence in flight)."""
        most = 0
        for lane in range(len(seq_ids)):
            if not valid[lane]:
                continue
            n = steps if lane_steps is None else lane_steps[lane]
            seq = self._seqs.get(int(seq_ids[lane]))
            if seq is None:
                return steps
            ran = sum(1 for _ in _greedy_run(seq.hash, new_tokens[lane][0], n, self.config.vocab_size, *ends[lane]))
            most = max(most, ran)
        return most

    def _finish_steps(self, job: _Job, status: JobStatus, logits: np.ndarray,
                      echo: np.ndarray) -> JobResult:
        """A multi-step decode: per valid lane ``steps`` steps, each step's argmax the next input
        (what ``steps`` single-step jobs with the argmax fed back give); the last step's logits."""
        B, S, V = len(job.seq_ids), job.ran or job.steps, self.config.vocab_size
        step_tokens = np.zeros((B, S), np.int32)
        lanes = [lane for lane in range(B) if job.valid[lane]]
        ran = [0] * B  # each lane's steps run (an end token or a stop may end it short of its own)
        if status is JobStatus.OK:
            for lane in lanes:
                seq = self._seqs.get(int(job.seq_ids[lane]))
                if seq is None or not seq.valid or seq.length != int(job.positions[lane]):
                    status = JobStatus.INVALID
                    break
        if status is JobStatus.OK:
            for lane in lanes:
                seq = self._seqs[int(job.seq_ids[lane])]
                h, n = seq.hash, 0
                most = S if job.lane_steps is None else min(S, job.lane_steps[lane])
                ends = job.ends[lane] if job.ends is not None else ()
                for h, row, tok in _greedy_run(seq.hash, job.new_tokens[lane][0], most, V, *ends):
                    logits[lane] = row
                    step_tokens[lane, n] = tok
                    n += 1
                ran[lane] = n
                echo[lane, 1] = job.seq_ids[lane]
                echo[lane, 2] = int(job.positions[lane]) + n - 1
                seq.hash = h
                seq.length += n
        elif status in (JobStatus.CCU_FAULT, JobStatus.DMA_UNKNOWN):
            for lane in lanes:
                seq = self._seqs.get(int(job.seq_ids[lane]))
                if seq is not None:
                    seq.valid = False
        short: np.ndarray | None = None
        if status is JobStatus.OK and self._dev.capabilities.host_multi_step:
            asked = [0 if not job.valid[lane] else job.steps if job.lane_steps is None else job.lane_steps[lane]
                     for lane in range(B)]
            if ran != asked:  # a lane ran short (the binding's hs_short): its steps run
                short = np.array(ran, np.int32)
                most = max(ran)
                if most < S:  # no lane ran the last steps: the run ended there
                    step_tokens = np.ascontiguousarray(step_tokens[:, :most])
        return dataclasses.replace(_result(job, status, logits, echo), step_tokens=step_tokens, lane_steps=short)

    def _finish_all(self, job: _Job, status: JobStatus, logits: np.ndarray,
                    echo: np.ndarray) -> JobResult:
        """A prefill returning every position's logits: lane i holds the logits after the first
        i + 1 tokens (what a prefill of those alone would return), echo (job, seq, position)."""
        toks, n, V = job.new_tokens[0], len(job.seq_ids), self.config.vocab_size
        seq = self._seqs.get(int(job.seq_ids[0]))
        start = int(job.positions[0])
        if status is JobStatus.OK and (seq is None or not seq.valid or seq.length != start):
            status = JobStatus.INVALID
        if status is JobStatus.OK:
            assert seq is not None
            h = seq.hash
            for i, t in enumerate(toks):
                h = _mix(h, t)
                logits[i] = fake_logits(h, V)
            echo[:, 1] = job.seq_ids
            echo[:, 2] = job.positions
            seq.hash = h
            seq.length += n
        elif status in (JobStatus.CCU_FAULT, JobStatus.DMA_UNKNOWN) and seq is not None:
            seq.valid = False
        return _result(job, status, logits, echo)


def _result(job: _Job, status: JobStatus, logits: np.ndarray, echo: np.ndarray) -> JobResult:
    """The job's result: each lane's checksum (0 for lanes without a sequence), then a crosstalk
    fault's corruption of a lane's logits after the checksum was taken."""
    checksum = row_checksums(logits)
    checksum[echo[:, 1] < 0] = 0
    if status is JobStatus.OK and job.fault is FaultKind.CROSSTALK:
        n = len(logits)
        lane = job.fault_lane % n
        logits[lane] = logits[(lane + 1) % n] if n > 1 else -logits[lane] + 1.0
    return JobResult(job.job_id, job.engine, status, logits, echo, checksum, 0.0)


class FakeBackend:
    """Trio-native fake device. ``jitter_s`` adds a seeded uniform delay to every job;
    ``frees_inline``: see :attr:`BackendCalbin.frees_inline`; ``shared_time``: PING and PONG share
    the device's time per the calbin's ``pingpong_overlap``, as calrt-sim."""

    def __init__(
        self,
        capabilities: RuntimeCapabilities | str = "sim-next",
        *,
        seed: int = 0,
        jitter_s: float = 0.0,
        queue_depth: int = 2,
        dram_bytes: int = 32 << 30,
        frees_inline: bool = False,
        shared_time: bool = False,
    ) -> None:
        self.capabilities = (
            RUNTIME_PROFILES[capabilities] if isinstance(capabilities, str) else capabilities
        )
        self._rng = random.Random(seed)
        self._jitter = jitter_s
        self._queue_depth = queue_depth
        self._dram = dram_bytes
        # As the software runtime: sequences are freed inside the scheduling pass (default: through
        # the scheduler task, the path of a runtime whose free is a device round trip).
        self.frees_inline = frees_inline
        # As calrt-sim: the (1 - pingpong_overlap) share of a job's time serialises with the other
        # engine's (default: the two engines never wait for each other).
        self._shared_time = shared_time
        self._shared_free_at = 0.0
        self._calbins: list[FakeCalbin] = []
        self._inflight: dict[int, _Job] = {}
        self._engine_free_at = {JobEngine.PING: 0.0, JobEngine.PONG: 0.0}
        self._next_job = 1
        self._faults: dict[JobEngine, list[tuple[int, FaultKind, int]]] = {
            JobEngine.PING: [], JobEngine.PONG: []
        }
        self._counts = {e: dict(submitted=0, completed=0, failed=0, busy=0, timeouts=0) for e in JobEngine}
        self._epoch = 0
        self._reset_event = trio.Event()  # set (and replaced) to wake the waits: a reset, a stop
        self.faulted = False
        self._needs_reconfigure = False
        self.resets = 0
        # Uncertain recovery drills: the next ``reset_failures`` resets raise; ``stays_faulted``
        # leaves the device faulted after every reset.
        self.reset_failures = 0
        self.stays_faulted = False
        self.closed = False

    # DeviceBackend ---------------------------------------------------------------------------------
    async def load_calbin(
        self,
        config: ModelConfig,
        weights: Mapping[str, np.ndarray],
        spec: ProfileSpec,
        timing: Timing | None = None,
        kv_owner: BackendCalbin | None = None,
    ) -> FakeCalbin:
        """``kv_owner``: join that calbin's KV group, as the runtime does (ext/README "Shared KV")."""
        await trio.lowlevel.checkpoint()
        if spec.compiled_batch > 1 and not self.capabilities.batch_profiles:
            raise NotSupported(f"compiled_batch {spec.compiled_batch} needs the batch capability")
        if self._calbins and not self.capabilities.multi_calbin:
            raise NotSupported("a second resident calbin needs the multi-calbin capability")
        group: _KvGroup | None = None
        if kv_owner is not None:
            if not self.capabilities.shared_kv:
                raise NotSupported("kv_owner: shared KV needs the shared_kv capability")
            if not isinstance(kv_owner, FakeCalbin) or kv_owner.released or kv_owner._dev is not self:
                raise InvalidArgument("kv_owner: must be a loaded, not released calbin of this device")
            o = kv_owner.spec
            for name in ("max_seq", "max_sequences", "kv_dtype"):
                if getattr(o, name) != getattr(spec, name):
                    raise InvalidArgument(f"kv_owner: {name} differs ({getattr(o, name)} != "
                                          f"{getattr(spec, name)})")
            if kv_owner.config != config:
                raise InvalidArgument("kv_owner: model description differs")
            if kv_owner.group.weights is not weights:
                raise InvalidArgument("kv_owner: weights must be the very same buffers")
            group = kv_owner.group
        else:
            group = _KvGroup(weights)
        cb = FakeCalbin(self, config, spec, timing or Timing(200.0, 5.0, {spec.compiled_batch: 1000.0}),
                        group)
        self._calbins.append(cb)
        return cb

    async def reset(self) -> None:
        await trio.lowlevel.checkpoint()
        if self.reset_failures > 0:
            self.reset_failures -= 1
            raise DeviceFaulted("reset failed (injected)")
        self._epoch += 1
        self.resets += 1
        self.faulted = self.stays_faulted
        now = trio.current_time()
        for job in self._inflight.values():
            if job.result is None and job.complete_at > now:
                job.result = job.calbin._finish(job, aborted=True)
        for cb in self._calbins:  # shared group sequences: invalidated once per member (idempotent)
            for s in cb._seqs.values():
                s.valid = False
        for e in JobEngine:
            self._engine_free_at[e] = now
        self._shared_free_at = now
        self._wake_waits()

    @property
    def needs_reconfigure(self) -> bool:
        return self._needs_reconfigure

    def healthy(self) -> bool:
        return not self.faulted

    def _reconfigured(self) -> None:
        self._needs_reconfigure = False

    def counters(self, engine: JobEngine) -> EngineCounters:
        c = self._counts[engine]
        inflight = sum(1 for j in self._inflight.values() if j.engine == engine)
        return EngineCounters(inflight=inflight, **c)

    def dram(self) -> tuple[int, int]:
        return self._dram, 0

    def inject_fault(self, kind: FaultKind, engine: JobEngine, nth: int, lane: int = 0) -> None:
        target = self._counts[engine]["submitted"] + self._counts[engine]["busy"] + nth
        self._faults[engine].append((target, kind, lane))

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._inflight:
            raise InvalidArgument(f"close with {len(self._inflight)} jobs in flight")
        self.closed = True

    def live_sequences(self) -> int:
        groups = {id(cb.group): cb for cb in self._calbins}  # a KV group counts once
        return sum(cb.live_sequences() for cb in groups.values())

    # internals -------------------------------------------------------------------------------------
    async def _submit(self, *args: Any) -> JobTicket:
        """:meth:`_submit_now` after a checkpoint (the plain async submit path)."""
        await trio.lowlevel.checkpoint()
        return self._submit_now(*args)

    def _submit_now(
        self,
        calbin: FakeCalbin,
        kind: str,
        seq_ids: np.ndarray,
        new_tokens: list[list[int]],
        positions: np.ndarray,
        valid: np.ndarray,
        engine: JobEngine,
        duration_s: float,
        steps: int = 1,
        lane_steps: list[int] | None = None,
        ends: list[tuple[frozenset[int], int]] | None = None,
    ) -> JobTicket:
        """Queue a job without a checkpoint (the runtime's submit only queues, too)."""
        c = self._counts[engine]
        ordinal = c["submitted"] + c["busy"] + 1
        fault: FaultKind | None = None
        fault_lane = 0
        for f in list(self._faults[engine]):
            if f[0] == ordinal:
                self._faults[engine].remove(f)
                fault, fault_lane = f[1], f[2]
        if self.faulted:
            raise DeviceFaulted("device needs a reset")
        queued = sum(1 for j in self._inflight.values() if j.engine == engine)
        if fault is FaultKind.DEVICE_BUSY or queued >= self._queue_depth:
            c["busy"] += 1
            raise DeviceBusy(f"{engine.name} queue full")
        ran: int | None = None
        if ends is not None:  # a host-driven run whose lanes all end on end tokens ends with its last
            most = calbin._steps_with_ends(seq_ids, new_tokens, valid, steps, lane_steps, ends)
            if most < steps:
                ran = most
                duration_s = duration_s * most / steps
        now = trio.current_time()
        start = max(now, self._engine_free_at[engine])
        if self._shared_time:
            start = max(start, self._shared_free_at)
            self._shared_free_at = start + (1.0 - calbin.timing.pingpong_overlap) * duration_s
        end = start + duration_s + (self._rng.random() * self._jitter if self._jitter else 0.0)
        self._engine_free_at[engine] = end
        job = _Job(
            self._next_job, engine, calbin, kind, seq_ids, new_tokens, positions, valid, now,
            math.inf if fault is FaultKind.TIMEOUT else end, fault, fault_lane, self._epoch, steps=steps,
            lane_steps=lane_steps, started_at=start, ran=ran, ends=ends,
        )
        self._next_job += 1
        self._inflight[job.job_id] = job
        c["submitted"] += 1
        return JobTicket(job.job_id, engine, job)

    def _stop_steps(self, engine: JobEngine) -> None:
        now = trio.current_time()
        for job in self._inflight.values():
            if job.engine != engine or job.kind != "decode" or job.steps == 1 or job.result is not None:
                continue
            if job.stopped or not math.isfinite(job.complete_at) or job.complete_at <= now:
                continue
            planned = job.ran or job.steps  # (fewer when its lanes all end on end tokens)
            step_s = (job.complete_at - job.started_at) / planned
            ran = max(1, math.ceil((now - job.started_at) / step_s)) if step_s > 0 else 1
            if ran >= planned:
                continue
            job.stopped = True
            job.ran = ran
            end = job.started_at + ran * step_s
            if self._engine_free_at[engine] == job.complete_at:  # nothing queued behind it
                self._engine_free_at[engine] = end
            job.complete_at = end
            self._wake_waits()  # its waiter looks at the new completion time

    def _wake_waits(self) -> None:
        """Every wait looks at its job again (a reset ended it, a stop moved its end)."""
        ev, self._reset_event = self._reset_event, trio.Event()
        ev.set()

    async def _wait(self, job: _Job, timeout_s: float) -> JobResult | None:
        deadline = trio.current_time() + timeout_s
        while job.result is None:
            if trio.current_time() >= job.complete_at:
                job.result = job.calbin._finish(job, aborted=False)
                if job.result.status in (JobStatus.CCU_FAULT, JobStatus.DMA_UNKNOWN):
                    self.faulted = True
                    if job.result.status is JobStatus.DMA_UNKNOWN:
                        self._needs_reconfigure = True
                break
            if trio.current_time() >= deadline:
                self._counts[job.engine]["timeouts"] += 1
                return None
            with trio.move_on_at(min(deadline, job.complete_at)):
                await self._reset_event.wait()
        await trio.lowlevel.checkpoint()
        if job.job_id in self._inflight:
            del self._inflight[job.job_id]
            c = self._counts[job.engine]
            if job.result.status is JobStatus.OK:
                c["completed"] += 1
            else:
                c["failed"] += 1
        return job.result
