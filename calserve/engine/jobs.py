"""What the scheduler hands an executor: one prefill or one decode batch, plus its outcome."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from calserve.runtime.types import JobResult

if TYPE_CHECKING:
    from calserve.engine.generations import Generation
    from calserve.engine.state import Seq

__all__ = ["DeviceJob", "JobOutcome"]


@dataclasses.dataclass(eq=False)
class DeviceJob:
    kind: str  # "prefill" | "decode"
    gen: Generation
    lanes: list[Seq | None]  # per compiled lane (prefill: one lane)
    tokens: np.ndarray  # prefill: the prompt; decode: input token per lane
    positions: np.ndarray  # decode: committed length per lane
    valid: np.ndarray  # decode: uint8 valid mask
    created_at: float  # scheduler time the job was built (batch wait accounting)
    seq_ids: np.ndarray | None = None  # decode: runtime sequence per lane, -1 inactive
    # decode: (seq_id, position) the device must echo for each active lane, as Python ints
    expect: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    job_id: int = -1  # runtime job id once submitted
    epoch: int = 0  # recovery epoch at submit: an ABORTED result from an older epoch is no new fault
    # The calbin (profile member of the generation's KV group) the job runs on; left None at
    # construction, it is the generation's KV owner (prefills, single-profile generations).
    calbin: Any = None
    # Derived once at construction (the hot path reads them several times per step):
    # Invariant: seqs == the non-None lanes in lane order; active == their lane indices (ascending).
    seqs: list[Seq] = dataclasses.field(init=False)
    active: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.active = [i for i, s in enumerate(self.lanes) if s is not None]
        self.seqs = [s for s in self.lanes if s is not None]
        if self.calbin is None:
            self.calbin = self.gen.calbin


class JobOutcome(NamedTuple):
    """How a job ended. Exactly one of ``result`` / ``submit_error`` is set. (A NamedTuple: one is
    built per job on the hot path.)"""

    result: JobResult | None = None
    submit_error: BaseException | None = None  # refused at submit: nothing reached the device
    timed_out: bool = False  # the wait passed its timeout once (a fault was reported)
