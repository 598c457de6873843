"""Tool calls in Llama 3.1 / 3.2 / 3.3's own syntax: the answer is the call's JSON.

Meta's templates for these models show the request's tools (a ``tools`` variable) with the
instruction to "respond with a JSON for a function call", render an earlier call as
``{"name": ..., "parameters": ...}`` and its result as an ``ipython`` turn; the model answers a
call with that JSON alone (one call a turn: the template refuses more). A package whose template
shows tools that way (it reads ``tools`` and has the ``ipython`` role header:
``Tokenizer.tool_syntax == "llama3_json"``) is served in it, as vLLM's ``llama3_json`` parser and
llama.cpp's server serve it:

- the tools and earlier turns go to the template as ``api/tools_native.py`` gives them;
- the answer is held by a grammar (llguidance Lark): with ``tool_choice: "auto"`` either text that
  does not begin with ``{`` or one call, ``{"name": <a tool of the request>, "parameters": <its
  arguments, validated>}``; with ``"required"`` or a named tool, the call.

The response is the OpenAI message of ``api/tools.py``; streamed, text streams as it comes and a
call (an answer whose first character is ``{``) comes whole at the end.
"""

from __future__ import annotations

import json
from typing import Any, Final, final

from calserve.api.tools_native import JSON_STYLE, ToolCalling

__all__ = ["llama_grammar", "llama_answer", "llama_call_schema", "LlamaText"]

_ARGS: Final = "parameters"  # the arguments' key in Llama's syntax


def llama_call_schema(tc: ToolCalling) -> dict[str, Any]:
    """The JSON schema of the one call an answer may hold."""
    defs, calls = tc.call_schemas()
    calls = [{**c, "properties": {"name": c["properties"]["name"],
                                  _ARGS: c["properties"]["arguments"]},
              "required": ["name", _ARGS]} for c in calls]
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"$defs": defs, **one, "x-guidance": JSON_STYLE}


def llama_grammar(tc: ToolCalling) -> str:
    """The Lark grammar (llguidance's dialect) of an answer (module docstring)."""
    call = f"call: %json {json.dumps(llama_call_schema(tc), ensure_ascii=False)}\n"
    if tc.mode == "auto":
        return "%llguidance {}\nstart: TEXT? | call\nTEXT: /[^{](.|\\n)*/\n" + call
    return "%llguidance {}\nstart: call\n" + call


def llama_answer(tc: ToolCalling, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """``(content, calls)`` of the generated ``text``: ``(None, [the call])`` when it is one
    call of the request's tools, else ``(text, None)``."""
    if not text.startswith("{"):
        return text, None
    try:
        call = json.loads(text)
    except ValueError:
        return text, None
    names = {t["name"] for t in tc.tools}
    if not (isinstance(call, dict) and call.get("name") in names
            and isinstance(call.get(_ARGS), dict)):
        return text, None
    return None, [{"name": call["name"], "arguments": call[_ARGS]}]


@final
class LlamaText:
    """The text of an answer that is not a call, as it grows (a call streams nothing)."""

    __slots__ = ("mode", "sent")

    def __init__(self) -> None:
        self.mode: str | None = None  # None: nothing yet; "text"; "calls"
        self.sent: list[str] = []

    def feed(self, text: str) -> str:
        """The answer's next characters -> the content they add (may be "")."""
        if self.mode is None and text:
            self.mode = "calls" if text.startswith("{") else "text"
        if self.mode != "text" or not text:
            return ""
        self.sent.append(text)
        return text
