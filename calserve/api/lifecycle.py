"""Runs the engine for the app's lifespan, in its own nursery, and decides what a crash does.

Why its own nursery: an exception escaping a task started directly in quart-trio's ``app.nursery``
closes that nursery and every later request that touches it fails with 500 (STACK.md). Here the
engine runs inside :meth:`EngineHost.run`, which catches everything the engine raises after start-up.

What a crash does (ARCHITECTURE.md "Supervision"):
- ``engine`` becomes None: ``/ready`` answers 503, new requests get 503 ``engine_unavailable``,
  ``calserve_engine_up`` drops to 0;
- ``failed`` is set: ``calserve serve`` waits on it, shuts hypercorn down and exits non-zero so a
  supervisor restarts the process (hypercorn's own CLI would exit 0).
A failure while starting propagates out of ``before_serving``: the lifespan start-up fails and the
server refuses to start (message in the log and on stderr).

Graceful drain (``SIGTERM`` to ``calserve serve``): :meth:`EngineHost.drain` marks the host draining
(``/ready`` answers 503 ``reason: draining`` from that moment, :meth:`drain_status`) and runs the
engine's drain (:mod:`calserve.engine.drain`). ``unclean`` says whether closing the engine left
device resources behind (``calserve serve`` then exits non-zero).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, final

import trio

from calserve.api.protocol import EngineLike
from calserve.config import CalserveConfig
from calserve.engine.types import EngineStatistics

__all__ = ["EngineFactory", "EngineHost"]

log = logging.getLogger("calserve.api")

EngineFactory = Callable[[CalserveConfig], AbstractAsyncContextManager[Any]]


def _is_cancel(exc: BaseException) -> bool:
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_cancel(e) for e in exc.exceptions)
    return False


@final
class EngineHost:
    """Owns the engine's lifetime. Invariant: ``engine is not None`` iff the engine is open and has
    not failed; ``failed`` is set at most once and never cleared."""

    def __init__(self, config: CalserveConfig, factory: EngineFactory) -> None:
        self.config = config
        self._factory = factory
        self.engine: EngineLike | None = None
        self.failure: BaseException | None = None
        self.failed = trio.Event()  # the engine died after start-up (not a deliberate stop)
        self._stop = trio.Event()
        self._done = trio.Event()
        self.drain_deadline: float | None = None  # set when the drain began (trio time)
        self.unclean: str | None = None  # why closing the engine did not release everything

    def statistics(self) -> EngineStatistics | None:
        eng = self.engine
        if eng is None:
            return None
        try:
            return eng.statistics()
        except Exception:  # a scrape must never crash the app
            log.exception("engine.statistics() failed")
            return None

    def _mark_failed(self, exc: BaseException | None, why: str) -> None:
        self.engine = None
        if not self.failed.is_set():
            self.failure = exc
            self.failed.set()
            log.critical("engine failed beyond recovery: %s", why, exc_info=exc)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the engine, report started, then hold it open until :meth:`stop`."""
        started = False
        try:
            async with self._factory(self.config) as engine:
                self.engine = engine
                started = True
                task_status.started()
                async with trio.open_nursery() as nursery:
                    wait_failed = getattr(engine, "wait_failed", None)
                    if wait_failed is not None:
                        # The engine stays open but cannot recover (e.g. reset budget spent).
                        async def watch() -> None:
                            await wait_failed()
                            self._mark_failed(None, "engine reported an unrecoverable failure")
                            nursery.cancel_scope.cancel()

                        nursery.start_soon(watch)
                    await self._stop.wait()
                    nursery.cancel_scope.cancel()
        except BaseException as exc:
            if not started or _is_cancel(exc) or isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise  # start-up failure (propagates out of before_serving) or our own cancel
            self._mark_failed(exc, f"{type(exc).__name__}: {exc}")
        finally:
            self.engine = None
            self._done.set()
        leaked = int(getattr(engine, "leaked_at_close", 0) or 0) if started else 0
        if leaked:
            self.unclean = f"{leaked} device KV sequences were still bound at close"
        if not self._stop.is_set() and not self.failed.is_set():
            self._mark_failed(None, "engine exited on its own")

    async def stop(self, timeout_s: float) -> None:
        """Deliberate shutdown: close the engine (it drains in-flight jobs) within ``timeout_s``."""
        self._stop.set()
        with trio.move_on_after(timeout_s) as scope:
            await self._done.wait()
        if scope.cancelled_caught:
            log.warning("engine did not stop within %.1fs", timeout_s)
            self.unclean = self.unclean or f"the engine did not close within {timeout_s:g} s"

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    async def drain(self, timeout_s: float, hurry: trio.Event | None = None) -> Any:
        """Begin the graceful drain (``/ready`` 503 from now on) and run the engine's: new
        requests refused, admitted ones finish within ``timeout_s`` (less once ``hurry`` is set),
        the rest end with an error event, every submitted job drains. Returns the engine's
        :class:`~calserve.engine.drain.DrainReport` (None for an engine without a drain)."""
        if self.drain_deadline is None:
            self.drain_deadline = trio.current_time() + timeout_s
        eng = self.engine
        run = getattr(eng, "drain", None)
        if run is None:
            return None
        return await run(timeout_s, hurry)

    def drain_status(self) -> tuple[dict[str, Any], dict[str, str]]:
        """``/ready``'s 503 body and headers while draining (issue 20's not-ready shape)."""
        left = max(0.0, (self.drain_deadline or 0.0) - trio.current_time())
        retry = str(max(1, math.ceil(left)))
        return ({"status": "not_ready", "reason": "draining",
                 "message": "the server is draining (shutting down): admitted requests finish, "
                            "new ones are refused", "drain_remaining_s": round(left, 3)},
                {"Retry-After": retry})
