"""Per-request SSE chunk encoder: the constant bytes of every chunk are built once per request.

Why: a streamed chunk is ``{"id", "object", "created", "model", "choices": [...], "usage"?}`` and
only the choice's text/logprobs/finish_reason change between chunks. Building that dict and encoding
it per token cost ~10 µs; here a token chunk is ``head + json(text) + tail`` (one msgspec call on a
str and two concatenations).

Invariant: the bytes are identical to ``render.sse`` of the dict the OpenAI shape defines (same key
order, compact msgspec JSON) — ``tests/api/test_chunks.py`` checks it against that reference for
arbitrary texts, logprobs, finish reasons and usage flags.
"""

from __future__ import annotations

from typing import Any, Final, final

import msgspec

from calserve.engine.types import Usage

__all__ = ["ChunkEncoder"]

_ENC: Final = msgspec.json.Encoder()
_END: Final = b"}\n\n"


@final
class ChunkEncoder:
    """Encodes the SSE events of one streamed completion (``chat`` or legacy ``completion``)."""

    __slots__ = ("chat", "_head", "_choice", "_usage_null", "_tok_head", "_tok_tail")

    def __init__(self, *, chat: bool, rid: str, created: int, model: str,
                 include_usage: bool, index: int = 0,
                 system_fingerprint: str | None = None) -> None:
        """``index``: the choice this encoder's chunks carry (``n`` > 1: one encoder per choice,
        same ``rid`` and ``created``); ``system_fingerprint``: the generation that serves it."""
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        # data: {"id":..,"object":..,"created":..,"model":..[,"system_fingerprint":..]
        self._head = (b'data: {"id":' + _ENC.encode(rid) + b',"object":' + _ENC.encode(obj)
                      + b',"created":' + _ENC.encode(created) + b',"model":'
                      + _ENC.encode(model))
        if system_fingerprint is not None:  # the generation that serves it (issue 14)
            self._head += b',"system_fingerprint":' + _ENC.encode(system_fingerprint)
        self._choice = self._head + b',"choices":[{"index":' + str(index).encode() + b','
        self._usage_null = b',"usage":null' if include_usage else b""
        # The hot case: a token chunk without logprobs and without finish_reason.
        if chat:
            self._tok_head = self._choice + b'"delta":{"content":'
            self._tok_tail = (b'},"logprobs":null,"finish_reason":null}]' + self._usage_null
                              + _END)
        else:
            self._tok_head = self._choice + b'"text":'
            self._tok_tail = b',"logprobs":null,"finish_reason":null}]' + self._usage_null + _END

    def text(self, text: str) -> bytes:
        """A content chunk with no logprobs and no finish reason (the per-token case)."""
        return self._tok_head + _ENC.encode(text) + self._tok_tail

    def chunk(self, text: str | None, lps: Any, fr: str | None, *, role: bool = False) -> bytes:
        """Any choice chunk. Chat: ``text`` None = no ``content`` key; ``lps`` is the list of
        content logprobs (wrapped as ``{"content": lps}``). Completion: ``text`` None = ""."""
        if lps is None and fr is None and not role and text is not None:
            return self.text(text)
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            body = (b'"delta":' + _ENC.encode(delta) + b',"logprobs":'
                    + (_ENC.encode({"content": lps}) if lps is not None else b"null"))
        else:
            body = b'"text":' + _ENC.encode(text or "") + b',"logprobs":' + _ENC.encode(lps)
        return (self._choice + body + b',"finish_reason":' + _ENC.encode(fr) + b"}]"
                + self._usage_null + _END)

    def delta(self, delta: dict[str, Any], lps: Any = None, fr: str | None = None) -> bytes:
        """A chat chunk with any ``delta`` (tool calls: ``api/tool_stream.py``); ``lps`` as in
        :meth:`chunk`."""
        return (self._choice + b'"delta":' + _ENC.encode(delta) + b',"logprobs":'
                + (_ENC.encode({"content": lps}) if lps is not None else b"null")
                + b',"finish_reason":' + _ENC.encode(fr) + b"}]" + self._usage_null + _END)

    def usage(self, u: Usage) -> bytes:
        """The final ``choices: []`` chunk carrying usage (``stream_options.include_usage``)."""
        return (self._head + b',"choices":[],"usage":{"prompt_tokens":'
                + str(u.prompt_tokens).encode() + b',"completion_tokens":'
                + str(u.completion_tokens).encode() + b',"total_tokens":'
                + str(u.total_tokens).encode() + b"}" + _END)
