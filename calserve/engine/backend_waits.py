"""How :class:`calserve.engine.backend.RuntimeBackend` runs blocking runtime calls and waits for jobs
without blocking trio: worker threads on a limiter of its own (control calls), one long-lived thread
per job engine (the hot path's fallback), and waits on the runtime's per-engine completion fd (the hot
path, no Python thread per step).

Split out of :mod:`calserve.engine.backend` (which keeps the device interface and the runtime backend
built from these parts); trio and OS primitives only, nothing here knows calbins or tickets.
"""

from __future__ import annotations

import functools
import math
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

    The poll before the park (``poll_us``, ``runtime.completion_poll_us``): a job of a small model
    at B1 completes ~20 µs after its post-submit work, and parking on the fd then costs the epoll
    wake-up (on a VM an IPI to a halted vCPU, ~10 µs a step). So a wait first yields to trio
    (``cancel_shielded_checkpoint``: other tasks and I/O still run, and trio's epoll does not block
    while a task is runnable) and checks the job, for up to an adaptive window, then parks. The
    window follows the software engine's poll (ext/README.md): a completion that came after the
    window but within the cap grows it, one that came later than the cap halves it, down to none —
    a ms-long step (a real model, a timed profile) stops polling after a few jobs. At most
    ``POLL_MAX_YIELDS`` yields a wait, so a wait can never hold trio busy forever (under an autojump
    clock a task that only checkpoints would keep fake time from moving).

    The timeout without a cancel scope per wait: a waiter's deadline is watched by an alarm, one
    trio system task per waiter that sleeps until the deadline of the wait in progress and, if the
    wait is still there then, writes the fd itself (the waiter wakes, finds no result and its
    deadline passed). Why: entering and leaving a ``CancelScope`` with a deadline around every
    step's ``wait_readable`` cost ~30-50 µs of the trio thread per decode step on the critical
    path (M1: measured with ``bench.m1_async_vs_sync``, P50 +2.4/2.6 % -> +1.2/2.3 % in paired
    runs with the scope removed), while the deadlines of consecutive steps only move forward: the
    alarm wakes about once per hang timeout (>= ``executor.hang_min_ms``) while jobs run, is
    woken early only by a deadline earlier than the one it sleeps until, and parks while nothing
    is waited for (no wake-ups at rest).
    """

    POLL_MAX_YIELDS = 64
    POLL_MIN_S = 10e-6

    def __init__(self, fd: int, poll_us: float = 0.0) -> None:
        self.fd = fd
        self.busy = False
        self.wakeups = 0  # fd wake-ups (spurious ones included), for tests and statistics
        self.alarms = 0  # waits the alarm ended at their deadline, for tests and statistics
        self.polled = 0  # waits the poll before the park answered, for tests and statistics
        self.poll_cap_s = max(0.0, poll_us) * 1e-6
        self.poll_window_s = self.poll_cap_s
        # The wait in progress's deadline (inf: none). The alarm task's state: the trio run it
        # belongs to, what it sleeps until (inf: parked or poked), its sleep's scope, the parked
        # task, the deadline it already poked the fd for.
        self._deadline = math.inf
        self._alarm_run: object | None = None
        self._alarm_until = math.inf
        self._alarm_sleep: trio.CancelScope | None = None
        self._alarm_parked: trio.lowlevel.Task | None = None
        self._poked = math.inf

    @property
    def alarm_sleeping(self) -> bool:
        """The alarm sleeps until a deadline (False: parked, nothing to watch), for tests."""
        return self._alarm_until != math.inf

    def _drain(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    @staticmethod
    def next_poll_window(window: float, cap: float, waited: float) -> float:
        """The poll window after a wait the poll did not answer, which took ``waited`` seconds:
        grown (x2, at least ``POLL_MIN_S``) when a longer poll would have caught it (``waited <=
        cap``), else halved, and none below ``POLL_MIN_S``; never above ``cap``."""
        if waited <= cap:
            return min(cap, max(window * 2.0, CompletionFdWaiter.POLL_MIN_S))
        half = window / 2.0
        return half if half >= CompletionFdWaiter.POLL_MIN_S else 0.0

    async def _poll(self, job: Any, until: float) -> JobResult | None:
        for _ in range(self.POLL_MAX_YIELDS):
            await trio.lowlevel.cancel_shielded_checkpoint()
            r: JobResult | None = job.result_nowait()
            if r is not None:
                self.polled += 1
                self._drain()  # this completion's count (if already written: else one spurious wake-up later)
                return r
            if trio.current_time() >= until:
                break
        return None

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
            t0 = trio.current_time()
            deadline = t0 + timeout_s
            if self.poll_window_s > 0.0:
                r = await self._poll(job, t0 + self.poll_window_s)  # never raises Cancelled
                if r is not None:
                    return r
            try:
                r = await self._until(job, deadline)
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    await self._until(job, deadline)
                raise
            if self.poll_cap_s > 0.0:
                self.poll_window_s = self.next_poll_window(
                    self.poll_window_s, self.poll_cap_s, trio.current_time() - t0)
            return r
        finally:
            self.busy = False

    async def _until(self, job: Any, deadline: float) -> JobResult | None:
        self._arm(deadline)
        try:
            while True:
                await trio.lowlevel.wait_readable(self.fd)
                self.wakeups += 1
                self._drain()
                r: JobResult | None = job.result_nowait()
                if r is not None:
                    return r
                if trio.current_time() >= deadline:
                    # counts the timeout in the runtime; returns the result if it completed just now
                    return wait_or_none(job, 0.0)
        finally:
            self._deadline = math.inf

    # ------------------------------------------------------------------ the alarm (class docstring)
    def _arm(self, deadline: float) -> None:
        self._deadline = deadline
        run = trio.lowlevel.current_trio_token()
        if self._alarm_run is not run:  # first wait in this trio run: start its alarm
            self._alarm_run = run
            self._alarm_until = math.inf
            self._alarm_sleep = self._alarm_parked = None
            self._poked = math.inf
            trio.lowlevel.spawn_system_task(self._alarm, name=f"calserve completion-fd {self.fd} alarm")
        elif deadline < self._alarm_until:  # it sleeps too long (or is parked): wake it
            parked, self._alarm_parked = self._alarm_parked, None
            if parked is not None:
                trio.lowlevel.reschedule(parked)
            elif self._alarm_sleep is not None:
                self._alarm_sleep.cancel()

    def _unpark(self, _: Any) -> trio.lowlevel.Abort:
        self._alarm_parked = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _alarm(self) -> None:
        while True:
            d = self._deadline
            if d == math.inf or d == self._poked:  # nothing to watch (or done for it): park
                self._alarm_until = math.inf
                self._alarm_parked = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._unpark)
                continue
            if trio.current_time() >= d:  # the wait is still there past its deadline: end it
                self._poked = d
                self.alarms += 1
                try:
                    os.eventfd_write(self.fd, 1)
                except OSError:  # the runtime closed it: no wait can be left on it
                    pass
                continue
            self._alarm_until = d
            with trio.CancelScope() as sleep:
                self._alarm_sleep = sleep
                await trio.sleep_until(d)
            self._alarm_sleep = None
