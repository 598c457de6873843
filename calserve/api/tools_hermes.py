"""Tool calls in the model's own syntax: Hermes ``<tool_call>`` tags.

Qwen2.5, Qwen3, Hermes 2/3 and the many fine-tunes that share their chat template were trained to
see the tools in their system turn (the template renders a ``tools`` variable) and to call them so::

    optional text for the user
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A package whose Jinja template reads ``tools`` and writes ``<tool_call>`` (and whose tokenizer
does not make ``<tool_call>`` a special token, which the detokenizer would drop:
``Tokenizer.tool_syntax``) is served in that syntax instead of the generic JSON answer of ``api/tools.py``: the request's tools go to the
template as Hugging Face's ``apply_chat_template(messages, tools=...)`` passes them, earlier turns
as they came (an assistant message's ``tool_calls`` with their ``arguments`` parsed to objects, as
those templates expect, and ``tool`` messages), and the answer is held by a grammar (llguidance
Lark, each call's JSON schema inline):

- ``tool_choice: "auto"``: the text is free until the model writes ``<tool_call>`` (a lazy
  trigger, as llguidance's structural tags); from there the call must name one of the request's
  tools with arguments that validate, further calls may follow (at most 16; one with
  ``parallel_tool_calls: false``) and nothing else. A model that never writes the tag answers in
  plain text.
- ``"required"`` or a named function: calls from the first token.

The calls' JSON is written as these models were trained to write it (``", "`` and ``": "``
between items, ``name`` first). The response is the OpenAI message of ``api/tools.py``: the text
before the first call (trailing whitespace dropped) as ``content`` (null when empty), the calls as
``tool_calls``; an answer whose calls do not parse (cut short by ``max_tokens``) is all text.
Streamed, the text before the tag streams as it comes, holding back only what could be the start
of the tag (and whitespace before it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final, Protocol, final

from calserve import errors as E

__all__ = ["TRIGGER", "hermes_grammar", "hermes_answer", "HermesText",
           "template_tools", "native_tool_message", "earlier_calls", "checked_call_id", "special_text_param", "call_schema", "held_back", "JSON_STYLE", "ToolCalling"]

TRIGGER: Final = "<tool_call>"
_OPEN: Final = TRIGGER + "\n"
_CLOSE: Final = "\n</tool_call>"
_NEXT: Final = "\n" + _OPEN  # between two calls
#: How the calls' JSON is written (Hermes/Qwen templates render earlier calls with Python's
#: ``json.dumps`` defaults) and no free whitespace (a model must not pad forever).
JSON_STYLE: Final = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolCalling(Protocol):
    """What this module reads of a request's tools (:class:`calserve.api.tools.ToolCalling`)."""

    @property
    def tools(self) -> tuple[dict[str, Any], ...]: ...
    @property
    def mode(self) -> str: ...
    @property
    def max_calls(self) -> int: ...
    def call_schemas(self) -> tuple[dict[str, Any], list[dict[str, Any]]]: ...


def template_tools(tc: ToolCalling) -> list[dict[str, Any]]:
    """The request's tools as a chat template's ``tools`` variable gets them (OpenAI's shape)."""
    return [{"type": "function", "function": dict(t)} for t in tc.tools]


def call_schema(tc: ToolCalling) -> dict[str, Any]:
    """The JSON schema of one call (``name`` and ``arguments``), in the Hermes JSON style."""
    defs, calls = tc.call_schemas()
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"$defs": defs, **one, "x-guidance": JSON_STYLE}


def hermes_grammar(tc: ToolCalling, think: str | None = None) -> str:
    """The Lark grammar (llguidance's dialect) of an answer (module docstring). ``think``: the
    model thinks first (``api/reasoning.py``), ``"optional"`` a ``<think>...</think>`` block
    before the calls of ``required``/a named tool, ``"open"`` the rest of a block the prompt
    opened (``auto``'s free text allows either already)."""
    close = json.dumps(_CLOSE)
    calls = f'"\\n" call {close}'
    if tc.max_calls > 1:
        calls += f' more\nmore: ({json.dumps(_NEXT)} call {close}){{0,{tc.max_calls - 1}}}'
    calls += f'\ncall: %json {json.dumps(call_schema(tc), ensure_ascii=False)}\n'
    if tc.mode == "auto":
        return ("%llguidance {}\n"
                f"start: TEXT | trigger {calls}"
                f"trigger[lazy]: TEXT {json.dumps(TRIGGER)}\n"
                "TEXT: /(.|\\n)*/\n")
    if think is None:
        return f"%llguidance {{}}\nstart: {json.dumps(TRIGGER)} {calls}"
    head = '"<think>" ' if think == "optional" else ""
    return (f"%llguidance {{}}\nstart: thought{'?' if head else ''} {json.dumps(TRIGGER)} {calls}"
            "thought: think_body WS?\n"
            f'think_body[lazy]: {head}/(.|\\n)*/ "</think>"\n'
            "WS: /[ \\t\\r\\n]+/\n")


def _parse_calls(tc: ToolCalling, text: str) -> list[dict[str, Any]] | None:
    """The calls of ``text`` (from its first tag to its end: calls and the newlines between them,
    as the grammar writes them), or None when that is not what it holds."""
    names = {t["name"] for t in tc.tools}
    calls: list[dict[str, Any]] = []
    pos = 0
    while True:
        if not text.startswith(_OPEN, pos):
            return None
        end = text.find(_CLOSE, pos + len(_OPEN))  # JSON text holds no raw newline
        if end < 0:
            return None
        try:
            call = json.loads(text[pos + len(_OPEN):end])
        except ValueError:
            return None
        if not (isinstance(call, dict) and call.get("name") in names
                and isinstance(call.get("arguments"), dict)):
            return None
        calls.append(call)
        pos = end + len(_CLOSE)
        if pos == len(text):
            return calls if len(calls) <= tc.max_calls else None
        if not text.startswith("\n", pos):
            return None
        pos += 1


def hermes_answer(tc: ToolCalling, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """``(content, calls)`` of the generated ``text``: the text before the first tag (trailing
    whitespace dropped; None when empty) and the calls, or ``(text, None)`` when it holds no
    calls that parse."""
    i = text.find(TRIGGER)
    calls = None if i < 0 else _parse_calls(tc, text[i:])
    if calls is None:
        return text, None
    return text[:i].rstrip() or None, calls


def held_back(buf: str, tag: str) -> int:
    """How many characters at the end of ``buf`` may not be streamed yet: the longest end that
    begins ``tag``, and the whitespace before it (dropped if the tag follows)."""
    k = min(len(buf), len(tag) - 1)
    while k and not tag.startswith(buf[len(buf) - k:]):
        k -= 1
    j = len(buf) - k
    while j and buf[j - 1].isspace():
        j -= 1
    return len(buf) - j


@final
class HermesText:
    """The text before the first ``<tool_call>`` as the answer grows (the stream's content)."""

    __slots__ = ("_buf", "mode", "sent")

    def __init__(self) -> None:
        self._buf = ""
        self.mode = "text"  # "calls" once the tag was written
        self.sent: list[str] = []  # what feed() returned

    def feed(self, text: str) -> str:
        """The answer's next characters -> the content they add (may be "")."""
        if self.mode == "calls" or not text:
            return ""
        buf = self._buf + text
        i = buf.find(TRIGGER)
        if i >= 0:
            self.mode = "calls"
            out, self._buf = buf[:i].rstrip(), ""
        else:
            keep = held_back(buf, TRIGGER)
            out, self._buf = buf[:len(buf) - keep], buf[len(buf) - keep:]
        if out:
            self.sent.append(out)
        return out


def _bad(param: str, why: str) -> E.RequestError:
    return E.RequestError(why, param=param)


def checked_call_id(tool_call_id: Any, where: str) -> str | None:
    """A ``tool`` message's ``tool_call_id`` (a string or absent); a 400 naming it otherwise."""
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise _bad(f"{where}.tool_call_id", f"`{where}.tool_call_id` must be a string")
    return tool_call_id


def earlier_calls(tool_calls: Any, where: str, max_calls: int) -> list[dict[str, Any]]:
    """An earlier assistant message's ``tool_calls`` as ``{"name", "arguments", "id"}`` each, the
    arguments parsed from their JSON text (a string that is not JSON stays that string), the id
    None when absent; 400s name ``where``'s fields."""
    if not isinstance(tool_calls, list) or len(tool_calls) > max_calls:
        raise _bad(f"{where}.tool_calls",
                   f"`{where}.tool_calls` must be a list of at most {max_calls} calls")
    calls: list[dict[str, Any]] = []
    for j, c in enumerate(tool_calls):
        f = c.get("function") if isinstance(c, dict) else None
        name = f.get("name") if isinstance(f, dict) else None
        args = f.get("arguments") if isinstance(f, dict) else None
        if not isinstance(name, str) or not isinstance(args, str):
            raise _bad(f"{where}.tool_calls[{j}].function",
                       f"`{where}.tool_calls[{j}].function` must have a string `name` and"
                       " `arguments` (JSON text)")
        try:
            parsed: Any = json.loads(args)
        except ValueError:
            parsed = args
        cid = c.get("id") if isinstance(c, dict) else None
        calls.append({"name": name, "arguments": parsed,
                      "id": cid if isinstance(cid, str) else None})
    return calls


def native_tool_message(role: str, content: str, tool_calls: Any, tool_call_id: Any,
                        where: str, max_calls: int) -> dict[str, Any]:
    """An earlier turn of tool calling as a Hermes template takes it: a ``tool`` message with its
    ``tool_call_id``, an assistant message's ``tool_calls`` with ``arguments`` parsed to objects;
    400s name ``where``'s fields."""
    if role == "tool":
        out: dict[str, Any] = {"role": "tool", "content": content}
        cid = checked_call_id(tool_call_id, where)
        if cid is not None:
            out["tool_call_id"] = cid
        return out
    calls: list[dict[str, Any]] = []
    for c in earlier_calls(tool_calls, where, max_calls):
        call: dict[str, Any] = {"type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}}
        if c["id"] is not None:
            call["id"] = c["id"]
        calls.append(call)
    return {"role": "assistant", "content": content, "tool_calls": calls}


def special_text_param(has_special: Any, tools: Sequence[dict[str, Any]],
                       messages: Sequence[dict[str, Any]]) -> str | None:
    """The field holding a special-token string where the template copies it as its own text (a
    tool's definition, an earlier call), or None. ``has_special(text)``: the tokenizer's test."""
    if has_special(json.dumps(list(tools), ensure_ascii=False)):
        return "tools"
    for i, m in enumerate(messages):
        if m.get("tool_calls") and has_special(json.dumps(m["tool_calls"], ensure_ascii=False)):
            return f"messages[{i}].tool_calls"
        if m.get("tool_call_id") and has_special(m["tool_call_id"]):
            return f"messages[{i}].tool_call_id"
    return None
