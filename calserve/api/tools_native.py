"""What the models' own tool-call syntaxes share (``api/tools_hermes.py``, ``api/tools_llama.py``).

A package whose chat template shows tools itself gets the request's tools as Hugging Face's
``apply_chat_template(messages, tools=...)`` passes them (:func:`template_tools`), and earlier turns
as they came: an assistant message's ``tool_calls`` with their ``arguments`` parsed to objects, as
those templates expect, and ``tool`` messages with their ``tool_call_id``
(:func:`native_tool_message`). The generic syntax (``api/tools.py``) checks earlier turns with the
same :func:`earlier_calls` / :func:`checked_call_id`. What such a template copies as its own text
(a tool's definition, an earlier call) must hold no special-token string
(:func:`special_text_param`); message contents stay literal (``Tokenizer.encode_chat``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final, Protocol

from calserve import errors as E

__all__ = ["ToolCalling", "JSON_STYLE", "template_tools", "earlier_calls", "checked_call_id",
           "native_tool_message", "special_text_param", "held_back"]

#: How the calls' JSON is written (Hermes/Qwen and Llama templates render earlier calls with
#: Python's ``json.dumps`` defaults) and no free whitespace (a model must not pad forever).
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
    """An earlier turn of tool calling as a template with its own tool syntax takes it: a
    ``tool`` message with its ``tool_call_id``, an assistant message's ``tool_calls`` with
    ``arguments`` parsed to objects; 400s name ``where``'s fields."""
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
