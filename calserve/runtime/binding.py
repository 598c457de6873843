"""The thin layer over the C extension ``calserve._calrt``: loading it, mapping its status codes onto
the :class:`~calserve.runtime.types.CalrtError` tree, and its stateless helpers (lane checksums).

Why a module of its own: :mod:`calserve.runtime.device` (the facade's handles) and the engine's hot
path (the runtime calbin of :mod:`calserve.engine.backend`: lane verification per decode step) both
need these, and nothing outside the runtime package touches the extension directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import numpy as np

from calserve.runtime.types import (
    CalrtError,
    DeviceAlreadyOpen,
    DeviceBusy,
    DeviceFaulted,
    InvalidArgument,
    JobResult,
    NotSupported,
    OutOfDeviceMemory,
    OutOfSequences,
    WaitTimeout,
)

_calrt: Any
_IMPORT_ERROR: ImportError | None
try:  # the extension is built by ``pip install -e .``
    from calserve import _calrt
except ImportError as exc:  # pragma: no cover - only when the build is missing
    _calrt = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None

__all__ = ["binding", "call", "logits_checksum", "corrupted_lanes", "bad_lanes", "verify_lanes"]

# CalRT status codes (calrt.h ``calrt_status``) -> facade exceptions.
_CODE_TO_ERROR: dict[int, type[CalrtError]] = {
    1: InvalidArgument,  # CALRT_E_INVALID_ARGUMENT
    2: NotSupported,  # CALRT_E_NOT_SUPPORTED
    3: DeviceAlreadyOpen,  # CALRT_E_ALREADY_OPEN
    4: OutOfDeviceMemory,  # CALRT_E_OUT_OF_DEVICE_MEMORY
    5: OutOfSequences,  # CALRT_E_OUT_OF_SEQUENCES
    6: DeviceBusy,  # CALRT_E_BUSY
    7: WaitTimeout,  # CALRT_E_TIMEOUT
    8: DeviceFaulted,  # CALRT_E_FAULTED
    9: DeviceFaulted,  # CALRT_E_NEEDS_RECONFIGURE
    10: InvalidArgument,  # CALRT_E_IN_USE (release/free while jobs are in flight)
    11: CalrtError,  # CALRT_E_HOST_OOM
    12: CalrtError,  # CALRT_E_INTERNAL
    13: InvalidArgument,  # CALRT_E_SEQUENCE_INVALID (invalidated by a reset)
    14: InvalidArgument,  # CALRT_E_CLOSED (handle used after close/release)
}

_T = TypeVar("_T")


def _raise(exc: BaseException) -> NoReturn:
    code = int(getattr(exc, "code", 12))
    cls = _CODE_TO_ERROR.get(code, CalrtError)
    raise cls(str(exc), code) from None


def call(fn: Callable[..., _T], *args: Any) -> _T:
    """Call into the binding, translating its status exception into the CalrtError tree."""
    try:
        return fn(*args)
    except _calrt.Error as exc:
        _raise(exc)


def binding() -> Any:
    """The extension module; :class:`CalrtError` when it is not built."""
    if _calrt is None:
        raise CalrtError(f"calserve._calrt is not built: {_IMPORT_ERROR}")
    return _calrt


def logits_checksum(row: np.ndarray) -> int:
    """The device's 64-bit lane checksum (``calrt_checksum``) of one float32 logits row."""
    a = np.ascontiguousarray(row, dtype=np.float32)
    return int(binding().checksum(a))


def corrupted_lanes(result: JobResult) -> list[int]:
    """Lanes whose logits do not match the checksum the device reported (crosstalk, spec §7.4).

    Inactive decode lanes (echo seq_id == -1) report checksum 0 and are skipped.
    """
    lanes = [i for i, sid in enumerate(result.echo[:, 1].tolist()) if sid >= 0]
    logits = np.ascontiguousarray(result.logits, dtype=np.float32)
    bad: list[int] = binding().bad_rows(logits, np.ascontiguousarray(result.checksum), lanes)
    return bad


def bad_lanes(result: JobResult, lanes: Sequence[int]) -> list[int]:
    """The lanes among ``lanes`` whose logits row does not match the device's checksum, in one C
    call over the result's own arrays (as the runtime returned them: no conversion, hot path)."""
    bad: list[int] = binding().bad_rows(result.logits, result.checksum, lanes)
    return bad


def verify_lanes(
    result: JobResult, job_id: int, lanes: Sequence[int], expect: Sequence[tuple[int, int]]
) -> list[int]:
    """The indices ``k`` for which lane ``lanes[k]`` did not echo ``(job_id, *expect[k])`` or whose
    logits row does not match its checksum (crosstalk, spec §7.4), in one C call; empty when all is
    well."""
    bad: list[int] = binding().verify_lanes(result.logits, result.checksum, result.echo, job_id, lanes,
                                            expect)
    return bad
