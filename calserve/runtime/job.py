"""A submitted CalRT job (:class:`Job`): its wait, its completion without blocking, its result.

Split from :mod:`calserve.runtime.device` (which creates jobs through :class:`~calserve.runtime.device.Calbin`
and re-exports this class): one job's handle, a one-step job of the runtime or a multi-step decode
the binding drives on the host (``ext/host_steps.h``).
"""

from __future__ import annotations

from typing import Any

from calserve.runtime.binding import call
from calserve.runtime.types import InvalidArgument, JobEngine, JobResult, JobStatus

__all__ = ["Job"]


# A job's status by its value: ``JobStatus(v)`` is ~1 µs of Enum machinery per job on the hot path.
_STATUS: dict[int, JobStatus] = {st.value: st for st in JobStatus}


class Job:
    """One submitted job. Owns its input/output buffers until it completed and was waited for.

    Invariant: a Job whose ``wait`` has not returned a result is still owned by the device; dropping the
    Python object is safe (the C job is reference counted) but its outcome is then lost.
    """

    __slots__ = ("_h", "job_id", "engine", "chip", "_result", "steps", "host")

    def __init__(self, handle: Any, engine: JobEngine, chip: int, steps: int = 1, host: bool = False) -> None:
        self._h = handle
        self.steps = steps  # > 1: a multi-step decode (its result carries step_tokens)
        # a multi-step decode the host drives (submit_decode(host=True)): its steps advance in wait
        # (blocking) and in done / result_nowait (never blocking)
        self.host = host
        self.job_id: int = int(handle.job_id)
        # a member already on the hot path (``JobEngine(e)`` is ~1 µs of Enum machinery per job)
        self.engine = engine if type(engine) is JobEngine else JobEngine(engine)
        self.chip = chip
        self._result: JobResult | None = None

    def wait(self, timeout_s: float) -> JobResult:
        """Block (GIL released) until the job finished; return its :class:`JobResult`.

        Raises :class:`WaitTimeout` if it did not finish within ``timeout_s`` — the job stays in flight
        and must be waited for again or the chip reset. Repeated waits return the same result.
        """
        if self._result is not None:
            return self._result
        if not timeout_s >= 0:
            raise InvalidArgument("timeout_s must be >= 0", 1)
        status, logits, echo, checksum, device_us = call(self._h.wait, int(timeout_s * 1e6))
        st = _STATUS.get(status)  # (not ``or``: OK is 0)
        self._result = JobResult(
            job_id=self.job_id,
            engine=self.engine,
            status=st if st is not None else JobStatus(status),
            logits=logits,
            echo=echo,
            checksum=checksum,
            device_us=float(device_us),
            step_tokens=self._h.step_tokens() if self.steps > 1 else None,
            lane_steps=self._h.lane_steps() if self.host else None,
        )
        return self._result

    def done(self) -> bool:
        """True once the job completed (any status); ``wait`` then returns without blocking."""
        return self._result is not None or bool(self._h.done())

    def stop(self) -> bool:
        """End a host-driven multi-step decode early (never blocks, any thread): its lanes end with
        the step in flight, each having run the least of its own steps and the steps run so far;
        the result's ``step_tokens`` are then ``[lanes, steps run]``. False (no effect) for any
        other job: a device job cannot be cut short. A stop after the last step's submit, or after
        the run finished, changes nothing."""
        return bool(self._h.stop())

    def submitted(self) -> int:
        """Device jobs this job submitted so far: 1, or a host-driven multi-step decode's steps."""
        return int(self._h.submitted())

    def result_nowait(self) -> JobResult | None:
        """The result if the job completed, else ``None`` — never blocks, never counts a timeout.

        The non-blocking half of the :meth:`Device.completion_fd` protocol (drain the fd, then call
        this; ``None`` means wait for the fd again)."""
        if self._result is not None:
            return self._result
        if not self._h.done():
            return None
        return self.wait(0.0)

    def __repr__(self) -> str:
        return f"Job(id={self.job_id}, engine={self.engine.name}, chip={self.chip})"
