"""The SSE stream of a chat answer with tools (api/tools.py) or reasoning (api/reasoning.py), as
the tokens come.

In the generic syntax the answer is one JSON object, ``{"response": "..."}`` or
``{"tool_calls": [...]}``, and its first characters say which (the grammar writes no whitespace):
a direct answer's string is decoded as it grows and streamed as ``content`` deltas (what a client
sees is the text, never the JSON around it; an escape sequence cut between two tokens waits for
its end). In the Hermes syntax (``api/tools_hermes.py``) the text before the first
``<tool_call>`` streams as it comes. Tool calls stream as OpenAI streams them
(``api/tool_scan.py``): a call's first ``tool_calls`` delta, with its id, type and name, once the
name is whole, then pieces of its ``arguments`` as the model writes them (with the logprobs of
their tokens). A thinking model's reasoning goes out
as ``reasoning_content`` deltas before the content (``api/reasoning.py``). Then the
finish chunk (``tool_calls`` for calls), the usage chunk and ``[DONE]``, or the error event, exactly
as :class:`~calserve.api.stream_encoder.StreamEncoder` ends a stream. The deltas of a stream add up
to the message of the same answer unstreamed (``tests/api/test_tool_stream.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

from calserve.api.chunks import ChunkEncoder
from calserve.api.convert import Prepared
from calserve.api.render import DONE, LogprobFormatter, finish_reason, new_id, now_s
from calserve.api.stream_encoder import NO_TERMINAL, failure_chunk, stream_error_chunk
from calserve.api.reasoning import Answer
from calserve.api.tool_scan import CallDelta
from calserve.api.tools import new_call_id
from calserve.engine.types import ErrorEvent, Event, FinishEvent, TokenEvent, Usage

__all__ = ["ToolStreamEncoder", "token_texts", "unsent"]

@final
class ToolStreamEncoder:
    """:class:`~calserve.api.stream_encoder.StreamEncoder`'s interface for an answer with tools
    or reasoning (module docstring)."""

    __slots__ = ("_chunks", "_answer", "_fmt", "_usage", "_last", "_all", "_lps", "_text",
                 "_ids", "_args", "tokens", "terminal", "finished")

    def __init__(self, chunks: ChunkEncoder, answer: Answer, *, include_usage: bool,
                 logprobs: LogprobFormatter | None, last: bool = True) -> None:
        self._chunks = chunks
        self._answer = answer
        self._fmt = logprobs
        self._usage = include_usage
        self._last = last
        self._all: list[str] = []  # every text of the answer
        self._lps: list[Any] = []  # logprobs not sent yet (tool calls: with the calls)
        self._text = self._answer.stream()
        self._ids: list[str] = []  # the streamed calls' ids
        self._args: list[list[str]] = []  # their arguments' text streamed
        self.tokens = 0
        self.terminal: FinishEvent | ErrorEvent | None = None
        self.finished = False

    @classmethod
    def for_choice(cls, prep: Prepared, answer: Answer, fmt: LogprobFormatter, *, rid: str,
                   created: int, index: int = 0, last: bool = True,
                   system_fingerprint: str | None = None) -> ToolStreamEncoder:
        chunks = ChunkEncoder(chat=True, rid=rid, created=created, model=prep.alias,
                              include_usage=prep.include_usage, index=index,
                              system_fingerprint=system_fingerprint)
        return cls(chunks, answer, include_usage=prep.include_usage,
                   logprobs=fmt if prep.logprobs is not None else None, last=last)

    @classmethod
    def for_request(cls, prep: Prepared, answer: Answer, fmt: LogprobFormatter,
                    system_fingerprint: str | None = None) -> ToolStreamEncoder:
        return cls.for_choice(prep, answer, fmt, rid=new_id("chatcmpl"), created=now_s(),
                              system_fingerprint=system_fingerprint)

    def opening(self) -> bytes:
        return self._chunks.chunk("", None, None, role=True)

    def failure(self, exc: BaseException) -> bytes:
        return failure_chunk(exc)

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._chunks.usage(usage)

    def encode(self, batch: Sequence[Event]) -> bytes:
        if not batch:  # the events ended without a terminal event: an engine bug
            self.tokens = 0
            self.finished = True
            return NO_TERMINAL
        reasoning: list[str] = []
        added: list[str] = []
        n_tokens, texts, terminal = token_texts(batch, self._fmt, self._lps)
        for text in texts:
            self._all.append(text)
            r, c = self._text.feed(text)
            reasoning.append(r)
            added.append(c)
        self.tokens = n_tokens
        out = b""
        text, thought = "".join(added), "".join(reasoning)
        if thought:
            delta = {"reasoning_content": thought, **({"content": text} if text else {})}
            out = self._chunks.delta(delta, self._lps or None)
            self._lps = []
        elif text or (self._lps and self._text.text_mode):
            out = self._chunks.chunk(text, self._lps or None, None)
            self._lps = []
        calls = self._text.take_calls()
        if calls:
            out += self._calls_delta(calls)
        if terminal is None:
            return out
        self.terminal = terminal
        self.finished = True
        if isinstance(terminal, ErrorEvent):
            return out + stream_error_chunk(terminal)
        return out + self._finish(terminal)

    def _finish(self, terminal: FinishEvent) -> bytes:
        chunks = self._chunks
        self._all.append(terminal.text)
        self._text.feed_calls(terminal.text)
        msg, fr = self._answer.message("".join(self._all), finish_reason(terminal.reason),
                                       self._text)
        lps = self._lps or None
        out = b""
        calls = msg.get("tool_calls")
        thought = unsent(msg.get("reasoning_content") or "", self._text.sent_reasoning)
        if thought:
            out += chunks.delta({"reasoning_content": thought}, None)
        rest = unsent(msg["content"] or "", self._text.sent)
        if rest or (lps and not calls):
            out += chunks.chunk(rest, None if calls else lps, None)
            if not calls:
                self._lps = []
        if calls:  # what the stream has not sent of them (text held back, the finish's text)
            more: list[CallDelta] = []
            for k, c in enumerate(calls):
                fn = c["function"]
                if k >= len(self._ids):
                    self._ids.append(c["id"])
                    self._args.append([])
                    more.append((k, fn["name"], fn["arguments"]))
                else:
                    piece = unsent(fn["arguments"], self._args[k])
                    if piece:
                        more.append((k, None, piece))
            if more or self._lps:
                out += self._calls_delta(more or [(len(calls) - 1, None, "")])
        out += chunks.delta({}, None, fr)
        if not self._last:
            return out
        if self._usage:
            out += chunks.usage(terminal.usage)
        return out + DONE

    def _calls_delta(self, calls: list[CallDelta]) -> bytes:
        """One ``tool_calls`` delta of what ``calls`` add (a call's first with its id, type and
        name), with the logprobs not sent yet."""
        merged: dict[int, dict[str, Any]] = {}
        for k, name, piece in calls:
            entry = merged.get(k)
            if entry is None:
                entry = merged[k] = {"index": k}
                if name is not None:
                    if k == len(self._ids):
                        self._ids.append(new_call_id())
                        self._args.append([])
                    entry.update(id=self._ids[k], type="function",
                                 function={"name": name, "arguments": ""})
                else:
                    entry["function"] = {"arguments": ""}
            entry["function"]["arguments"] += piece
            self._args[k].append(piece)
        lps, self._lps = self._lps or None, []
        return self._chunks.delta({"tool_calls": list(merged.values())}, lps)


def token_texts(batch: Sequence[Event], fmt: LogprobFormatter | None, lps: list[Any]
                ) -> tuple[int, list[str], FinishEvent | ErrorEvent | None]:
    """A batch of engine events: its token count, each token event's text (the logprobs of each,
    formatted for chat, appended to ``lps`` when ``fmt``), and its terminal event (None: none;
    events after it are ignored)."""
    n_tokens = 0
    texts: list[str] = []
    for ev in batch:
        if not isinstance(ev, TokenEvent):
            return n_tokens, texts, ev
        n_tokens += len(ev.token_ids)
        texts.append(ev.text)
        if fmt is not None and ev.logprobs:
            lps.extend(fmt.chat(ev.logprobs))
    return n_tokens, texts, None


def unsent(full: str, sent: list[str]) -> str:
    """What of ``full`` the stream has not sent (``sent`` its start; "" when it is not)."""
    done = "".join(sent)
    return full[len(done):] if full.startswith(done) else ""
