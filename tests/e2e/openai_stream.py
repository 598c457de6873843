"""A chat completion streamed through the openai library and put together as the library puts it
together (``ChatCompletionStreamState``: tool calls' deltas joined by their index, arguments
concatenated), without the parsing its ``stream()`` helper adds (which raises on an answer cut at
``max_tokens``)."""

from __future__ import annotations

from typing import Any

import openai
from openai.lib.streaming.chat import ChatCompletionStreamState


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[Any, int]:
    """The completion a streamed request adds up to, and how many chunks carried a piece of a
    tool call's arguments."""
    state: Any = ChatCompletionStreamState()
    pieces = 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        pieces += sum(1 for c in chunk.choices for t in c.delta.tool_calls or []
                      if t.function is not None and t.function.arguments)
    return state.current_completion_snapshot, pieces
