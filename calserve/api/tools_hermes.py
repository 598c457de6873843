"""Tool calls in the model's own syntax: Hermes ``<tool_call>`` tags.

Qwen2.5, Qwen3, Hermes 2/3 and the many fine-tunes that share their chat template were trained to
see the tools in their system turn (the template renders a ``tools`` variable) and to call them so::

    optional text for the user
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A package whose Jinja template reads ``tools`` and writes ``<tool_call>`` (and whose tokenizer
does not make ``<tool_call>`` a special token, which the detokenizer would drop:
``Tokenizer.tool_syntax``) is served in that syntax instead of the generic JSON answer of
``api/tools.py``: the request's tools and earlier turns go to the template as
``api/tools_native.py`` gives them, and the answer is held by a grammar (llguidance Lark, each call's JSON schema inline):

- ``tool_choice: "auto"``: the text is free until the model writes ``<tool_call>`` (a lazy
  trigger, as llguidance's structural tags); from there the call must name one of the request's
  tools with arguments that validate, further calls may follow (at most 16; one with
  ``parallel_tool_calls: false``) and nothing else. A model that never writes the tag answers in
  plain text.
- ``"required"`` or a named function: calls from the first token.

The calls' JSON is written as these models were trained to write it (``", "`` and ``": "``
between items, ``name`` first). The response is the OpenAI message of ``api/tools.py``: the text
before the first call (trailing whitespace dropped) as ``content`` (null when empty), the calls as
``tool_calls`` (cut short by ``max_tokens``: as far as they were written); an answer in which no
call of a request's tool begins is all text. Streamed, the text before the tag streams as it
comes, holding back only what could be the start of the tag (and whitespace before it), and the
calls as they are written (``api/tool_scan.py`` with :data:`HERMES_FRAMING`).
"""

from __future__ import annotations

import json
from typing import Any, Final, final

from calserve.api.tool_scan import Framing
from calserve.api.tools_native import JSON_STYLE, ToolCalling, held_back

__all__ = ["TRIGGER", "HERMES_FRAMING", "hermes_grammar", "HermesText", "call_schema"]

TRIGGER: Final = "<tool_call>"
_OPEN: Final = TRIGGER + "\n"
_CLOSE: Final = "\n</tool_call>"
_NEXT: Final = "\n" + _OPEN  # between two calls
#: How the calls are written around their JSON (``api/tool_scan.py``).
HERMES_FRAMING: Final = Framing(_OPEN, True, '{"name": "', '", "arguments": ', "}" + _CLOSE, _NEXT,
                                None)


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
