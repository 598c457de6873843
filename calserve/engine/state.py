"""Plain records of the engine: one :class:`Seq` per accepted request, the device jobs, the actor
messages and what :class:`~calserve.engine.core.EngineCore` hands its shells (:class:`CoreOutput`).

Ownership (who may write what) is the point of this module:

- Every :class:`Seq` scheduling field (lease, seq_id, position, inflight, ...) and every
  :class:`DeviceJob` field after construction is written only by the engine core
  (:mod:`calserve.engine.core` and the job builder it owns); the shells (executors, recovery,
  registry, actors) read what they need and change state only through the core's methods.
- The request lifecycle is ``Seq.state``, moved only by the core's request table through the one
  transition table of :mod:`calserve.core.request_state` (an illegal move raises); ``queued`` and
  ``ended`` are read from it. ``inflight`` names the job a Running request is in (Invariant:
  ``inflight is not None`` <=> ``state`` in ``RUNNING``), ``pending_*`` an ending decided while
  it runs (the table's CANCEL self-loop on a Running state). The request actor only renders the
  core's messages as a stream.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

import numpy as np

from calserve.core.request_state import TERMINAL, RequestState
from calserve.engine.types import ErrorEvent, FinishReason, GenerateRequest, TokenLogprob
from calserve.runtime.types import JobEngine, JobResult, JobStatus

if TYPE_CHECKING:
    from calserve.engine.generations import Generation

__all__ = ["Seq", "Admitted", "Tokens", "TokenRun", "Scored", "End", "ActorMsg", "DeviceJob", "JobOutcome", "CoreOutput",
           "NO_OUTPUT", "Fault", "Release", "STATUS_NAMES"]

#: ``status.name.lower()`` of every job status, the key of the per-status counts and fault
#: reasons (an enum's ``name`` is a Python-level property: looked up once here, not per step).
STATUS_NAMES: Final[dict[JobStatus, str]] = {s: s.name.lower() for s in JobStatus}


@dataclasses.dataclass(frozen=True)
class Admitted:
    at: float


class Tokens(NamedTuple):
    """One sampled token. ``hidden``: EOS / stop token id, counted in usage but never shown.

    A NamedTuple (immutable like the other messages) because one is built per token on the
    dispatcher's hot path, where a frozen dataclass's ``__init__`` costs several times more."""

    token_id: int
    logprob: TokenLogprob | None
    first: bool
    hidden: bool = False


class TokenRun(NamedTuple):
    """The tokens one sequence drew in one multi-step decode job, in order (never with logprobs:
    only plain greedy lanes run several steps a job): one message for all of them, so the actor
    detokenises and writes them in one step. ``first``: the run holds the request's first token;
    ``hidden``: its last token is an EOS / stop token id, counted in usage but never shown."""

    token_ids: list[int]
    first: bool
    hidden: bool = False


@dataclasses.dataclass(frozen=True)
class Scored:
    """Every prompt token's logprob (``SamplingParams.prompt_logprobs``), sent once, before the
    request's first token; the first one's logprob is NaN (no context)."""

    logprobs: tuple[TokenLogprob, ...]


@dataclasses.dataclass(frozen=True)
class End:
    """The request's resources are back; the actor must emit the terminal event and stop.

    Exactly one of ``reason`` / ``error`` is set."""

    reason: FinishReason | None = None
    error: ErrorEvent | None = None


ActorMsg = Admitted | Tokens | TokenRun | Scored | End


class Inbox(Protocol):
    """The engine's side of a request actor's inbox (``actor.ActorInbox``, or a trio memory send
    channel): never blocks, unbounded."""

    def send_nowait(self, msg: ActorMsg) -> None: ...


@dataclasses.dataclass(eq=False)
class Seq:
    rid: int
    req: GenerateRequest
    gen: Generation
    arrival: float
    deadline: float | None
    seed: int
    prompt: np.ndarray  # int32 prompt tokens
    qclass: Any  # core QueueClass
    inbox: Inbox
    # --- the core's (engine/requests.py) ---------------------------------------------------------
    state: RequestState = RequestState.NEW  # the lifecycle (spec §4), one table, one writer
    lease: Any = None  # KvLease while a lane is held
    seq_id: int | None = None  # runtime KV sequence (created by the prefill job)
    position: int = 0  # committed KV length (== position of the next decode input token)
    last_token: int = -1
    generated: int = 0  # tokens sampled so far
    # the tokens sampled so far (a re-prefill after a fault rebuilds the KV from prompt + these)
    tokens: list[int] = dataclasses.field(default_factory=list)
    retries: int = 0  # consecutive faults that lost its KV with no token in between
    # Invariant: inflight is not None <=> exactly one job containing this request is on the device;
    # while set, the lane is Updating and nothing of the request is released.
    inflight: DeviceJob | None = None
    # Pending ending decided while a job was in flight (cancel / stop string / shutdown): applied
    # when the job drains. Cancel is idempotent: setting it twice changes nothing.
    pending_reason: FinishReason | None = None
    pending_error: ErrorEvent | None = None
    admitted_at: float | None = None  # set once admission popped it: active for its tenant
    first_token_at: float | None = None
    ready_since: float = 0.0  # when it last became decode-ready (batching window)
    run_since: float = 0.0  # when it was last admitted or resumed (time-slicing: engine/timeslice.py)
    # Consecutive decode batches that passed this ready sequence over (starvation accounting).
    passed_over: int = 0
    # A token message held back until the next job was submitted (EngineCore.flush); whoever
    # sends this request anything else first delivers it (EngineCore end), so messages keep order.
    deferred: Any = None
    job_ids: list[int] = dataclasses.field(default_factory=list)  # recent job ids, for logs
    # The sampler's per-request state when its logits are processed (penalty counts, grammar
    # matcher: engine/logits.py), made on first use; a pure function of ``prompt`` + ``tokens``
    # (it catches up with ``tokens`` before every draw), so a re-prefill needs nothing of it.
    sampling_state: Any = None
    # Scoring the prompt (``prompt_logprobs``; None: not, or done): the prompt tokens its prefill
    # takes, the last of them the pending decode input. Each completed step's logits score
    # ``prompt[score_upto]``, which becomes the next input, until every prompt token is scored.
    score_upto: int | None = None
    prompt_scores: list[TokenLogprob] | None = None  # the scores so far (prompt order)

    def __post_init__(self) -> None:
        if self.req.sampling.prompt_logprobs is not None and self.score_upto is None:
            self.score_upto = 1  # the prefill takes the first prompt token, which has no score
            self.prompt_scores = [TokenLogprob(int(self.prompt[0]), math.nan)]

    def score_whole_prompt(self, gen: Any) -> bool:
        """Right before its prefill: whether the prefill scores the whole prompt at once (every
        position's logits, :meth:`Generation.scores_in_prefill`) — only while nothing is scored
        yet; then it takes the whole prompt (``score_upto`` = its length), else the first token
        (teacher forcing)."""
        if self.prompt_scores is None or len(self.prompt_scores) != 1:
            return False
        whole = bool(gen.scores_in_prefill(len(self.prompt)))
        self.score_upto = len(self.prompt) if whole else 1
        return whole

    def prefill_input(self) -> np.ndarray:
        """What its prefill computes: the prompt, plus the generated tokens after a fault lost its
        KV (the next token sampled from it continues the request exactly); while the prompt is
        scored, the prompt up to the pending input (its logits score the next prompt token)."""
        if self.score_upto is not None:
            return self.prompt[:self.score_upto]
        if not self.tokens:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.tokens, np.int32)])

    @property
    def queued(self) -> bool:
        """In its generation's admission queue."""
        return self.state is RequestState.WAITING_ADMISSION

    @property
    def ended(self) -> bool:
        """The request ended (exactly once); its resources are back or on their way."""
        return self.state in TERMINAL

    @property
    def admitted(self) -> bool:
        """Popped by admission: counts as active for its tenant until released."""
        return self.admitted_at is not None

    @property
    def tenant(self) -> str:
        return self.req.tenant

    @property
    def max_new(self) -> int:
        return self.req.sampling.max_tokens


@dataclasses.dataclass(eq=False)
class DeviceJob:
    """One prefill or one decode batch: what the core hands an executor."""

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
    epoch: int = 0  # recovery epoch at hand-over: an ABORTED result from an older epoch is no new fault
    # The calbin (profile member of the generation's KV group) the job runs on; left None at
    # construction, it is the generation's KV owner (prefills, single-profile generations).
    calbin: Any = None
    # The hung-job timeout once computed from the package's modeled decode step (constant for the
    # profile: continuations copy it, see FaultWatch.hang_timeout); None: computed per job.
    hang_timeout_s: float | None = None
    # prefill: every position's logits, a lane each (its request scores the whole prompt)
    all_logits: bool = False
    # decode: greedy steps the device runs (runtime capability multi_step; batches.decode_steps),
    # each active lane's argmax fed back; expect then holds each lane's last step's positions
    steps: int = 1
    # ... and each sequence's own steps (in ``seqs`` order; None: every one ``steps``)
    seq_steps: list[int] | None = None
    # decode driven by the host: the core asked the run to end with its step in flight
    # (Planner.stop_runs, stop_for); its result may then have fewer steps (JobBuilder.ran_short)
    stop_asked: bool = False
    # Derived once at construction (the hot path reads them several times per step):
    # Invariant: seqs == the non-None lanes in lane order; active == their lane indices (ascending).
    seqs: list[Seq] = dataclasses.field(init=False)
    active: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        lanes = self.lanes
        try:
            n = lanes.index(None)
        except ValueError:
            n = len(lanes)
        if lanes.count(None) == len(lanes) - n:  # the usual layout: active lanes first
            self.active = list(range(n))
            self.seqs = lanes[:n]  # type: ignore[assignment]  # no None before index n
        else:
            self.active = [i for i, s in enumerate(lanes) if s is not None]
            self.seqs = [s for s in lanes if s is not None]
        if self.calbin is None:
            self.calbin = self.gen.calbin

    @property
    def host_driven(self) -> bool:
        """A multi-step decode the host drives (runtime capability ``host_multi_step``): it can be
        ended with its step in flight (``Planner.stop_runs``) and its lanes end on their end
        tokens (``completion.run_ends``)."""
        return self.steps > 1 and self.gen.host_steps

    def successor(self, tokens: np.ndarray, positions: np.ndarray, created_at: float,
                  expect: list[tuple[int, int]]) -> DeviceJob:
        """A new, unsubmitted job over this one's lanes, profile member and sequences with other
        inputs: a continuation's whole construction is a field copy (the lane-derived ``seqs`` and
        ``active``, and the read-only ``lanes``, ``valid`` and ``seq_ids``, are shared, none is ever
        mutated). The hot path of every fast decode step (``JobBuilder.continuation``)."""
        job = object.__new__(DeviceJob)
        d = job.__dict__
        d.update(self.__dict__)
        d["tokens"] = tokens
        d["positions"] = positions
        d["created_at"] = created_at
        d["expect"] = expect
        d["job_id"] = -1
        d["epoch"] = 0
        return job


class JobOutcome(NamedTuple):
    """How a job ended. Exactly one of ``result`` / ``submit_error`` is set. (A NamedTuple: one is
    built per job on the hot path.)"""

    result: JobResult | None = None
    submit_error: BaseException | None = None  # refused at submit: nothing reached the device
    timed_out: bool = False  # the wait passed its timeout once (a fault was reported)


class Fault(NamedTuple):
    """A job that ended in a device fault of the current epoch: recovery must reset the device."""

    reason: str  # "timeout" | "crosstalk" | "ccu_fault" | "dma_unknown" | ... (lower-case status)
    job: DeviceJob


class Release(NamedTuple):
    """An ended request's runtime sequence the shell must free, then confirm to the core
    (``EngineCore.confirm_released``): spec §9.2, a lane is reused only after the runtime freed it."""

    lane: int
    seq_id: int
    request_id: int
    ended_at: float


@dataclasses.dataclass(eq=False)
class CoreOutput:
    """What one call into the core asks of its shells, in the order they must act.

    Actor messages are not in here: the core delivers them into each request's inbox (a
    non-blocking sink handed in with the request, :class:`Inbox`) in order as it decides them,
    except the continuing sequences' token messages, which wait for :meth:`EngineCore.flush`
    after the next submit (spec §19 M1)."""

    # jobs to hand to the executor of each job engine, in decision order
    jobs: list[tuple[JobEngine, DeviceJob]] = dataclasses.field(default_factory=list)
    # host-driven multi-step decodes in flight to end with their step in flight (other work
    # waits for them: Planner.stop_runs); the shell asks their calbins (BackendCalbin.stop_steps)
    stops: list[tuple[JobEngine, DeviceJob]] = dataclasses.field(default_factory=list)
    # faults of the current epoch, for the recovery task (one reset covers several)
    faults: list[Fault] = dataclasses.field(default_factory=list)
    # generations with ended sequences whose free is a device round trip (the shell frees them on
    # a worker thread, then confirms); inline-free runtimes are freed inside the pass
    release_gens: list[Generation] = dataclasses.field(default_factory=list)
    # the scheduler task must run a pass now (something ended, recovery finished, ...)
    wake: bool = False
    # the earliest instant a pass must run again (deadline, batching window), inf if none
    timer: float = float("inf")


class _ReadOnlyOutput(CoreOutput):
    """:data:`NO_OUTPUT`: a :class:`CoreOutput` that asks nothing and cannot be changed (empty
    tuples, no attribute assignment). It is shared by every call that asks nothing (the hot path's
    answer), so a caller that set ``wake`` on it once would make every later such answer wake the
    scheduler: after a device recovery whose resume pass asked nothing, the scheduler task then
    ran pass after pass without waiting (a busy loop, and under a fake clock a test that never
    ends)."""

    def __init__(self) -> None:
        for name, value in (("jobs", ()), ("stops", ()), ("faults", ()), ("release_gens", ()), ("wake", False),
                            ("timer", float("inf"))):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"the shared empty CoreOutput is read-only (set {name!r} on a new one)")


#: The output of a call that asks nothing of the shells (read-only: see ``_ReadOnlyOutput``).
NO_OUTPUT: Final[CoreOutput] = _ReadOnlyOutput()
