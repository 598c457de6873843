"""Plain types of the CalRT facade, shared by the real runtime and the engine's fake device.

No trio and no I/O here. The facade contract (implemented by :mod:`calserve.runtime.device` over the
C binding ``calserve._calrt``; mirrored, async, by the engine's trio-native fake device) is:

``Device.open(profile="calrt-0.7.6", dram_bytes=..., null_compute=False) -> Device``
    One physical VirtualDevice per process: a second open raises :class:`DeviceAlreadyOpen`.
``Device.load_calbin(config, weights, spec, timing=None, chip=0, kv_owner=None) -> Calbin``
    CreateCalbin + configure + KvManager. Charges DRAM (weights + KV for ``spec.max_sequences`` x
    ``spec.max_seq``); :class:`OutOfDeviceMemory` if it does not fit; :class:`NotSupported` for a
    second resident calbin without the multi-calbin capability, or ``compiled_batch > 1`` without the
    batch capability. With ``kv_owner`` (C3 ``shared_kv``, sim-next only) the new calbin joins the
    owner's KV group: same KvManager, sequences and weights, charged once.
``Calbin``: ``introspect()``, ``release()``, KvManager (``can_allocate(n)``, ``create_sequence()``,
    ``free_sequence(id)``, ``committed_len(id)``, ``remove_tokens_at_end(id, n)``, ``do_shift(id, n)``,
    NotSupported ops), jobs (``submit_prefill``, ``submit_decode``) returning a ``Job`` whose
    ``wait(timeout_s)`` returns a :class:`JobResult` or raises :class:`WaitTimeout` (the job stays in
    flight: it must still be waited for, or the device reset).
``Device.reset()`` aborts every in-flight job (each completes with ``JobStatus.ABORTED``) and
    invalidates every KV sequence; after ``JobStatus.DMA_UNKNOWN`` calbins must be reconfigured.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

__all__ = [
    "JobEngine",
    "JobStatus",
    "FaultKind",
    "RuntimeCapabilities",
    "RUNTIME_PROFILES",
    "Timing",
    "ProfileSpec",
    "JobResult",
    "RunEnds",
    "EngineCounters",
    "CalrtError",
    "DeviceAlreadyOpen",
    "DeviceBusy",
    "NotSupported",
    "OutOfDeviceMemory",
    "OutOfSequences",
    "InvalidArgument",
    "WaitTimeout",
    "DeviceFaulted",
]


class JobEngine(enum.IntEnum):
    """The two job engines (banks) of a VirtualDevice (spec §14)."""

    PING = 0
    PONG = 1


class JobStatus(enum.IntEnum):
    """How a job ended, as the device reports it."""

    OK = 0
    ABORTED = 1  # the device was reset while the job was in flight; outputs are garbage
    CCU_FAULT = 2  # compute fault: the device needs a reset; KV of the job's sequences is unknown
    DMA_UNKNOWN = 3  # DMA state unknown: reset AND reconfigure required
    INVALID = 4  # rejected at execution (bad sequence/position); nothing written


class FaultKind(enum.IntEnum):
    """Faults the software runtime can inject deterministically (sim only)."""

    TIMEOUT = 0  # the job never completes until a reset (then ABORTED)
    CCU_FAULT = 1
    DMA_UNKNOWN = 2
    DEVICE_BUSY = 3  # the submit is refused with DeviceBusy
    CROSSTALK = 4  # one lane's logits corrupted (echo/checksum reveal it)


@dataclasses.dataclass(frozen=True)
class RuntimeCapabilities:
    """What a runtime profile can do. The spec's C3 capabilities are off on ``calrt-0.7.6``."""

    name: str
    batch_profiles: bool  # compiled_batch > 1 (C3)
    multi_calbin: bool  # more than one configured calbin resident (C3)
    chip_scoped: bool  # two chips with their own DRAM/queues/reset domain (C3)
    pingpong: bool  # two job engines usable (C1/C2)
    do_shift: bool  # DoShift present (C1)
    incremental_prefill: bool = False  # chunked prefill: not declared by any profile (spec §6)
    # calbins of one model share one KvManager + weights (load_calbin(kv_owner=...)); C3, sim only
    shared_kv: bool = False
    # a prefill can return every position's logits (submit_prefill(all_logits=True)): a prompt
    # scored in one job; C3-style (whether a calbin can output them is a vendor question), sim only
    prompt_logits: bool = False
    # a decode job may run several greedy steps, each lane's argmax fed back on the device
    # (submit_decode(steps=N)): the host's per-job work paid once per N tokens; C3-style, sim only
    multi_step: bool = False
    # the multi-step decode jobs are driven by the host (runtime.host_multi_step): N one-step
    # device jobs back to back, each lane's argmax fed back by the binding in C (ext/host_steps.c),
    # on any runtime; not a device capability (the engine's backend sets it with multi_step)
    host_multi_step: bool = False


RUNTIME_PROFILES: dict[str, RuntimeCapabilities] = {
    "calrt-0.7.6": RuntimeCapabilities(
        name="calrt-0.7.6",
        batch_profiles=False,
        multi_calbin=False,
        chip_scoped=False,
        pingpong=True,
        do_shift=True,
    ),
    "sim-next": RuntimeCapabilities(
        name="sim-next",
        batch_profiles=True,
        multi_calbin=True,
        chip_scoped=True,
        pingpong=True,
        do_shift=True,
        shared_kv=True,
        prompt_logits=True,
        multi_step=True,
    ),
}


@dataclasses.dataclass(frozen=True)
class Timing:
    """Modeled device time. A job takes at least this long, measured from its start on its engine."""

    prefill_base_us: float = 0.0
    prefill_us_per_token: float = 0.0
    # decode step time per compiled batch size, e.g. {1: 4000.0, 16: 4000.0}
    decode_step_us: dict[int, float] = dataclasses.field(default_factory=dict)
    # 0.0: PING and PONG serialise (one device); 1.0: they overlap fully
    pingpong_overlap: float = 0.0

    def step_us(self, batch: int) -> float:
        """The modeled decode step for ``batch``: exact figure, else linear interpolation between
        the neighbouring batch sizes, else the nearest one (0 when there are no figures)."""
        pts = sorted((int(k), float(v)) for k, v in self.decode_step_us.items())
        if not pts:
            return 0.0
        for b, us in pts:
            if b == batch:
                return us
        lo = [p for p in pts if p[0] < batch]
        hi = [p for p in pts if p[0] > batch]
        if lo and hi:
            (b0, u0), (b1, u1) = lo[-1], hi[0]
            return u0 + (u1 - u0) * (batch - b0) / (b1 - b0)
        return (lo[-1] if lo else hi[0])[1]


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
    """One compiled batch profile of a calbin (spec §2 BatchProfile)."""

    compiled_batch: int
    max_seq: int
    max_sequences: int  # KV sequences the KvManager is configured for
    kv_dtype: str = "fp32"  # "fp32" | "bf16"
    valid_mask: bool = True  # the profile takes a per-lane valid mask (spec §7.3)
    inactive_logits: bool = False  # inactive lanes return logits (zeros) or not
    inactive_writes_kv: bool = False  # must be False for a usable B>1 profile
    exact_submodel: str = "decoder"


@dataclasses.dataclass
class JobResult:
    """What a finished job returned."""

    job_id: int
    engine: JobEngine
    status: JobStatus
    # float32 [lanes, vocab]; lanes = 1 for prefill (n with all_logits), compiled_batch for decode
    logits: np.ndarray
    echo: np.ndarray  # int64 [lanes, 3]: (job_id, seq_id, position) per lane, as the device saw it
    checksum: np.ndarray  # uint64 [lanes]: checksum of each lane's logits row
    device_us: float  # measured time on the engine
    # a multi-step decode (submit_decode(steps=N > 1)): int32 [lanes, N], lane l's token k the argmax
    # of step k's logits; logits/echo/checksum are then the last step's. None for any other job.
    step_tokens: np.ndarray | None = None
    # a host-driven multi-step decode where a lane ran short of its own steps (it ended on one of its
    # end tokens, or the run was stopped): int32 [lanes], each lane's steps run (0: not valid).
    # None for any other job, and when every lane ran all of its own steps.
    lane_steps: np.ndarray | None = None


#: A host-driven multi-step decode's end tokens (``Device.submit_decode(ends=...)``): ``(end_off,
#: end_ids, end_from)``, int32 arrays: lane i's ``end_ids[end_off[i]:end_off[i + 1]]``, counted from
#: its step ``end_from[i]`` on (None: from its first)
RunEnds = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


@dataclasses.dataclass(frozen=True)
class EngineCounters:
    submitted: int
    completed: int
    failed: int
    busy: int
    timeouts: int
    inflight: int


class CalrtError(Exception):
    """A CalRT call failed. ``code`` is the CalRT status code."""

    code: int = -1

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class DeviceAlreadyOpen(CalrtError):
    pass


class DeviceBusy(CalrtError):
    pass


class NotSupported(CalrtError):
    pass


class OutOfDeviceMemory(CalrtError):
    pass


class OutOfSequences(CalrtError):
    pass


class InvalidArgument(CalrtError):
    pass


class WaitTimeout(CalrtError):
    """Wait returned before the job finished; the job is still in flight."""


class DeviceFaulted(CalrtError):
    """The device needs a reset before it accepts new jobs."""
