"""The async device interface the engine uses, and its implementation over the real runtime facade.

Only the executor, the model manager and recovery call a backend. Two implementations honour the same
contract (the facade contract in :mod:`calserve.runtime.types`):

- :class:`RuntimeBackend` wraps the synchronous :class:`calserve.runtime.Device` facade. Control calls
  go through ``trio.to_thread.run_sync`` on a :class:`trio.CapacityLimiter` owned by the backend (the
  process-wide default limiter is shared with unrelated code, STACK.md "Threads and cancellation").
  The hot path (submit + first wait of a job) submits inline and waits in trio on the runtime's
  per-engine completion fd (:class:`~calserve.engine.backend_waits.CompletionFdWaiter`, no Python
  thread per step); a runtime without that fd falls back to one wait thread per engine
  (:class:`~calserve.engine.backend_waits.EngineThread`).
- :class:`calserve.testing.fake_device.FakeBackend` is trio-native (completions are ``trio.sleep``), for
  fake-clock tests: ``autojump_clock`` jumps while trio waits on worker threads, so the real runtime
  must never run under it.

Job protocol (spec §12 "forced delete is not cancel"): ``submit_*`` returns a :class:`JobTicket`;
``wait(ticket, timeout_s)`` returns the :class:`JobResult` or ``None`` when the timeout passed with the
job still in flight. A ticket must be waited for until it returns a result; a timed-out job completes
``ABORTED`` after :meth:`DeviceBackend.reset`. The executor shields submit+wait as one unit.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
import trio

from calserve.config import FaultsConfig
from calserve.engine.fault_plan import FaultPlan
from calserve.engine.backend_waits import CompletionFdWaiter, DeviceThreads, EngineThread, wait_or_none
from calserve.runtime.binding import bad_lanes as binding_bad_lanes
from calserve.runtime.binding import verify_lanes as binding_verify_lanes
from calserve.runtime.reference import ModelConfig
from calserve.runtime.types import (
    EngineCounters,
    FaultKind,
    JobEngine,
    JobResult,
    ProfileSpec,
    RunEnds,
    RuntimeCapabilities,
    Timing,
)

__all__ = ["JobTicket", "BackendCalbin", "DeviceBackend", "RuntimeBackend", "row_checksums"]

log = logging.getLogger("calserve.engine")

# The waiting machinery lives in :mod:`calserve.engine.backend_waits`; the engine-part tests know the
# engine thread by its name here.
_EngineThread = EngineThread


@dataclasses.dataclass
class JobTicket:
    """A submitted job. ``native`` is the implementation's job object (never touched by the engine)."""

    job_id: int
    engine: JobEngine
    native: Any


def _ticket(job: Any, engine: JobEngine) -> JobTicket:
    """The ticket of a runtime ``Job`` just submitted on ``engine``."""
    return JobTicket(int(job.job_id), engine, job)


def row_checksums(logits: np.ndarray) -> np.ndarray:
    """The fake device's per-lane checksum: CRC-32 of each float32 row (cheap, in C)."""
    rows = np.ascontiguousarray(logits, dtype=np.float32)
    return np.array([zlib.crc32(r.tobytes()) for r in rows], dtype=np.uint64)


class BackendCalbin(Protocol):
    """One configured calbin (one batch profile) with its KvManager, seen asynchronously."""

    spec: ProfileSpec
    config: ModelConfig
    # True when freeing a sequence is host bookkeeping that never blocks (free_sequences_now works):
    # the scheduler then returns an ended request's lane inside the pass that admits the next one.
    frees_inline: bool = False

    def introspect(self) -> dict[str, Any]: ...

    async def create_sequence(self) -> int: ...

    async def free_sequences(self, seq_ids: Sequence[int]) -> None:
        """Free several sequences in one device round trip; ids already invalid are skipped."""
        ...

    def free_sequences_now(self, seq_ids: Sequence[int]) -> None:
        """:meth:`free_sequences` without a checkpoint; only when :attr:`frees_inline`."""
        raise NotImplementedError

    async def committed_len(self, seq_id: int) -> int: ...

    async def submit_prefill(self, seq_id: int, tokens: np.ndarray, engine: JobEngine,
                             all_logits: bool = False) -> JobTicket:
        """``all_logits`` (``capabilities.prompt_logits``): every position's logits, a lane each."""
        ...

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
        """``steps`` > 1 (``capabilities.multi_step``): that many greedy steps in one job (lane
        ``i`` only ``lane_steps[i]`` of them when given), the result's ``step_tokens`` the tokens
        ``[lanes, steps]`` (runtime ``Calbin.submit_decode``). ``ends`` (only with a run the host
        drives, ``capabilities.host_multi_step``, ``DeviceJob.host_driven``): each lane's end tokens
        (``completion.run_ends``), a lane ending with the step that draws one; the result's
        ``lane_steps`` then say each lane's steps run (``runtime.Device.submit_decode``)."""
        ...

    async def wait(self, ticket: JobTicket, timeout_s: float) -> JobResult | None: ...

    async def submit_decode_wait(
        self,
        seq_ids: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        valid: np.ndarray,
        engine: JobEngine,
        timeout_s: float,
        after_submit: Callable[[], None] | None = None,
        steps: int = 1,
        lane_steps: np.ndarray | None = None,
        ends: RunEnds | None = None,
    ) -> tuple[JobTicket, JobResult | None]:
        """Submit + first wait in one device round trip (the hot path: one thread hop per step).

        ``after_submit`` is called once the job was accepted, before the wait (host work that
        overlaps the device step). The body is the default for implementations that subclass this
        protocol explicitly (the fake device: plain ``submit_decode`` then ``wait``);
        :class:`_RuntimeCalbin` overrides it with its inline-submit hot path."""
        t = await self.submit_decode(seq_ids, tokens, positions, valid, engine, steps, lane_steps, ends)
        if after_submit is not None:
            after_submit()
        return t, await self.wait(t, timeout_s)

    async def submit_prefill_wait(
        self, seq_id: int, tokens: np.ndarray, engine: JobEngine, timeout_s: float,
        after_submit: Callable[[], None] | None = None, all_logits: bool = False,
    ) -> tuple[JobTicket, JobResult | None]:
        """Submit + first wait of a prefill; default as for :meth:`submit_decode_wait`."""
        t = await self.submit_prefill(seq_id, tokens, engine, all_logits)
        if after_submit is not None:
            after_submit()
        return t, await self.wait(t, timeout_s)

    def stop_steps(self, engine: JobEngine) -> None:
        """End the multi-step decode in flight on ``engine`` with its step in flight, when the
        host drives it (``capabilities.host_multi_step``; each lane then runs the least of its
        steps and the steps run, and the result's ``step_tokens`` are ``[lanes, steps run]``).
        Never blocks; no effect on any other job (a device job cannot be cut short), nor once
        the run's last step was submitted. Default: nothing to stop."""

    async def reconfigure(self) -> None: ...

    async def release(self) -> None: ...

    def checksum_ok(self, result: JobResult, lanes: Sequence[int]) -> list[bool]:
        """Per requested lane: does the runtime's checksum match the logits row received?"""
        ...

    def verify_lanes(
        self, result: JobResult, job_id: int, lanes: Sequence[int], expect: Sequence[tuple[int, int]]
    ) -> list[int]:
        """The indices ``k`` for which lane ``lanes[k]`` did not echo ``(job_id, *expect[k])`` or whose
        logits row does not match its checksum (crosstalk, spec §7.4); empty when all is well.

        Default in Python over :meth:`checksum_ok`; the runtime calbin does it in one C call."""
        echo = result.echo.tolist()
        sums = self.checksum_ok(result, lanes)
        return [k for k, (lane, (sq, pos)) in enumerate(zip(lanes, expect, strict=True))
                if not (sums[k] and echo[lane] == [job_id, sq, pos])]


class DeviceBackend(Protocol):
    capabilities: RuntimeCapabilities

    async def load_calbin(
        self,
        config: ModelConfig,
        weights: Mapping[str, np.ndarray],
        spec: ProfileSpec,
        timing: Timing | None = None,
        kv_owner: BackendCalbin | None = None,
    ) -> BackendCalbin:
        """``kv_owner`` (``capabilities.shared_kv`` only): join that calbin's KV group."""
        ...

    async def reset(self) -> None:
        """Abort every in-flight job (they complete ABORTED) and invalidate every KV sequence."""
        ...

    @property
    def needs_reconfigure(self) -> bool: ...

    def healthy(self) -> bool:
        """False while the device (any chip) is faulted and needs a reset (checked after one)."""
        ...

    def counters(self, engine: JobEngine) -> EngineCounters: ...

    def dram(self) -> tuple[int, int]: ...

    def inject_fault(self, kind: FaultKind, engine: JobEngine, nth: int, lane: int = 0) -> None: ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------------------------------
# Real runtime


class _RuntimeCalbin:
    def __init__(
        self,
        native: Any,
        threads: DeviceThreads,
        engine_threads: dict[JobEngine, EngineThread],
        fd_waiters: Mapping[JobEngine, CompletionFdWaiter] | None = None,
        faults: FaultPlan | None = None,
        host_steps: bool = False,
    ) -> None:
        self._c = native
        # multi-step decodes driven by the host binding (runtime.host_multi_step): waited for on the
        # engine's thread, which drives their steps (a completion fd would wake trio every step)
        self._host_steps = host_steps
        # the host-driven run last submitted on each engine (stop_steps; a finished one: no effect)
        self._runs: dict[JobEngine, Any] = {}
        self._faults = faults  # runtime.faults: arms a fault on a drawn share of submits
        self._t = threads
        self._et = engine_threads
        self._fw: Mapping[JobEngine, CompletionFdWaiter] = fd_waiters or {}
        self.spec: ProfileSpec = native.spec
        self.config: ModelConfig = native.config

    def introspect(self) -> dict[str, Any]:
        info: dict[str, Any] = self._c.introspect()
        return info

    async def create_sequence(self) -> int:
        # Inline, like submit: creating a KV sequence is KvManager bookkeeping on the host (the KV
        # memory was reserved at configure), microseconds, never a device round trip, while a worker
        # thread hop costs ~0.2 ms on the TTFT path (spec §19 M1). Freeing scrubs the sequence's KV
        # is inline too (free_sequences). (A vendor runtime whose create blocks: see ext/README.md.)
        return int(self._c.create_sequence())

    frees_inline = True

    async def free_sequences(self, seq_ids: Sequence[int]) -> None:
        self.free_sequences_now(seq_ids)
        await trio.lowlevel.checkpoint()

    def free_sequences_now(self, seq_ids: Sequence[int]) -> None:
        # Inline, like create: KvManager bookkeeping plus a scrub of the positions the sequence ever
        # wrote (microseconds for a typical request; at most its max_seq block). A worker-thread hop
        # here ran concurrently with the next request's first decode steps and widened their
        # latency tail through GIL hand-overs (spec §19 M1 P99). See ext/README.md, vendor question 8.
        for s in seq_ids:
            try:
                self._c.free_sequence(s)
            except Exception:  # already invalidated by a reset: nothing to free
                pass

    async def committed_len(self, seq_id: int) -> int:
        return int(await self._t.run(self._c.committed_len, seq_id))

    async def submit_prefill(self, seq_id: int, tokens: np.ndarray, engine: JobEngine,
                             all_logits: bool = False) -> JobTicket:
        job = await self._t.run(self._c.submit_prefill, seq_id, tokens, engine, all_logits)
        return _ticket(job, engine)

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
        job = await self._t.run(self._c.submit_decode, seq_ids, tokens, positions, valid, engine, steps,
                                lane_steps, self._host_steps, ends)
        return _ticket(job, engine)

    async def wait(self, ticket: JobTicket, timeout_s: float) -> JobResult | None:
        r = await self._t.run(wait_or_none, ticket.native, timeout_s)
        if r is not None:
            self._ran(ticket.engine, ticket.native)
        return r

    def _submit_wait(self, job: Any, engine: JobEngine, timeout_s: float) -> tuple[JobTicket, JobResult | None]:
        return _ticket(job, engine), wait_or_none(job, timeout_s)

    async def submit_decode_wait(
        self,
        seq_ids: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        valid: np.ndarray,
        engine: JobEngine,
        timeout_s: float,
        after_submit: Callable[[], None] | None = None,
        steps: int = 1,
        lane_steps: np.ndarray | None = None,
        ends: RunEnds | None = None,
    ) -> tuple[JobTicket, JobResult | None]:
        # Submit inline: it only queues the job (DeviceBusy when the queue is full, never blocks), so
        # the device starts now instead of after a GIL hand-over to a worker thread; the blocking
        # wait runs on the engine's thread. Nothing between submit and wait can be cancelled.
        if self._faults is not None:
            self._faults.before_submit(engine, valid)
        job = self._c.submit_decode(seq_ids, tokens, positions, valid, engine, steps, lane_steps,
                                    self._host_steps, ends)
        if not job.host:
            return await self._wait_hot(job, engine, timeout_s, after_submit)
        self._runs[engine] = job
        t, r = await self._wait_hot(job, engine, timeout_s, after_submit)
        if r is not None:
            self._ran(engine, job)
        return t, r

    def _ran(self, engine: JobEngine, job: Any) -> None:
        """``job`` finished: no stop for it any more (nor its buffers kept alive here)."""
        if self._runs.get(engine) is job:
            del self._runs[engine]

    def stop_steps(self, engine: JobEngine) -> None:
        job = self._runs.get(engine)
        if job is not None:
            job.stop()

    async def _wait_hot(self, job: Any, engine: JobEngine, timeout_s: float,
                        after_submit: Callable[[], None] | None) -> tuple[JobTicket, JobResult | None]:
        """The caller's ``after_submit``, then the first wait of the just-submitted job: on the
        completion fd when the runtime has one (no Python thread per step), else on the engine's
        thread."""
        if after_submit is not None:
            after_submit()
        w = self._fw.get(engine)
        if w is not None and not w.busy and not job.host:
            return _ticket(job, engine), await w.wait(job, timeout_s)
        return await self._et[engine].run(lambda: self._submit_wait(job, engine, timeout_s))

    async def submit_prefill_wait(
        self, seq_id: int, tokens: np.ndarray, engine: JobEngine, timeout_s: float,
        after_submit: Callable[[], None] | None = None, all_logits: bool = False,
    ) -> tuple[JobTicket, JobResult | None]:
        if self._faults is not None:
            self._faults.before_submit(engine)
        job = self._c.submit_prefill(seq_id, tokens, engine, all_logits)
        return await self._wait_hot(job, engine, timeout_s, after_submit)

    async def reconfigure(self) -> None:
        await self._t.run(self._c.reconfigure)

    async def release(self) -> None:
        await self._t.run(self._c.release)

    def verify_lanes(
        self, result: JobResult, job_id: int, lanes: Sequence[int], expect: Sequence[tuple[int, int]]
    ) -> list[int]:
        return binding_verify_lanes(result, job_id, lanes, expect)

    def checksum_ok(self, result: JobResult, lanes: Sequence[int]) -> list[bool]:
        bad = binding_bad_lanes(result, lanes)  # one C call
        if not bad:
            return [True] * len(lanes)
        return [lane not in bad for lane in lanes]


#: gen0 threshold of a serving process (CPython's default is 700): see :func:`tune_gc_for_serving`.
SERVING_GC_GEN0 = 10_000


def tune_gc_for_serving(gen0: int = SERVING_GC_GEN0) -> None:
    """Keep the cyclic GC off the per-token path of a serving process (spec §19 M1 P99).

    Measured in ``bench.m1_async_vs_sync`` (closed, 2560 steps): with CPython's defaults 13 gen0
    collections (p50 80 us, max 277 us) and one gen1 (~1 ms) land on decode steps. The engine's
    steady state frees almost everything by reference counting (~3.5 net container allocations per
    step), so a raised gen0 threshold makes collections rare (none in that run at 10k or 50k), and
    ``gc.freeze()`` after a model load moves the long-lived start-up objects (weights, tokenizer,
    config) out of every later collection's scan.

    Why 10k and not higher (issue 7 soak, ``bench.soak_probe``): the HTTP server makes cyclic
    garbage the engine does not (hypercorn's per-connection objects, ~30 per closed connection), so
    a gen0 collection there frees most of its young generation at once and its pause grows with the
    threshold: at 50k one pause was 34 ms of CPU (15k objects freed; 214-384 ms wall-clock on a
    contended host in the 30-min soak), at 10k 4-15 ms every 20-60 s, same RSS, M1 P99 unchanged.
    The pile of uncollected garbage is bounded by the threshold either way (no leak).
    Idempotent; process-wide, so only :meth:`RuntimeBackend.open`
    (the serving process's own device) calls it, never a backend built around a caller's device.
    """
    if gen0 <= 0:
        return  # runtime.gc_gen0_threshold 0: CPython's own policy
    cur0, gen1, gen2 = gc.get_threshold()
    if cur0 and cur0 < gen0:
        gc.set_threshold(gen0, gen1, gen2)
    gc.freeze()


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as ``nproc`` counts them)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


class RuntimeBackend:
    """The async face of the software (or vendor) CalRT. Owns the one ``Device`` of the process."""

    def __init__(self, device: Any, threads: int = 4, completion_fd: bool = True, tune_gc: bool = False,
                 faults: FaultsConfig | None = None, gc_gen0: int = SERVING_GC_GEN0,
                 completion_poll_us: float = 0.0, host_multi_step: bool = False) -> None:
        """``completion_fd=False`` forces the engine-thread wait even when the runtime offers
        completion fds (the path a vendor runtime without them takes). ``completion_poll_us``: the
        cap of the completion waits' poll before they park on the fd (``runtime.completion_poll_us``;
        :class:`CompletionFdWaiter`; 0 = park at once). ``tune_gc``: call
        :func:`tune_gc_for_serving` after every model load (set by :meth:`open`). ``faults``:
        ``runtime.faults`` (software runtime only; rate 0 = none). ``host_multi_step``
        (``runtime.host_multi_step``): multi-step decode jobs driven by the host binding on any
        runtime (the capabilities then say ``multi_step`` and ``host_multi_step``)."""
        self._tune_gc = tune_gc
        self._gc_gen0 = gc_gen0
        self.faults: FaultPlan | None = None
        if faults is not None and faults.rate > 0:
            self.faults = FaultPlan(faults.rate, faults.kinds, faults.seed,
                                    lambda kind, engine, nth, lane: device.inject_fault(kind, engine, nth, lane))
        self._dev = device
        self._t = DeviceThreads(threads)  # control calls (sequences, reset, configure) and later waits
        self._et = {e: EngineThread(f"calrt-{e.name.lower()}") for e in JobEngine}
        self.capabilities: RuntimeCapabilities = device.capabilities
        self._host_steps = host_multi_step
        if host_multi_step:
            self.capabilities = dataclasses.replace(self.capabilities, multi_step=True, host_multi_step=True)
        # Per chip: engine -> waiter on the runtime's completion fd (empty: the runtime has none).
        self._fw: dict[int, dict[JobEngine, CompletionFdWaiter]] = {}
        # On one CPU the poll would only take turns with the runtime's own threads (the device).
        if completion_poll_us > 0 and _usable_cpus() < 2:
            completion_poll_us = 0.0
        get_fd = getattr(device, "completion_fd", None) if completion_fd else None
        if get_fd is not None:
            for chip in range(int(getattr(device, "chips", 1))):
                fds = {e: get_fd(e, chip) for e in JobEngine}
                if all(fd is not None for fd in fds.values()):
                    self._fw[chip] = {e: CompletionFdWaiter(fd, completion_poll_us) for e, fd in fds.items()}

    @property
    def completion_fd_waits(self) -> bool:
        """True when job waits happen on the runtime's completion fds (no wait thread per step)."""
        return bool(self._fw)

    @classmethod
    async def open(
        cls,
        profile: str = "calrt-0.7.6",
        dram_bytes: int = 32 << 30,
        null_compute: bool = False,
        completion_jitter_us: int = 0,
        seed: int = 0,
        faults: FaultsConfig | None = None,
        gc_gen0: int = SERVING_GC_GEN0,
        device: int = 0,
        completion_poll_us: float = 0.0,
        host_multi_step: bool = False,
    ) -> RuntimeBackend:
        """Open board ``device`` (``runtime.device``). Each board draws its own injected faults:
        the fault seed is mixed with the board index (board 0 keeps ``faults.seed`` as it is)."""
        from calserve.runtime import Device

        dev = Device.open(
            profile=profile,
            dram_bytes=dram_bytes,
            null_compute=null_compute,
            completion_jitter_us=completion_jitter_us,
            seed=seed,
            device=device,
        )
        if faults is not None and device:
            faults = msgspec.structs.replace(faults, seed=faults.seed + 1_000_003 * device)
        log.info("opened board %d (%s, profile %s)", dev.device, dev.serial or "no serial", profile)
        return cls(dev, tune_gc=gc_gen0 > 0, faults=faults, gc_gen0=gc_gen0,
                   completion_poll_us=completion_poll_us, host_multi_step=host_multi_step)

    async def load_calbin(
        self,
        config: ModelConfig,
        weights: Mapping[str, np.ndarray],
        spec: ProfileSpec,
        timing: Timing | None = None,
        kv_owner: BackendCalbin | None = None,
    ) -> BackendCalbin:
        if kv_owner is None:
            native = await self._t.run(self._dev.load_calbin, config, weights, spec, timing)
        else:  # a member of kv_owner's shared-KV group (one KvManager, sim-next only)
            assert isinstance(kv_owner, _RuntimeCalbin)
            owner = kv_owner._c
            native = await self._t.run(
                lambda: self._dev.load_calbin(config, weights, spec, timing, kv_owner=owner))
        if self._tune_gc:
            tune_gc_for_serving(self._gc_gen0)  # after a model load: alive now = lives as long as the model
        return _RuntimeCalbin(native, self._t, self._et, self._fw.get(int(getattr(native, "chip", 0))),
                              self.faults, self._host_steps)

    async def reset(self) -> None:
        await self._t.run(self._dev.reset)

    @property
    def needs_reconfigure(self) -> bool:
        return bool(self._dev.needs_reconfigure)

    def healthy(self) -> bool:
        faulted = getattr(self._dev, "faulted", None)
        if faulted is None:
            return True
        return not any(faulted(chip) for chip in range(int(getattr(self._dev, "chips", 1))))

    def counters(self, engine: JobEngine) -> EngineCounters:
        c: EngineCounters = self._dev.counters(engine)
        return c

    def dram(self) -> tuple[int, int]:
        cap, used = self._dev.dram()
        return int(cap), int(used)

    def inject_fault(self, kind: FaultKind, engine: JobEngine, nth: int, lane: int = 0) -> None:
        self._dev.inject_fault(kind, engine, nth, lane)

    async def aclose(self) -> None:
        for et in self._et.values():
            et.close()
        for waiters in self._fw.values():  # the runtime closes these fds with the device
            for w in waiters.values():
                trio.lowlevel.notify_closing(w.fd)
        self._fw.clear()
        await self._t.run(self._dev.close)
