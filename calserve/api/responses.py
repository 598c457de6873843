"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

Clients built on the Responses API (the OpenAI Agents SDK, Codex-style CLIs, ``client.responses``)
send a conversation as ``input`` items and get ``output`` items back. A request is turned into the
chat request it means (:func:`chat_body`) and prepared, admitted, scheduled and sampled exactly as
one (the package's chat template, tools in the model's own syntax, ``text.format`` as constrained
decoding, a thinking model's reasoning); only the request's and the answer's shapes differ:

- ``input``: a string (one user turn) or items: messages (``user``/``assistant``/``system``/
  ``developer`` — as ``system`` — with a string or ``input_text``/``output_text`` parts),
  ``function_call`` (an earlier call: joins the assistant turn before it) and
  ``function_call_output`` (its result, a ``tool`` turn); earlier ``reasoning`` items are dropped,
  as the chat templates drop earlier thinking. ``instructions`` is a system turn before them.
- ``tools`` are function tools (``{"type": "function", "name", "parameters", ...}``),
  ``tool_choice`` ``auto``/``none``/``required``/``{"type": "function", "name"}``,
  ``text.format`` ``text``/``json_object``/``json_schema``, ``max_output_tokens``,
  ``temperature``, ``top_p``, ``parallel_tool_calls``, ``metadata`` (echoed), ``user``, and
  ``seed`` (an extension, as on chat).
- The answer (:func:`output_items`): a ``reasoning`` item (a thinking model), a ``message`` item
  with one ``output_text`` part, ``function_call`` items; ``status`` ``completed``, or
  ``incomplete`` with ``incomplete_details.reason: "max_output_tokens"``; usage as
  ``input_tokens``/``output_tokens``. Streamed: ``api/responses_stream.py``.
- ``include: ["message.output_text.logprobs"]`` (+ ``top_logprobs`` 0–20): each token's logprob
  (and its ``top_logprobs`` alternatives) on the ``output_text`` part and on each streamed delta,
  for a plain text answer (an answer shaped by tools or a thinking model's reasoning carries
  none: its tokens are not all the text's).

- ``store`` (true unless false) keeps the response (``api/response_store.py``): a follow-up names
  it with ``previous_response_id`` instead of resending the conversation (its input items and
  output items come before the new ``input``; its ``instructions`` do not carry over, as on
  OpenAI), and ``GET``/``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` read
  and forget it. An unknown (expired, deleted, another tenant's) ``previous_response_id`` is a 400
  naming it.

What needs a hosted feature is a 400 naming the field (``conversation``, ``background``,
``prompt``, built-in tools such as ``web_search``, ``item_reference`` items, non-text input
parts, ``include`` values other than ``message.output_text.logprobs`` and
``reasoning.encrypted_content`` (accepted: :data:`ENCRYPTED_REASONING`),
``truncation: "auto"``, ``max_tool_calls``). Errors found while preparing the chat request name
the Responses field (``max_output_tokens``, ``text.format``, ``tools[1].parameters``,
``input[3]``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Annotated, Any, Final

import msgspec

from calserve import errors as E
from calserve.api.render import new_id, now_s
from calserve.api.response_store import with_ids
from calserve.api.schemas import ChatBody, ChatMessage, ContentPart, PosInt, Seed, Temperature, TopP, User
from calserve.engine.types import Usage

__all__ = ["ResponsesBody", "ResponseEcho", "chat_body", "output_items", "response_object",
           "usage_object", "responses_param", "own_items"]

MAX_METADATA = 16  # OpenAI's bound on ``metadata`` pairs
LOGPROBS: Final = "message.output_text.logprobs"
#: Codex-style clients ask for it with ``store: false``, to send reasoning back as an opaque blob.
#: Accepted: nothing is hidden here (a reasoning item's text is its ``content``), so a reasoning
#: item's ``encrypted_content`` is null, and earlier reasoning items are dropped anyway.
ENCRYPTED_REASONING: Final = "reasoning.encrypted_content"


class ResponsesBody(msgspec.Struct, kw_only=True):
    """The request fields served (unknown fields are ignored, as on the other routes)."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None  # extension (as on chat)
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # accepted; a model thinks as its template says
    metadata: Annotated[dict[str, str], msgspec.Meta(max_length=MAX_METADATA)] | None = None
    user: User | None = None
    store: bool | None = None  # None: true (OpenAI's default)
    previous_response_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    # Known, and refused when set (module docstring)
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    include: Annotated[list[str], msgspec.Meta(max_length=16)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None


@dataclasses.dataclass(frozen=True)
class ResponseEcho:
    """What a response object repeats of its request, and how its errors name fields."""

    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict[str, Any]
    metadata: dict[str, str]
    user: str | None
    sources: tuple[str, ...]  # chat message k came from this Responses field (``input[3]``)
    top_logprobs: int | None = None  # logprobs asked for (``include``): the alternatives' count
    previous_response_id: str | None = None
    #: What is stored as the answer's input items (the previous response's context, then this
    #: request's ``input``, each with an id); None: the answer is not stored.
    stored_input: list[dict[str, Any]] | None = None

    @property
    def store(self) -> bool:
        return self.stored_input is not None


def _unsupported(param: str, why: str) -> E.UnsupportedParameter:
    return E.UnsupportedParameter(f"`{param}` is not supported: {why}", param=param)


def _refuse_unserved(b: ResponsesBody) -> None:
    if b.conversation is not None:
        raise _unsupported("conversation", "no Conversations API on this server; name the last"
                           " response in `previous_response_id`, or send the whole conversation"
                           " in `input`")
    if b.background:
        raise _unsupported("background", "responses run in the foreground")
    if b.prompt is not None:
        raise _unsupported("prompt", "no stored prompt templates; send `instructions` and `input`")
    for i, what in enumerate(b.include or ()):
        if what not in (LOGPROBS, ENCRYPTED_REASONING):
            raise _unsupported(f"include[{i}]", f"{what!r} (served: {LOGPROBS!r},"
                               f" {ENCRYPTED_REASONING!r})")
    if b.truncation not in (None, "disabled"):
        raise _unsupported("truncation", "the conversation is never cut to fit: a prompt longer"
                           " than the context is a 400")
    if b.max_tool_calls is not None:
        raise _unsupported("max_tool_calls", "send `parallel_tool_calls: false` for one call")


def _text_of(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    """A message's content (a string or text parts) as its text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise E.RequestError(f"`{param}` must be a string or a list of content parts", param=param)
    out = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise _unsupported(f"{where}.type", f"{kind!r} parts (this server takes text:"
                               f" {', '.join(kinds)})")
        text = part.get("text")
        if not isinstance(text, str):
            raise E.RequestError(f"`{where}.text` must be a string", param=f"{where}.text")
        out.append(text)
    return "".join(out)


_ROLES: Final = {"user": "user", "assistant": "assistant", "system": "system",
                 "developer": "system"}
_TEXT_PARTS: Final = ("input_text", "output_text")


def _str_field(item: dict[str, Any], key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise E.RequestError(f"`{where}.{key}` must be a string", param=f"{where}.{key}")
    return v


def own_items(b: ResponsesBody) -> list[dict[str, Any]]:
    """The request's ``input`` as items (a string is one user message)."""
    if isinstance(b.input, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": b.input}]}]
    return b.input


def _messages(b: ResponsesBody, previous: list[dict[str, Any]] | None
              ) -> tuple[list[ChatMessage], list[str]]:
    """The chat turns of ``instructions``, the ``previous`` response's context (its input and
    output items) and ``input``, and the field each came from."""
    msgs: list[ChatMessage] = []
    src: list[str] = []
    if b.instructions:
        msgs.append(ChatMessage(role="system", content=b.instructions))
        src.append("instructions")
    if previous:
        _add_items(previous, lambda i: "previous_response_id", msgs, src)
    if isinstance(b.input, str):
        msgs.append(ChatMessage(role="user", content=b.input))
        src.append("input")
    else:
        _add_items(b.input, lambda i: f"input[{i}]", msgs, src)
    if not msgs:
        raise E.RequestError("`input` must hold at least one message", param="input")
    return msgs, src


def _add_items(items: list[dict[str, Any]], where_of: Callable[[int], str],
               msgs: list[ChatMessage], src: list[str]) -> None:
    """The chat turns of Responses items (``where_of(i)``: the field item ``i`` came from)."""
    for i, item in enumerate(items):
        where = where_of(i)
        kind = item.get("type") or ("message" if "role" in item else None)
        if not isinstance(kind, str) and kind is not None:
            raise E.RequestError(f"`{where}.type` must be a string", param=f"{where}.type")
        if kind == "message":
            given = item.get("role")
            role = _ROLES.get(given) if isinstance(given, str) else None
            if role is None:
                raise E.RequestError(f"`{where}.role` must be one of {sorted(_ROLES)}",
                                     param=f"{where}.role")
            msgs.append(ChatMessage(role=role, content=_text_of(item.get("content"),
                                                                f"{where}.content", _TEXT_PARTS)))
            src.append(where)
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id", where), "type": "function",
                    "function": {"name": _str_field(item, "name", where),
                                 "arguments": _str_field(item, "arguments", where)}}
            last = msgs[-1] if msgs else None
            if last is not None and last.role == "assistant":  # (instructions are a system turn)
                last.tool_calls = [*(last.tool_calls or []), call]  # the same assistant turn
            else:
                msgs.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
                src.append(where)
        elif kind == "function_call_output":
            out = item.get("output")
            text = _text_of(out, f"{where}.output", ("input_text", "output_text"))
            msgs.append(ChatMessage(role="tool", content=text,
                                    tool_call_id=_str_field(item, "call_id", where)))
            src.append(where)
        elif kind == "reasoning":
            continue  # earlier thinking: the templates drop it too
        else:
            raise _unsupported(f"{where}.type", f"{kind!r} items (served: message, function_call,"
                               " function_call_output, reasoning)")


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise _unsupported(f"tools[{i}].type", f"{t.get('type')!r} (only function tools: no"
                               " hosted tools on this server)")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice  # auto / none / required (api/tools.py checks the value)
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _unsupported("tool_choice", "served: \"auto\", \"none\", \"required\" or"
                       " {\"type\": \"function\", \"name\": ...}")


def _format(text: dict[str, Any] | None) -> Any:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise E.RequestError("`text.format` must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return dict(fmt)  # text / json_object (others: engine/grammar.py names the field)


def chat_body(b: ResponsesBody, previous: list[dict[str, Any]] | None = None, store: bool = False
              ) -> tuple[ChatBody, ResponseEcho]:
    """The chat request ``b`` means, and what its response repeats (module docstring).
    ``previous``: the context of the response ``b.previous_response_id`` names (its input and
    output items); ``store``: the answer will be stored."""
    _refuse_unserved(b)
    msgs, src = _messages(b, previous)
    logprobs = LOGPROBS in (b.include or ())
    chat = ChatBody(
        messages=msgs, model=b.model, max_completion_tokens=b.max_output_tokens,
        logprobs=logprobs or None, top_logprobs=b.top_logprobs if logprobs else None,
        temperature=b.temperature, top_p=b.top_p, seed=b.seed, stream=b.stream,
        tools=_tools(b.tools), tool_choice=_tool_choice(b.tool_choice),
        parallel_tool_calls=b.parallel_tool_calls, response_format=_format(b.text), user=b.user)
    echo = ResponseEcho(
        instructions=b.instructions, max_output_tokens=b.max_output_tokens,
        temperature=1.0 if b.temperature is None else b.temperature,
        top_p=1.0 if b.top_p is None else b.top_p, tools=list(b.tools or []),
        tool_choice="auto" if b.tool_choice is None else b.tool_choice,
        parallel_tool_calls=b.parallel_tool_calls is not False,
        text={"format": (b.text or {}).get("format") or {"type": "text"}},
        metadata=dict(b.metadata or {}), user=b.user, sources=tuple(src),
        top_logprobs=(b.top_logprobs or 0) if logprobs else None,
        previous_response_id=b.previous_response_id,
        stored_input=[*(previous or ()), *with_ids(own_items(b))] if store else None)
    return chat, echo


_MSG_PARAM: Final = re.compile(r"^messages\[(\d+)\]")
_RENAMES: Final = (("max_completion_tokens", "max_output_tokens"),
                   ("response_format.json_schema", "text.format"),
                   ("response_format", "text.format"))
_TOOL_FN: Final = re.compile(r"^tools\[(\d+)\]\.function")


def responses_param(param: str | None, sources: tuple[str, ...]) -> str | None:
    """The Responses field behind a chat request's field (``messages[2].content`` -> the input
    item it came from; ``max_completion_tokens`` -> ``max_output_tokens``, ...)."""
    if param is None:
        return None
    m = _MSG_PARAM.match(param)
    if m is not None:
        k = int(m.group(1))
        return sources[k] if k < len(sources) else "input"
    if param == "messages":
        return "input"
    for old, new in _RENAMES:
        if param == old or param.startswith(old + ".") or param.startswith(old + "["):
            return new + param[len(old):]
    return _TOOL_FN.sub(r"tools[\1]", param)


def renamed(exc: E.CalserveError, sources: tuple[str, ...]) -> E.CalserveError:
    """``exc`` (raised while preparing the chat request) naming the Responses field."""
    new = responses_param(exc.param, sources)
    if new == exc.param:
        return exc
    message = exc.message
    if exc.param is not None and new is not None:
        message = message.replace(f"`{exc.param}`", f"`{new}`")
        for old, repl in _RENAMES:
            message = message.replace(f"`{old}`", f"`{repl}`")
    return type(exc)(message, param=new, retry_after=exc.retry_after)


def usage_object(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def text_item(item_id: str, text: str, status: str, logprobs: list[Any] | None = None
              ) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [text_part(text, logprobs)]}


def text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "encrypted_content": None, "status": status}


def call_item(call: dict[str, Any], item_id: str, status: str = "completed") -> dict[str, Any]:
    """A ``function_call`` item of an OpenAI ``tool_calls`` entry (``in_progress``: its arguments
    not yet known; ``incomplete``: cut short, as far as they were written)."""
    fn = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": fn["name"],
            "arguments": "" if status == "in_progress" else fn["arguments"], "status": status}


def item_status(finish: str) -> str:
    return "incomplete" if finish == "length" else "completed"


def output_items(message: dict[str, Any], finish: str, logprobs: list[Any] | None = None
                 ) -> list[dict[str, Any]]:
    """The output items of a chat answer's ``message`` (module docstring): its reasoning, its
    text (an empty one only when there is nothing else), its calls. An item followed by another
    is complete; the last text or reasoning item has the response's status (``incomplete``: cut
    at ``max_output_tokens``). ``logprobs``: the text's tokens' (a plain answer's)."""
    status = item_status(finish)
    thought = message.get("reasoning_content")
    calls = message.get("tool_calls") or []
    content = message.get("content")
    text = bool(content) or not (calls or thought)
    out: list[dict[str, Any]] = []
    if thought:
        out.append(reasoning_item(new_id("rs"), thought, status if not (text or calls)
                                  else "completed"))
    if text:
        out.append(text_item(new_id("msg"), content or "", status if not calls else "completed",
                             logprobs))
    out.extend(call_item(c, new_id("fc"), status if k == len(calls) - 1 else "completed")
               for k, c in enumerate(calls))
    return out


def response_object(echo: ResponseEcho, rid: str, created: int, model: str, status: str,
                    output: list[dict[str, Any]], usage: Usage | None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``response`` object (``status``: in_progress, completed, incomplete, failed)."""
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo.instructions, "max_output_tokens": echo.max_output_tokens,
        "model": model, "output": output, "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": echo.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": echo.store, "temperature": echo.temperature, "text": echo.text,
        "tool_choice": echo.tool_choice, "tools": echo.tools, "top_p": echo.top_p,
        "truncation": "disabled", "usage": None if usage is None else usage_object(usage),
        "user": echo.user, "metadata": echo.metadata,
    }


def json_response(echo: ResponseEcho, model: str, message: dict[str, Any], finish: str,
                  usage: Usage, logprobs: list[Any] | None = None) -> dict[str, Any]:
    """The whole (unstreamed) response of a chat answer (``logprobs``: a plain answer's)."""
    return response_object(echo, new_id("resp"), now_s(), model, item_status(finish),
                           output_items(message, finish, logprobs), usage)
