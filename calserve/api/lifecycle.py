"""Runs the engine for the app's lifespan, in its own nursery, and decides what a crash does.

Why its own nursery: an exception escaping a task started directly in quart-trio's ``app.nursery``
closes that nursery and every later request that touches it fails with 500 (quart-trio 0.12). Here the
engine runs inside :meth:`EngineHost.run`, which catches everything the engine raises after start-up.

What a crash does (supervision):
- ``engine`` becomes None: ``/ready`` answers 503, new requests get 503 ``engine_unavailable``,
  ``calserve_engine_up`` drops to 0;
- ``failed`` is set: ``calserve serve`` waits on it, shuts hypercorn down and exits non-zero so a
  supervisor restarts the process (hypercorn's own CLI would exit 0).
Listen first: :meth:`EngineHost.run` reports started at once, so the server serves HTTP while the
engine opens (the model loads) in the background: ``/health`` answers 200, ``/ready`` 503
``loading`` (:mod:`calserve.api.readiness`), generation routes 503 + Retry-After. A failure while
opening is logged once (one line for a deliberate refusal, a traceback for a bug) and sets
``failed`` with ``start_failure``: ``calserve serve`` then exits 1, the hypercorn CLI's worker
exits 1 (``create_app(exit_on_start_failure=True)``).

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
from calserve.errors import CalserveError
from calserve.engine.types import EngineStatistics

__all__ = ["EngineFactory", "EngineHost", "describe"]

log = logging.getLogger("calserve.api")

EngineFactory = Callable[[CalserveConfig], AbstractAsyncContextManager[Any]]


def describe(exc: BaseException) -> str:
    """One line for an exception: a group's first leaf (a start-up failure is one cause)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return str(exc) if isinstance(exc, CalserveError) else f"{type(exc).__name__}: {exc}"


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
        self.failed = trio.Event()  # the engine failed to open or died (not a deliberate stop)
        self.start_failure: BaseException | None = None  # why it never opened, if so
        self.opened = trio.Event()  # the engine opened, or failed to (start-up is over)
        self._stop = trio.Event()
        self._done = trio.Event()
        self.drain_deadline: float | None = None  # set when the drain began (trio time)
        self.unclean: str | None = None  # why closing the engine did not release everything
        self._loading_scope = trio.CancelScope()  # a stop while loading cancels the load

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

    @property
    def loading(self) -> bool:
        """The engine is still opening (start-up: packages verified, model loaded, warmed)."""
        return not self.opened.is_set()

    def _start_failed(self, exc: BaseException) -> None:
        self.start_failure = exc
        self.failure = exc
        expected = isinstance(exc, CalserveError) or (
            isinstance(exc, BaseExceptionGroup)
            and all(isinstance(e, CalserveError) for e in exc.exceptions))
        log.critical("calserve: the model could not be loaded at start-up: %s", describe(exc),
                     exc_info=None if expected else exc)
        self.failed.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Report started at once (listen first), open the engine, then hold it open until
        :meth:`stop`. Never raises but its own cancellation: a start-up failure is recorded
        (``start_failure``, ``failed``) and logged once; a stop while loading cancels the load."""
        started = False
        task_status.started()
        try:
            with self._loading_scope:  # cancelled only by a stop() while loading
                async with self._factory(self.config) as engine:
                    self.engine = engine
                    started = True
                    self.opened.set()
                    log.info("calserve: engine started (models: %s)", ", ".join(self.config.models))
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
            if _is_cancel(exc) or isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise  # our own cancel
            if not started:
                self._start_failed(exc)
            else:
                self._mark_failed(exc, f"{type(exc).__name__}: {exc}")
        finally:
            self.engine = None
            self.opened.set()
            self._done.set()
        leaked = int(getattr(engine, "leaked_at_close", 0) or 0) if started else 0
        if leaked:
            self.unclean = f"{leaked} device KV sequences were still bound at close"
        if started and not self._stop.is_set() and not self.failed.is_set():
            self._mark_failed(None, "engine exited on its own")

    async def stop(self, timeout_s: float) -> None:
        """Deliberate shutdown: close the engine (it drains in-flight jobs) within ``timeout_s``;
        an engine still loading is cancelled."""
        self._stop.set()
        if self.loading:
            self._loading_scope.cancel()
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
