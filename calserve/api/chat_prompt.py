"""A chat request's prompt: its messages validated, its tools shown, the model's template rendered.

- :func:`chat_messages`: the OpenAI messages as the ``{"role", "content"}`` dicts a template takes
  (earlier turns of tool calling as plain messages, ``api/tools.py``, or as a template with its own
  tool syntax takes them, ``api/tools_native.py``);
- :func:`chat_input`: a chat body's tools, messages and the tools its template shows;
- :func:`template_variables`: a request's ``chat_template_kwargs``, checked;
- :func:`render_chat`: the rendering and its token ids (message contents literal, never control
  tokens: ``Tokenizer.encode_chat``), refused before tokenizing when it cannot fit the context.

Used by chat requests (``api/convert.py``) and ``/tokenize`` (``api/routes.py``) alike, so both see
the same prompt.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from calserve import errors as E
from calserve.api.protocol import TokenizerLike
from calserve.api.schemas import ChatBody, ChatMessage, TokenizeBody
from calserve.api.tokenizing import check_text_fits, encode_text
from calserve.api.tools import MAX_PARALLEL_CALLS, ToolCalling, parse_tools, tool_messages
from calserve.api.tools_native import native_tool_message, special_text_param, template_tools
from calserve.models.chat_template import RESERVED_VARIABLES
from calserve.models.tokenizer import Tokenizer

__all__ = ["chat_messages", "chat_input", "template_variables", "render_chat",
           "MAX_TEMPLATE_VARIABLES", "MAX_TEMPLATE_VARIABLES_BYTES"]

#: Bounds on a request's ``chat_template_kwargs`` (:func:`template_variables`).
MAX_TEMPLATE_VARIABLES: Final = 32
MAX_TEMPLATE_VARIABLES_BYTES: Final = 65536
_IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_CHAT_ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool"})


def chat_messages(messages: list[ChatMessage], native: bool = False) -> list[dict[str, Any]]:
    """Validate chat messages into the plain ``{"role", "content"}`` list the template takes;
    ``native`` (a template with its own tool syntax): earlier turns of tool calling as it takes
    them (``api/tools_native.py``), else as plain messages (``api/tools.py``)."""
    if not messages:
        raise E.RequestError("`messages` must not be empty", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role not in _CHAT_ROLES:
            raise E.UnsupportedParameter(
                f"role {m.role!r} is not supported (use system, developer, user, assistant or"
                " tool)", param=f"messages[{i}].role",
            )
        if m.tool_calls is not None and m.role != "assistant":
            raise E.RequestError("only an assistant message has `tool_calls`",
                                 param=f"messages[{i}].tool_calls")
        if m.content is None:
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for j, p in enumerate(m.content):
                if p.type != "text":
                    raise E.UnsupportedParameter(
                        f"content part type {p.type!r} is not supported (text only)",
                        param=f"messages[{i}].content[{j}].type",
                    )
                if p.text is None:
                    raise E.RequestError(
                        f"`messages[{i}].content[{j}].text` is required for a text part",
                        param=f"messages[{i}].content[{j}].text",
                    )
                parts.append(p.text)
            text = "".join(parts)
        if native and (m.role == "tool" or m.tool_calls is not None):
            out.append(native_tool_message(m.role, text, m.tool_calls, m.tool_call_id,
                                           f"messages[{i}]", MAX_PARALLEL_CALLS))
            continue
        if m.role == "tool" or m.tool_calls is not None:  # an earlier turn of tool calling
            shown = tool_messages(m.role, text, m.tool_calls, m.tool_call_id, f"messages[{i}]")
            if m.role == "tool" and i and messages[i - 1].role == "tool":
                # the results of parallel calls: one user turn (templates that insist on
                # alternating user and assistant turns would refuse two in a row)
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + shown["content"]}
            else:
                out.append(shown)
            continue
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def chat_input(tok: TokenizerLike, body: ChatBody | TokenizeBody
               ) -> tuple[ToolCalling | None, list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A chat body's ``(tools, messages, the template's tools)``: with tools in the generic
    syntax the instructions join the messages (``api/tools.py``); a template with its own tool
    syntax gets the tools to show and earlier calls as it takes them (``api/tools_native.py``),
    none of them holding a special-token string (the template copies them as its own text)."""
    syntax = tok.tool_syntax if isinstance(tok, Tokenizer) else None
    tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls, syntax or "json")
    msgs = chat_messages(body.messages or [], native=syntax is not None)
    if tools is not None and tools.syntax == "json":
        return tools, tools.with_instructions(msgs), None
    shown = None if tools is None else template_tools(tools)
    if isinstance(tok, Tokenizer) and syntax is not None:
        bad = special_text_param(tok.has_special_text, shown or [], msgs)
        if bad is not None:
            raise E.RequestError(f"`{bad}` holds a special-token string, which this model's chat"
                                 " template would copy as a control token", param=bad)
    return tools, msgs, shown


def template_variables(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A request's ``chat_template_kwargs`` (vLLM's extension: more variables for the model's own
    chat template, ``{"enable_thinking": false}`` for Qwen3), checked: an object of at most
    :data:`MAX_TEMPLATE_VARIABLES` names (identifiers, none of the variables the rendering sets
    itself) whose JSON is at most :data:`MAX_TEMPLATE_VARIABLES_BYTES`; a 400 naming the field
    otherwise (the schema makes it an object). None for none."""
    if value is None:
        return None
    param = "chat_template_kwargs"
    if len(value) > MAX_TEMPLATE_VARIABLES:
        raise E.RequestError(f"`{param}` holds {len(value)} names; at most"
                             f" {MAX_TEMPLATE_VARIABLES} are allowed", param=param)
    for k in value:
        if not _IDENTIFIER.fullmatch(k) or k in RESERVED_VARIABLES:
            raise E.RequestError(f"`{param}` name `{k[:64]}` is not allowed (an identifier of at"
                                 " most 64 characters, not one the rendering sets itself:"
                                 f" {', '.join(sorted(RESERVED_VARIABLES))})", param=param)
    if len(json.dumps(value, ensure_ascii=False)) > MAX_TEMPLATE_VARIABLES_BYTES:
        raise E.RequestError(f"`{param}` is larger than {MAX_TEMPLATE_VARIABLES_BYTES} characters"
                             " of JSON", param=param)
    return dict(value)


def render_chat(tok: TokenizerLike, messages: list[dict[str, Any]], add_generation_prompt: bool,
                max_seq: int | None, tools: list[dict[str, Any]] | None = None,
                variables: dict[str, Any] | None = None) -> tuple[str | None, tuple[int, ...]]:
    """Render (the model's chat template, given ``tools`` to show when not None and the
    request's ``variables``) and tokenize: ``(prompt text, ids)``, the text None when the
    tokenizer renders straight to ids. A rendering longer than ``max_seq`` tokens can hold is
    refused before it is tokenized (param ``messages``; ``max_seq`` None: the caller keeps only
    the end of the ids, any length is tokenized), as is a template that fails."""
    if isinstance(tok, Tokenizer):
        rendered: Any = tok.apply_chat_template(messages, add_generation_prompt, tools, variables)
    else:
        assert tools is None  # chat_input: only a package tokenizer's template shows tools
        rendered = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    if isinstance(rendered, str):
        if max_seq is not None:
            check_text_fits(tok, max_seq, len(rendered), "messages", "the rendered conversation")
        # message contents are text, never control tokens (Tokenizer.encode_chat)
        if not isinstance(tok, Tokenizer):
            return rendered, encode_text(tok, rendered)
        literal = tok.encode_chat(messages, rendered, add_generation_prompt, tools, variables)
        if literal is None:
            return rendered, encode_text(tok, rendered, prompt=True)
        return rendered, tuple(tok.with_bos(literal))
    return None, tuple(int(t) for t in rendered)
