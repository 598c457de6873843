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
call (an answer whose first character is ``{``) as it is written (``api/tool_scan.py``).
"""

from __future__ import annotations

import json
from typing import Any, Final, final

from calserve.api.tool_scan import Framing
from calserve.api.tools_native import JSON_STYLE, ToolCalling

__all__ = ["LLAMA_FRAMING", "llama_grammar", "llama_call_schema", "LlamaText"]

_ARGS: Final = "parameters"  # the arguments' key in Llama's syntax
#: How the call is written around its JSON (``api/tool_scan.py``): the answer is the call.
LLAMA_FRAMING: Final = Framing("", False, '{"name": "', f'", "{_ARGS}": ', "}", None, "")


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
