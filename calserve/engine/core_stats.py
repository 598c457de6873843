"""The engine core's plain records: its counters, the frozen statistics snapshot, a fast step."""

from __future__ import annotations

import dataclasses
import math

from calserve.engine.completion import Sampled
from calserve.engine.state import CoreOutput, DeviceJob, JobOutcome, Seq
from calserve.runtime.types import JobEngine

__all__ = ["CoreState", "CoreStats", "CoreStatistics", "FastStep"]


@dataclasses.dataclass(eq=False)
class CoreState:
    """The engine core's own mutable state, shared by its parts (planner, step handler)."""

    # Invariant: slots[e] is the job handed to engine e's executor until its completion was handed
    # back (on_completion; the fast path's successor takes the slot at once).
    slots: dict[JobEngine, DeviceJob | None]
    paused: bool = False  # recovery in progress: no new jobs
    # Degradation (calserve.engine.degrade / reset_budget): new jobs only to this engine (None: any),
    # only the smallest decode profile, and no admission before admit_after.
    only: JobEngine | None = None
    batch_one: bool = False
    admit_after: float = -math.inf
    # Invariant: epoch counts device resets; a job remembers the epoch it was handed over in.
    epoch: int = 0
    # what the current call into the core asks of its shells (EngineCore._take hands it out)
    out: CoreOutput = dataclasses.field(default_factory=CoreOutput)
    # Sequences that continue decoding whose token message (``Seq.deferred``) goes out after the
    # next job was submitted: the actor's per-token step is not needed to decide or build the next
    # job (spec §19 M1). Tenant charges are not deferred with it (fair order needs them).
    # Invariant: a deferred message reaches its actor before any other message to it (the request
    # table's end() delivers it first), and no later than the shell's flush after the next submit.
    deferred: list[Seq] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CoreStats:
    """The core's own counters (the job builder and the request table keep theirs)."""

    passes: int = 0
    starvation_events_total: int = 0
    crosstalk_total: int = 0
    stale_total: int = 0  # results of jobs aborted by our own reset
    requeued_busy: int = 0
    fast_steps_total: int = 0  # decode jobs submitted before their predecessor's bookkeeping
    rotations_total: int = 0  # ... of them, another batch of the ready set (not a continuation)
    quarantined_jobs_total: int = 0  # jobs whose KV state a fault left unknown
    readmitted_total: int = 0  # requests re-prefilled after a fault lost their KV
    # host-driven multi-step decodes asked to end with their step in flight (Planner.stop_runs),
    # and the steps runs did not run (asked to stop, or every lane ended on its end token)
    runs_stopped_total: int = 0
    steps_cut_total: int = 0
    # how each handed-back job ended (spec §16 executor "Wait rc/status"): ok, the JobStatus
    # names (aborted, ccu_fault, dma_unknown, invalid), timeout, refused (at submit)
    job_status_total: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CoreStatistics:
    waiting: int  # requests in admission queues
    prefill_ready: dict[str, int]  # admitted, waiting for their prefill, by class
    decode_ready: int
    holders: int  # admitted, not ended
    inflight_jobs: int
    queue_oldest_wait_s: dict[str, float]  # decode/short/medium/long
    batches_total: dict[int, int]
    lanes_active_total: dict[int, int]
    lanes_total: dict[int, int]
    prefill_jobs_total: int
    batch_wait_s_total: float
    continuations_total: int
    decode_steps_total: dict[int, int]
    kv_free_seconds_total: float
    passes: int
    starvation_events_total: int
    crosstalk_total: int
    stale_total: int
    requeued_busy: int
    fast_steps_total: int
    quarantined_jobs_total: int
    readmitted_total: int
    epoch: int
    job_status_total: dict[str, int] = dataclasses.field(default_factory=dict)
    # engine/parking.py, engine/timeslice.py: parked now (client behind or time-sliced); parks
    # because a stream's client was behind; parks by time-slicing
    parked: int = 0
    parks_total: int = 0
    timeslices_total: int = 0
    rotations_total: int = 0  # decode jobs decided before the completion that freed their engine
    runs_stopped_total: int = 0
    steps_cut_total: int = 0


class FastStep:
    """A completion whose next job was decided before its bookkeeping (``EngineCore.fast_decode``).

    ``nxt`` is the job to submit now: the continuation, or with ``rotated`` another batch of the
    ready set (None: hand the step to ``EngineCore.on_completion`` with the tokens already
    sampled). ``EngineCore.finish_fast`` does the bookkeeping once ``nxt`` was submitted
    (idempotent: ``finished``). ``rows``: a multi-step decode's tokens per lane, checked already
    (``completion.step_rows``), so the bookkeeping does not check and convert them again."""

    __slots__ = ("engine", "job", "outcome", "nxt", "sampled", "now", "finished", "rotated", "rows")

    def __init__(self, engine: JobEngine, job: DeviceJob, outcome: JobOutcome,
                 nxt: DeviceJob | None, sampled: Sampled, now: float, rotated: bool = False,
                 rows: list[list[int]] | None = None) -> None:
        self.engine = engine
        self.job = job
        self.outcome = outcome
        self.nxt = nxt
        self.sampled = sampled
        self.rows = rows
        self.now = now  # the instant the decision was taken: the bookkeeping decides as of it too
        self.finished = False
        self.rotated = rotated
