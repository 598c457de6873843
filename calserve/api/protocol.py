"""What the HTTP layer needs from the engine (structural types).

``calserve.engine.engine.Engine`` satisfies these; so does ``tests/api/fake_engine.FakeEngine``. The
HTTP layer depends only on these protocols and ``calserve.engine.types``, which keeps it testable
in-process without a device.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from calserve.engine.types import EngineStatistics, Event, GenerateRequest, ModelInfo

__all__ = ["TokenizerLike", "HandleLike", "EngineLike"]


class TokenizerLike(Protocol):
    eos_token_ids: Any

    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> Any: ...  # str (then encoded) or token ids


class HandleLike(Protocol):
    @property
    def request_id(self) -> str: ...

    def events(self) -> AsyncIterator[Event]: ...


class EngineLike(Protocol):
    @property
    def default_alias(self) -> str: ...

    async def submit(self, req: GenerateRequest) -> HandleLike: ...

    def cancel(self, request_id: str) -> Any: ...  # may be sync or return an awaitable

    def statistics(self) -> EngineStatistics: ...

    def models(self) -> Sequence[ModelInfo]: ...

    def tokenizer(self, alias: str | None = None) -> TokenizerLike: ...

    def ready(self, alias: str | None = None) -> bool: ...
