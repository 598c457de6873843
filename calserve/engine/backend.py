"""The async device interface the engine uses, and its implementation over the real runtime facade.

Only the executor, the model manager and recovery call a backend. Two implementations honour the same
contract (the facade contract in :mod:`calserve.runtime.types`):

- :class:`RuntimeBackend` wraps the synchronous :class:`calserve.runtime.Device` facade. Control calls
  go through ``trio.to_thread.run_sync`` on a :class:`trio.CapacityLimiter` owned by the backend (the
  process-wide default limiter is shared with unrelated code, STACK.md "Threads and cancellation").
  The hot path (submit + first wait of a job) submits inline and waits in trio on the runtime's
  per-engine completion fd (:class:`_CompletionFdWaiter`, no Python thread per step); a runtime
  without that fd falls back to one wait thread per engine (:class:`_EngineThread`).
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
import functools
import gc
import os
import queue
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
import outcome
import trio

from calserve.runtime.reference import ModelConfig
from calserve.runtime.types import (
    EngineCounters,
    FaultKind,
    JobEngine,
    JobResult,
    ProfileSpec,
    RuntimeCapabilities,
    Timing,
    WaitTimeout,
)

__all__ = ["JobTicket", "BackendCalbin", "DeviceBackend", "RuntimeBackend", "row_checksums"]

T = TypeVar("T")


@dataclasses.dataclass
class JobTicket:
    """A submitted job. ``native`` is the implementation's job object (never touched by the engine)."""

    job_id: int
    engine: JobEngine
    native: Any


def _ticket(job: Any, engine: JobEngine) -> JobTicket:
    """The ticket of a runtime ``Job`` just submitted on ``engine``."""
    return JobTicket(int(job.job_id), engine, job)


def _wait_or_none(job: Any, timeout_s: float) -> JobResult | None:
    """``Job.wait`` with the backend's timeout convention: ``None`` (not :class:`WaitTimeout`) when
    the job is still in flight after ``timeout_s`` (the runtime counts the timeout either way)."""
    try:
        r: JobResult = job.wait(timeout_s)
    except WaitTimeout:
        return None
    return r


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

    async def submit_prefill(self, seq_id: int, tokens: np.ndarray, engine: JobEngine) -> JobTicket: ...

    async def submit_decode(
        self,
        seq_ids: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        valid: np.ndarray,
        engine: JobEngine,
    ) -> JobTicket: ...

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
    ) -> tuple[JobTicket, JobResult | None]:
        """Submit + first wait in one device round trip (the hot path: one thread hop per step).

        ``after_submit`` is called once the job was accepted, before the wait (host work that
        overlaps the device step). The body is the default for implementations that subclass this
        protocol explicitly (the fake device: plain ``submit_decode`` then ``wait``);
        :class:`_RuntimeCalbin` overrides it with its inline-submit hot path."""
        t = await self.submit_decode(seq_ids, tokens, positions, valid, engine)
        if after_submit is not None:
            after_submit()
        return t, await self.wait(t, timeout_s)

    async def submit_prefill_wait(
        self, seq_id: int, tokens: np.ndarray, engine: JobEngine, timeout_s: float,
        after_submit: Callable[[], None] | None = None,
    ) -> tuple[JobTicket, JobResult | None]:
        """Submit + first wait of a prefill; default as for :meth:`submit_decode_wait`."""
        t = await self.submit_prefill(seq_id, tokens, engine)
        if after_submit is not None:
            after_submit()
        return t, await self.wait(t, timeout_s)

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

    def counters(self, engine: JobEngine) -> EngineCounters: ...

    def dram(self) -> tuple[int, int]: ...

    def inject_fault(self, kind: FaultKind, engine: JobEngine, nth: int, lane: int = 0) -> None: ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------------------------------
# Real runtime


class _Threads:
    """Runs sync device calls in worker threads on a limiter of our own, with strict drain.

    Invariant: a call that reached the device returns to us; the caller's cancellation is re-raised
    only after the result was reclaimed (STACK.md: the limiter wait itself is cancellable, so the whole
    call, limiter wait included, is shielded)."""

    def __init__(self, threads: int) -> None:
        self.limiter = trio.CapacityLimiter(threads)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        with trio.CancelScope(shield=True):
            result = await trio.to_thread.run_sync(
                functools.partial(fn, *args), limiter=self.limiter
            )
        await trio.lowlevel.checkpoint_if_cancelled()
        return result


class _Doorbell:
    """A file descriptor one thread rings and trio waits on with ``wait_readable``.

    Why not ``TrioToken.run_sync_soon``: that wakes trio's entry-queue task, which runs the
    callback, which reschedules the waiter one batch later. ``wait_readable`` lets epoll reschedule
    the waiting task itself (measured on the 2-core box under load: ~140 -> ~75 us p50 from the
    thread's signal to the trio task running). eventfd on Linux, a pipe elsewhere.
    """

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self._wfd = self.fd
        else:  # pragma: no cover - non-Linux
            self.fd, self._wfd = os.pipe()
            os.set_blocking(self.fd, False)

    def ring(self) -> None:
        if self._wfd == self.fd:
            os.eventfd_write(self.fd, 1)
        else:  # pragma: no cover - non-Linux
            os.write(self._wfd, b"\0")

    def clear(self) -> None:
        try:
            if self._wfd == self.fd:
                os.eventfd_read(self.fd)
            else:  # pragma: no cover - non-Linux
                os.read(self.fd, 4096)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        if self._wfd != self.fd:  # pragma: no cover - non-Linux
            os.close(self._wfd)


class _EngineThread:
    """One long-lived OS thread per job engine for the hot path (submit + wait) when the runtime has
    no completion fd (the fallback of :class:`_CompletionFdWaiter`).

    Why not ``trio.to_thread``: it checkpoints before the thread starts, so every other ready task
    (request actors detokenising and streaming the previous token) would run between a completion
    and the next submit, adding their cost to every step. Here the call is queued synchronously —
    the device starts at once — and trio runs those tasks while the device computes. The result
    comes back through a :class:`_Doorbell` (epoll wakes the waiting executor directly).
    Invariant: one call at a time per thread (the executor of that engine is its only user), and the
    caller always waits for the result (shielded): nothing submitted is ever abandoned.
    Invariant: ``_result`` is written before the doorbell rings and read after it rang.
    """

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._bell = _Doorbell()
        self._result: outcome.Outcome[Any] | None = None
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                fn = self._q.get()
                if fn is None:
                    return
                self._result = outcome.capture(fn)
                self._bell.ring()
        finally:
            # Closed by the thread itself, after its last ring: never a write to a reused fd number.
            self._bell.close()

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the thread; always reclaims its result. If the caller is cancelled while
        waiting (the executor shields, so only an unshielded caller), the wait is finished in a
        shielded scope and the cancellation re-raised afterwards — no per-call CancelScope on the
        hot path."""
        assert not self._busy, "one call at a time per engine thread"
        self._busy = True
        self._q.put(fn)
        try:
            await trio.lowlevel.wait_readable(self._bell.fd)
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await trio.lowlevel.wait_readable(self._bell.fd)
            self._take()
            raise
        out: T = self._take().unwrap()
        return out

    def _take(self) -> outcome.Outcome[Any]:
        self._bell.clear()
        res, self._result = self._result, None
        self._busy = False
        assert res is not None
        return res

    def close(self) -> None:
        """Stop the thread (call from trio, with no call in flight)."""
        trio.lowlevel.notify_closing(self._bell.fd)
        self._q.put(None)


class _CompletionFdWaiter:
    """Waits for a job of one job engine inside trio, on the runtime's completion fd (spec §19 M1).

    Why: with :class:`_EngineThread` a completion wakes a Python thread blocked in ``Job.wait``,
    which rings a doorbell, which wakes trio — two wake-ups per step where the synchronous baseline
    has one. Here the runtime's engine worker writes the fd itself (``Device.completion_fd``) and
    epoll wakes the executor task directly; the result is then collected without blocking.

    Protocol (never loses a wake-up, never polls): check ``result_nowait``; if not done, wait until
    the fd is readable, drain it, check again. The runtime writes the fd only after the job reports
    done, so a "not done" seen after a drain is always followed by a readable fd. A stale count (a
    job of this engine waited for on a thread) costs one spurious wake-up.
    Invariant: at most one task waits on the fd (``busy``); callers fall back to the engine thread
    otherwise. Invariant: a job handed to :meth:`wait` is waited for until it completes or the
    timeout passes, even if the caller is cancelled (the cancellation is re-raised afterwards).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.busy = False
        self.wakeups = 0  # fd wake-ups (spurious ones included), for tests and statistics

    def _drain(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    async def wait(self, job: Any, timeout_s: float) -> JobResult | None:
        """The job's result, or ``None`` if it is still in flight after ``timeout_s`` (counted as a
        runtime wait timeout, like ``Job.wait``)."""
        assert not self.busy, "one waiter per completion fd"
        self.busy = True
        try:
            r: JobResult | None = job.result_nowait()
            if r is not None:
                # Done already: still a schedule point (the executor loops on this), not a cancel point.
                await trio.lowlevel.cancel_shielded_checkpoint()
                return r
            deadline = trio.current_time() + timeout_s
            try:
                return await self._until(job, deadline)
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    await self._until(job, deadline)
                raise
        finally:
            self.busy = False

    async def _until(self, job: Any, deadline: float) -> JobResult | None:
        while True:
            with trio.CancelScope(deadline=deadline):
                await trio.lowlevel.wait_readable(self.fd)
                self.wakeups += 1
                self._drain()
            r: JobResult | None = job.result_nowait()
            if r is not None:
                return r
            if trio.current_time() >= deadline:
                # counts the timeout in the runtime; returns the result if it completed just now
                return _wait_or_none(job, 0.0)


class _RuntimeCalbin:
    def __init__(
        self,
        native: Any,
        threads: _Threads,
        engine_threads: dict[JobEngine, _EngineThread],
        fd_waiters: Mapping[JobEngine, _CompletionFdWaiter] | None = None,
    ) -> None:
        self._c = native
        self._t = threads
        self._et = engine_threads
        self._fw: Mapping[JobEngine, _CompletionFdWaiter] = fd_waiters or {}
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

    async def submit_prefill(self, seq_id: int, tokens: np.ndarray, engine: JobEngine) -> JobTicket:
        job = await self._t.run(self._c.submit_prefill, seq_id, tokens, engine)
        return _ticket(job, engine)

    async def submit_decode(
        self,
        seq_ids: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        valid: np.ndarray,
        engine: JobEngine,
    ) -> JobTicket:
        job = await self._t.run(self._c.submit_decode, seq_ids, tokens, positions, valid, engine)
        return _ticket(job, engine)

    async def wait(self, ticket: JobTicket, timeout_s: float) -> JobResult | None:
        return await self._t.run(_wait_or_none, ticket.native, timeout_s)

    def _submit_wait(self, job: Any, engine: JobEngine, timeout_s: float) -> tuple[JobTicket, JobResult | None]:
        return _ticket(job, engine), _wait_or_none(job, timeout_s)

    async def submit_decode_wait(
        self,
        seq_ids: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        valid: np.ndarray,
        engine: JobEngine,
        timeout_s: float,
        after_submit: Callable[[], None] | None = None,
    ) -> tuple[JobTicket, JobResult | None]:
        # Submit inline: it only queues the job (DeviceBusy when the queue is full, never blocks), so
        # the device starts now instead of after a GIL hand-over to a worker thread; the blocking
        # wait runs on the engine's thread. Nothing between submit and wait can be cancelled.
        job = self._c.submit_decode(seq_ids, tokens, positions, valid, engine)
        return await self._wait_hot(job, engine, timeout_s, after_submit)

    async def _wait_hot(self, job: Any, engine: JobEngine, timeout_s: float,
                        after_submit: Callable[[], None] | None) -> tuple[JobTicket, JobResult | None]:
        """The caller's ``after_submit``, then the first wait of the just-submitted job: on the
        completion fd when the runtime has one (no Python thread per step), else on the engine's
        thread."""
        if after_submit is not None:
            after_submit()
        w = self._fw.get(engine)
        if w is not None and not w.busy:
            return _ticket(job, engine), await w.wait(job, timeout_s)
        return await self._et[engine].run(lambda: self._submit_wait(job, engine, timeout_s))

    async def submit_prefill_wait(
        self, seq_id: int, tokens: np.ndarray, engine: JobEngine, timeout_s: float,
        after_submit: Callable[[], None] | None = None,
    ) -> tuple[JobTicket, JobResult | None]:
        job = self._c.submit_prefill(seq_id, tokens, engine)
        return await self._wait_hot(job, engine, timeout_s, after_submit)

    async def reconfigure(self) -> None:
        await self._t.run(self._c.reconfigure)

    async def release(self) -> None:
        await self._t.run(self._c.release)

    def verify_lanes(
        self, result: JobResult, job_id: int, lanes: Sequence[int], expect: Sequence[tuple[int, int]]
    ) -> list[int]:
        from calserve.runtime.binding import verify_lanes

        return verify_lanes(result, job_id, lanes, expect)

    def checksum_ok(self, result: JobResult, lanes: Sequence[int]) -> list[bool]:
        from calserve.runtime.binding import bad_lanes

        bad = bad_lanes(result, lanes)  # one C call
        if not bad:
            return [True] * len(lanes)
        return [lane not in bad for lane in lanes]


#: gen0 threshold of a serving process (CPython's default is 700): see :func:`tune_gc_for_serving`.
SERVING_GC_GEN0 = 10_000


def tune_gc_for_serving() -> None:
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
    gen0, gen1, gen2 = gc.get_threshold()
    if gen0 and gen0 < SERVING_GC_GEN0:
        gc.set_threshold(SERVING_GC_GEN0, gen1, gen2)
    gc.freeze()


class RuntimeBackend:
    """The async face of the software (or vendor) CalRT. Owns the one ``Device`` of the process."""

    def __init__(self, device: Any, threads: int = 4, completion_fd: bool = True, tune_gc: bool = False) -> None:
        """``completion_fd=False`` forces the engine-thread wait even when the runtime offers
        completion fds (the path a vendor runtime without them takes). ``tune_gc``: call
        :func:`tune_gc_for_serving` after every model load (set by :meth:`open`)."""
        self._tune_gc = tune_gc
        self._dev = device
        self._t = _Threads(threads)  # control calls (sequences, reset, configure) and later waits
        self._et = {e: _EngineThread(f"calrt-{e.name.lower()}") for e in JobEngine}
        self.capabilities: RuntimeCapabilities = device.capabilities
        # Per chip: engine -> waiter on the runtime's completion fd (empty: the runtime has none).
        self._fw: dict[int, dict[JobEngine, _CompletionFdWaiter]] = {}
        get_fd = getattr(device, "completion_fd", None) if completion_fd else None
        if get_fd is not None:
            for chip in range(int(getattr(device, "chips", 1))):
                fds = {e: get_fd(e, chip) for e in JobEngine}
                if all(fd is not None for fd in fds.values()):
                    self._fw[chip] = {e: _CompletionFdWaiter(fd) for e, fd in fds.items()}

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
    ) -> RuntimeBackend:
        from calserve.runtime import Device

        dev = Device.open(
            profile=profile,
            dram_bytes=dram_bytes,
            null_compute=null_compute,
            completion_jitter_us=completion_jitter_us,
            seed=seed,
        )
        return cls(dev, tune_gc=True)

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
            tune_gc_for_serving()  # after a model load: what is alive now lives as long as the model
        return _RuntimeCalbin(native, self._t, self._et, self._fw.get(int(getattr(native, "chip", 0))))

    async def reset(self) -> None:
        await self._t.run(self._dev.reset)

    @property
    def needs_reconfigure(self) -> bool:
        return bool(self._dev.needs_reconfigure)

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
