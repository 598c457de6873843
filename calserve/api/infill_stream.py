"""The SSE body of a streamed llama.cpp ``/infill`` (``api/infill.py``): a ``data: {"content",
"stop": false}`` event per batch of text, then one with ``stop: true`` and llama-server's summary
(no ``[DONE]``, as llama-server); an error ends it with the OpenAI-shaped error event."""

from __future__ import annotations

from collections.abc import Sequence

from calserve.api.infill import InfillInfo, infill_summary
from calserve.api.render import sse
from calserve.api.stream_encoder import failure_chunk, stream_error_chunk
from calserve.api.tool_stream import token_texts
from calserve.engine.types import ErrorEvent, Event, FinishEvent, Usage

__all__ = ["InfillStreamEncoder"]


class InfillStreamEncoder:
    """The SSE body of a streamed ``/infill`` (what ``pump_stream`` drives, as StreamEncoder)."""

    def __init__(self, alias: str, info: InfillInfo) -> None:
        self._alias = alias
        self._info = info
        self.tokens = 0
        self.terminal: FinishEvent | ErrorEvent | None = None
        self.finished = False

    def opening(self) -> bytes:
        return b""

    def encode(self, batch: Sequence[Event]) -> bytes:
        if not batch:  # the events ended without a terminal event: an engine bug
            self.finished = True
            return failure_chunk(RuntimeError("the engine ended the request without a terminal event"))
        n, texts, terminal = token_texts(batch, None, [])
        self.tokens = n
        text = "".join(texts)
        out = sse({"content": text, "stop": False}) if text else b""
        if terminal is None:
            return out
        self.terminal = terminal
        self.finished = True
        if isinstance(terminal, FinishEvent):
            return out + sse({"content": terminal.text,
                              **infill_summary(self._alias, self._info, terminal)})
        return out + stream_error_chunk(terminal)

    def failure(self, exc: BaseException) -> bytes:
        return failure_chunk(exc)

    def usage_chunk(self, usage: Usage) -> bytes:  # no usage chunk in llama-server's stream
        return b""
