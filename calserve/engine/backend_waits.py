"""How :class:`calserve.engine.backend.RuntimeBackend` runs blocking runtime calls and waits for jobs
without blocking trio: worker threads on a limiter of its own (control calls), one long-lived thread
per job engine (the hot path's fallback), and waits on the runtime's per-engine completion fd (the hot
path, no Python thread per step).

Split out of :mod:`calserve.engine.backend` (which keeps the device interface and the runtime backend
built from these parts); trio and OS primitives only, nothing here knows calbins or tickets.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from calserve.runtime.types import JobResult, WaitTimeout

__all__ = ["DeviceThreads", "Doorbell", "EngineThread", "CompletionFdWaiter", "wait_or_none"]

T = TypeVar("T")


def wait_or_none(job: Any, timeout_s: float) -> JobResult | None:
    """``Job.wait`` with the backend's timeout convention: ``None`` (not :class:`WaitTimeout`) when
    the job is still in flight after ``timeout_s`` (the runtime counts the timeout either way)."""
    try:
        r: JobResult = job.wait(timeout_s)
    except WaitTimeout:
        return None
    return r


class DeviceThreads:
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


class Doorbell:
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


class EngineThread:
    """One long-lived OS thread per job engine for the hot path (submit + wait) when the runtime has
    no completion fd (the fallback of :class:`CompletionFdWaiter`).

    Why not ``trio.to_thread``: it checkpoints before the thread starts, so every other ready task
    (request actors detokenising and streaming the previous token) would run between a completion
    and the next submit, adding their cost to every step. Here the call is queued synchronously —
    the device starts at once — and trio runs those tasks while the device computes. The result
    comes back through a :class:`Doorbell` (epoll wakes the waiting executor directly).
    Invariant: one call at a time per thread (the executor of that engine is its only user), and the
    caller always waits for the result (shielded): nothing submitted is ever abandoned.
    Invariant: ``_result`` is written before the doorbell rings and read after it rang.
    """

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._bell = Doorbell()
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


class CompletionFdWaiter:
    """Waits for a job of one job engine inside trio, on the runtime's completion fd (spec §19 M1).

    Why: with :class:`EngineThread` a completion wakes a Python thread blocked in ``Job.wait``,
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
                return wait_or_none(job, 0.0)
