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
from typing import Any

__all__ = [
    "SamplingParams",
    "GenerateRequest",
    "FinishReason",
    "TokenLogprob",
    "TokenEvent",
    "Usage",
    "FinishEvent",
    "ErrorEvent",
    "Event",
    "ModelInfo",
    "ProfileInfo",
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
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None = no logprobs; k >= 0 = chosen token's + top-k alternatives


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


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One or more new tokens (coalesced when the client is slow) and the text they add.

    ``text`` is the incrementally detokenised text these tokens add (may be "" while a multi-byte
    character or a possible stop string is pending)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None


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


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    """The request ended with an error after it was accepted (device fault, shutdown, ...)."""

    message: str
    kind: str  # "device_error" | "shutdown" | "unavailable" | "internal"
    usage: Usage | None = None


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
