"""The SSE stream of a ``POST /v1/responses`` answer (``api/responses.py``), as the tokens come.

OpenAI's event sequence, each event ``event: <type>`` + ``data: {...}`` with a ``sequence_number``:
``response.created`` and ``response.in_progress`` first; a thinking model's reasoning as a
``reasoning`` item (``response.output_item.added``, ``response.reasoning_text.delta``...,
``response.reasoning_text.done``, ``response.output_item.done``); the text as a ``message`` item
(``output_item.added``, ``content_part.added``, ``response.output_text.delta``...,
``output_text.done``, ``content_part.done``, ``output_item.done``); tool calls as they are
written, each a ``function_call`` item (``output_item.added`` once its name is whole, its
arguments as ``response.function_call_arguments.delta`` events as the model writes them, then
``.done``), as on chat (``api/tool_scan.py``); then ``response.completed`` (or
``response.incomplete``: cut at ``max_output_tokens``) holding the whole response, whose items are
the streamed ones (same ids, same text). An error ends the stream with ``response.failed`` (the
response with its ``error``). No ``[DONE]``: the terminal response event is the end.

The text and reasoning are split as they grow by the answer's own stream
(:class:`~calserve.api.reasoning.AnswerText`: tools in the model's syntax hold back what may begin
a call), so the deltas add up to the unstreamed response of the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

from calserve.api.errors import ApiError, error_event_to_api, from_exception
from calserve.api.reasoning import Answer, AnswerText
from calserve.api.render import LogprobFormatter, encode, finish_reason, new_id, now_s
from calserve.api.responses import (
    ResponseEcho, call_item, item_status, reasoning_item, response_object, text_item, text_part,
)
from calserve.api.tool_stream import token_texts, unsent
from calserve.api.tools import openai_call
from calserve.engine.types import ErrorEvent, Event, FinishEvent, Usage

__all__ = ["ResponsesStreamEncoder"]


@final
class ResponsesStreamEncoder:
    """:class:`~calserve.api.stream_encoder.SseEncoder`'s interface for a Responses answer."""

    __slots__ = ("_model", "_answer", "_echo", "_rid", "_created", "_seq", "_text", "_all", "_items",
                 "_open", "_open_text", "_fmt", "_lps", "_lps_sent", "_call", "_calls", "tokens",
                 "terminal", "finished", "response")

    def __init__(self, model: str, answer: Answer | None, echo: ResponseEcho,
                 logprobs: LogprobFormatter | None = None) -> None:
        """``answer``: how the chat answer is shaped (tools, reasoning; None: plain text);
        ``logprobs``: the request asked for them (a plain answer's go with its deltas)."""
        self._model = model
        self._answer = answer
        self._echo = echo
        self._rid = new_id("resp")
        self._created = now_s()
        self._seq = 0
        self._text: AnswerText | None = None if answer is None else answer.stream()
        self._all: list[str] = []  # every text of the answer
        self._items: list[dict[str, Any]] = []  # output items so far (done ones completed)
        self._open: dict[str, Any] | None = None  # the item being streamed (reasoning or message)
        self._open_text: list[str] = []  # its text so far
        self._fmt = logprobs if answer is None else None
        self._lps: list[Any] = []  # logprobs not sent yet (their tokens' text may be held)
        self._lps_sent: list[Any] = []  # every logprob sent with a delta
        self._call: tuple[int, dict[str, Any], list[str]] | None = None  # the call item streaming:
        # (its output index, its OpenAI call, its arguments' text so far)
        self._calls = 0  # calls streamed (their items begun)
        self.tokens = 0
        self.terminal: FinishEvent | ErrorEvent | None = None
        self.finished = False
        #: The response of the terminal event, once encoded (what ``store`` keeps)
        self.response: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------ events
    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode(body) + b"\n\n"

    def _response(self, status: str, usage: Usage | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self._echo, self._rid, self._created, self._model, status,
                               self._items, usage, error)

    def opening(self) -> bytes:
        return (self._event("response.created", response=self._response("in_progress"))
                + self._event("response.in_progress", response=self._response("in_progress")))

    def usage_chunk(self, usage: Usage) -> bytes:
        return b""  # usage travels in the terminal response event

    def failure(self, exc: BaseException) -> bytes:
        return self._failed(from_exception(exc))

    def _failed(self, err: ApiError) -> bytes:
        out = self._close("incomplete") + self._close_call("incomplete")
        error = {"code": err.code or err.type, "message": err.message}
        self.response = self._response("failed", None, error)
        return out + self._event("response.failed", response=self.response)

    # ------------------------------------------------------------------------------ items
    def _begin(self, kind: str) -> bytes:
        """Open a reasoning or message item (closing the other)."""
        out = b""
        if self._open is not None:
            if self._open["type"] == kind:
                return out
            out = self._close("completed")
        idx = len(self._items)
        if kind == "reasoning":
            item = reasoning_item(new_id("rs"), "", "in_progress")
            self._items.append(item)
            self._open = item
            return out + self._event("response.output_item.added", output_index=idx, item=item)
        item = text_item(new_id("msg"), "", "in_progress")
        self._items.append(item)
        self._open = item
        return (out + self._event("response.output_item.added", output_index=idx, item=item)
                + self._event("response.content_part.added", item_id=item["id"],
                              output_index=idx, content_index=0, part=text_part("")))

    def _delta(self, kind: str, text: str) -> bytes:
        out = self._begin(kind)
        item = self._open
        assert item is not None
        self._open_text.append(text)
        ev = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {}
        if kind != "reasoning":
            extra["logprobs"], self._lps = self._lps, []
            self._lps_sent.extend(extra["logprobs"])
        return out + self._event(ev, item_id=item["id"], output_index=len(self._items) - 1,
                                 content_index=0, delta=text, **extra)

    def _close(self, status: str) -> bytes:
        """Finish the open item (its whole text in its done events)."""
        item = self._open
        if item is None:
            return b""
        self._open = None
        text = "".join(self._open_text)
        self._open_text = []
        idx = len(self._items) - 1
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, status)
            self._items[idx] = done
            return (self._event("response.reasoning_text.done", item_id=item["id"],
                                output_index=idx, content_index=0, text=text)
                    + self._event("response.output_item.done", output_index=idx, item=done))
        done = text_item(item["id"], text, status, self._lps_sent)
        self._items[idx] = done
        return (self._event("response.output_text.done", item_id=item["id"], output_index=idx,
                            content_index=0, text=text, logprobs=self._lps_sent)
                + self._event("response.content_part.done", item_id=item["id"],
                              output_index=idx, content_index=0,
                              part=text_part(text, self._lps_sent))
                + self._event("response.output_item.done", output_index=idx, item=done))

    def _feed(self, text: str) -> bytes:
        if self._text is None:
            return self._delta("message", text) if text else b""
        reasoning, content = self._text.feed(text)
        out = self._delta("reasoning", reasoning) if reasoning else b""
        out += self._delta("message", content) if content else b""
        for k, name, piece in self._text.take_calls():
            if name is not None:
                out += self._begin_call(openai_call(name, ""))
            out += self._call_args(piece)
        return out

    # ------------------------------------------------------------------------------ calls
    def _begin_call(self, call: dict[str, Any]) -> bytes:
        """A ``function_call`` item begins (the item before it is complete)."""
        out = self._close("completed") + self._close_call("completed")
        idx = len(self._items)
        item = call_item(call, new_id("fc"), "in_progress")
        self._items.append(item)
        self._call = (idx, call, [])
        self._calls += 1
        return out + self._event("response.output_item.added", output_index=idx, item=item)

    def _call_args(self, piece: str) -> bytes:
        assert self._call is not None
        idx, call, parts = self._call
        if not piece:
            return b""
        parts.append(piece)
        return self._event("response.function_call_arguments.delta",
                           item_id=self._items[idx]["id"], output_index=idx, delta=piece)

    def _close_call(self, status: str) -> bytes:
        if self._call is None:
            return b""
        idx, call, parts = self._call
        self._call = None
        args = "".join(parts)
        done = call_item({**call, "function": {**call["function"], "arguments": args}},
                         self._items[idx]["id"], status)
        self._items[idx] = done
        return (self._event("response.function_call_arguments.done", item_id=done["id"],
                            output_index=idx, name=done["name"], arguments=args)
                + self._event("response.output_item.done", output_index=idx, item=done))

    # ------------------------------------------------------------------------------ the stream
    def encode(self, batch: Sequence[Event]) -> bytes:
        if not batch:  # the events ended without a terminal event: an engine bug
            self.tokens = 0
            self.finished = True
            return self._failed(ApiError(500, "the engine ended the request without a terminal"
                                         " event", type="server_error", code="internal_error"))
        n_tokens, parts, terminal = token_texts(batch, self._fmt, self._lps)
        self.tokens = n_tokens
        text = "".join(parts)
        self._all.append(text)
        out = self._feed(text) if text else b""
        if terminal is None:
            return out
        self.terminal = terminal
        self.finished = True
        if isinstance(terminal, ErrorEvent):
            return out + self._failed(error_event_to_api(terminal))
        return out + self._finish(terminal)

    def _finish(self, terminal: FinishEvent) -> bytes:
        self._all.append(terminal.text)
        full = "".join(self._all)
        fr = finish_reason(terminal.reason)
        answer = self._answer
        if answer is None:
            msg: dict[str, Any] = {"role": "assistant", "content": full}
        else:
            if self._text is not None:
                self._text.feed_calls(terminal.text)
            msg, fr = answer.message(full, fr, self._text)
        status = item_status(fr)
        out = b""
        # what the stream has not sent of the reasoning and the content (the answer's own
        # feeder held back what may begin a call, or a tag cut short)
        thought = unsent(msg.get("reasoning_content") or "", [self._sent("reasoning")])
        if thought:
            out += self._delta("reasoning", thought)
        calls = msg.get("tool_calls") or []
        rest = unsent(msg.get("content") or "", [self._sent("message")])
        if rest:
            out += self._delta("message", rest)
        elif not (calls or self._items):
            out += self._begin("message")  # an empty answer is still one message
        if self._lps:  # tokens whose text never came (a stop string's): their logprobs all the same
            out += self._delta("message", "")
        out += self._close(status if not calls else "completed")
        # the calls: what the stream has not sent of them (the finish's text, a call begun in it)
        for k, call in enumerate(calls):
            args = call["function"]["arguments"]
            if k < self._calls - 1:
                continue  # complete, its item done when the next call began
            if k >= self._calls:
                out += self._begin_call({**call, "function": {**call["function"], "arguments": ""}})
                out += self._call_args(args)
            elif self._call is not None:
                out += self._call_args(unsent(args, self._call[2]))
            out += self._close_call(status if k == len(calls) - 1 else "completed")
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        self.response = self._response(status, terminal.usage)
        return out + self._event(kind, response=self.response)

    def _sent(self, kind: str) -> str:
        """The text streamed so far in the items of ``kind`` (the open one included)."""
        done = "".join(c["text"] for i in self._items if i["type"] == kind and i is not self._open
                       for c in i["content"])
        open_ = "".join(self._open_text) if self._open is not None and \
            self._open["type"] == kind else ""
        return done + open_
