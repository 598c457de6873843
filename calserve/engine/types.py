"""What the engine's Python API takes and gives (the contract between ``engine/`` and ``api/``).

Usage from the HTTP layer::

    async with Engine.open(config) as engine:            # starts scheduler/executor/recovery/models
        handle = await engine.submit(GenerateRequest(...))   # raises CapacityError/UnavailableError/
                                                             # RequestError/UnknownModel at admission
        async for ev in handle.events():                     # TokenEvent* then exactly one terminal
            ...                                              # FinishEvent or ErrorEvent
        engine.cancel(handle.request_id)                     # idempotent; also handle.cancel()

``engine.statistics()`` returns an :class:`EngineStatistics` snapshot for ``/metrics``;
``engine.models()`` the :class:`ModelInfo` list for ``/v1/models`` and ``/ready``;
``engine.tokenizer(alias)`` the package's tokenizer (encode/decode/chat template).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection
from typing import Any

__all__ = [
    "SamplingParams",
    "GenerateRequest",
    "FinishReason",
    "TokenLogprob",
    "TokenEvent",
    "token_event",
    "Usage",
    "FinishEvent",
    "ErrorEvent",
    "Event",
    "ModelInfo",
    "ProfileInfo",
    "TenantStats",
    "ExecutorEngineStats",
    "EngineStatistics",
    "RequestTimings",
]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request seed: same seed + same prompt = same output
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop strings are ignored before this many tokens
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings; the stop text is not emitted
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: it is, then
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens' text (not EOS's)
    # checked once per sampled token: convert.py passes a frozenset (a lookup whatever its length)
    stop_token_ids: Collection[int] = ()
    logprobs: int | None = None  # None = no logprobs; k >= 0 = chosen token's + top-k alternatives
    # None = off; k >= 0: every prompt token's logprob and its position's top-k (``echo`` with
    # ``logprobs``, ``prompt_logprobs``), from the prefill when the runtime returns every
    # position's logits (capability prompt_logits), else by teacher forcing: the prefill takes
    # the first prompt token and each later one is fed as a decode input; the stream's first
    # token event then carries them, the first one's logprob NaN (it has no context). With it
    # ``max_tokens`` may be 0 (score the prompt, generate nothing).
    prompt_logprobs: int | None = None
    # Logits processors (OpenAI / vLLM meaning; engine/logits.py): penalties over the generated
    # tokens (repetition: prompt and generated), additive biases, min-p; all off by default.
    presence_penalty: float = 0.0  # [-2, 2]: minus this once for every token already generated
    frequency_penalty: float = 0.0  # [-2, 2]: minus this times the token's count so far
    repetition_penalty: float = 1.0  # [0.01, 10]: positive logits / p, negative * p, seen tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), unique ids
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p x the most likely one
    # vLLM's allowed_token_ids: only these may be drawn (every other token's logit -inf)
    allowed_token_ids: tuple[int, ...] = ()
    # Constrained decoding (response_format): an ``engine.grammar.Grammar``, or None
    grammar: Any = None
    # Derived: any processor above is on (the all-greedy fast path checks this one flag).
    processed: bool = dataclasses.field(init=False, default=False, compare=False)
    # Derived: greedy, no logprobs, nothing processed (the engine's per-batch argmax-only check).
    plain_greedy: bool = dataclasses.field(init=False, default=False, compare=False)

    def __post_init__(self) -> None:
        processed = bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_p or self.grammar is not None
            or self.allowed_token_ids)
        object.__setattr__(self, "processed", processed)
        object.__setattr__(self, "plain_greedy", self.temperature == 0.0 and self.logprobs is None
                           and self.prompt_logprobs is None and not processed)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    model: str | None = None  # alias; None = the default alias
    tenant: str = "default"
    deadline_s: float | None = None  # relative deadline in seconds; None = config default
    # Opaque label for logs (e.g. the OpenAI "user" field); never a metric label.
    user: str | None = None


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string / stop token
    LENGTH = "length"  # max_tokens or context
    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # log-softmax of the raw logits (before temperature)
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) highest first
    # 1 + how many tokens the row scores higher (a scored prompt token's, vLLM's ``rank``;
    # None where nobody asked: drawn tokens)
    rank: int | None = None


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One or more new tokens (coalesced when the client is slow) and the text they add.

    ``text`` is the incrementally detokenised text these tokens add (may be "" while a multi-byte
    character or a possible stop string is pending)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None


_new_object = object.__new__


def token_event(token_ids: tuple[int, ...], text: str,
                logprobs: tuple[TokenLogprob, ...] | None) -> TokenEvent:
    """``TokenEvent(token_ids, text, logprobs)``, built without the frozen dataclass's
    ``__init__`` (three ``object.__setattr__`` calls, ~1 µs): the stream builds one per event read.
    The same object in every respect (fields, equality, hash, still frozen: tests/engine_parts/
    test_parts_stream.py)."""
    ev: TokenEvent = _new_object(TokenEvent)
    d = ev.__dict__
    d["token_ids"] = token_ids
    d["text"] = text
    d["logprobs"] = logprobs
    return ev


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason
    usage: Usage
    text: str = ""  # trailing text flushed at the end (held back for stop-string matching)
    timings: RequestTimings | None = None


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    """The request ended with an error after it was accepted (device fault, shutdown, ...)."""

    message: str
    kind: str  # "device_error" | "shutdown" | "unavailable" | "internal"
    usage: Usage | None = None
    timings: RequestTimings | None = None


Event = TokenEvent | FinishEvent | ErrorEvent


@dataclasses.dataclass(frozen=True)
class ProfileInfo:
    compiled_batch: int
    tier: str  # "C0".."C4"
    available: bool  # runnable on this runtime profile


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    alias: str
    generation: int
    state: str  # ModelState name, e.g. "Ready"
    max_seq: int
    profiles: tuple[ProfileInfo, ...]
    package_sha256: str
    created: int  # unix time of publish
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# Statistics snapshot for /metrics (spec §16). Frozen; the engine builds one on demand from the
# statistics() of its parts. Labels stay bounded: alias, tenant, outcome, state, class, engine, reason.


@dataclasses.dataclass(frozen=True)
class TenantStats:
    waiting_requests: int
    waiting_tokens: int
    active_sequences: int
    service_tokens: float  # delivered service in cost units (prefill + output_token_cost * decode)
    virtual_lag: float  # tenant virtual time minus global virtual time


@dataclasses.dataclass(frozen=True)
class ExecutorEngineStats:
    submitted: int
    completed: int
    failed: int
    busy: int
    timeouts: int
    inflight: int


@dataclasses.dataclass(frozen=True)
class EngineStatistics:
    # requests
    requests_running: int  # admitted, not terminal (prefill/decode ready or running)
    requests_waiting: int  # waiting for admission or model
    requests_total: dict[str, int]  # terminal outcome -> count ("completed", "cancelled", "failed", "deadline", ...)
    # admission
    admitted_total: int
    rejected_total: dict[str, int]  # outcome -> count ("invalid", "capacity", "unavailable", "quota")
    waiting_prompt_tokens: int
    tenants: dict[str, TenantStats]
    starvation_events_total: int
    # queues (class: "decode" | "short" | "medium" | "long")
    queue_depth: dict[str, int]
    queue_oldest_wait_s: dict[str, float]
    # batches
    batches_total: dict[int, int]  # compiled B -> decode batches run
    lanes_active_total: dict[int, int]  # compiled B -> active lanes summed over batches
    lanes_total: dict[int, int]  # compiled B -> compiled lanes summed over batches (fill = active/total)
    # compiled B -> greedy steps the decode batches ran (scheduler.batch.multi_step: more than one a batch)
    decode_steps_total: dict[int, int]
    current_compiled_batch: int
    batch_wait_s_total: float
    prefill_jobs_total: int
    # KV
    kv_sequences: dict[str, int]  # KvSequenceState name -> count
    kv_tokens_reserved: int
    kv_tokens_used: int
    kv_free_seconds_total: float
    # executor
    executor_inflight_jobs: int
    executor: dict[str, ExecutorEngineStats]  # "ping" | "pong"
    # models: alias -> (generation, state name)
    models: dict[str, tuple[int, str]]
    model_load_seconds: dict[str, float]  # alias -> last load duration
    # recovery
    faults_total: dict[str, int]  # reason -> count
    resets_total: int
    quarantined_jobs_total: int
    quarantined_kv_total: int
    recovery_seconds_total: float
    # degradation and the reset budget (README "Device faults")
    pingpong_state: str = "off"  # dual | single (degraded) | off (one engine configured)
    pingpong_degradations_total: dict[str, int] = dataclasses.field(default_factory=dict)  # by reason
    reset_budget_level: str = "ok"  # ok | degraded | failed
    resets_in_window: int = 0  # resets of the last 10 minutes on this board (persisted)
    uncertain_recoveries_total: int = 0
    # fault reason -> (recovery episodes, seconds summed, worst episode)
    recovery_seconds_by_reason: dict[str, tuple[int, float, float]] = dataclasses.field(
        default_factory=dict)
    # operator metrics (defaults: engines that do not report them)
    kv_tokens_capacity: int = 0  # max KV tokens over the generations (the usage ratio's base)
    kv_lanes_total: int = 0
    job_status_total: dict[str, int] = dataclasses.field(default_factory=dict)
    model_phase_seconds: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    device_restarts_total: int = 0
    # streams parked (engine/parking.py: the client is behind; engine/timeslice.py: taking turns)
    requests_parked: int = 0
    stream_parks_total: int = 0
    timeslices_total: int = 0
    # decode jobs decided before their predecessor's bookkeeping (engine/core.py fast_decode):
    # "continuation" (the same sequences) or "rotation" (engine/rotation.py: another ready batch)
    decided_early_total: dict[str, int] = dataclasses.field(default_factory=dict)
    # host-driven multi-step decodes asked to end early because a prompt waited for them or one
    # of their requests ended early (engine/planner.py stop_runs, stop_for), and the device
    # steps runs did not run (those, and runs whose lanes all ended on their end tokens first)
    decode_runs_stopped_total: int = 0
    decode_steps_cut_total: int = 0


@dataclasses.dataclass(frozen=True)
class RequestTimings:
    """Attached to the terminal event so the HTTP layer can fill its histograms."""

    queue_s: float  # submit -> admitted
    ttft_s: float | None  # submit -> first token
    e2e_s: float  # submit -> terminal
