"""How long a stream holds its next chunk: fixed, or adaptive to the server's own CPU load.

Each SSE event costs the server a fixed amount of CPU in the HTTP stack (one hypercorn send: ~30 µs
on the bench machine) on top of the per-token work. While the server's thread has CPU to spare that
cost buys the lowest inter-token latency, so every token goes out at once. When the thread is
saturated (the device is faster than the host can stream, e.g. a small model at high concurrency),
one send per token takes CPU from every other stream and from the engine: the token rate of the
whole server drops. Then grouping the tokens a stream produced within a short interval into one
event is the better trade — the idea of TCP autocorking (coalesce small writes while the link is
busy, send at once when it is idle), applied to SSE.

:class:`StreamPacer` measures the serving thread's busy fraction lazily, on the streams' own calls,
in windows of ``window_s``: the time it ran plus the time it was runnable but waited for a CPU
(Linux ``/proc/thread-self/schedstat``; elsewhere its CPU time alone) over wall time. The wait
counts because a thread that shares its core with others (the software runtime's compute threads,
a neighbour process) is just as saturated when it spends 40 % of the time waiting to run: measured
at the bench's 1 ms step, the thread ran 60-78 % of the time and the core was full. It answers the
hold interval:

- ``server.stream_interval_ms`` > 0: that interval, always (like vLLM's ``--stream-interval``, in
  time rather than tokens);
- else ``server.stream_busy_interval_ms`` (default 20 ms; 0 = never) while the thread is saturated:
  engaged when a window's busy fraction reaches ``server.stream_busy_fraction`` (0.9), released
  when one falls below 0.7 of it (hysteresis: coalescing lowers the load it reacts to).

The first token of a stream is never held (TTFT is unchanged); a held chunk never waits past the
interval; the terminal event goes out with the tokens held before it.

A hold is a wait until a time, once per event of every grouped stream. ``trio.sleep_until`` costs a
cancel scope with its own deadline and a ``Cancelled`` raised and caught when it expires: ~113k
instructions per event under callgrind (``python -m bench.token_path --hold sleep``, its docstring
has the recipe); :class:`HoldTimer` keeps the held streams in one heap and wakes the due ones from one
task whose own deadline is the heap's earliest: ~5k (``--hold timer``; issue 18, bench/README).

Holds ride the loop's wake-ups (``server.stream_hold_coalesce_ms``, default 2 ms; 0 = off): when
the serving loop wakes from an idle wait (it had nothing to run for at least :data:`IDLE_MIN_S`:
a device completion, a request, a hold's own time), every hold due within that margin is released
at once, up to the margin early and never late. On a device that paces the host, the loop
sleeps between completions, and each wake-up from idle costs far more than the work it wakes
for (on the bench's 2-vCPU VM the same Python ran +40-100 % slower after a sleep: cold caches, a
halted vCPU; bench/README, session 44). A hold that expired on its own ~1 ms after a completion
woke the loop a second time for one event; it now goes out with the completion's wake. A loop that
never idles (saturated: the grouping's own case) is not touched: no hold is released early there.
With 64 streams on a 2 ms B16 step and 72 ms holds, the serving thread went to sleep ~15 % fewer
times a token in process and ~5 % fewer over HTTP, where the host's CPU a token fell in 5 of 6
alternated pairs (median ratio 0.88; bench/README, session 47).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, final

import trio

if TYPE_CHECKING:
    from calserve.config import ServerConfig

__all__ = ["StreamPacer", "HoldTimer", "WakeCoalescer", "RELEASE_RATIO", "IDLE_MIN_S", "thread_demand_s"]

log = logging.getLogger("calserve.api")

RELEASE_RATIO: Final = 0.7  # released below this share of the engage threshold
_SCHEDSTAT: Final = "/proc/thread-self/schedstat"
#: The shortest wait of the serving loop that counts as idle for the holds' coalescing (s): one
#: that ended sooner found work at once (IO ready), and the vCPU did not go to sleep.
IDLE_MIN_S: Final = 1e-4


def thread_demand_s() -> float:
    """Seconds the calling thread ran plus waited runnable for a CPU (Linux schedstat), else its
    CPU time (``time.thread_time``)."""
    try:
        fd = os.open(_SCHEDSTAT, os.O_RDONLY)
    except OSError:
        return time.thread_time()
    try:
        run_ns, wait_ns = os.read(fd, 128).split()[:2]
        return (int(run_ns) + int(wait_ns)) * 1e-9
    except (OSError, ValueError):
        return time.thread_time()
    finally:
        os.close(fd)


@final
class HoldTimer:
    """Holds tasks until a time (:meth:`hold_until`, what ``trio.sleep_until`` does) and wakes them
    from one task (:meth:`run`, started in the app's nursery), so a hold costs a heap push and a
    reschedule instead of a cancel scope with a deadline of its own (module docstring).

    Before :meth:`run` started and after it ended, :meth:`hold_until` is ``trio.sleep_until``: a
    pump never waits for a timer that does not run. A held task is cancellable as in a sleep
    (its entry is cleared; the timer skips it when it comes due).

    ``coalesce_s`` > 0: while :meth:`run` runs, a trio instrument releases the holds due within
    that margin whenever the loop wakes from idle (:meth:`release_soon`; module docstring).

    Invariant: every live entry (a task, not None) belongs to a task parked in :meth:`hold_until`;
    while :meth:`run` sleeps, its scope's deadline is at most the earliest entry's time."""

    __slots__ = ("_heap", "_seq", "_scope", "_stop", "holds", "coalesce_s", "coalesced", "_idle_clock")

    def __init__(self, coalesce_s: float = 0.0, *,
                 idle_clock: Callable[[], float] = time.perf_counter) -> None:
        if coalesce_s < 0:
            raise ValueError("coalesce_s must be >= 0")
        # (until, tie-breaker, [task or None]): a cancelled hold sets its entry's task to None
        self._heap: list[tuple[float, int, list[Any]]] = []
        self._seq = itertools.count()
        self._scope: trio.CancelScope | None = None  # the timer's sleep, while it sleeps
        self._stop: trio.CancelScope | None = None  # the whole of run(), while it runs
        self.holds = 0  # holds taken by the timer (tests, statistics)
        #: the margin (s) of the wake-up coalescing (0: off); read when run() starts
        self.coalesce_s = coalesce_s
        self.coalesced = 0  # holds released before their time by the coalescing (tests, statistics)
        self._idle_clock = idle_clock  # measures the loop's idle waits (real time)

    @property
    def running(self) -> bool:
        return self._stop is not None

    def statistics(self) -> int:
        """Entries in the heap (live holds plus cancelled ones not yet due)."""
        return len(self._heap)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Wake each held task at its time until :meth:`stop` or a cancel (then the rest at once:
        their reads happen, nothing is lost). A bug in here ends the timer, never its nursery:
        the holds then fall back to ``trio.sleep_until``."""
        self._stop = stop = trio.CancelScope()
        coalescer = WakeCoalescer(self.release_soon, self._idle_clock) if self.coalesce_s > 0 else None
        if coalescer is not None:
            trio.lowlevel.add_instrument(coalescer)
        task_status.started()
        try:
            with stop:
                await self._wake_due_forever()
        except Exception:
            log.exception("the stream hold timer failed; holds fall back to trio.sleep_until")
        finally:
            if coalescer is not None:
                trio.lowlevel.remove_instrument(coalescer)
            self._scope = self._stop = None
            self._release(math.inf)  # every hold at once: their reads happen, nothing is lost

    def _release(self, until: float) -> int:
        """Wake every hold due by ``until``; how many live ones it woke."""
        heap = self._heap
        n = 0
        while heap and heap[0][0] <= until:
            entry = heapq.heappop(heap)[2]
            task = entry[0]
            if task is not None:
                entry[0] = None
                trio.lowlevel.reschedule(task)
                n += 1
        return n

    async def _wake_due_forever(self) -> None:
        heap = self._heap
        while True:
            self._release(trio.current_time())
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as scope:
                self._scope = scope
                await trio.sleep_forever()
            self._scope = None

    def release_soon(self) -> None:
        """Wake every hold due within ``coalesce_s`` from now, early (what the loop's wake-up from
        idle calls, from the trio thread: module docstring), and move the timer's own wake-up to
        the earliest hold left."""
        heap = self._heap
        if not heap:
            return
        until = trio.current_time() + self.coalesce_s
        if heap[0][0] > until:
            return
        self.coalesced += self._release(until)
        scope = self._scope
        if scope is not None:
            scope.deadline = heap[0][0] if heap else math.inf

    def stop(self) -> None:
        """End :meth:`run` (the app's ``after_serving``: its nursery would otherwise wait for the
        timer until quart-trio's background-task timeout)."""
        if self._stop is not None:
            self._stop.cancel()

    async def hold_until(self, until: float) -> None:
        """Return at ``until`` (trio's clock) or later; at once (a checkpoint) when it has passed."""
        if self._stop is None:  # the timer does not run
            await trio.sleep_until(until)
            return
        if until <= trio.current_time():
            await trio.lowlevel.checkpoint()
            return
        entry: list[Any] = [trio.lowlevel.current_task()]
        heapq.heappush(self._heap, (until, next(self._seq), entry))
        self.holds += 1
        scope = self._scope
        if scope is not None and until < scope.deadline:
            scope.deadline = until  # the timer sleeps until the earliest hold

        def abort(_: Any) -> trio.lowlevel.Abort:
            entry[0] = None  # cancelled: the timer skips the entry when it comes due
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


class WakeCoalescer(trio.abc.Instrument):
    """The trio instrument of :class:`HoldTimer`'s coalescing: after an IO wait that idled the loop
    (it had nothing to run, and the wait lasted :data:`IDLE_MIN_S` or more), the holds due soon go
    out with this wake-up. A loop that always has work never waits with a timeout, so never here."""

    def __init__(self, release_soon: Callable[[], None], clock: Callable[[], float]) -> None:
        self._release_soon = release_soon
        self._clock = clock
        self._since: float | None = None

    def before_io_wait(self, timeout: float) -> None:
        self._since = self._clock() if timeout > 0 else None

    def after_io_wait(self, timeout: float) -> None:
        since = self._since
        if since is not None and self._clock() - since >= IDLE_MIN_S:
            self._release_soon()


@final
class StreamPacer:
    """Answers the current hold interval (s) for a stream's next chunk. Call from the trio thread
    (the busy fraction is that thread's)."""

    __slots__ = ("fixed_s", "busy_s", "engage", "release", "window_s", "_clock", "_cpu", "_t0",
                 "_c0", "_engaged", "busy_fraction", "engagements", "timer")

    def __init__(self, fixed_s: float = 0.0, busy_s: float = 0.0, busy_fraction: float = 0.9, *,
                 window_s: float = 0.1, clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = thread_demand_s, timer: HoldTimer | None = None) -> None:
        if fixed_s < 0 or busy_s < 0 or not 0.0 < busy_fraction <= 1.0 or window_s <= 0:
            raise ValueError("intervals must be >= 0, busy_fraction in (0, 1], window > 0")
        self.fixed_s = fixed_s
        self.busy_s = busy_s
        self.engage = busy_fraction
        self.release = busy_fraction * RELEASE_RATIO
        self.window_s = window_s
        self._clock = clock
        self._cpu = cpu
        self._t0 = clock()
        self._c0 = cpu()
        self._engaged = False
        self.busy_fraction = 0.0  # of the last complete window
        self.engagements = 0  # times coalescing switched on (metrics, tests)
        #: How a stream waits out its hold (its task is started in the app's nursery; until
        #: then, ``trio.sleep_until``).
        self.timer = timer if timer is not None else HoldTimer()

    @classmethod
    def from_config(cls, server: ServerConfig, timer: HoldTimer | None = None) -> StreamPacer:
        return cls(server.stream_interval_ms / 1000.0, server.stream_busy_interval_ms / 1000.0,
                   server.stream_busy_fraction, timer=timer)

    @property
    def engaged(self) -> bool:
        return self._engaged

    def interval(self) -> float:
        """The hold interval for the chunk just written: 0 = the next read takes whatever is queued."""
        if self.fixed_s:
            return self.fixed_s
        if not self.busy_s:
            return 0.0
        now = self._clock()
        dt = now - self._t0
        if dt >= self.window_s:
            cpu = self._cpu()
            busy = (cpu - self._c0) / dt
            self._t0, self._c0 = now, cpu
            self.busy_fraction = busy
            if self._engaged:
                if busy < self.release:
                    self._engaged = False
            elif busy >= self.engage:
                self._engaged = True
                self.engagements += 1
        return self.busy_s if self._engaged else 0.0
