"""Server-wide graceful drain (``SIGTERM`` to ``calserve serve``; spec §3 one process per board).

:func:`drain_engine` is what an instance does before it goes away, so that a load balancer in front
of it loses no request it accepted:

1. from now on the engine refuses new requests (``UnavailableError``: 503 + Retry-After, so a
   client or a load balancer sends them to another instance);
2. every admitted request runs on until it ends on its own, for at most ``timeout_s``
   (``server.drain_timeout_s``); ``hurry`` (a second signal) ends this wait early;
3. the requests still running then end with one error event saying why (the shutdown path of the
   engine core: a request whose job is on the device ends when that job drains);
4. every submitted job drains (``wait_idle``): this step has no timeout and no ``hurry`` — a job
   handed to the device is never abandoned (each is bounded by ``executor.wait_timeout_ms``).

What is left afterwards (returning lanes and calbins, closing the device) is the engine's normal
close. The per-generation drain of a model reload is a different thing (model control plane); this
one is for the whole engine and ends with the process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import trio

if TYPE_CHECKING:
    from calserve.engine.driver import CoreDriver
    from calserve.engine.registry import RequestRegistry

__all__ = ["DrainReport", "drain_engine", "REFUSAL", "drain_cut_message"]

log = logging.getLogger("calserve.engine.drain")

#: The message of a request refused while the engine drains (503 + Retry-After).
REFUSAL: Final = ("this server is draining (shutting down) and accepts no new requests: "
                  "send the request to another instance")


def drain_cut_message(timeout_s: float, shortened: bool) -> str:
    """The error event of a request still running when the drain wait ended."""
    why = ("a second stop signal ended the drain early" if shortened else
           f"it did not finish within the drain timeout (server.drain_timeout_s {timeout_s:g} s)")
    return f"the server stopped while this request was running: {why}; retry it"


@dataclass(frozen=True, slots=True)
class DrainReport:
    admitted: int  # requests running or queued when the drain began
    finished: int  # of those, ended on their own (finished, stopped or cancelled) during the wait
    cut: int  # ended with the drain's error event when the wait was over
    waited_s: float  # how long the wait for the admitted requests took
    shortened: bool  # ``hurry`` ended the wait


async def drain_engine(registry: RequestRegistry, driver: CoreDriver, timeout_s: float,
                       hurry: trio.Event | None = None) -> DrainReport:
    """Refuse new requests, let the admitted ones finish within ``timeout_s`` (less if ``hurry`` is
    set), end the rest with an error event, drain every submitted job. Idempotent in effect."""
    start = trio.current_time()
    registry.draining = REFUSAL
    admitted = len(registry.live)
    log.info("draining: %d admitted requests may run for up to %g s", admitted, timeout_s)
    shortened = False
    async with trio.open_nursery() as nursery:
        async def on_hurry() -> None:
            nonlocal shortened
            assert hurry is not None
            await hurry.wait()
            shortened = True
            nursery.cancel_scope.cancel()

        if hurry is not None:
            nursery.start_soon(on_hurry)
        with trio.move_on_after(timeout_s):
            await registry.wait_empty()
        nursery.cancel_scope.cancel()
    waited = trio.current_time() - start
    left = len(registry.live)
    if left:
        log.warning("drain: %d requests still running after %.1f s: ending them", left, waited)
        registry.shutdown(drain_cut_message(timeout_s, shortened))
    # The job drain: not shortened by anything (a job on the device is never abandoned).
    await registry.wait_empty()
    await driver.wait_idle()
    report = DrainReport(admitted, admitted - left, left, waited, shortened)
    log.info("drained: %d admitted, %d finished, %d ended by the drain, waited %.2f s%s",
             report.admitted, report.finished, report.cut, report.waited_s,
             " (shortened)" if shortened else "")
    return report
