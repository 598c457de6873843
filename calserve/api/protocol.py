"""What the HTTP layer needs from the engine (structural types).

``calserve.engine.engine.Engine`` satisfies these (``calserve.api.state`` has mypy check it); so does
``tests/api/fake_engine.FakeEngine``. The HTTP layer depends only on these protocols and
``calserve.engine.types``, which keeps it testable in-process without a device.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Protocol, runtime_checkable

from calserve.engine.types import EngineStatistics, Event, GenerateRequest, ModelInfo

__all__ = ["TokenizerLike", "HandleLike", "EngineLike"]


class TokenizerLike(Protocol):
    eos_token_ids: Any

    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> Any: ...  # str (then encoded) or token ids


@runtime_checkable
class HandleLike(Protocol):
    """One accepted request (what :meth:`EngineLike.submit` returns): its id and its events.

    Invariant: the events are ``TokenEvent*`` then exactly one ``FinishEvent`` or ``ErrorEvent``
    (``calserve.engine.types``), whichever way they are read. The HTTP layer reads them with
    :meth:`receive_many` and, unless it read the terminal event, ends the request with
    :meth:`aclose` (``calserve.api.running.RequestLease``)."""

    @property
    def request_id(self) -> int | str: ...  # for logs (the engine's ids are ints, the fake's str)

    def events(self) -> AsyncIterator[Event]:
        """The events one at a time, ending after the terminal one."""
        ...

    def receive_many(self) -> Awaitable[list[Event]]:
        """Everything queued, at least one event (waits for one); ``[]`` after the terminal
        event. Token events queued together may come as one (their ids, texts, logprobs joined)."""
        ...

    def cancel(self) -> None:
        """Ask the engine to stop the request (idempotent); its events still end with a
        terminal event."""
        ...

    async def aclose(self) -> None:
        """The consumer is gone: cancel the request (unless it ended) and drop what is queued
        (idempotent)."""
        ...


class EngineLike(Protocol):
    @property
    def default_alias(self) -> str: ...

    async def submit(self, req: GenerateRequest) -> HandleLike: ...

    def statistics(self) -> EngineStatistics: ...

    def models(self) -> Sequence[ModelInfo]: ...

    def tokenizer(self, alias: str | None = None) -> TokenizerLike: ...

    def ready(self, alias: str | None = None) -> bool: ...
