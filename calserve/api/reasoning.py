"""A thinking model's reasoning apart from its answer: ``reasoning_content`` beside ``content``.

Qwen3, DeepSeek-R1's distillations, SmolLM3 and their kind think before they answer, between
``<think>`` and ``</think>``, and their chat templates know it (they drop earlier turns' thinking,
or render ``enable_thinking: false`` as an empty block). For a package whose template holds both
tags (as text: a special token would be dropped by the detokenizer), a chat answer that begins with
a think block is returned as llama.cpp's server and vLLM's reasoning parsers return it: the
block's text (trimmed) as ``message.reasoning_content``, the rest (leading whitespace dropped) as
``content``; streamed, as ``reasoning_content`` deltas and then ``content`` deltas, adding up to the
same. A template that opens the block itself (the prompt ends with ``<think>``) gets an answer
that begins inside it. A block cut short (``max_tokens``) is all reasoning. ``reasoning_format:
"none"`` in the request keeps everything in ``content``; an answer without a block is unchanged.

With tools (``api/tools.py``): the text before a Hermes answer's calls is split the same way (a
model thinks, then calls); the generic JSON answer has no text to split.

:class:`Answer` is what the HTTP layer holds per chat request to shape its message
(:meth:`Answer.message`) and its stream (:meth:`Answer.stream`, for ``api/tool_stream.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final, final

from calserve.api.tool_scan import CallDelta, CallScanner
from calserve.api.tools import ResponseText, ToolCalling
from calserve.api.tools_hermes import HermesText
from calserve.api.tools_native import held_back
from calserve.api.tools_llama import LlamaText

__all__ = ["OPEN", "CLOSE", "Reasoning", "Answer", "AnswerText", "split_reasoning"]

OPEN: Final = "<think>"
CLOSE: Final = "</think>"


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str]:
    """``(reasoning, content)`` of an answer (module docstring); reasoning None without a block."""
    if opened:
        body = text
    else:
        s = text.lstrip()
        if not s.startswith(OPEN):
            return None, text
        body = s[len(OPEN):]
    end = body.find(CLOSE)
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(CLOSE):].lstrip()


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """A request's answer begins with a think block (or inside one, ``opened``)."""

    opened: bool = False

    @classmethod
    def of(cls, prompt: str | None, tags: bool, fmt: str | None) -> Reasoning | None:
        """For a request whose rendered ``prompt`` is known, to a package whose template thinks
        (``tags``), unless ``fmt`` (``reasoning_format``) is ``none``."""
        if not tags or fmt == "none" or prompt is None:
            return None
        return cls(opened=prompt.rstrip().endswith(OPEN))


@final
class _Split:
    """:func:`split_reasoning` as the text grows: each piece -> (reasoning, content) added."""

    __slots__ = ("_buf", "_state", "_began")

    def __init__(self, opened: bool) -> None:
        self._buf = ""
        self._state = "think" if opened else "start"  # start -> think -> content, or -> content
        self._began = False  # the current part (reasoning, then content) has sent a character

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._buf + text
        self._buf = ""
        if self._state == "start":
            s = buf.lstrip()
            if not s or (len(s) < len(OPEN) and OPEN.startswith(s)):
                self._buf = buf  # may still open a block
                return "", ""
            if not s.startswith(OPEN):
                self._state = "plain"  # no block: the answer is content, as it is
                return "", buf
            self._state, buf = "think", s[len(OPEN):]
        if self._state == "plain":
            return "", buf
        if self._state == "think":
            end = buf.find(CLOSE)
            if end < 0:
                keep = held_back(buf, CLOSE)
                out, self._buf = buf[:len(buf) - keep], buf[len(buf) - keep:]
                return self._part(out), ""
            reasoning = self._part(buf[:end].rstrip())
            self._state, self._began = "content", False
            return reasoning, self._part(buf[end + len(CLOSE):])
        return "", self._part(buf)

    def flush(self) -> tuple[str, str]:
        """The text ended (the tool calls began: nothing more comes to the content): what the
        split held back, as :func:`split_reasoning` takes it at the end of a text: a block not
        opened is content, a partial ``</think>`` is reasoning."""
        buf, self._buf = self._buf, ""
        if not buf:
            return "", ""
        if self._state == "start":
            self._state = "plain"
            return "", buf
        if self._state == "think":
            return self._part(buf), ""
        return "", self._part(buf)

    def _part(self, text: str) -> str:
        if not self._began:
            text = text.lstrip()
            self._began = bool(text)
        return text


@final
class AnswerText:
    """What streams of an answer as it grows: reasoning and content (after the tool syntax's own
    feeder, which passes on the text before the calls)."""

    __slots__ = ("_tools", "_split", "_scan", "sent", "sent_reasoning", "calls")

    def __init__(self, tools: ResponseText | HermesText | LlamaText | None,
                 reasoning: Reasoning | None, scan: CallScanner | None = None) -> None:
        self._tools = tools
        self._split = None if reasoning is None else _Split(reasoning.opened)
        self._scan = scan
        self.sent: list[str] = []  # content fed out
        self.sent_reasoning: list[str] = []
        self.calls: list[CallDelta] = []  # what the text fed so far added to the calls, not taken

    @property
    def scan(self) -> CallScanner | None:
        """The scan of the calls (None: no tools), fed everything :meth:`feed` was."""
        return self._scan

    def feed_calls(self, text: str) -> None:
        """``text`` (the answer's last characters, which no delta will carry) to the calls' scan
        alone."""
        if self._scan is not None:
            self._scan.feed(text)

    def take_calls(self) -> list[CallDelta]:
        """The calls' deltas since the last take (``api/tool_scan.py``)."""
        out, self.calls = self.calls, []
        return out

    @property
    def text_mode(self) -> bool:
        """The answer is (still) text: logprobs go with its deltas."""
        return self._tools is None or self._tools.mode == "text"

    def feed(self, text: str) -> tuple[str, str]:
        """The answer's next characters -> ``(reasoning, content)`` they add (either may be "");
        what they add to the calls waits in :attr:`calls`."""
        if self._scan is not None:
            self.calls += self._scan.feed(text)
        ended = False  # the content is complete: the tool calls began
        if self._tools is not None:
            text = self._tools.feed(text)
            ended = self._tools.mode != "text"
        if self._split is None:
            r, c = "", text
        else:
            r, c = self._split.feed(text) if text else ("", "")
            if ended:  # what the split held back (a "<" that did not open a block) goes first
                r2, c2 = self._split.flush()
                r, c = r + r2, c + c2
        if not (r or c):
            return "", ""
        if r:
            self.sent_reasoning.append(r)
        if c:
            self.sent.append(c)
        return r, c


@dataclasses.dataclass(frozen=True)
class Answer:
    """How a chat request's answer is shaped: its tool calls and/or its reasoning."""

    tools: ToolCalling | None = None
    reasoning: Reasoning | None = None

    @property
    def _split(self) -> Reasoning | None:
        """The reasoning to split off the text (none in the generic JSON tool answer)."""
        return None if self.tools is not None and self.tools.syntax == "json" else self.reasoning

    def message(self, text: str, finish: str, stream: AnswerText | None = None
                ) -> tuple[dict[str, Any], str]:
        """The assistant message and ``finish_reason`` of the generated ``text`` (``stream``:
        the answer's stream, fed all of ``text``: its scan of the calls is used, not redone)."""
        if self.tools is not None:
            msg, finish = self.tools.message(text, finish, None if stream is None else stream.scan)
        else:
            msg = {"role": "assistant", "content": text}
        content = msg.get("content")
        split = self._split
        if split is not None and isinstance(content, str):
            reasoning, rest = split_reasoning(content, split.opened)
            if reasoning is not None:
                msg["content"] = None if (msg.get("tool_calls") and not rest) else rest
                msg["reasoning_content"] = reasoning
        return msg, finish

    def stream(self) -> AnswerText:
        if self.tools is None:
            return AnswerText(None, self._split)
        return AnswerText(self.tools.text_stream(), self._split, self.tools.scanner())
