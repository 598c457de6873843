"""Tool calling (OpenAI ``tools`` / ``tool_choice`` / ``parallel_tool_calls``) for any model.

The model is told about the tools in its system message and answers with one JSON object, held to a
schema by constrained decoding (the grammar of ``response_format``: ``engine/grammar.py``)::

    {"tool_calls": [{"name": "<a tool>", "arguments": {...the tool's parameters...}}, ...]}
    {"response": "<text for the user>"}

This is llama.cpp server's *generic* tool-call format: it needs nothing of the model's chat template,
so it works for every package (SmolLM2's template, like most small models', has no tool syntax), and
the answer always parses: each call names a tool of the request and its ``arguments`` validate
against that tool's ``parameters``. ``tool_choice``: ``"auto"`` (the default with tools) allows both
forms; ``"required"`` only calls; ``{"type": "function", "function": {"name": N}}`` only calls of N;
``"none"`` leaves the tools out (a plain answer). ``parallel_tool_calls: false`` allows one call.
A package whose chat template has the Hermes ``<tool_call>`` syntax (Qwen2.5, Qwen3, Hermes) is
answered in that syntax instead (``api/tools_hermes.py``, ``syntax="hermes"``), and one in Llama
3.1+'s (the answer is the call's JSON) in that one (``api/tools_llama.py``, ``"llama3_json"``);
another model's own syntax (Mistral's ``[TOOL_CALLS]``) is not parsed: its calls come in the
generic format, which it is told.

The response is OpenAI's: calls as ``message.tool_calls`` (ids ``call_<24 hex>``, ``arguments``
the JSON text the model wrote), ``content`` null, ``finish_reason`` ``"tool_calls"``; a
``response`` as ``content``. An answer cut short (``max_tokens``, a deadline, a stop string) is
not JSON: a direct answer's text so far is returned as ``content``; the calls named so far as
``tool_calls``, the last one's ``arguments`` cut short, as OpenAI returns them; an answer cut
before a call's name is whole as the JSON generated; with the ``finish_reason`` (``length``).
Object schemas in ``parameters`` that do not say ``additionalProperties`` get ``false`` (the
named arguments only: a small model otherwise adds keys until ``max_tokens``). Streamed
(``stream: true``), a direct answer's text streams as it comes and each call as it is written
(its name once whole, then its arguments in pieces: ``api/tool_scan.py``, ``api/tool_stream.py``),
in every syntax. Earlier turns: an assistant message with
``tool_calls`` is shown to the model as the JSON it would have written, and a ``tool`` message as
a user message
``{"tool_response": {"tool_call_id": ..., "content": ...}}`` (the results of parallel calls, one
line each, in one user message: ``chat_prompt.chat_messages``).

Bounds (issue 12): at most :data:`MAX_TOOLS` tools, names ``^[A-Za-z0-9_-]{1,64}$`` and unique,
descriptions up to :data:`MAX_DESCRIPTION_CHARS`; the combined schema passes the grammar's bounds.
Every refusal is a 400 naming the field (``tools[i].function.name``, ``tool_choice``, ...).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Callable
from typing import Any, Final, final

from calserve import errors as E
from calserve.api.tool_scan import CallScanner, Framing
from calserve.api.tools_hermes import HERMES_FRAMING, HermesText, call_schema, hermes_grammar
from calserve.api.tools_llama import LLAMA_FRAMING, LlamaText, llama_call_schema, llama_grammar
from calserve.api.tools_native import checked_call_id, earlier_calls
from calserve.engine.grammar import Grammar, compile_json_schema, compile_lark

__all__ = ["ToolCalling", "ResponseText", "parse_tools", "tool_messages", "MAX_TOOLS",
           "MAX_DESCRIPTION_CHARS", "RESPONSE_PREFIX", "openai_call", "new_call_id"]

MAX_TOOLS: Final = 128
MAX_DESCRIPTION_CHARS: Final = 4096
MAX_PARALLEL_CALLS: Final = 16  # calls in one answer (parallel_tool_calls true)
_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_PARAMETERS: Final[dict[str, Any]] = {"type": "object", "properties": {}}
#: How a direct answer begins (the grammar writes no whitespace between JSON tokens).
RESPONSE_PREFIX: Final = '{"response":"'
#: How the calls are written around their JSON (``api/tool_scan.py``).
JSON_FRAMING: Final = Framing('{"tool_calls":[', False, '{"name":"', '","arguments":', "}", ",", "]}")


@dataclasses.dataclass(frozen=True)
class ToolCalling:
    """The tools of one chat request, as the prompt shows them and the grammar holds the answer."""

    tools: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"} each
    mode: str  # "auto" | "required" | the one tool's name
    parallel: bool
    # "json": the answer of this module; "hermes": api/tools_hermes.py; "llama3_json":
    # api/tools_llama.py (one call an answer)
    syntax: str = "json"

    @property
    def max_calls(self) -> int:
        """The calls one answer may hold."""
        return MAX_PARALLEL_CALLS if self.parallel and self.syntax != "llama3_json" else 1

    @property
    def forced(self) -> str | None:
        """The tool every call must name (``tool_choice`` naming one), else None."""
        return None if self.mode in ("auto", "required") else self.mode

    def call_schemas(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """``($defs, one schema per callable tool)``: each tool's ``parameters`` sits in ``$defs``
        (``tool_<i>``) with its local ``$ref``s rebased there (a schema whose references point
        into itself, pydantic's ``#/$defs/Model``, means the same inside it); a call is
        ``{"name": <the tool>, "arguments": <its parameters>}``."""
        defs = {f"tool_{i}": _rebase(t["parameters"], f"#/$defs/tool_{i}")
                for i, t in enumerate(self.tools)}
        calls = [{"type": "object",
                  "properties": {"name": {"const": t["name"]},
                                 "arguments": {"$ref": f"#/$defs/tool_{i}"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for i, t in enumerate(self.tools) if self.forced in (None, t["name"])]
        return defs, calls

    def schema(self) -> dict[str, Any]:
        """The JSON schema of the answer (module docstring; :meth:`call_schemas`)."""
        defs, calls = self.call_schemas()
        items: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        call_form = {"type": "object",
                     "properties": {"tool_calls": {"type": "array", "items": items, "minItems": 1,
                                                   "maxItems": self.max_calls}},
                     "required": ["tool_calls"], "additionalProperties": False}
        if self.mode != "auto":
            return {"$defs": defs, **call_form}
        text_form = {"type": "object", "properties": {"response": {"type": "string"}},
                     "required": ["response"], "additionalProperties": False}
        return {"$defs": defs, "anyOf": [call_form, text_form]}

    def instructions(self) -> str:
        """What the system message tells the model."""
        listing = json.dumps(list(self.tools), ensure_ascii=False, separators=(",", ":"))
        call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
        if self.mode == "auto":
            how = (f"When a tool can answer the request, call it: answer with {call}. Otherwise"
                   ' answer the user directly: answer with {"response": "<your answer>"}.')
        elif self.forced is None:
            how = f"Call one or more tools: answer with {call}."
        else:
            how = f"Call the tool `{self.forced}`: answer with {call}."
        if not self.parallel:
            how += " Call at most one tool at a time."
        return ("You have access to these tools (the arguments of each follow its JSON Schema"
                f" `parameters`):\n{listing}\nAnswer with one JSON object. {how}")

    def with_instructions(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with the instructions appended to the first system message (one is put
        first when there is none)."""
        text = self.instructions()
        if messages and messages[0]["role"] == "system":
            first = messages[0]["content"]
            return [{"role": "system", "content": f"{first}\n\n{text}" if first else text},
                    *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def grammar(self, tok: Any, vocab: int, think: str | None = None) -> Grammar:
        """The compiled grammar that holds the answer in this syntax, for ``tok``'s logits of
        width ``vocab`` (its 400s name ``tools``); ``think``: a thinking model may think before
        calls it must make (Hermes: ``hermes_grammar``)."""
        if self.syntax == "hermes":
            return compile_lark(hermes_grammar(self, think), call_schema(self), tok, vocab,
                                "tools_hermes", "tools")
        if self.syntax == "llama3_json":
            return compile_lark(llama_grammar(self), llama_call_schema(self), tok, vocab,
                                "tools_llama3_json", "tools")
        return compile_json_schema(self.schema(), tok, vocab, param="tools")

    def text_stream(self) -> ResponseText | HermesText | LlamaText:
        """What streams of the answer as content while it grows (``api/tool_stream.py``)."""
        if self.syntax == "hermes":
            return HermesText()
        return LlamaText() if self.syntax == "llama3_json" else ResponseText()

    def scanner(self) -> CallScanner:
        """A scan of this syntax's calls in an answer's text (``api/tool_scan.py``)."""
        framing = (HERMES_FRAMING if self.syntax == "hermes" else
                   LLAMA_FRAMING if self.syntax == "llama3_json" else JSON_FRAMING)
        return CallScanner(framing, frozenset(t["name"] for t in self.tools))

    def message(self, text: str, finish: str, scan: CallScanner | None = None
                ) -> tuple[dict[str, Any], str]:
        """The assistant message and ``finish_reason`` of the generated ``text``: its calls as
        far as they were written (the last one's arguments cut short when the answer was;
        ``finish_reason`` ``tool_calls`` when every call is whole), the text before them (Hermes)
        as ``content``; an answer without a call is text (a direct answer's ``response``).
        ``scan``: this syntax's scan fed ``text`` already (a stream's), else one is made."""
        if scan is None:
            scan = self.scanner()
            scan.feed(text)
        if scan.calls:
            content = None
            if self.syntax == "hermes" and scan.start:
                content = text[:scan.start].rstrip() or None
            whole = scan.closed() and all(_parses(c.arguments) for c in scan.calls)
            return ({"role": "assistant", "content": content,
                     "tool_calls": [openai_call(c.name, c.arguments) for c in scan.calls]},
                    "tool_calls" if whole and finish == "stop" else finish)
        if self.syntax != "json":
            return {"role": "assistant", "content": text}, finish
        try:
            answer = json.loads(text)
        except ValueError:  # cut short: not JSON (yet); a direct answer's text so far
            partial = _partial_response(text)
            return {"role": "assistant", "content": text if partial is None else partial}, finish
        if isinstance(answer, dict) and isinstance(answer.get("response"), str):
            return {"role": "assistant", "content": answer["response"]}, finish
        return {"role": "assistant", "content": text}, finish


def new_call_id() -> str:
    """An OpenAI tool call id: ``call_<24 hex>``."""
    return f"call_{secrets.token_hex(12)}"


def openai_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """One call as OpenAI's ``tool_calls`` hold it (``arguments``: the JSON text generated)."""
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _map_schema(schema: Any, fix: Callable[[dict[str, Any], dict[str, Any]], None],
                depth: int = 0) -> Any:
    """A copy of ``schema`` in which every object has been passed to ``fix(original, copy)``
    (children first). The walk stops at the grammar's depth bound (the schema is checked after)."""
    if depth > 64:
        return schema
    if isinstance(schema, list):
        return [_map_schema(v, fix, depth + 1) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _map_schema(v, fix, depth + 1) for k, v in schema.items()}
    fix(schema, out)
    return out


def _close(original: dict[str, Any], copy: dict[str, Any]) -> None:
    if isinstance(original.get("properties"), dict) and "additionalProperties" not in original:
        copy["additionalProperties"] = False


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and says nothing of extra ones (OpenAI's ``strict`` asks it of the client; here
    it is the default, as in xgrammar's strict mode): a model is held to the named arguments
    instead of adding keys until ``max_tokens``. What it accepts still validates against the
    original."""
    return _map_schema(schema, _close)


def _rebase(schema: Any, base: str) -> Any:
    """``schema`` moved to ``base`` (a JSON pointer fragment): its local ``$ref``s (``#``,
    ``#/...``) point where they pointed, from there."""

    def fix(original: dict[str, Any], copy: dict[str, Any]) -> None:
        ref = original.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            copy["$ref"] = base + ref[1:]

    return _map_schema(schema, fix)


_DECODER: Final = json.JSONDecoder(strict=False)


def _safe_end(s: str) -> tuple[int, bool]:
    """How much of ``s`` (a JSON string's inside, from its start) decodes on its own, and whether
    the string's closing quote ends it there: an escape is never cut (``\\uD83D`` waits for its
    low surrogate's escape too)."""
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c == '"':
            return i, True
        if c != "\\":
            i += 1
            continue
        if i + 1 >= n:
            return i, False
        if s[i + 1] != "u":
            i += 2
            continue
        if i + 6 > n:
            return i, False
        if "\\ud800" <= s[i:i + 6].lower() <= "\\udbff":  # a high surrogate: its pair too
            if i + 8 > n or (s[i + 6:i + 8] == "\\u" and i + 12 > n):
                return i, False
            i += 12 if s[i + 6:i + 8] == "\\u" else 6
            continue
        i += 6
    return n, False


@final
class ResponseText:
    """The text of a ``{"response": "..."}`` answer as it grows; nothing for tool calls."""

    __slots__ = ("_buf", "mode", "done", "sent")

    def __init__(self) -> None:
        self._buf = ""
        self.mode: str | None = None  # None: undecided; "text"; "calls"
        self.done = False  # the string's closing quote was seen
        self.sent: list[str] = []  # what feed() returned

    def feed(self, text: str) -> str:
        """The answer's next characters -> the text they add (may be "")."""
        if self.mode == "calls" or self.done or not text:
            return ""
        buf = self._buf + text
        if self.mode is None:
            if len(buf) < len(RESPONSE_PREFIX):
                self._buf = buf
                if not RESPONSE_PREFIX.startswith(buf):
                    self.mode = "calls"
                return ""
            if not buf.startswith(RESPONSE_PREFIX):
                self.mode = "calls"
                return ""
            self.mode = "text"
            buf = buf[len(RESPONSE_PREFIX):]
        end, closed = _safe_end(buf)
        self.done = closed
        self._buf = buf[end:]
        if end == 0:
            return ""
        try:
            out: str = _DECODER.decode('"' + buf[:end] + '"')
        except ValueError:  # not JSON text (a grammar bypassed): nothing more is streamed
            self.mode = "calls"
            return ""
        self.sent.append(out)
        return out


def _partial_response(text: str) -> str | None:
    """The text of a ``{"response": "...`` answer cut short (what :class:`ResponseText` streamed
    of it), else None."""
    if not text.startswith(RESPONSE_PREFIX):
        return None
    r = ResponseText()
    r.feed(text)
    return "".join(r.sent) if r.mode == "text" else None


def _bad(param: str, why: str) -> E.RequestError:
    return E.RequestError(why, param=param)


def _tool(i: int, t: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function":
        raise _bad(f"{where}.type", f"`{where}` must be an object with `type: \"function\"`")
    f = t.get("function")
    if not isinstance(f, dict):
        raise _bad(f"{where}.function", f"`{where}.function` must be an object")
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{where}.function.name",
                   f"`{where}.function.name` must be 1 to 64 letters, digits, `_` or `-`")
    desc = f.get("description")
    if desc is not None and (not isinstance(desc, str) or len(desc) > MAX_DESCRIPTION_CHARS):
        raise _bad(f"{where}.function.description",
                   f"`{where}.function.description` must be a string of at most"
                   f" {MAX_DESCRIPTION_CHARS} characters")
    params = f.get("parameters")
    if params is None or params == {}:  # no arguments ({} would allow any JSON value)
        params = _NO_PARAMETERS
    if not isinstance(params, dict):
        raise _bad(f"{where}.function.parameters",
                   f"`{where}.function.parameters` must be a JSON Schema object")
    strict = f.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{where}.function.strict", f"`{where}.function.strict` must be a boolean")
    out: dict[str, Any] = {"name": name}
    if desc:
        out["description"] = desc
    out["parameters"] = _closed(params)
    return out


def parse_tools(tools: Any, tool_choice: Any, parallel: bool | None, syntax: str = "json"
                ) -> ToolCalling | None:
    """The request's :class:`ToolCalling` (answered in ``syntax``), or None when it calls no tool
    (no tools, or ``tool_choice: "none"``); a 400 naming the field for anything malformed."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "`tool_choice` needs `tools`")
        return None
    if not isinstance(tools, list) or not tools:
        raise _bad("tools", "`tools` must be a non-empty list of functions")
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"`tools` holds {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    parsed = [_tool(i, t) for i, t in enumerate(tools)]
    names = [t["name"] for t in parsed]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise _bad(f"tools[{i}].function.name", f"tool name `{n}` appears twice in `tools`")
    if tool_choice in (None, "auto"):
        mode = "auto"
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        mode = "required"
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise _bad("tool_choice", f"`tool_choice` names `{str(name)[:64]}`, which is not in"
                                      " `tools`")
        mode = name
    else:
        raise _bad("tool_choice", '`tool_choice` must be "none", "auto", "required" or'
                                  ' {"type": "function", "function": {"name": ...}}')
    return ToolCalling(tuple(parsed), mode, parallel is not False, syntax)


def tool_messages(role: str, content: str, tool_calls: Any, tool_call_id: str | None,
                  where: str) -> dict[str, str]:
    """The plain message an earlier turn's tool call (``assistant`` with ``tool_calls``) or tool
    result (``tool``) is shown to the model as (module docstring); 400s name ``where``'s fields."""
    if role == "tool":
        body = {"tool_response": {"tool_call_id": checked_call_id(tool_call_id, where),
                                  "content": content}}
        return {"role": "user", "content": json.dumps(body, ensure_ascii=False)}
    calls = [{"name": c["name"], "arguments": c["arguments"]}  # shown without their ids
             for c in earlier_calls(tool_calls, where, MAX_PARALLEL_CALLS)]
    answer: dict[str, Any] = {"tool_calls": calls}
    text = json.dumps(answer, ensure_ascii=False)
    return {"role": "assistant", "content": f"{content}\n{text}" if content else text}

